"""Time of one engine step from its shape: linears by rows, attention by context, fixed overhead.

An engine step (engine/llm_engine.py) runs every scheduled token through each layer's four
matmuls as one flat batch of T rows, attends each decode row over its context and each prefill
chunk (or speculative verification row) over its own, then the LM head over the N rows that
sample, then sampling and bookkeeping. So

    time = L * sum_linear t_lin(T) + t_head(N) + L * (t_dec(decode contexts) + sum t_pre(q, ctx))
           + overhead(seqs, T)

with L layers. `StepModel` subclasses give the terms: `MeasuredModel` from a `hw probe` profile
(hardware.py), `RooflineModel` from datasheet peak FLOP/s and bandwidth.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

from mixserve.models.config import ModelConfig
from mixserve.plan.cost_model import BF16, WeightFormat, linear_shapes


@dataclass
class StepBatch:
    """The shape of one engine step.

    decode_contexts: per decode row (one new token), its context length in tokens, the new
        token included.
    spans: per multi-token row (a prefill chunk or a speculative verification row),
        (query tokens, context tokens at its end).
    sampled_rows: rows that go through the LM head (1 per sampling sequence, k + 1 per
        verification row).
    masked_rows: of those, the rows of constrained requests (structured output), whose grammar
        masks are filled and applied in the step.
    """

    decode_contexts: list[int] = field(default_factory=list)
    spans: list[tuple[int, int]] = field(default_factory=list)
    sampled_rows: int = 0
    masked_rows: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.decode_contexts) + sum(q for q, _ in self.spans)

    @property
    def num_seqs(self) -> int:
        return len(self.decode_contexts) + len(self.spans)


def _finite_nonneg(vals, what: str) -> list[float]:
    out = [float(v) for v in vals]
    if not all(math.isfinite(v) and v >= 0 for v in out):
        raise ValueError(f"{what}: needs finite values >= 0 (got {vals!r:.80})")
    return out


class Table:
    """Piecewise-linear y(x) through measured points (x ascending): flat below the first point,
    proportional to x above the last (a matmul past the measured rows is compute-bound).

    With monotone=True each y is lowered to the smallest y at any larger x: a matmul over more
    rows never takes less time, so a point above a larger one is a disturbed measurement (noise
    only ever adds time). Left as measured, a 1-row time above the 2-row one makes a 2-row
    speculative verification look cheaper than plain decoding. Raises ValueError for empty,
    mismatched, negative or non-finite input."""

    def __init__(self, xs: list[float], ys: list[float], monotone: bool = False):
        if not xs or len(xs) != len(ys):
            raise ValueError("table: needs as many y values as x values, at least one")
        pts = sorted(zip(_finite_nonneg(xs, "table rows"), _finite_nonneg(ys, "table seconds")))
        if pts[0][0] <= 0 or not all(y > 0 for _, y in pts):
            raise ValueError("table: rows and seconds must be > 0")
        self.xs = [x for x, _ in pts]
        self.ys = [y for _, y in pts]
        if monotone:
            for i in range(len(self.ys) - 2, -1, -1):
                self.ys[i] = min(self.ys[i], self.ys[i + 1])

    def __call__(self, x: float) -> float:
        xs, ys = self.xs, self.ys
        if x <= xs[0]:
            return ys[0]
        if x >= xs[-1]:
            return ys[-1] * x / xs[-1]
        i = bisect.bisect_right(xs, x)
        w = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
        return (1 - w) * ys[i - 1] + w * ys[i]


class Grid:
    """Seconds of one call of shape (rows, context) from a measured grid: bilinear in
    (log rows, log context) on the time per slot (seconds / (rows * context)), times rows *
    context. Per slot, because that is what varies slowly: the time itself spans three orders of
    magnitude over the grid. Past the grid's largest rows or context the time per slot stays at
    the edge's (proportional growth); below its smallest the call costs what the smallest measured
    shape does (a call has a fixed cost that a smaller shape does not shrink)."""

    def __init__(self, rows: list[int], contexts: list[int], seconds: list[list[float]]):
        if not rows or not contexts or len(seconds) != len(rows) or any(len(r) != len(contexts) for r in seconds):
            raise ValueError("grid: seconds must be [len(rows)][len(contexts)], both non-empty")
        for axis, vals in (("rows", rows), ("context", contexts)):
            if any(not v > 0 for v in _finite_nonneg(vals, f"grid {axis}")) or list(vals) != sorted(set(vals)):
                raise ValueError(f"grid: {axis} must be positive and strictly increasing (got {vals!r:.80})")
        for r in seconds:
            _finite_nonneg(r, "grid seconds")
        self.r0, self.c0 = rows[0], contexts[0]
        self.lr = [math.log(r) for r in rows]
        self.lc = [math.log(c) for c in contexts]
        self.per_slot = [[t / (r * c) for t, c in zip(ts, contexts)] for ts, r in zip(seconds, rows)]

    @staticmethod
    def _bracket(xs: list[float], x: float) -> tuple[int, int, float]:
        if x <= xs[0]:
            return 0, 0, 0.0
        if x >= xs[-1]:
            return len(xs) - 1, len(xs) - 1, 0.0
        i = bisect.bisect_right(xs, x)
        return i - 1, i, (x - xs[i - 1]) / (xs[i] - xs[i - 1])

    def __call__(self, rows: int, context: int) -> float:
        rows, context = max(rows, self.r0), max(context, self.c0)
        i0, i1, wr = self._bracket(self.lr, math.log(max(1, rows)))
        j0, j1, wc = self._bracket(self.lc, math.log(max(1, context)))
        g = self.per_slot
        top = (1 - wc) * g[i0][j0] + wc * g[i0][j1]
        bot = (1 - wc) * g[i1][j0] + wc * g[i1][j1]
        return ((1 - wr) * top + wr * bot) * rows * context


class SpanGrid:
    """Seconds of one layer's attention for a span of q queries after a prefix of p cached tokens
    (context q + p at its end) from a measured (queries, prefix) grid (`contexts`: the context each
    cell was timed at, where not q + p: a cell past the model's context is timed at its largest).

    Along the prefix a row's time is piecewise linear in the cached tokens (each query reads that
    many more keys), through its cells and on past the last with the last segment's slope; each row
    is made non-decreasing in the prefix (noise only adds time). Across rows the time per query is
    interpolated in log q; below the smallest row a span costs its time per query, past the largest
    its time per query-key pair. Interpolating the time per pair instead put a 4-query span at
    prefix 64 at 12x its measured time (its prefix-0 cell is mostly fixed cost; a break-it round).
    Raises ValueError for a malformed grid, or one with fewer than two prefixes timed."""

    def __init__(self, queries: list[int], prefixes: list[int], seconds: list[list[float]],
                 contexts: list[list[int]] | None = None):
        if not queries or not prefixes or len(seconds) != len(queries) or any(len(r) != len(prefixes) for r in seconds):
            raise ValueError("span grid: seconds must be [len(queries)][len(prefix)], both non-empty")
        for axis, vals in (("queries", queries), ("prefix", [p + 1 for p in prefixes])):
            if any(not v > 0 for v in _finite_nonneg(vals, f"span grid {axis}")) or list(vals) != sorted(set(vals)):
                raise ValueError(f"span grid: {axis} must be positive and strictly increasing (got {vals!r:.80})")
        for r in seconds:
            _finite_nonneg(r, "span grid seconds")
        ctx = contexts or [[q + p for p in prefixes] for q in queries]
        if len(ctx) != len(queries) or any(len(r) != len(prefixes) for r in ctx) or \
                any(not q <= c for r, q in zip(ctx, queries) for c in r):
            raise ValueError("span grid: context must be [len(queries)][len(prefix)], each at least its queries")
        self.q = [int(q) for q in queries]
        self.lq = [math.log(q) for q in queries]
        self.rows: list[tuple[list[float], list[float]]] = []  # per row: (prefixes timed, seconds)
        for q, ts, cs in zip(queries, seconds, ctx):
            pts: dict[float, float] = {}
            for t, c in zip(ts, cs):  # cells cut to the model's context share a prefix: keep the least
                pts[c - q] = min(t, pts.get(c - q, math.inf))
            xs = sorted(pts)
            ys = [pts[x] for x in xs]
            for k in range(len(ys) - 2, -1, -1):
                ys[k] = min(ys[k], ys[k + 1])
            self.rows.append((xs, ys))
        # the time each query adds per cached token, past a row's last cell: its last segment's,
        # or (a row cut to one prefix) the nearest row's with two
        slopes = [(ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) / q if len(xs) > 1 else None
                  for q, (xs, ys) in zip(self.q, self.rows)]
        known = [i for i, v in enumerate(slopes) if v is not None]
        if not known:
            raise ValueError("span grid: needs at least two prefixes timed")
        self.slope = [slopes[min(known, key=lambda k: abs(k - i))] for i in range(len(slopes))]

    def _row(self, i: int, pre: float) -> float:
        xs, ys = self.rows[i]
        if pre <= xs[0]:
            return ys[0]
        if pre >= xs[-1]:
            return ys[-1] + self.slope[i] * self.q[i] * (pre - xs[-1])
        k = bisect.bisect_right(xs, pre)
        w = (pre - xs[k - 1]) / (xs[k] - xs[k - 1])
        return (1 - w) * ys[k - 1] + w * ys[k]

    def __call__(self, q: int, ctx: int) -> float:
        if not (math.isfinite(q) and math.isfinite(ctx)):
            raise ValueError(f"span grid: queries and context must be finite (got {q}, {ctx})")
        if q <= 0:
            return 0.0
        pre = max(0.0, ctx - q)
        if q <= self.q[0]:
            return self._row(0, pre) * q / self.q[0]
        if q >= self.q[-1]:
            top = self.q[-1]
            return self._row(len(self.q) - 1, pre) * _span_score_elements(q, q + pre) / _span_score_elements(top, top + pre)
        i1 = bisect.bisect_right(self.lq, math.log(q))
        i0 = i1 - 1
        w = (math.log(q) - self.lq[i0]) / (self.lq[i1] - self.lq[i0])
        return ((1 - w) * self._row(i0, pre) / self.q[i0] + w * self._row(i1, pre) / self.q[i1]) * q


class StepModel:
    """Base: combines per-component times into a step time. Subclasses implement
    linear_time, decode_attention_time, span_attention_time and overhead (seconds)."""

    kind = "abstract"

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg
        self.shapes = linear_shapes(cfg)
        # structured output: a step's grammar masks take mask_fit[0] + mask_fit[1] * rows seconds
        # for its constrained rows (hw probe measures it; 0 where a profile has none: a lower bound)
        self.mask_fit = (0.0, 0.0)

    def mask_time(self, rows: int) -> float:
        """Seconds to fill and apply `rows` constrained rows' grammar masks in one step."""
        return self.mask_fit[0] + self.mask_fit[1] * rows if rows > 0 else 0.0

    def linear_time(self, shape_name: str, rows: int, fmt: WeightFormat) -> float:
        raise NotImplementedError

    def decode_attention_time(self, contexts: list[int]) -> float:
        """One layer, all decode rows of the step."""
        raise NotImplementedError

    def span_attention_time(self, q: int, ctx: int) -> float:
        """One layer, one multi-token span of q queries ending at context ctx."""
        raise NotImplementedError

    def overhead(self, num_seqs: int, num_tokens: int) -> float:
        raise NotImplementedError

    def body_linear_time(self, rows: int, fmt: WeightFormat = BF16) -> float:
        """All layers' matmuls for `rows` rows (LM head excluded), seconds."""
        if rows <= 0:
            return 0.0
        return self.cfg.num_layers * sum(self.linear_time(s.name, rows, fmt) for s in self.shapes if s.per_layer)

    def head_time(self, rows: int, fmt: WeightFormat = BF16) -> float:
        return self.linear_time("lm_head", rows, fmt) if rows > 0 else 0.0

    def step_time(self, b: StepBatch, fmt: WeightFormat = BF16) -> float:
        """Seconds for one engine step of shape `b` with weights in `fmt`."""
        if b.num_tokens == 0:
            return 0.0
        attn = self.decode_attention_time(b.decode_contexts) if b.decode_contexts else 0.0
        attn += sum(self.span_attention_time(q, c) for q, c in b.spans)
        return (self.body_linear_time(b.num_tokens, fmt) + self.head_time(b.sampled_rows, fmt)
                + self.cfg.num_layers * attn + self.overhead(b.num_seqs, b.num_tokens)
                + self.mask_time(b.masked_rows))

    def breakdown(self, b: StepBatch, fmt: WeightFormat = BF16) -> dict:
        """step_time's terms, seconds: linear, lm_head, attention, overhead, grammar masks."""
        attn = self.decode_attention_time(b.decode_contexts) if b.decode_contexts else 0.0
        attn += sum(self.span_attention_time(q, c) for q, c in b.spans)
        return {"linear": self.body_linear_time(b.num_tokens, fmt), "lm_head": self.head_time(b.sampled_rows, fmt),
                "attention": self.cfg.num_layers * attn, "overhead": self.overhead(b.num_seqs, b.num_tokens),
                "masks": self.mask_time(b.masked_rows)}


def _span_score_elements(q: int, ctx: int) -> int:
    """Query-key pairs a causal span of q queries ending at context ctx attends:
    sum over its queries of their context = q * ctx - q * (q - 1) / 2."""
    return q * ctx - q * (q - 1) // 2


def decode_groups(contexts: list[int], block_size: int) -> list[tuple[int, int]]:
    """(rows, padded context in slots) of each decode attention call the model runner makes for
    decode rows of these context lengths (tokens, the new one included): rows sorted longest
    first and split as the runner does (engine/model_runner.py decode_group_bounds), each row
    padded to its group's longest context in whole blocks."""
    from mixserve.engine.model_runner import decode_group_bounds

    ctx = sorted(contexts, reverse=True)
    return [(e - s, -(-ctx[s] // block_size) * block_size) for s, e in decode_group_bounds(ctx)]


def _lin3(coef: list[float], a: float, b: float) -> float:
    return coef[0] + coef[1] * a + coef[2] * b


class MeasuredModel(StepModel):
    """Step times interpolated from a measured `hw probe` profile (hardware.py).

    Linears: the measured seconds per call by rows, per shape and format (Table). Attention and
    overhead: the profile's least-squares fits, per layer:
    decode: each call, as the model runner groups and pads the rows (decode_groups), from the
    profile's (rows, context) grid (Grid), or for older profiles t = a * calls + b * rows + c *
    padded slots; span: the profile's (queries, cached prefix) grid (SpanGrid), or for older
    profiles t = a + b * q + c * (query-key pairs);
    overhead t = a + b * seqs + c * tokens. Structured output: `structured.fit` (a, b): a step's
    masks take a + b * rows seconds for its constrained rows (0 for a profile without it).
    block_size: KV block size in tokens (default: the profile's, else 16). Raises ValueError for a
    profile with missing, negative or non-finite timings.
    """

    kind = "measured"

    def __init__(self, cfg: ModelConfig, profile: dict, block_size: int | None = None):
        super().__init__(cfg)
        self.profile = profile
        self.tables = {fmt: {name: Table(t["rows"], t["seconds"], monotone=True) for name, t in shapes.items()}
                       for fmt, shapes in profile["linear"].items()}
        for fmt, tabs in self.tables.items():
            missing = [s.name for s in self.shapes if s.name not in tabs]
            if missing:
                raise ValueError(f"linear {fmt}: no timings for {', '.join(missing)}")
        if "bf16" not in self.tables:
            raise ValueError("linear: no bf16 timings")
        att = profile["attention"]
        g = att["decode"].get("grid")  # profiles before the grid have only the fit
        self.dec_grid = Grid(g["rows"], g["context"], g["seconds"]) if g else None
        self.dec = _finite_nonneg(att["decode"]["fit"], "attention decode fit")
        self.span = _finite_nonneg(att["span"]["fit"], "attention span fit")
        # profiles before the span grid have only the fit, and so do probes of a context under 256
        # tokens made before the grid's second column was ensured (one prefix: no slope to go on)
        sg = att["span"].get("grid")
        self.span_grid = (SpanGrid(sg["queries"], sg["prefix"], sg["seconds"], sg.get("context"))
                          if sg and len(sg.get("prefix") or ()) > 1 else None)
        self.ovh = _finite_nonneg(profile["overhead"]["fit"], "overhead fit")
        for name, f in (("attention decode fit", self.dec), ("attention span fit", self.span),
                        ("overhead fit", self.ovh)):
            if len(f) != 3:
                raise ValueError(f"{name}: needs 3 coefficients (got {len(f)})")
        masks = profile.get("structured") or {}
        self.mask_fit = tuple(_finite_nonneg(masks.get("fit", [0.0, 0.0]), "structured fit"))
        if len(self.mask_fit) != 2:
            raise ValueError(f"structured fit: needs 2 coefficients (got {len(self.mask_fit)})")
        # the engine's KV block size to plan for: decode groups are padded to whole blocks
        self.block_size = int(block_size or profile.get("block_size", 16))
        if self.block_size < 1:
            raise ValueError(f"block_size: must be >= 1 (got {self.block_size})")

    def linear_time(self, shape_name: str, rows: int, fmt: WeightFormat) -> float:
        # a GGUF's head is stored quantized like the rest (its own table row)
        name = fmt.name if (shape_name != "lm_head" or fmt.lm_head_int4 or fmt.name == "gguf") else "bf16"
        if name not in self.tables:
            raise ValueError(f"format: the profile has no {name} measurements (measured: {sorted(self.tables)})")
        return self.tables[name][shape_name](rows)

    def decode_attention_time(self, contexts: list[int]) -> float:
        # the probe times one group of equal contexts; a real step's rows are grouped and each
        # group padded as the model runner does, so charge each group as a call of its padded shape
        groups = decode_groups(contexts, self.block_size)
        if self.dec_grid is not None:
            return sum(self.dec_grid(rows, ctx) for rows, ctx in groups)
        padded = sum(rows * ctx for rows, ctx in groups)
        return max(0.0, self.dec[0] * len(groups) + self.dec[1] * len(contexts) + self.dec[2] * padded)

    def span_attention_time(self, q: int, ctx: int) -> float:
        if self.span_grid is not None:
            return self.span_grid(q, ctx)
        return max(0.0, _lin3(self.span, q, _span_score_elements(q, ctx)))

    def overhead(self, num_seqs: int, num_tokens: int) -> float:
        return max(0.0, _lin3(self.ovh, num_seqs, num_tokens))


@dataclass(frozen=True)
class Accelerator:
    """Datasheet figures (not measured here): dense bf16 tensor FLOP/s (no sparsity), memory
    bandwidth in bytes/s, memory in bytes."""

    name: str
    bf16_flops: float
    bandwidth: float
    memory_bytes: float
    source: str


ACCELERATORS = {
    "h100-sxm": Accelerator("NVIDIA H100 SXM5 80GB", 989e12, 3.35e12, 80e9,
                            "NVIDIA H100 Tensor Core GPU datasheet: BF16 1,979 TFLOPS with sparsity (989.5 dense), "
                            "HBM3 3.35 TB/s"),
    "h200": Accelerator("NVIDIA H200 SXM 141GB", 989e12, 4.8e12, 141e9,
                        "NVIDIA H200 Tensor Core GPU datasheet: BF16 1,979 TFLOPS with sparsity (989.5 dense), "
                        "HBM3e 4.8 TB/s, 141 GB"),
    "a100-80gb": Accelerator("NVIDIA A100 SXM 80GB", 312e12, 2.039e12, 80e9,
                             "NVIDIA A100 Tensor Core GPU datasheet: BF16 312 TFLOPS dense, HBM2e 2,039 GB/s"),
    "l4": Accelerator("NVIDIA L4 24GB", 121e12, 300e9, 24e9,
                      "NVIDIA L4 Tensor Core GPU datasheet: BF16 242 TFLOPS with sparsity (121 dense), "
                      "GDDR6 300 GB/s, 24 GB"),
}


class RooflineModel(StepModel):
    """Roofline step time from datasheet figures: each matmul and each attention call takes
    max(FLOPs / peak FLOP/s, bytes / bandwidth) (Williams et al., CACM 2009), summed; per-step
    overhead is `overhead_s` (0 by default: a lower bound). Labelled "datasheet, not measured here".
    int4 matmuls are taken to read int4 bytes and compute at the bf16 peak (dequantize in the
    kernel, as AWQ's GEMM does).
    """

    kind = "datasheet"

    def __init__(self, cfg: ModelConfig, acc: Accelerator, overhead_s: float = 0.0, kv_dtype_bytes: int = 2):
        super().__init__(cfg)
        self.acc = acc
        self.overhead_s = overhead_s
        self.kv_layer_token = 2 * cfg.num_kv_heads * cfg.head_dim * kv_dtype_bytes
        self.head_flops = 4 * cfg.num_heads * cfg.head_dim  # per query-key pair, one layer
        self._shape = {s.name: s for s in self.shapes}

    def linear_time(self, shape_name: str, rows: int, fmt: WeightFormat) -> float:
        s = self._shape[shape_name]
        quantized = s.per_layer or fmt.lm_head_int4
        byts = fmt.linear_bytes(s.numel, s.in_features, quantized) + 2 * rows * (s.in_features + s.out_features)
        return max(2 * rows * s.numel / self.acc.bf16_flops, byts / self.acc.bandwidth)

    def decode_attention_time(self, contexts: list[int]) -> float:
        n = sum(contexts)
        return max(n * self.head_flops / self.acc.bf16_flops, n * self.kv_layer_token / self.acc.bandwidth)

    def span_attention_time(self, q: int, ctx: int) -> float:
        return max(_span_score_elements(q, ctx) * self.head_flops / self.acc.bf16_flops,
                   ctx * self.kv_layer_token / self.acc.bandwidth)

    def overhead(self, num_seqs: int, num_tokens: int) -> float:
        return self.overhead_s

    def bound(self, shape_name: str, rows: int, fmt: WeightFormat = BF16) -> str:
        """"compute" or "bandwidth": the larger roofline term of one matmul at `rows` rows."""
        s = self._shape[shape_name]
        c = 2 * rows * s.numel / self.acc.bf16_flops
        m = fmt.linear_bytes(s.numel, s.in_features, s.per_layer or fmt.lm_head_int4) / self.acc.bandwidth
        return "compute" if c >= m else "bandwidth"
