"""Model loading: a model spec (built-in name, GGUF path or HF folder) -> a ready model.

Resolution is models/registry.py; GGUF dequantization and safetensors reading models/weights.py;
int4 checkpoints and load-time RTN quant/loading.py; the network models/llama.py.
"""
from __future__ import annotations

import concurrent.futures
import json
import logging
import os
from dataclasses import asdict
from pathlib import Path

import torch

import mixserve.startup as startup
from mixserve.models.config import ModelConfig
from mixserve.models.llama import LlamaForCausalLM
from mixserve.models.registry import resolve_model
from mixserve.models.weights import convert_gguf, load_hf_weights
from mixserve.quant.awq import AWQConfig
from mixserve.quant.checkpoint import default_out_dir, missing_pieces
from mixserve.quant.loading import QuantSpec

log = logging.getLogger("mixserve")


def is_awq_folder(spec: str) -> bool:
    """True when `spec` is a folder whose config.json has a `quantization_config` (an int4 AWQ checkpoint)."""
    cfg = Path(spec) / "config.json"
    return cfg.is_file() and "quantization_config" in json.loads(cfg.read_text())


GGUF_WEIGHTS = ("native", "dequantize")


def use_native_gguf(gguf_weights: str | None, quantization: str | None, built: bool = True) -> bool:
    """Whether a GGUF file loads with its quantized weights as stored (layers/gguf_linear.py).

    gguf_weights: "native", "dequantize", or None (native where a variant of the kernel, AVX512-VNNI
    or AVX2, runs on this machine and no int4 quantization is asked for: RTN and AWQ start from the
    dequantized weights; gguf_kernels.default_native).
    built=False: decided from the CPU's flags alone, without waiting for the kernel's build (the
    loader reads and repacks the file beside it, then asks again with built=True).
    Raises ValueError for another value, or "native" with quantization or without the kernel."""
    from mixserve.layers import gguf_kernels

    if not built:
        flags = gguf_kernels.cpu_flags()
        # MIXSERVE_NO_CPP_KERNELS: no kernel at all, so no read and repack first (the built check says why)
        runs = (not flags or gguf_kernels.NEEDS <= flags) and not os.environ.get("MIXSERVE_NO_CPP_KERNELS")
        if gguf_weights == "native" and not quantization and runs:
            return True
        if gguf_weights is None:
            return quantization is None and runs and gguf_kernels.may_default_native()

    if gguf_weights not in (None, *GGUF_WEIGHTS):
        raise ValueError(f"gguf_weights: must be native or dequantize (got {gguf_weights!r})")
    if gguf_weights == "dequantize":
        return False
    if gguf_weights == "native":
        if quantization:
            raise ValueError(f"gguf_weights native: --quantization {quantization} starts from the dequantized "
                             "weights; use --gguf-weights dequantize")
        if not gguf_kernels.available():
            why = ("MIXSERVE_NO_CPP_KERNELS turns the C++ kernels off" if os.environ.get("MIXSERVE_NO_CPP_KERNELS")
                   else "it needs AVX2, FMA and F16C, and a C++ compiler")
            raise ValueError(f"gguf_weights native: the native GGUF kernel is not available on this machine "
                             f"({why}); use --gguf-weights dequantize")
        return True
    return quantization is None and gguf_kernels.default_native()


def _load_native_gguf(path, dtype, max_positions, progress, kernel_runs=lambda: True):
    """(cfg, model, tokenizer, folder) of a GGUF loaded natively, or None where `kernel_runs()`,
    asked once the weights are read (it waits for the kernel's build), says the native kernel
    does not run here after all (its build failed: the caller dequantizes)."""
    from mixserve.layers import gguf_kernels
    from mixserve.models import native_store
    from mixserve.models.weights import gguf_meta_dir, read_gguf_native

    def meta():  # the folder (its tokenizer converted once) and the tokenizer, on one thread
        folder = gguf_meta_dir(path)
        return folder, _tokenizer(folder)

    tok_later = _later(meta)
    try:
        # the repacked layout a start before kept (models/native_store.py); else read and repack
        # the file, and keep the result for the next start
        store = native_store.store_path(path)
        kept = native_store.load(store, path)
        if kept is not None:
            cfg, weights, types = kept
            source = f"the repacked layout kept in {store}"
        else:
            if progress:  # the header's parse is seconds before the repack's bar shows
                log.warning("reading %s and repacking it for the native kernel (once: kept in %s for later "
                            "starts)", Path(path).name, store)
            cfg, _, weights, types = read_gguf_native(path, progress=progress)
            native_store.save_in_background(store, path, cfg, weights, types)
            source = "repacked from the file"
        if not kernel_runs():
            log.warning("the native GGUF kernel is not available here after all (%s); dequantizing %s",
                        gguf_kernels.why_not_native(), Path(path).name)
            concurrent.futures.wait([tok_later])
            return None
        model = LlamaForCausalLM(cfg, weights, dtype, max_positions or cfg.max_position_embeddings, None)
        qtypes = {getattr(w, "qtype", None) for w in weights.values()}
        del weights, kept  # the planes' only other references, so that each old plane is freed as it is copied
        from mixserve.layers.gguf_linear import weights_on_huge_pages

        # a kept layout was read onto huge pages (native_store.load); a repacked one, and planes
        # the model made at construction (fused q/k/v and gate/up), are moved now
        weights_on_huge_pages(model)
        startup.mark("huge pages")
    except BaseException:
        concurrent.futures.wait([tok_later])  # its own error, if any, is not this one
        raise
    parts = [f"{t} x{n} ({b / 1e6:.0f} MB)" for t, (n, b) in sorted(types.items(), key=lambda kv: -kv[1][1])]
    native = [t for t in types if t != "F32" and t in qtypes]
    model.weight_format = (f"GGUF weights native ({', '.join(parts)}): {', '.join(native) or 'none'} through the "
                           f"integer kernel (layers/gguf_kernels.py, {gguf_kernels.isa()}), the rest "
                           f"dequantized to {dtype}; {source}")
    model.source_file = Path(path)  # what its float linears' packed copies are kept under (packed_weights)
    startup.mark("weights")
    folder, tok = tok_later.result()
    startup.mark("tokenizer")
    return cfg, model, tok, folder


def _tokenizer(folder: Path):
    if (folder / "tokenizer.json").exists() or (folder / "tokenizer_config.json").exists():
        from mixserve.models.tokenizer import load_tokenizer_folder

        return load_tokenizer_folder(folder)
    return None


def _later(fn) -> concurrent.futures.Future:
    """fn() on a thread of its own, started now. The tokenizer loads this way beside the weights:
    parsing tokenizer.json (models/tokenizer.py: transformers is not imported for it) is mostly the
    GIL-free Rust parser and file reads, the weights' load mostly GIL-free copies."""
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mixserve-tokenizer")
    try:
        return pool.submit(fn)
    finally:
        pool.shutdown(wait=False)  # the thread ends with fn


def load_model(spec: str, dtype: torch.dtype, max_positions: int | None = None, progress: bool = True,
               quantization: str | None = None, group_size: int = 128, lm_head: bool = False,
               gguf_weights: str | None = None):
    """Resolve, (convert,) and load a model. Returns (cfg, model, tokenizer or None, folder).

    GGUF files load natively (their quantized tensors as stored, run by layers/gguf_kernels.py)
    or, with gguf_weights="dequantize" (and always for rtn/awq), from a float32 copy dequantized
    once to an HF folder beside them (models/weights.py); see `use_native_gguf`. A folder whose
    config.json has an AWQ `quantization_config` loads int4 (quant/loading.py); quantization="rtn"
    rounds a dense model's linears to int4 at load; "awq" insists on an AWQ checkpoint. lm_head:
    round a dense-stored LM head to int4 at load too.
    Raises FileNotFoundError / ValueError from model resolution, or ValueError when the
    quantization asked for does not match the checkpoint, with a clear message.
    """
    r = resolve_model(spec)
    if r.kind != "gguf" and gguf_weights == "native":
        raise ValueError(f"gguf_weights native: {spec} is not a GGUF file ({r.kind}); leave --gguf-weights unset")
    if r.kind == "gguf" and use_native_gguf(gguf_weights, quantization, built=False):
        # the file is read and repacked while the kernel builds (a cold start: ~10 s each here)
        loaded = _load_native_gguf(r.path, dtype, max_positions, progress,
                                   lambda: use_native_gguf(gguf_weights, quantization))
        if loaded is not None:
            return loaded
    folder = convert_gguf(r.path, progress=progress) if r.kind == "gguf" else r.path
    cfg = ModelConfig.from_folder(folder)
    quant = QuantSpec.from_hf_config(json.loads((Path(folder) / "config.json").read_text()))
    if quantization == "rtn":
        if quant is not None:
            raise ValueError(f"quantization rtn: {folder} is already an AWQ checkpoint")
        quant = QuantSpec("rtn", group_size)
    elif quantization == "awq" and quant is None:
        # the result of a default `mixserve quantize --model spec`, if there is one
        cached = default_out_dir(spec, AWQConfig(), "pystdlib", 32, 512)
        done = cached / "mixserve_quant.json"
        if done.exists() and json.loads(done.read_text()).get("source") != str(Path(folder).resolve()):
            raise ValueError(f"quantization awq: the cached run {cached} was made from another model than {folder}; "
                             f"run `mixserve quantize --model {spec} --out DIR` and load DIR")
        if not done.exists():
            raise ValueError(f"quantization awq: {folder} is not an AWQ checkpoint and no default AWQ run is cached; "
                             f"run `mixserve quantize --model {spec}` (AWQ is never replaced by RTN)")
        if json.loads(done.read_text()).get("config") != asdict(AWQConfig()):
            # e.g. made by an older mixserve whose default AWQ searched clipping
            raise ValueError(f"quantization awq: the cached run {cached} was made with other AWQ settings than "
                             f"today's default; run `mixserve quantize --model {spec}` again, or load the folder")
        missing = missing_pieces(cached, Path(folder))
        if missing:
            raise ValueError(f"quantization awq: the cached run {cached} lacks {', '.join(missing)}; "
                             f"run `mixserve quantize --model {spec}` again (it redoes such a run)")
        folder = cached
        cfg = ModelConfig.from_folder(folder)
        quant = QuantSpec.from_hf_config(json.loads((folder / "config.json").read_text()))
    if lm_head and quant is not None:
        quant.lm_head = True
        quant.lm_head_group_size = group_size
    tok_later = _later(lambda: _tokenizer(Path(folder)))
    try:
        weights = load_hf_weights(folder)
        model = LlamaForCausalLM(cfg, weights, dtype, max_positions or cfg.max_position_embeddings, quant)
    except BaseException:
        concurrent.futures.wait([tok_later])  # its own error, if any, is not this one
        raise
    # the dense weights' bytes in the compute dtype (the file's copy is float32, cast at load)
    loaded = sum(t.numel() for t in weights.values()) * torch.empty(0, dtype=dtype).element_size()
    del weights
    kind = "int4 " + quant.method if quant is not None else "dense"
    model.weight_format = f"{kind} weights in {dtype}"
    if r.kind == "gguf" and quant is not None:
        model.weight_format += " (dequantized from the GGUF)"
    elif r.kind == "gguf":
        from mixserve.layers import gguf_kernels

        # what the choice costs a decode step: every weight byte is read once a token (issue 43)
        why = "--gguf-weights dequantize" if gguf_weights == "dequantize" else gguf_kernels.why_not_native()
        model.weight_format += (f" (dequantized from the GGUF: {loaded / 1e6:,.0f} MB of weights as loaded, against "
                                f"the file's {Path(r.path).stat().st_size / 1e6:,.0f} MB natively; {why})")
    startup.mark("weights")
    tok = tok_later.result()
    startup.mark("tokenizer")
    return cfg, model, tok, folder


def check_same_vocab(cfg, tok, dcfg, dtok) -> None:
    """Refuse a draft whose vocabulary differs from the target's: same token count and the same
    strings for a spread sample of ids. Raises ValueError naming what differs."""
    if dcfg.vocab_size != cfg.vocab_size:
        raise ValueError(f"draft_model: vocabulary size {dcfg.vocab_size} differs from the target's {cfg.vocab_size}")
    if tok is None and dtok is None:
        return  # token-id-only models (tests): the sizes agree, nothing more to compare
    if tok is None or dtok is None:
        raise ValueError("draft_model: both models need a tokenizer to check they share a vocabulary")
    n = min(len(tok), len(dtok))
    if len(tok) != len(dtok):
        raise ValueError(f"draft_model: tokenizer has {len(dtok)} tokens, the target's has {len(tok)}")
    ids = sorted(set(range(0, n, max(1, n // 997))) | {n - 1})
    a, b = tok.convert_ids_to_tokens(ids), dtok.convert_ids_to_tokens(ids)
    bad = [(i, x, y) for i, x, y in zip(ids, a, b) if x != y]
    if bad:
        raise ValueError(f"draft_model: token strings differ from the target's, e.g. id {bad[0][0]}: "
                         f"{bad[0][1]!r} vs {bad[0][2]!r}")
