"""Weight loading: GGUF files (read natively, or dequantized once and cached as an HF folder) and HF
safetensors folders.

GGUF spec: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md. Files are read by the `gguf`
package's reader (models/gguf_file.py). The block types mixserve parses (layers/gguf_blocks.py: Q4_0,
Q4_1, Q5_0, Q8_0, Q4_K, Q6_K) are dequantized in PyTorch, bit-equal to `gguf.quants.dequantize` and
faster; every other type the package knows goes through `gguf.quants.dequantize`.
"""
from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from mixserve.env import publish_or_scratch
from mixserve.layers import gguf_blocks
from mixserve.models.config import ModelConfig

# GGUF tensor name (after "blk.N.") -> HF name (after "model.layers.N.")
_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
CONVERTED_SUFFIX = ".mixserve"


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def gguf_config(reader) -> tuple[ModelConfig, dict]:
    """Read a ModelConfig (and extra tokenizer facts) from GGUF metadata.

    Raises:
        ValueError: the architecture is not llama or qwen2.
    """
    arch = _field(reader, "general.architecture")
    if arch not in ("llama", "qwen2"):
        raise ValueError(f"unsupported GGUF architecture {arch!r}: mixserve runs llama/qwen2 decoders")
    names = {t.name for t in reader.tensors}
    n_heads = _field(reader, f"{arch}.attention.head_count")
    hidden = _field(reader, f"{arch}.embedding_length")
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    vocab = _field(reader, f"{arch}.vocab_size") or int(embd.shape[1])
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    eos_ids = [eos] if eos is not None else []
    if arch == "qwen2":
        # Qwen's generation_config ends on both <|im_end|> (the GGUF EOS) and <|endoftext|>
        # (GGUF's BOS/pad id), which the model emits at the end of a plain document.
        for extra in (bos, _field(reader, "tokenizer.ggml.padding_token_id")):
            if extra is not None and extra not in eos_ids:
                eos_ids.append(extra)
    cfg = ModelConfig(
        arch=arch,
        vocab_size=int(vocab),
        hidden_size=int(hidden),
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
        num_layers=int(_field(reader, f"{arch}.block_count")),
        num_heads=int(n_heads),
        num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", n_heads)),
        head_dim=int(_field(reader, f"{arch}.attention.key_length", hidden // n_heads)),
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=int(_field(reader, f"{arch}.context_length", 4096)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        eos_token_ids=eos_ids,
        bos_token_id=bos,
    )
    # a GGUF without a vocabulary carries no tokenizer (the model still runs on token ids); one with
    # it must load it (issue 46: a load that raised was once cached as "no tokenizer")
    return cfg, {"add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
                 "has_tokenizer": "tokenizer.ggml.tokens" in reader.fields}


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (convert_hf_to_gguf `permute`), which reorders
    each head's rows from HF's rotate-half layout to GGML's interleaved RoPE layout."""
    head_half = w.shape[0] // n_head // 2
    return w.reshape(n_head, head_half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_name(gguf_name: str) -> str:
    """The HF tensor name of a GGUF tensor name. Raises ValueError for one mixserve does not know."""
    if gguf_name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[gguf_name]
    if gguf_name.startswith("blk."):
        _, idx, rest = gguf_name.split(".", 2)
        if rest in _GGUF_LAYER_NAMES:
            return f"model.layers.{idx}.{_GGUF_LAYER_NAMES[rest]}"
    if gguf_name == "rope_freqs.weight":
        raise ValueError("GGUF with rope_freqs (scaled RoPE) is not supported")
    raise ValueError(f"unknown GGUF tensor {gguf_name!r}")


def _heads_to_unpermute(cfg: ModelConfig, name: str) -> int | None:
    """llama GGUFs store Q/K rows permuted (convert_hf_to_gguf `permute`): the head count to undo it with."""
    if cfg.arch != "llama":
        return None
    if name.endswith(("q_proj.weight", "q_proj.bias")):
        return cfg.num_heads
    if name.endswith(("k_proj.weight", "k_proj.bias")):
        return cfg.num_kv_heads
    return None


def dequantize_gguf(path: str | Path, progress: bool = True) -> tuple[ModelConfig, dict, dict[str, torch.Tensor]]:
    """Dequantize every tensor of a GGUF file to float32, under HF tensor names.

    Returns (config, tokenizer facts, {hf_name: float32 tensor in HF [out, in] layout}).
    Raises ValueError for an unsupported architecture or an unknown tensor name.
    """
    import gguf
    from mixserve.models.gguf_file import open_gguf

    reader = open_gguf(path)
    cfg, extra = gguf_config(reader)
    tensors: dict[str, torch.Tensor] = {}
    for t in tqdm(reader.tensors, desc="dequantize", unit="tensor", disable=not progress):
        name = _hf_name(t.name)
        heads = _heads_to_unpermute(cfg, name)
        qtype = t.tensor_type.name
        if qtype in gguf_blocks.PARSERS and len(t.shape) == 2:
            # the same bits as gguf.quants, in PyTorch's threaded elementwise ops (benchmarks/gguf_read.py)
            w = gguf_blocks.dequantize(qtype, np.asarray(t.data), int(t.shape[0]))
            tensors[name] = torch.from_numpy(_unpermute(w.numpy(), heads).copy()) if heads else w
            continue
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
        arr = np.asarray(arr, dtype=np.float32).reshape(tuple(int(d) for d in reversed(t.shape)))
        if heads:
            arr = _unpermute(arr, heads)
        tensors[name] = torch.from_numpy(np.array(arr, dtype=np.float32, order="C", copy=True))
    return cfg, extra, tensors


def read_gguf_native(path: str | Path, progress: bool = True) -> tuple[ModelConfig, dict, dict, dict]:
    """A GGUF file's tensors under HF names, the quantized ones kept as the file stores them.

    2-D tensors of a type with a native kernel (layers/gguf_linear.NATIVE_TYPES) become GGUFWeight
    (the blocks repacked, not a value changed; Q/K rows of llama files reordered as in
    `dequantize_gguf`); every other tensor (norms, biases, a type without a kernel) is
    dequantized to float32 by the `gguf` package.
    Returns (config, tokenizer facts, {hf_name: GGUFWeight or float32 tensor},
    {GGUF type: [tensor count, bytes in the file]}).
    Raises ValueError for an unsupported architecture or an unknown tensor name.
    """
    import gguf
    from mixserve.models.gguf_file import open_gguf

    from mixserve.layers.gguf_linear import NATIVE_TYPES, GGUFWeight

    reader = open_gguf(path)
    cfg, extra = gguf_config(reader)
    tensors: dict = {}
    types: dict[str, list[int]] = {}
    for t in tqdm(reader.tensors, desc="repack", unit="tensor", disable=not progress):
        name = _hf_name(t.name)
        qtype = t.tensor_type.name
        count = types.setdefault(qtype, [0, 0])
        count[0] += 1
        count[1] += int(t.n_bytes)
        heads = _heads_to_unpermute(cfg, name)
        if qtype in NATIVE_TYPES and len(t.shape) == 2:
            w = GGUFWeight.from_blocks(qtype, np.asarray(t.data), int(t.shape[0]))
            if heads:
                w = w.permute_rows(torch.from_numpy(_unpermute(np.arange(w.out_features), heads).copy()))
            tensors[name] = w
            continue
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
        arr = np.asarray(arr, dtype=np.float32).reshape(tuple(int(d) for d in reversed(t.shape)))
        if heads:
            arr = _unpermute(arr, heads)
        tensors[name] = torch.from_numpy(np.array(arr, dtype=np.float32, order="C", copy=True))
    return cfg, extra, tensors, types


def converted_dir(gguf_path: str | Path, suffix: str = "") -> Path:
    """Where the dequantized copy of a GGUF lives (`suffix` "-meta": its tokenizer-and-config
    folder): beside the file, or under the mixserve cache root where that folder cannot be
    written. A complete copy in either place is found first, so a cache prepared beside its file
    and then mounted read-only is still read from there."""
    from mixserve.env import cache_root, writable_dir

    gguf_path = Path(gguf_path).resolve()
    beside = gguf_path.with_name(gguf_path.name + CONVERTED_SUFFIX + suffix)
    st = gguf_path.stat()
    # two files of one name and size (another folder, or one replaced in place) must not share it
    ident = hashlib.sha256(f"{gguf_path}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:10]
    under_root = cache_root() / "converted" / f"{gguf_path.name}-{st.st_size}-{ident}{CONVERTED_SUFFIX}{suffix}"
    for folder in (beside, under_root):
        if _complete(folder):
            return folder
    return beside if writable_dir(gguf_path.parent) is None else under_root


def convert_gguf(gguf_path: str | Path, progress: bool = True) -> Path:
    """Dequantize a GGUF once into an HF folder (config.json, model.safetensors in float32,
    tokenizer files); later loads memory-map it. A no-op when the folder is complete.

    Returns the folder. Raises ValueError for an unsupported or corrupt file, RuntimeError when its
    tokenizer cannot be loaded (nothing is cached then; see _write_meta).
    """
    out = converted_dir(gguf_path)
    if _complete(out):
        return out
    t0 = time.perf_counter()
    cfg, extra, tensors = dequantize_gguf(gguf_path, progress=progress)

    def fill(tmp: Path) -> None:
        save_file(tensors, str(tmp / "model.safetensors"))
        _write_meta(gguf_path, cfg, extra, tmp)
        _write_done(tmp, f"converted in {time.perf_counter() - t0:.1f} s")

    return publish_or_scratch(out, fill, _complete, f"the float32 copy of {Path(gguf_path).name}")


def _write_done(folder: Path, note: str) -> None:
    """The last file a finished step writes: a note and the size of every other file, so that a
    file cut short later (a full disk, a partial copy) makes the folder incomplete."""
    sizes = {p.name: p.stat().st_size for p in folder.iterdir() if p.is_file()}
    (folder / "DONE").write_text(json.dumps({"note": note, "sizes": sizes}, indent=1))


def _complete(folder: Path) -> bool:
    """A converted or -meta folder that a finished step wrote and that is still whole: DONE, every
    file it lists at its size, no TOKENIZER_ERROR (what caches before issue 46 left beside DONE
    when the tokenizer's load raised), and no NO_TOKENIZER written under another transformers
    version than this one (a newer one may load that tokenizer). A DONE of before issue 46 (plain
    text, no sizes) stands when the rest holds."""
    try:
        done = (folder / "DONE").read_text()
    except OSError:
        return False
    if (folder / "TOKENIZER_ERROR").exists():
        return False
    try:
        sizes = json.loads(done).get("sizes", {})
    except (ValueError, AttributeError):
        sizes = {}  # a plain-text DONE of before issue 46
    if not isinstance(sizes, dict):
        return False
    for name, size in sizes.items():
        try:
            if (folder / name).stat().st_size != size:
                return False
        except OSError:
            return False
    note = folder / "NO_TOKENIZER"
    if note.exists():
        try:
            recorded = json.loads(note.read_text()).get("transformers")
        except (OSError, ValueError, AttributeError):
            recorded = None
        if recorded is not None and recorded != _transformers_version():
            return False
    return True


def _transformers_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("transformers")
    except PackageNotFoundError:
        return None


def _write_meta(gguf_path: str | Path, cfg: ModelConfig, extra: dict, folder: Path) -> None:
    """config.json, generation_config.json, mixserve_source.json and the tokenizer's files of a
    GGUF into `folder`. A GGUF with no vocabulary, or with a tokenizer type this transformers
    cannot build (ValueError, KeyError: bert, t5, ...), gets a NO_TOKENIZER note saying why (it runs
    on token ids; the latter is retried under another transformers version).

    Raises RuntimeError when loading the tokenizer raised anything else (ImportError, OSError,
    MemoryError, AttributeError, ...): a fault of this install or machine (issue 46: a module
    shadowing the `kernels` package), never a fact about the model to cache.
    """
    (folder / "config.json").write_text(json.dumps(cfg.to_hf(), indent=1))
    # which file this copy came from (quant/provenance.py reads its release name from there)
    (folder / "mixserve_source.json").write_text(json.dumps({"gguf": str(Path(gguf_path).resolve())}))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": cfg.eos_token_ids}))
    if not extra.get("has_tokenizer", True):
        (folder / "NO_TOKENIZER").write_text(json.dumps(
            {"why": "this GGUF carries no tokenizer.ggml.tokens: the model runs on token ids"}))
        return
    try:
        from transformers import AutoTokenizer

        from mixserve.models.gguf_file import package_reader_is_fast

        with package_reader_is_fast():
            tok = AutoTokenizer.from_pretrained(str(Path(gguf_path).parent), gguf_file=Path(gguf_path).name)
        tok.save_pretrained(str(folder))
    except (ValueError, KeyError, NotImplementedError) as e:  # a tokenizer type it cannot build (bert, t5)
        # a fact about the file and these library versions: kept with them, so that other versions
        # try again (_complete); the model still runs on token ids
        (folder / "NO_TOKENIZER").write_text(json.dumps(
            {"why": f"transformers {_transformers_version()} cannot build this GGUF's tokenizer: {e!r}",
             "transformers": _transformers_version()}))
    except Exception as e:  # the install or the machine (ImportError, MemoryError, ...), not the model
        raise RuntimeError(f"the tokenizer in {gguf_path} could not be loaded by transformers: {e!r}. "
                           "Nothing was cached; the next load tries again") from e


def gguf_meta_dir(gguf_path: str | Path) -> Path:
    """A folder with a GGUF's config.json, generation_config.json and tokenizer files but no
    weights (what a natively loaded GGUF needs besides the file): the dequantized copy's folder
    when that exists, else one written once beside it (`<converted>-meta`)."""
    full = converted_dir(gguf_path)
    if _complete(full):
        return full
    out = converted_dir(gguf_path, "-meta")
    if _complete(out):
        return out
    from mixserve.models.gguf_file import open_gguf

    cfg, extra = gguf_config(open_gguf(gguf_path))

    def fill(tmp: Path) -> None:
        _write_meta(gguf_path, cfg, extra, tmp)
        _write_done(tmp, "tokenizer and config only")

    return publish_or_scratch(out, fill, _complete, f"the tokenizer and config of {Path(gguf_path).name}")


def load_tokenizer(spec: str | Path):
    """The tokenizer of a model (built-in name, GGUF path or HF folder) without its weights
    (models/tokenizer.py: on `tokenizers` where that is enough, else transformers'); a
    GGUF is converted first (once). Raises FileNotFoundError / ValueError when the model cannot
    be resolved, ValueError when it has no tokenizer."""
    from mixserve.models.registry import resolve_model
    from mixserve.models.tokenizer import load_tokenizer_folder

    r = resolve_model(spec)
    folder = gguf_meta_dir(r.path) if r.kind == "gguf" else Path(r.path)
    if not ((folder / "tokenizer.json").exists() or (folder / "tokenizer_config.json").exists()):
        why = ""
        if (folder / "NO_TOKENIZER").exists():
            try:
                why = ": " + json.loads((folder / "NO_TOKENIZER").read_text())["why"]
            except (OSError, ValueError, KeyError, TypeError):
                pass
        raise ValueError(f"model {spec!r} has no tokenizer (in {folder}){why}")
    return load_tokenizer_folder(folder)


def load_hf_weights(folder: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of the *.safetensors files in an HF folder (memory-mapped where possible).

    Raises FileNotFoundError when there are none.
    """
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {folder}")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(f)))
    return out
