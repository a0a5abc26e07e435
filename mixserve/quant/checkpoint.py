"""Writing int4 checkpoints in the AutoAWQ GEMM layout (pack.py), and the `quantize` job.

The folder holds config.json with `quantization_config` {quant_method: awq, bits: 4, group_size,
zero_point: true, version: gemm, modules_to_not_convert}, model.safetensors (qweight/qzeros/scales
per quantized linear under HF names; every other tensor float16, as AutoAWQ writes them), the
tokenizer and generation config, and mixserve_quant.json (method, calibration, time, chosen α).
"""
from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from mixserve.models.config import ModelConfig
from mixserve.quant.awq import LINEARS, AWQConfig, QuantReport, quantize_weights
from mixserve.quant.groupwise import quantize_groupwise
from mixserve.quant.pack import pack_awq

_COPY = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
         "generation_config.json", "chat_template.jinja", "added_tokens.json")


def awq_tensors(name: str, w: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """qweight int32 [in, out/8], qzeros int32 [in/g, out/8], scales float16 [in/g, out] for a
    weight [out, in] (HF layout)."""
    try:
        q, s, z = quantize_groupwise(w.float(), group_size)
    except ValueError as e:
        raise ValueError(f"{name}: cannot round to int4: {e}") from None
    return {name + ".qweight": pack_awq(q.t().contiguous()), name + ".qzeros": pack_awq(z.t().contiguous()),
            name + ".scales": s.t().contiguous()}


def build_state_dict(cfg: ModelConfig, weights: dict[str, torch.Tensor], qc: AWQConfig,
                     report: QuantReport, lm_head: bool = False) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors from transformed float weights (quantize_weights' output)."""
    skipped = {s.split(":")[0] for s in report.skipped}
    targets = {f"model.layers.{i}.{n}" for i in range(cfg.num_layers) for n in LINEARS} - skipped
    if lm_head:
        targets.add("lm_head")
    sd: dict[str, torch.Tensor] = {}
    for k, v in weights.items():
        base, _, leaf = k.rpartition(".")
        if leaf == "weight" and base in targets:
            sd.update(awq_tensors(base, v, qc.group_size))
        else:
            sd[k] = v.to(torch.float16).contiguous()
    if lm_head and "lm_head.qweight" not in sd:  # tied head: quantize a copy of the embedding
        sd.update(awq_tensors("lm_head", weights["model.embed_tokens.weight"], qc.group_size))
    return sd


def save_checkpoint(out: str | Path, cfg: ModelConfig, sd: dict[str, torch.Tensor], qc: AWQConfig,
                    report: QuantReport, source: Path, meta: dict) -> Path:
    """Write the folder atomically (env.publish_dir: built beside it, then renamed; a write that
    raises removes it, so no half-written checkpoint ever has the folder's name); a checkpoint of
    other settings already there is replaced. Returns the folder."""
    from mixserve.env import publish_dir

    return publish_dir(Path(out), lambda tmp: _fill(tmp, cfg, sd, qc, report, source, meta),
                       lambda o: same_run(o, source, meta, qc))


def same_run(out: Path, source: Path, meta: dict, qc: AWQConfig) -> bool:
    """Whether `out` holds a finished checkpoint of these settings (`meta`'s keys and `qc`) with
    nothing missing (`missing_pieces`)."""
    try:
        old = json.loads((out / "mixserve_quant.json").read_text())
    except (OSError, ValueError, RecursionError):
        return False
    return (isinstance(old, dict) and all(old.get(k) == v for k, v in meta.items())
            and old.get("config") == asdict(qc) and not missing_pieces(out, source))


def missing_pieces(out: Path, source: Path) -> list[str]:
    """The files a finished checkpoint in `out` lacks: its weights, config, and each tokenizer or
    generation file that its source folder has (a run from a source whose tokenizer failed to
    load once wrote a checkpoint without one; issue 46)."""
    need = ["model.safetensors", "config.json", *(f for f in _COPY if (source / f).exists())]
    return [f for f in need if not (out / f).is_file()]


def _fill(tmp: Path, cfg: ModelConfig, sd: dict[str, torch.Tensor], qc: AWQConfig, report: QuantReport,
          source: Path, meta: dict) -> None:
    save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    hf = cfg.to_hf()
    hf["torch_dtype"] = "float16"
    if "lm_head.qweight" in sd:
        hf["tie_word_embeddings"] = False
    hf["quantization_config"] = {
        "quant_method": "awq", "bits": qc.bits, "group_size": qc.group_size, "zero_point": True,
        "version": "gemm", "modules_to_not_convert": [s.split(":")[0] for s in report.skipped] or None,
    }
    (tmp / "config.json").write_text(json.dumps(hf, indent=1))
    for f in _COPY:
        if (source / f).exists():
            shutil.copy(source / f, tmp / f)
    (tmp / "mixserve_quant.json").write_text(json.dumps(
        {**meta, "config": asdict(qc), "seconds": round(report.seconds, 1), "skipped": report.skipped,
         "alphas": report.alphas, "groups": report.groups, "verdict": report.verdict() if report.groups else None},
        indent=1))


def default_out_dir(model: str, qc: AWQConfig, calib: str, n: int, seq_len: int) -> Path:
    """Cache folder for a quantize run, so a repeated run with the same settings is a no-op."""
    from mixserve.env import cache_root

    tag = Path(calib).stem if Path(calib).is_file() else calib
    name = Path(model).name.replace(".gguf", "")
    if qc.method == "rtn":
        return cache_root() / "quantized" / f"{name}-rtn-w{qc.bits}-g{qc.group_size}"
    clip = "-clip-" + "+".join(qc.clip_groups) if qc.clip_groups else ""
    return cache_root() / "quantized" / f"{name}-awq-w{qc.bits}-g{qc.group_size}-{tag}-{n}x{seq_len}{clip}"


def measure_rates(cfg: ModelConfig, group_size: int) -> dict[str, float]:
    """This machine's cost of the search's three kinds of work, timed (kernel_choice.time_calls,
    a median) on a weight the size of the model's stacked gate/up (the cost per weight grows once a
    weight leaves the cache): seconds per weight of one α candidate (fake_quantize(w * s) / s), and
    seconds per FLOP of a float32 and of a bfloat16 matmul over 512 tokens. Takes a few seconds on
    a 1.5B model."""
    from mixserve.layers.kernel_choice import time_calls
    from mixserve.quant.groupwise import fake_quantize

    g = torch.Generator().manual_seed(0)
    k = cfg.hidden_size if cfg.hidden_size % group_size == 0 else group_size * -(-4096 // group_size)
    w, s = torch.randn(min(2 * cfg.intermediate_size, 16384), k, generator=g), torch.rand(k, generator=g) + 0.5
    x = torch.randn(512, k, generator=g)

    def best(fn) -> float:
        return time_calls([None], lambda _: fn())

    flops = 2 * x.shape[0] * w.numel()
    xb, wb = x.bfloat16(), w.bfloat16()
    return {"grid_s_per_weight": best(lambda: fake_quantize(w * s, group_size) / s) / w.numel(),
            "f32_s_per_flop": best(lambda: x @ w.t()) / flops,
            "bf16_s_per_flop": best(lambda: xb @ wb.t()) / flops}


def estimate_seconds(cfg: ModelConfig, n: int, seq_len: int, qc: AWQConfig, rates: dict[str, float]) -> float:
    """Rough run time up front from `measure_rates`: the float32 forward over the calibration
    tokens, the α grid (per candidate: the group's weights rounded, then a bf16 error matmul over
    search_tokens) and the clip search, block by block."""
    weights = (cfg.hidden_size * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * cfg.hidden_size
               + 3 * cfg.hidden_size * cfg.intermediate_size)
    fwd = 2 * n * seq_len * weights * rates["f32_s_per_flop"]
    per_candidate = (weights * rates["grid_s_per_weight"]
                     + 2 * min(qc.search_tokens, n * seq_len) * weights * rates["bf16_s_per_flop"])
    clip = (len(qc.clip_groups) / 3 * qc.max_shrink * qc.n_grid
            * (weights * rates["grid_s_per_weight"] + 2 * qc.clip_tokens * weights * rates["bf16_s_per_flop"]))
    return (fwd + qc.n_grid * per_candidate + clip) * cfg.num_layers


def quantize(model: str, qc: AWQConfig, calib: str = "pystdlib", n_samples: int = 32, seq_len: int = 512,
             out: str | Path | None = None, lm_head: bool = False, progress: bool = True,
             log=print) -> Path:
    """`mixserve quantize`: load a dense model, calibrate (AWQ), write the checkpoint.

    Returns the folder; when it already holds a finished run with the same settings, returns it
    at once. Raises ValueError for bad settings or too little calibration text.
    """
    from mixserve.data.corpora import calibration_docs, token_stream
    from mixserve.models.weights import convert_gguf, load_hf_weights
    from mixserve.models.registry import resolve_model

    if qc.bits != 4:
        raise ValueError(f"w_bit: only 4 is supported (got {qc.bits})")
    if qc.group_size < 32 or qc.group_size % 32:
        raise ValueError(f"group_size: must be a multiple of 32 (got {qc.group_size})")
    if n_samples < 1 or seq_len < 16:
        raise ValueError("calib_samples must be >= 1 and calib_seq_len >= 16")
    out = Path(out) if out else default_out_dir(model, qc, calib, n_samples, seq_len)
    if out.exists() and not out.is_dir():
        raise ValueError(f"out: {out} is a file")
    if out.is_dir() and any(out.iterdir()) and not (out / "mixserve_quant.json").exists():
        raise ValueError(f"out: {out} is a non-empty folder that is not a mixserve quantize output; "
                         "choose another (nothing was overwritten)")
    meta = {"model": model, "method": qc.method, "calib": calib if qc.method == "awq" else None,
            "calib_samples": n_samples, "calib_seq_len": seq_len, "lm_head": lm_head}
    r = resolve_model(model)
    folder = convert_gguf(r.path, progress=progress) if r.kind == "gguf" else Path(r.path)
    if out.resolve() == folder.resolve():
        raise ValueError("out: must not be the model's own folder")
    meta["source"] = str(folder.resolve())
    from mixserve.quant.provenance import quantized_release, release_warning

    source_release = quantized_release(model)
    warning = release_warning(model, source_release, "quantize")
    if warning:
        log(warning)
    done = out / "mixserve_quant.json"
    if done.exists():
        try:
            old = json.loads(done.read_text())
        except (OSError, ValueError, RecursionError):
            old = None
        missing = missing_pieces(out, folder)
        if not isinstance(old, dict):
            log(f"{done}: unreadable, so the run is redone")
        elif missing:
            log(f"{out}: lacks {', '.join(missing)}, so the run is redone")
        elif same_run(out, folder, meta, qc):
            log(f"{out}: already quantized with these settings" + (f"; {old['verdict']}" if old.get("verdict") else ""))
            return out
    meta["source_release"] = source_release
    cfg = ModelConfig.from_folder(folder)
    if json.loads((folder / "config.json").read_text()).get("quantization_config"):
        raise ValueError(f"model: {folder} is already quantized; quantize a dense model")
    weights = load_hf_weights(folder)
    calib_ids = None
    if qc.method == "awq":
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(folder))
        docs = calibration_docs(calib, tok)
        ids = token_stream(docs, tok, n_samples * seq_len, tok.eos_token_id, seed=qc.seed)
        if len(ids) < seq_len:
            raise ValueError(f"calib: {calib!r} gives {len(ids)} tokens, fewer than one sample of {seq_len}")
        if len(ids) < n_samples * seq_len:
            log(f"calib: {calib!r} has {len(ids)} tokens: using {len(ids) // seq_len} samples, not {n_samples}")
        n = len(ids) // seq_len
        calib_ids = torch.tensor(ids[: n * seq_len]).view(n, seq_len)
        try:  # an estimate must never stop the run
            est = estimate_seconds(cfg, n, seq_len, qc, measure_rates(cfg, qc.group_size))
            when = (f"{est / 60:.0f} min" if est >= 90 else f"{est:.0f} s") + " on this machine (measured rates)"
        except Exception as e:
            when = f"an unknown time (the rates could not be measured: {e})"
        log(f"AWQ on {model}: {n} x {seq_len} calibration tokens from {calib}; expected about {when}")
    t0 = time.perf_counter()
    # each block's line as it is done (above the progress bar when there is one)
    on_block = tqdm.write if progress and log is print else log
    new_w, report = quantize_weights(cfg, weights, calib_ids, qc, progress=progress, on_block=on_block)
    for s in report.skipped:
        log(f"left unquantized: {s}")
    if report.groups:
        log(report.verdict())
    sd = build_state_dict(cfg, new_w, qc, report, lm_head)
    report.seconds = time.perf_counter() - t0
    save_checkpoint(out, cfg, sd, qc, report, folder, meta)
    log(f"wrote {out} in {report.seconds:.0f} s")
    return out
