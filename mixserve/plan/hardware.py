"""`mixserve hw probe`: measure this machine for one model, and load hardware for the planner.

The probe times the engine's own code on the model's real shapes (random weights: the time of a
matmul does not depend on the values):
  * each fused linear (qkv, o, gate_up, down, lm_head) by rows, as DenseLinear (bf16) and
    Int4Linear (int4, group size 128) — layers/linear.py;
  * paged attention (layers/attention.py) of decode batches by rows and context, and of prefill
    chunks by query tokens and context, through the model runner's own batch preparation;
  * memory bandwidth from a large tensor copy (bytes read + bytes written per second);
  * per-step overhead: real engine steps minus what the linear and attention measurements predict
    for them; the rest (scheduling, batch preparation, embedding, norms, RoPE, sampling, output
    handling) is a + b * seqs from decode batches of 1 to 64 rows, plus c * tokens from prefills.
The profile is JSON; `load_step_model` turns it, or a named accelerator, into a StepModel.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from mixserve.device import move_module, resolve_device, synchronize
from mixserve.models.config import ModelConfig
from mixserve.plan.cost_model import BF16, WeightFormat, gguf_format, linear_shapes
from mixserve.plan.step_time import ACCELERATORS, MeasuredModel, RooflineModel, StepBatch, StepModel

# 3 and 5 are the verification passes of k = 2 and 4 speculative tokens (k + 1 rows), whose cost the
# controller and the planner need, not an interpolation between 2, 4 and 8 (issue 34)
# 1024 and 2048: a prefill chunk's rows (the engine's default budget is 2048 tokens); past the last
# point a table extrapolates in proportion, which on a Zen 5 EPYC made the 0.5B's 2048-row gate+up 22%
# too cheap (the kernel's cost per row grows from 512 rows on)
DEFAULT_ROWS = [1, 2, 3, 4, 5, 8, 16, 32, 64, 128, 256, 512, 1024, 2048]
# decode attention is timed on this grid of (rows, context) per call: its cost per slot is not
# constant (a 32 x 2048 call costs 2.7x per slot what an 8 x 2048 one does on these CPUs, once the
# gathered K/V outgrow the cache), so the planner interpolates the grid instead of a line
DECODE_ATTENTION_ROWS = (1, 4, 16, 64)
DECODE_ATTENTION_CONTEXTS = (64, 256, 1024, 2048)
# a prefill chunk's (or a verification's) attention: queries by the cached prefix before them (a
# chunk after a cached prefix or an earlier chunk). A grid, because a least-squares fit over a few
# shapes (a + b * q + c * query-key pairs) was ruled by the largest: ~1 ms a layer for any span,
# 3.4x a 5-query span's and 60x a 16-token prompt's (issue 34, multi-turn TTFT)
SPAN_QUERIES = (4, 16, 64, 256, 1024, 2048)
SPAN_PREFIXES = (0, 256, 1024, 2048)
PROFILE_VERSION = 1
OVERHEAD_DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64)  # rows of the engine decode steps probe_overhead times

# mixserve's code that does not run in the engine: a profile stays good across changes to it. Everything
# else (the engine, its layers and kernels, quant/, the KV cache, host_memory.py, ...) sets its speed
NOT_ENGINE = ("bench", "data", "plan", "replicas", "server", "cli.py")


def engine_fingerprint() -> str:
    """12 hex digits of sha256 over mixserve's source but NOT_ENGINE (every .py, by relative path) and
    torch's version: what a `hw probe` profile's timings depend on besides the machine. Conservative: any
    edit counts, a comment too. ~5 ms."""
    import hashlib

    import mixserve

    root = Path(mixserve.__file__).parent
    h = hashlib.sha256(torch.__version__.encode())
    for f in sorted(root.rglob("*.py")):
        rel = f.relative_to(root)
        if rel.parts[0] in NOT_ENGINE:
            continue
        h.update(str(rel).encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:12]


def stale_warning(prof: dict) -> str | None:
    """A warning when `prof` was timed on other engine code than this process runs (or says not)."""
    theirs, mine = prof.get("engine_fingerprint"), engine_fingerprint()
    if theirs == mine:
        return None
    what = (f"code whose fingerprint was {theirs}" if theirs is not None
            else "code from before profiles named it")
    return (f"the profile was timed on engine {what}, this mixserve's is {mine}: the engine's speed may have "
            "changed since (a stale profile predicted the int4 decode step at 40 ms where the engine took 58, and "
            "the native default's capacity at half what it was: BENCHMARKS.md, 2026-12-06); run `mixserve hw probe` "
            "again")


def _time(fn, repeats: int, warmup: int = 1, device="cpu") -> float:
    """Median seconds of `repeats` calls after `warmup` (oneDNN builds a primitive per new shape
    on first use; the median drops a noisy neighbour's spikes). On CUDA each call is timed to the
    end of its kernels (launches are asynchronous)."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def fit_nonneg(X: np.ndarray, y: np.ndarray) -> list[float]:
    """Least squares y ≈ X @ c with c >= 0: terms whose coefficient comes out negative (noise)
    are dropped and the rest refitted. Returns the coefficients, 0 for dropped terms."""
    keep = list(range(X.shape[1]))
    while keep:
        c, *_ = np.linalg.lstsq(X[:, keep], y, rcond=None)
        if (c >= 0).all():
            out = [0.0] * X.shape[1]
            for i, v in zip(keep, c):
                out[i] = float(v)
            return out
        keep.pop(int(np.argmin(c)))
    return [0.0] * X.shape[1]


def gguf_shape_types(path, cfg: ModelConfig) -> dict[str, list[tuple[str, int]]]:
    """For each fused matmul shape (cost_model.linear_shapes), the GGUF block types of its parts
    as the file stores them, [(type, rows), ...] in output order, taken from the layer whose
    parts weigh most (the files mix types across layers; Q4_K_M's attn_v and ffn_down alternate)."""
    from mixserve.models.gguf_file import open_gguf

    parts = {"qkv": ("attn_q", "attn_k", "attn_v"), "o": ("attn_output",), "gate_up": ("ffn_gate", "ffn_up"),
             "down": ("ffn_down",)}
    by_name = {t.name: t for t in open_gguf(path).tensors}
    out = {}
    for shape, kinds in parts.items():
        best = None
        for i in range(cfg.num_layers):
            ts = [by_name[f"blk.{i}.{k}.weight"] for k in kinds]
            key = (sum(int(t.n_bytes) for t in ts), [(t.tensor_type.name, int(t.shape[1])) for t in ts])
            best = key if best is None or key[0] > best[0] else best
        out[shape] = best[1]
    head = by_name.get("output.weight", by_name["token_embd.weight"])
    out["lm_head"] = [(head.tensor_type.name, int(head.shape[1]))]
    return out


def _make_linear(fmt: str, out_f: int, in_f: int, dtype, group_size: int, chooser, head: bool = False,
                 tied: bool = False, gguf_parts: list[tuple[str, int]] | None = None, device="cpu"):
    """A linear as the engine would build and run it here: DenseLinear / Int4Linear / GGUFLinear
    (random weights of the file's block types, `gguf_parts`) with the kernel `chooser` picks for
    its shape (layers/kernel_choice.py); head: an LM head, with its float32 result (`float_out`);
    tied: a dense head whose plain weight the embedding holds. On CUDA the linear is moved there
    as the engine places a model (LlamaForCausalLM.place): cuBLAS for bf16, PyTorch's CUDA int4
    kernel for int4; the CPU kernel choice does not apply."""
    from mixserve.layers import batch_invariance
    from mixserve.layers.gguf_linear import NATIVE_TYPES, GGUFLinear, random_weight
    from mixserve.layers.linear import DenseLinear, Int4Linear, choose_linear_kernel

    g = torch.Generator().manual_seed(0)
    if fmt == "gguf" and all(t in NATIVE_TYPES for t, _ in gguf_parts):
        lin = GGUFLinear([random_weight(t, n, in_f, seed=i) for i, (t, n) in enumerate(gguf_parts)], None, dtype)
    elif fmt in ("bf16", "gguf"):  # a GGUF part without a native kernel: the engine runs that linear dense
        lin = DenseLinear(torch.randn(out_f, in_f, generator=g).to(dtype) * 0.02)
    else:
        q = torch.randint(0, 16, (out_f, in_f), generator=g, dtype=torch.int32)
        s = torch.rand(out_f, in_f // group_size, generator=g).half() * 0.01
        z = torch.randint(0, 16, (out_f, in_f // group_size), generator=g, dtype=torch.int32)
        lin = Int4Linear(q, s, z, group_size, None, dtype)
    lin.float_out = head
    if isinstance(lin, DenseLinear):
        lin.keep_plain = head and tied
    if torch.device(device).type != "cpu":
        if head and isinstance(lin, Int4Linear):  # as LlamaForCausalLM.place: a dense head on the GPU
            lin = DenseLinear(lin.dense_weight().to(dtype))
            lin.float_out = True
        lin = move_module(lin, torch.device(device))
    # the engine's default on the CPU is batch invariance (layers/batch_invariance.py): its kernels
    invariant = torch.device(device).type == "cpu" and batch_invariance.unavailable() is None
    choose_linear_kernel(lin, chooser, dtype, invariant=invariant)
    if invariant:
        batch_invariance.apply_linear(lin)
    return lin


def _rotating_timer(lin, nbytes: int, device="cpu"):
    """seconds(x) of one call of `lin` on rotating copies past the last-level cache, as a decode
    step streams its weights (a cache-hot timing made bf16 look 3-5x faster than in the engine at
    1 row, benchmarks/probe_cache.py). Copies share nothing but the kernel choice."""
    import copy

    from mixserve.layers.gguf_linear import GGUFLinear, clone_weight
    from mixserve.layers.kernel_choice import rotating_copies, time_calls

    def clone():
        m = copy.copy(lin)
        for k, v in list(vars(lin).items()):
            if isinstance(v, torch.Tensor) and not k.startswith("_"):
                setattr(m, k, v.clone())
        if isinstance(lin, GGUFLinear):  # its tensors live in the parts
            m.parts = [clone_weight(p) for p in lin.parts]
        return m
    if torch.device(device).type == "cuda":
        # past the GPU's L2 (tens of MB): copies worth 256 MB, at most 16
        copies = [lin] + [clone() for _ in range(min(15, (256 << 20) // max(1, nbytes)))]

        def gpu_timer(x, passes: int):
            with torch.inference_mode():
                for m in copies[:2]:
                    m(x)
                return min(_time(lambda: [m(x) for m in copies], 1, 0, device) / len(copies)
                           for _ in range(max(1, passes)))
        return gpu_timer
    copies = [lin] + rotating_copies(clone, nbytes)[1:]

    def timer(x, passes: int):
        with torch.inference_mode():
            return time_calls(copies, lambda m: m(x), min_passes=passes, min_seconds=0.0)
    return timer


def _recheck(timer, rows: list[int], ts: list[float], in_features: int, dtype, repeats: int,
             slack: float = 1.15, device="cpu") -> list[int]:
    """A matmul never gets much faster with more rows, so a point over `slack` times the next
    larger one was probably disturbed (another process, a thread wake-up): time it again, keeping
    the smaller median, up to twice. (A 1-row gate/up at 1.20 ms beside 0.76 ms at 2 rows once put
    3 ms on the fitted per-step overhead.) Updates ts in place; returns the rows still over twice
    the next larger one's time."""
    suspect = []
    for i in range(len(rows) - 2, -1, -1):
        for _ in range(2):
            if ts[i] <= slack * ts[i + 1]:
                break
            x = torch.randn(rows[i], in_features, device=device).to(dtype)
            ts[i] = min(ts[i], timer(x, 2 * repeats))
        if ts[i] > 2 * ts[i + 1]:
            suspect.append(rows[i])
    return sorted(suspect)


def probe_linears(cfg: ModelConfig, rows: list[int], formats: list[str], dtype, repeats: int,
                  group_size: int = 128, log=print, chooser=None, gguf_path=None, device="cpu") -> dict:
    """{format: {shape: {"rows": [...], "seconds": [...], "kernel": ...}}}: median seconds of one
    call, with the kernel the engine chooses on this machine, weights rotating past the cache.
    Format "gguf" needs `gguf_path`: each shape is timed with that file's block types."""
    from mixserve.layers.kernel_choice import KernelChooser
    from mixserve.layers.linear import int4_supported

    chooser = chooser or KernelChooser(timing="measure", budget_s=math.inf)
    out = {}
    if "gguf" in formats:
        if torch.device(device).type != "cpu":
            raise ValueError("formats: gguf's native kernels are CPU code; on a GPU the engine runs GGUF dequantized")
        if gguf_path is None:
            raise ValueError("formats: gguf needs a GGUF model (its block types are what is timed)")
        gguf_types = gguf_shape_types(gguf_path, cfg)
    # bf16 first: an int4 shape the kernel cannot take reuses its dense time
    for fmt in sorted(set(formats) | ({"bf16"} if "int4" in formats else set())):
        out[fmt] = {}
        for s in linear_shapes(cfg):
            why = int4_supported(s.out_features, s.in_features, group_size) if fmt == "int4" else None
            if why:  # the engine leaves this linear dense (quant/loading.py make_linear): so is its time
                out[fmt][s.name] = {**out["bf16"][s.name], "note": f"runs dense in the engine: {why}"}
                log(f"  {fmt:5} {s.name:8} runs dense ({why})")
                continue
            gparts = gguf_types[s.name] if fmt == "gguf" else None
            lin = _make_linear(fmt, s.out_features, s.in_features, dtype, group_size, chooser,
                               head=s.name == "lm_head", tied=cfg.tie_word_embeddings, gguf_parts=gparts,
                               device=device)
            if fmt == "gguf" and hasattr(lin, "qtypes"):
                switch = lin.float_dense_rows if lin.float_out else lin.dense_rows
                kernel = f"gguf {lin.qtypes}, " + (f"dense from {switch} rows" if switch is not None
                                                   else "kernel at every row count")
                nbytes = lin.weight_bytes()
            elif fmt == "gguf":
                kernel = f"dense {lin.impl} ({'+'.join(t for t, _ in gparts)}: no native kernel for all parts)"
                nbytes = s.numel * (torch.finfo(dtype).bits // 8)
            elif torch.device(device).type != "cpu":
                kernel = ("cuBLAS" if fmt == "bf16" else f"int4 {getattr(lin, 'kernel', '?')}, "
                          f"dense from {lin.dense_rows} rows")
                nbytes = s.numel * (torch.finfo(dtype).bits // 8 if fmt == "bf16" else 1) // (1 if fmt == "bf16" else 2)
            else:
                kernel = getattr(lin, "impl", None) or f"int4, dense from {lin.dense_rows} rows"
                nbytes = s.numel * (torch.finfo(dtype).bits // 8 if fmt == "bf16" else 1) // (1 if fmt == "bf16" else 2)
            timer = _rotating_timer(lin, nbytes, device)
            ts = []
            for r in rows:
                x = torch.randn(r, s.in_features, device=device).to(dtype)
                # few passes for the big calls: their spread is small relative to their time
                ts.append(timer(x, repeats if r * s.numel < 2e9 else 1))
            suspect = _recheck(timer, rows, ts, s.in_features, dtype, repeats, device=device)
            del timer
            out[fmt][s.name] = {"rows": list(rows), "seconds": ts, "out_features": s.out_features,
                                "in_features": s.in_features, "kernel": kernel}
            if suspect:
                out[fmt][s.name]["suspect_rows"] = suspect
                log(f"  warning: {fmt} {s.name}: fewer rows still timed slower than more at rows {suspect} after "
                    "re-measuring; the host is probably busy, and a plan from this profile will be off")
            log(f"  {fmt:5} {s.name:8} [{s.out_features}x{s.in_features}] {kernel}: "
                + " ".join(f"{r}:{t * 1e3:.2f}ms" for r, t in zip(rows, ts)))
    return {f: out[f] for f in formats}


class _Holder:
    """Stands in for a model when only the runner's batch preparation is wanted (batch_invariant:
    the runner prepares every row for the paged kernel, as for an invariant model)."""

    def __init__(self, batch_invariant: bool = False):
        self.batch_invariant = batch_invariant

    def bind_kv_cache(self, k, v):
        pass


def _attention_case(cfg: ModelConfig, dtype, decode_ctx: list[int], span: tuple[int, int] | None,
                    repeats: int, block_size: int = 16, decode: str = "sdpa", device="cpu",
                    invariant: bool = False) -> float:
    """Median seconds of one layer's paged_attention for the given batch, prepared by the
    engine's ModelRunner over a BlockManager holding just these sequences. invariant: as a
    batch-invariant engine runs it, every row (prefill ones too) on the paged kernel (issue 34:
    timed on SDPA instead, a 2048-token chunk's attention came out 3.5x too cheap)."""
    from mixserve.engine.model_runner import BatchItem, ModelRunner
    from mixserve.kv.block_manager import BlockManager
    from mixserve.layers.attention import paged_attention

    need = sum(-(-c // block_size) for c in decode_ctx) + (-(-span[1] // block_size) if span else 0)
    bm = BlockManager(need + 1, block_size)
    one = ModelConfig(**{**cfg.as_dict(), "num_layers": 1})
    runner = ModelRunner(_Holder(invariant), one, bm, need + 1, block_size, dtype, device)
    items = []
    for i, c in enumerate(decode_ctx):
        bm.append_slots(i, 0, c)
        items.append(BatchItem(i, [0] * c, c - 1, c, 1))
    if span:
        q, c = span
        bm.append_slots(10**6, 0, c)
        items.append(BatchItem(10**6, [0] * c, c - q, c, 1))
    batch = runner.prepare(items)
    T = batch.input_ids.shape[0]
    qt = torch.randn(T, cfg.num_heads, cfg.head_dim, device=device).to(dtype)
    kt = torch.randn(T, cfg.num_kv_heads, cfg.head_dim, device=device).to(dtype)
    vt = torch.randn(T, cfg.num_kv_heads, cfg.head_dim, device=device).to(dtype)
    kc, vc = runner.k_caches[0], runner.v_caches[0]
    with torch.inference_mode():
        return _time(lambda: paged_attention(qt, kt, vt, kc, vc, batch.meta, cfg.head_dim ** -0.5, decode), repeats,
                     device=device)


def probe_attention(cfg: ModelConfig, dtype, repeats: int, max_context: int = 2048, log=print,
                    chooser=None, device="cpu", invariant: bool = False) -> dict:
    """Decode attention over a (rows, context) grid and span attention over (queries, context),
    one layer, with least-squares fits; the decode grid itself is kept for the planner
    (MeasuredModel interpolates it), the decode fit is for reading. Decode rows use the kernel
    the engine chooses here (`chooser`); with `invariant` (a batch-invariant engine) every row
    uses the paged kernel, as the engine's runner prepares them."""
    from mixserve.layers.attention import choose_decode_kernel
    from mixserve.layers.kernel_choice import KernelChooser

    chooser = chooser or KernelChooser(timing="measure", budget_s=math.inf)
    decode = (choose_decode_kernel(chooser, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, dtype)
              if torch.device(device).type == "cpu" else "sdpa")
    dec_pts = []
    rows_grid = DECODE_ATTENTION_ROWS
    ctx_grid = sorted({c for c in DECODE_ATTENTION_CONTEXTS if c < max_context} | {max_context})
    for b in rows_grid:
        for c in ctx_grid:
            t = _attention_case(cfg, dtype, [c] * b, None, repeats, decode=decode, device=device, invariant=invariant)
            dec_pts.append({"rows": b, "context": c, "seconds": t})
    X = np.array([[1.0, p["rows"], p["rows"] * p["context"]] for p in dec_pts])
    dec_fit = fit_nonneg(X, np.array([p["seconds"] for p in dec_pts]))
    grid = {"rows": list(rows_grid), "context": ctx_grid,
            "seconds": [[next(p["seconds"] for p in dec_pts if p["rows"] == b and p["context"] == c)
                         for c in ctx_grid] for b in rows_grid]}
    span_pts = []
    qs = sorted({q for q in SPAN_QUERIES if q < max_context} | {max_context})
    # two prefixes at least (a short context's probe): a row's time grows along them
    prefixes = sorted({p for p in SPAN_PREFIXES if p < max_context} | {max_context // 2})
    timed: dict[tuple[int, int], float] = {}
    for q in qs:
        for pre in prefixes:
            c = min(q + pre, max_context)  # past the model's context the cell is its largest shape
            if (q, c) not in timed:
                timed[q, c] = _attention_case(cfg, dtype, [], (q, c), repeats, device=device, invariant=invariant)
            span_pts.append({"queries": q, "prefix": pre, "context": c, "seconds": timed[q, c]})
    X = np.array([[1.0, p["queries"], p["queries"] * p["context"] - p["queries"] * (p["queries"] - 1) // 2]
                  for p in span_pts])
    span_fit = fit_nonneg(X, np.array([p["seconds"] for p in span_pts]))
    cell = {(p["queries"], p["prefix"]): p for p in span_pts}
    span_grid = {"queries": qs, "prefix": prefixes,
                 "seconds": [[cell[q, pre]["seconds"] for pre in prefixes] for q in qs],
                 "context": [[cell[q, pre]["context"] for pre in prefixes] for q in qs]}
    log(f"  attention decode fit a={dec_fit[0] * 1e6:.1f}us b={dec_fit[1] * 1e6:.2f}us/row "
        f"c={dec_fit[2] * 1e9:.2f}ns/context-token; span fit a={span_fit[0] * 1e6:.1f}us "
        f"b={span_fit[1] * 1e6:.2f}us/query c={span_fit[2] * 1e9:.3f}ns/pair (per layer)")
    return {"invariant": invariant,
            "decode": {"points": dec_pts, "fit": dec_fit, "terms": ["1", "rows", "sum(context)"], "grid": grid,
                       "kernel": "paged (every row: batch invariance)" if invariant else decode},
            "span": {"points": span_pts, "fit": span_fit, "terms": ["1", "queries", "query-key pairs"],
                     "grid": span_grid}}


def probe_masks(model: str, vocab_size: int, eos_ids: list[int], steps: int = 16, log=print) -> dict:
    """Structured output's cost per step: seconds to fill and apply the grammar masks of 1 and of 24
    constrained rows (the 24 JSON schemas of data/schemas.py, each matcher moved on by a random
    allowed token between steps, so the states vary), the median over `steps` steps, and the fit
    t = a + b * rows through the two (StepModel.mask_time). Raises ValueError where the model
    has no tokenizer."""
    import random
    import statistics

    from mixserve.data.schemas import SCHEMAS
    from mixserve.models.weights import load_tokenizer
    from mixserve.structured_output import StructuredOutputs, masks
    from mixserve.structured_output.compiler import GrammarCompiler

    tok = load_tokenizer(model)
    gc = GrammarCompiler(lambda: tok, vocab_size, eos_ids)
    rng = random.Random(0)
    logits = torch.zeros(len(SCHEMAS), vocab_size)
    points = {}
    for n in (1, len(SCHEMAS)):
        ms = [gc.matcher(StructuredOutputs(json=s)) for _, s in SCHEMAS[:n]]
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            mask = masks.fill(gc.executor, [(k, m, []) for k, m in enumerate(ms)], n, vocab_size)
            masks.apply(logits[:n], list(range(n)), mask)
            times.append(time.perf_counter() - t0)
            ok = masks.allowed(mask, vocab_size)
            for k, m in enumerate(ms):
                ids = [i for i in ok[k].nonzero().flatten().tolist() if i not in eos_ids]
                if ids and not m.is_stopped():
                    m.consume_token(rng.choice(ids))
        points[n] = statistics.median(times)
    n = len(SCHEMAS)
    b = max(0.0, (points[n] - points[1]) / (n - 1))
    a = max(0.0, points[1] - b)
    log(f"  grammar masks: {1e3 * points[1]:.2f} ms for 1 constrained row, {1e3 * points[n]:.2f} ms for {n}")
    return {"seconds": {str(k): v for k, v in points.items()}, "fit": [a, b], "terms": ["1", "rows"],
            "source": f"{n} JSON schemas (data/schemas.py), random allowed tokens, median of {steps} steps"}


def probe_bandwidth(nbytes: int = 1 << 29, repeats: int = 5, device="cpu") -> float:
    """Bytes per second of a large tensor copy on `device`, counting the read and the write."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    b = torch.empty_like(a)
    t = _time(lambda: b.copy_(a), repeats, device=device)
    return 2 * nbytes / t


def fit_overhead(decode: list[dict], prefill: list[dict]) -> list[float]:
    """[a, b, c] seconds of overhead = a + b * seqs + c * tokens from engine-step points
    ({"seqs", "tokens", "seconds", "predicted_compute"}): a and b (>= 0) by least squares on the
    decode points' residuals alone, each weighted by 1 / predicted_compute, then c (>= 0) as the
    median per-token residual of the prefill points after a + b (0 without prefill points). See probe_overhead for why."""
    # each point weighted by 1 / its predicted compute: the residual's noise is a share of the step
    # (the host drifts by a few percent), so a 64-row step's ±10 ms must not outvote the 1-row step
    w = np.array([1.0 / max(p["predicted_compute"], 1e-6) for p in decode])
    X = np.array([[1.0, p["seqs"]] for p in decode]) * w[:, None]
    y = np.array([p["seconds"] - p["predicted_compute"] for p in decode]) * w
    a, b = fit_nonneg(X, y)
    per_token = [(p["seconds"] - p["predicted_compute"] - a - b) / p["tokens"] for p in prefill]
    return [a, b, max(0.0, statistics.median(per_token)) if per_token else 0.0]


def overhead_engine(model: str, dtype, device="cpu", gguf_weights: str | None = None, context: int | None = None):
    """The engine `probe_overhead` steps (its own kernel choices, a 256 MiB cache); gguf_weights as
    EngineArgs' (a GGUF model: "native" where its tables were timed, else "dequantize", so that the
    steps run the weights whose tables predict them). context: the model's context length, when
    under the engine's 2048 tokens here."""
    from mixserve.engine.args import EngineArgs
    from mixserve.engine.llm_engine import LLMEngine

    return LLMEngine(EngineArgs(model=model, dtype=dtype, kv_cache_memory="256MiB", progress=False,
                                max_num_batched_tokens=4096, max_model_len=min(2048, context or 2048),
                                device=str(device),
                                gguf_weights=gguf_weights))


def engine_format(model, gguf_path=None) -> WeightFormat:
    """The WeightFormat an engine's model runs: "gguf" (cost_model.gguf_format of `gguf_path`) when
    its linears are native GGUF ones, else bf16 (the dense tables; an int4 engine is not probed)."""
    from mixserve.layers.gguf_linear import GGUFLinear

    if gguf_path is not None and any(isinstance(m, GGUFLinear) for m in model.modules()):
        return gguf_format(gguf_path)
    return BF16


def live_linear_seconds(model, rows: int, repeats: int) -> float:
    """Median seconds of one pass of `rows` random rows through every linear of `model` (an
    engine's, all layers then the LM head, in module order), as a decode step streams them: the
    machine's linear speed at this moment, for `probe_overhead`'s drift correction."""
    from mixserve.layers.gguf_linear import GGUFLinear
    from mixserve.layers.linear import DenseLinear, Int4Linear

    # native GGUF linears too: the default for a GGUF model, whose embedding has no `.weight`
    lins = [m for m in model.modules() if isinstance(m, (DenseLinear, Int4Linear, GGUFLinear))]
    device = next(iter(model.buffers()), None)
    device = device.device if device is not None else next(model.parameters()).device
    xs = {k: torch.randn(rows, k, device=device).to(model.dtype) for k in {m.in_features for m in lins}}

    def one():
        for m in lins:
            m(xs[m.in_features])
    with torch.inference_mode():
        return _time(one, repeats, device=device)


def probe_overhead(model: str, dtype, partial: dict, repeats: int, log=print,
                   decode_batches: tuple[int, ...] = OVERHEAD_DECODE_BATCHES, engine=None,
                   reference: dict | None = None, fmt: WeightFormat = BF16) -> dict:
    """Real engine steps minus the linear + attention time `partial` predicts for them.

    Decode batches of `decode_batches` rows (32-token prompts, the median of `repeats` steps each)
    give a + b * seqs: in a decode step the matmuls are small, so the residual is mostly the
    per-step and per-sequence work (scheduling, batch preparation, norms, RoPE, sampling, output
    handling). Prefills of 32 and 256 tokens (at most half the context) then give c (per token) from what is left after
    a + b. Prefill residuals are not used for a and b: there the matmul time is tens of times
    the overhead, so their residual is mostly the linear tables' own error, and one such point
    once pulled the per-step constant from 25 ms to 9 ms and invented a per-sequence term.
    Drift: the tables were timed minutes before these steps, and the host's speed drifts by a few
    percent over minutes, as much as the 1-row overhead itself. With `reference` ({rows: seconds
    of `live_linear_seconds` on `engine`'s model, timed right after the tables}), each decode
    point's predicted linear time is scaled by the same timing repeated right after its steps.
    fmt: the weights the engine runs (engine_format): its steps are predicted from that format's
    tables (a native GGUF engine's steps from the bf16 tables once left a negative residual).
    Returns {"points", "fit": [a, b, c] seconds, "terms", "format"}."""
    from mixserve.sampling_params import SamplingParams

    eng = engine or overhead_engine(model, dtype)
    sm = MeasuredModel(eng.cfg, {**partial, "overhead": {"fit": [0.0, 0.0, 0.0]}})
    pts = []
    # a short-context model (a test's) gets shorter prefills and budgets within its context
    big = min(256, eng.max_model_len // 2)
    sp = SamplingParams(max_tokens=max(repeats + 2, min(1500, eng.max_model_len - big - 1)), ignore_eos=True,
                        temperature=0.0)
    rng = torch.Generator().manual_seed(0)

    def ids(n):
        return torch.randint(0, eng.cfg.vocab_size, (n,), generator=rng).tolist()

    for b in decode_batches:
        rids = [eng.add_request(ids(32), sp) for _ in range(b)]
        eng.step()  # the prefills
        ctx = [33] * b
        ts, pred = [], []
        for _ in range(repeats + 1):  # the first decode step of a new batch size pays oneDNN's setup
            t0 = time.perf_counter()
            eng.step()
            ts.append(time.perf_counter() - t0)
            pred.append(sm.breakdown(StepBatch(ctx, [], b), fmt))
            ctx = [c + 1 for c in ctx]
        lin = statistics.median(p["linear"] + p["lm_head"] for p in pred[1:])
        attn = statistics.median(p["attention"] for p in pred[1:])
        point = {"seqs": b, "tokens": b, "seconds": statistics.median(ts[1:]), "predicted_compute": lin + attn}
        if reference and b in reference:
            drift = live_linear_seconds(eng.model, b, repeats) / reference[b]
            point.update(predicted_compute=lin * drift + attn, drift=drift)
        pts.append(point)
        for r in rids:
            eng.abort(r)
    pre = []
    for n in (32, big) * (repeats + 1):  # the first of each shape pays for oneDNN's primitive setup
        rid = eng.add_request(ids(n), sp)
        t0 = time.perf_counter()
        eng.step()
        t = time.perf_counter() - t0
        eng.abort(rid)
        pre.append({"seqs": 1, "tokens": n, "seconds": t,
                    "predicted_compute": sm.step_time(StepBatch([], [(n, n)], 1), fmt)})
    pre = pre[2:]
    fit = fit_overhead(pts, pre)
    for n in (32, big):  # report the median prefill of each shape
        ps = sorted((p for p in pre if p["tokens"] == n), key=lambda p: p["seconds"])
        pts.append(ps[len(ps) // 2])
    for p in pts:
        log(f"  engine step seqs={p['seqs']} tokens={p['tokens']}: {p['seconds'] * 1e3:.2f} ms, "
            f"linear+attention predict {p['predicted_compute'] * 1e3:.2f} ms"
            + (f" (linears x{p['drift']:.3f}: the machine's speed since the tables)" if "drift" in p else ""))
    log(f"  overhead fit a={fit[0] * 1e3:.3f}ms b={fit[1] * 1e3:.3f}ms/seq c={fit[2] * 1e6:.2f}us/token")
    return {"points": pts, "fit": fit, "terms": ["1", "seqs", "tokens"], "format": fmt.name}


def default_probe_formats(resolved, device) -> tuple[str, ...]:
    """The weight formats `hw probe` times unless told: bf16 and int4, and a GGUF model's tensors as
    stored where the engine runs them so by default (cost_model.default_format: its native kernel
    here, a CPU). Without them the probe's engine steps ran the dequantized bf16 copy, ~2.5x slower
    a decode step than the native engine `serve` starts, and `plan` could not plan that default."""
    from mixserve.plan.cost_model import default_format

    native = resolved.kind == "gguf" and torch.device(device).type == "cpu" and default_format(resolved).name == "gguf"
    return ("bf16", "int4", "gguf") if native else ("bf16", "int4")


def probe(model: str, rows: list[int] | None = None, formats: tuple[str, ...] | None = None,
          repeats: int = 5, max_context: int = 2048, engine_steps: bool = True, log=print,
          device: str = "cpu") -> dict:
    """Measure this machine for `model` (a built-in name, GGUF or HF folder) on `device` ("cpu",
    "cuda", "auto"). Returns the profile dict (JSON-serializable); see the module docstring for
    what is measured. On a GPU the profile also carries `datasheet` (gpu_datasheet_ratio): the
    measured bandwidth and bf16 GEMM rate over the named GPU's datasheet figures.

    Raises ValueError for empty rows, an unknown format, or a device that is not here.
    """
    from mixserve.env import machine_info
    from mixserve.engine.args import default_dtype
    from mixserve.models.weights import gguf_meta_dir
    from mixserve.models.registry import resolve_model

    rows = sorted(set(rows or DEFAULT_ROWS))
    if not rows or rows[0] < 1:
        raise ValueError("rows: give positive row counts, e.g. 1,2,4,...,512")
    r = resolve_model(model)
    dev = resolve_device(device)
    formats = tuple(dict.fromkeys(formats)) if formats is not None else default_probe_formats(r, dev)  # once each
    bad = [f for f in formats if f not in ("bf16", "int4", "gguf")]
    if bad:
        raise ValueError(f"formats: unknown {bad}; use bf16, int4 and/or gguf")
    if "gguf" in formats and r.kind != "gguf":
        raise ValueError(f"formats: gguf times a GGUF file's own block types; {model} is not a GGUF model")
    folder = gguf_meta_dir(r.path) if r.kind == "gguf" else r.path
    cfg = ModelConfig.from_folder(folder)
    gpu = dev.type == "cuda"
    dtype = default_dtype(dev)
    where = torch.cuda.get_device_name(dev) if gpu else machine_info()["cpu"]
    log(f"probing {model} on {where} ({torch.get_num_threads()} threads, {dtype}; formats {', '.join(formats)})")
    warnings = []
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    cores = os.cpu_count() or 1
    if load > 0.5 * cores and not gpu:
        warnings.append(f"the load average was {load:.1f} on {cores} cores when the probe started: other work "
                        "shares the CPUs, and the timings may not be this machine's")
        log(f"  warning: {warnings[-1]}")
    from mixserve.layers.kernel_choice import KernelChooser, amx_permitted, cap_threads

    cap_threads()
    if not gpu:
        # malloc as the engine sets it (LLMEngine): without it every big activation of a many-row call
        # faulted fresh pages in, and the 1024-3000-row tables predicted a prefill 25-43% slower than the
        # engine ran it (benchmarks/prefill_chunks.py, 2026-12-06)
        from mixserve.host_memory import keep_freed_heap

        keep_freed_heap()
    amx = amx_permitted() and not gpu
    chooser = KernelChooser(timing="measure", budget_s=math.inf)
    t0 = time.perf_counter()
    bw = probe_bandwidth(device=dev)
    log(f"  memory bandwidth (copy, read + write): {bw / 1e9:.1f} GB/s")
    prof = {
        "version": PROFILE_VERSION,
        "kind": "measured",
        "model": model,
        "config": cfg.as_dict(),
        "dtype": str(dtype).replace("torch.", ""),
        "int4_group_size": 128,
        "machine": {**machine_info(), "device": where if gpu else "cpu"},
        "engine_fingerprint": engine_fingerprint(),
        "bandwidth_bytes_per_s": bw,
        "linear": probe_linears(cfg, rows, list(formats), dtype, repeats, log=log, chooser=chooser,
                                gguf_path=r.path if r.kind == "gguf" else None, device=dev),
    }
    eng = reference = None
    if engine_steps:
        # the engine steps come minutes after the tables: the same linears timed through the
        # engine now and again then measure the host's drift between the two (probe_overhead)
        # a GGUF model's steps run native only where its gguf tables were timed to predict them
        gguf_path = r.path if r.kind == "gguf" else None
        eng = overhead_engine(model, dtype, dev, gguf_weights=None if gguf_path is None or gpu else
                              ("native" if "gguf" in formats else "dequantize"), context=cfg.max_position_embeddings)
        eng_fmt = engine_format(eng.model, gguf_path)
        reference = {b: live_linear_seconds(eng.model, b, repeats) for b in OVERHEAD_DECODE_BATCHES}
    # the rows' attention as the engine runs it: with batch invariance (the CPU default) every row,
    # prefill ones too, on the paged kernel
    if eng is not None:
        invariant = bool(getattr(eng.model, "batch_invariant", False))
    else:
        from mixserve.layers import batch_invariance

        invariant = not gpu and batch_invariance.unavailable() is None
    prof["attention"] = probe_attention(cfg, dtype, repeats, max_context, log=log, chooser=chooser, device=dev,
                                        invariant=invariant)
    prof["kernels"] = {"amx": amx, "threads": torch.get_num_threads(),
                       "choices": {c.key: {"name": c.name, "source": c.source, "timings": c.timings}
                                   for c in chooser.choices.values()}}
    log(f"  kernels ({torch.get_num_threads()} threads, AMX {'permitted' if amx else 'not used'}):")
    for line in chooser.describe():
        log(f"    {line}")
    if engine_steps:
        prof["overhead"] = probe_overhead(model, dtype, prof, repeats, log=log, engine=eng, reference=reference,
                                          fmt=eng_fmt)
        del eng
    else:
        prof["overhead"] = {"points": [], "fit": [0.0, 0.0, 0.0], "terms": ["1", "seqs", "tokens"],
                            "note": "not measured (--no-engine-steps)"}
    try:
        prof["structured"] = probe_masks(model, cfg.vocab_size, list(cfg.eos_token_ids), log=log)
    except ValueError as e:  # no tokenizer: no constrained requests to plan for
        prof["structured"] = {"fit": [0.0, 0.0], "terms": ["1", "rows"], "note": f"not measured: {e}"}
    if gpu:
        prof["datasheet"] = gpu_datasheet_ratio(where, bw, prof["linear"].get("bf16", {}))
        d = prof["datasheet"]
        if d.get("accelerator"):
            log(f"  against the {d['name']} datasheet: bandwidth {d['bandwidth_ratio']:.0%}, "
                f"bf16 GEMM {d['flops_ratio']:.0%} of the roofline the planner's --hardware {d['accelerator']} assumes")
        else:
            log(f"  no datasheet entry for {where!r} ({', '.join(ACCELERATORS)})")
    prof["probe_seconds"] = time.perf_counter() - t0
    for w in consistency_warnings(prof):
        warnings.append(w)
        log(f"  warning: {w}")
    prof["warnings"] = warnings
    return prof


def gpu_datasheet_ratio(gpu_name: str, bandwidth: float, bf16_linear: dict) -> dict:
    """The probe's GPU figures over the datasheet's (plan/step_time.ACCELERATORS) for the GPU
    named `gpu_name` (torch.cuda.get_device_name, e.g. "NVIDIA H200"): bandwidth (copy, bytes/s)
    and the best bf16 linear rate (FLOP/s, 2 * rows * out * in / seconds over `bf16_linear`'s
    table). Returns {} fields with None when no accelerator's name matches."""
    import re

    key = None
    name = gpu_name.lower()
    for k in ACCELERATORS:
        # "h100-sxm" -> the word "h100" in the name ("l4" must not match "L40S")
        if re.search(rf"\b{re.escape(k.split('-')[0])}\b", name) and (key is None or len(k) > len(key)):
            key = k
    flops = 0.0
    for t in bf16_linear.values():
        for r, sec in zip(t["rows"], t["seconds"]):
            flops = max(flops, 2 * r * t["out_features"] * t["in_features"] / max(sec, 1e-12))
    if key is None:
        return {"accelerator": None, "bandwidth_bytes_per_s": bandwidth, "bf16_flops": flops}
    acc = ACCELERATORS[key]
    return {"accelerator": key, "name": acc.name, "bandwidth_bytes_per_s": bandwidth, "bf16_flops": flops,
            "bandwidth_ratio": bandwidth / acc.bandwidth, "flops_ratio": flops / acc.bf16_flops}


def consistency_warnings(prof: dict, factor: float = 1.5) -> list[str]:
    """Ways a profile contradicts itself: an engine decode step that the linear and attention
    tables predict at more than `factor` times its measured time (the tables' parts cannot take
    longer than the whole step). It happens when the CPUs are shared during the probe: with
    every core's thread waiting on a busy neighbour, a 1-row matmul that takes 0.1 ms alone
    took 8 ms. Returns one message per contradiction (empty when consistent)."""
    out = []
    pts = prof.get("overhead", {}).get("points", []) if isinstance(prof.get("overhead"), dict) else []
    for p in pts if isinstance(pts, list) else []:
        try:
            bad = p["seqs"] == p["tokens"] and p["predicted_compute"] > factor * p["seconds"]
        except (KeyError, TypeError):
            continue  # a hand-edited point: not this check's business
        if bad:
            out.append(f"a decode step of {p['seqs']} rows took {p['seconds'] * 1e3:.1f} ms, but the matmul and "
                       f"attention timings add up to {p['predicted_compute'] * 1e3:.1f} ms: the probe was disturbed "
                       "(a busy machine, or more threads than free cores); run it again on a quiet machine, or "
                       "with OMP_NUM_THREADS set to the free cores")
    return out


def load_step_model(hardware: str, cfg: ModelConfig | None = None,
                    block_size: int | None = None) -> tuple[StepModel, dict]:
    """A StepModel from a profile JSON path or an accelerator name (h100-sxm, h200, a100-80gb,
    l4). `cfg` is the model to plan for; a measured profile is only valid for the model it was
    measured with (its shapes). block_size: the KV block size (tokens) planned for, to which decode
    groups are padded (default: the profile's, else 16). Returns (model, description dict); a
    measured profile's description carries the probe's warnings.

    Raises ValueError for an unknown name, an unreadable profile, or a model/profile mismatch.
    """
    if hardware.lower() in ACCELERATORS:
        if cfg is None:
            raise ValueError("hardware: a datasheet accelerator needs the model's config")
        acc = ACCELERATORS[hardware.lower()]
        return RooflineModel(cfg, acc), {"kind": "datasheet", "label": "datasheet, not measured here",
                                         "name": acc.name, "bf16_flops": acc.bf16_flops,
                                         "bandwidth_bytes_per_s": acc.bandwidth, "memory_bytes": acc.memory_bytes,
                                         "source": acc.source}
    p = Path(hardware)
    if not p.is_file():
        raise ValueError(f"hardware: {hardware!r} is neither a profile file nor one of {sorted(ACCELERATORS)}")
    try:
        prof = json.loads(p.read_text(encoding="utf-8"))
        pcfg = ModelConfig(**prof["config"])
    except (ValueError, KeyError, TypeError) as e:  # ValueError: bad JSON or not UTF-8
        raise ValueError(f"hardware: {hardware} is not a `mixserve hw probe` profile ({e})") from None
    if prof.get("version", PROFILE_VERSION) != PROFILE_VERSION:
        raise ValueError(f"hardware: {hardware} is a profile of version {prof.get('version')!r}, this mixserve "
                         f"reads version {PROFILE_VERSION}; run `mixserve hw probe` again")
    if cfg is not None:
        mine = [(s.name, s.out_features, s.in_features) for s in linear_shapes(cfg)] + [cfg.num_layers]
        theirs = [(s.name, s.out_features, s.in_features) for s in linear_shapes(pcfg)] + [pcfg.num_layers]
        if mine != theirs:
            raise ValueError(f"hardware: {hardware} was measured for {prof.get('model')!r}, whose shapes differ "
                             "from the model planned for; run `mixserve hw probe --model` for it")
    try:
        sm = MeasuredModel(pcfg, prof, block_size)
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        # a truncated or hand-edited profile: name what is missing instead of a traceback
        raise ValueError(f"hardware: {hardware} is not a complete `mixserve hw probe` profile "
                         f"({type(e).__name__}: {e})") from None
    return sm, {"kind": "measured", "label": "measured here", "model": prof.get("model"),
                "machine": prof.get("machine"), "bandwidth_bytes_per_s": prof.get("bandwidth_bytes_per_s"),
                "warnings": _profile_warnings(prof) + [w for w in (stale_warning(prof),) if w]}


def _profile_warnings(prof: dict) -> list[str]:
    """The probe's own warnings (a list of strings); profiles from before the probe kept them are checked."""
    ws = prof.get("warnings")
    if ws is None:
        return list(consistency_warnings(prof))
    if isinstance(ws, str):  # a hand-edited profile: one warning, not its characters
        return [ws]
    return [str(w) for w in ws] if isinstance(ws, list) else [str(ws)]
