"""Linears and embeddings on GGUF block-quantized weights as the file stores them.

`GGUFWeight` is one tensor in the native kernel's layout (layers/gguf_kernels.py), built from the
file's blocks without changing a bit of them (layers/gguf_blocks.py). `GGUFLinear` multiplies by one
or more such parts stacked along the output (a fused q/k/v whose parts have different types);
`GGUFEmbedding` dequantizes the rows it looks up.
"""
from __future__ import annotations

import logging
import os

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from mixserve.layers import gguf_blocks, gguf_kernels
from mixserve.layers.gguf_blocks import BLOCK_SIZES, PARSERS
from mixserve.layers.int4_dequant import scratch

NATIVE_TYPES = tuple(PARSERS)
_EMPTY_U8 = torch.empty(0, dtype=torch.uint8)
_NO_ROWS = torch.empty(0, dtype=torch.long)
# rows of weight dequantized at a time for float32 many-row logits (a whole head in float32 is 0.5 GB)
F32_SLICE_ROWS = 4096
# largest weight (elements) dequantized into the reused scratch buffer for the many-row GEMM
SCRATCH_MAX_ELEMENTS = 32 << 20
# int8 levels per activation row in the native kernel (the LM head has its own three). One level
# (llama.cpp's Q8_0 activations) moved the 0.5B's top-2 logit gap by up to 0.137 against the float32
# dequantized reference over 128 teacher-forced HumanEval positions, and flipped the first token of
# shared/cases/seeded-output-depends-on-batch.md case 2, whose reference gap is 0.026 (not a near-tie);
# two levels (the residual of the first quantized again) moved it by at most 0.001, under the 0.01 tie
# rule (emulated in PyTorch on this project's AVX2 EPYC, BENCHMARKS.md "One request, one answer").
# Since issue 43's panel kernel the two levels are one int16 per channel, x16 = round(256 x / dx), the
# second level's step dx / 256 fixed (it was max|rest| / 127 <= dx / 254), so both sum in int32
# (layers/gguf_src.py); tests/integration/test_gguf_native_real.py checks the 0.5B's greedy answers
# against the dequantized load with the tie rule. MIXSERVE_GGUF_ACT_LEVELS=1 gives llama.cpp's
# activations back.
_LEVELS_ENV = os.environ.get("MIXSERVE_GGUF_ACT_LEVELS", "2")
ACT_LEVELS = int(_LEVELS_ENV) if _LEVELS_ENV in ("1", "2", "3", "4") else 2
HEAD_LEVELS = 3  # an LM head's float32 logits (forward_float)
if _LEVELS_ENV != str(ACT_LEVELS):
    logging.getLogger("mixserve").warning("MIXSERVE_GGUF_ACT_LEVELS=%r is not 1-4: using 2", _LEVELS_ENV)


def _pad_rows(a: np.ndarray, rows: int) -> np.ndarray:
    return a if a.shape[0] == rows else np.concatenate([a, np.zeros((rows - a.shape[0],) + a.shape[1:], a.dtype)])


def _panel_planes(f: gguf_blocks.Fields, hb: int) -> dict[str, np.ndarray]:
    """A tensor's Fields in the 16-row panel layout layers/gguf_src.py describes: lo and hi (uint8),
    d, sc, dm, mn ([panels, K/S * 16] or [panels, K/G * 16], lane fastest); rows padded with zeros
    to whole panels."""
    n, k = f.q.shape
    g, npan = f.group, -(-n // 16)
    ng, h = k // g, g // 8
    t = _pad_rows(f.q, npan * 16).reshape(npan, 16, ng, g // 4, 4).transpose(0, 2, 3, 1, 4)  # [P, ng, G/4, 16, 4]
    out = {"lo": ((t[:, :, :h] & 15) | ((t[:, :, h:] & 15) << 4)).reshape(npan, -1)}
    if hb == 4:
        out["hi"] = ((t[:, :, :h] >> 4) | ((t[:, :, h:] >> 4) << 4)).reshape(npan, -1)
    elif hb:
        bits = (t >> 4) & ((1 << hb) - 1)
        hi = np.zeros((npan, ng, 16, 4), np.uint8)
        for step in range(g // 4):
            hi |= (bits[:, :, step] << (hb * step)).astype(np.uint8)
        out["hi"] = hi.reshape(npan, -1)
    for name in ("d", "sc", "dm", "mn"):
        v = getattr(f, name)
        if v is not None:
            out[name] = _pad_rows(v, npan * 16).reshape(npan, 16, -1).transpose(0, 2, 1).reshape(npan, -1)
    return {name: np.ascontiguousarray(v) for name, v in out.items()}


def require_kernel() -> None:
    """Load the native kernel (registering the ops GGUFWeight's methods call), waiting for its
    build. Raises RuntimeError where it is not available on this machine."""
    if not gguf_kernels.available():
        raise RuntimeError("the native GGUF kernel is not available on this machine (needs AVX2, FMA and F16C, and "
                           "a C++ compiler); load with gguf_weights='dequantize'")


class GGUFWeight:
    """One GGUF tensor [N, K] (N output rows, K input channels) in the native layout.

    Built with `from_blocks`; `qtype` is the GGUF type name ("Q4_K", ...). Tensors, each
    [panels, bytes or values a panel] in 16-row panels (layers/gguf_src.py): lo, hi, d, sc, dm, mn
    (empty where the type has none). Only these stay resident.
    """

    TENSORS = ("lo", "hi", "d", "sc", "dm", "mn")

    def __init__(self, qtype: str, n: int, k: int, tensors: dict, group: int, superblock: int, hb: int, zero: int):
        # no wait for the kernel here: a cold start repacks the file while the kernel builds; the
        # modules that run it (GGUFLinear, GGUFEmbedding) and random_weight ask for it
        self.qtype, self.out_features, self.in_features = qtype, n, k
        self.group, self.superblock, self.hb, self.zero = group, superblock, hb, zero
        # the few-row kernel's software prefetch, in 64-byte lines ahead of its stream (0: the
        # hardware's prefetch alone), chosen by timing
        self.prefetch = 0
        # the many-row kernel's variant: 0 AVX512-VNNI, 1 AMX-INT8 tiles (where gguf_kernels allows
        # them; else 0's), chosen by timing; the same bits either way
        self.many = 0
        # the few-row kernel's passes over the panels (16-channel groups: Q6_K): 0 the kernel's fixed
        # rule (two panels a pass where K >= 4096), 1 one panel, 2 two; chosen by timing; the same bits
        self.passes = 0
        for name in self.TENSORS:
            setattr(self, name, tensors[name])

    @property
    def panels(self) -> int:
        """How many 16-row panels hold the N output rows (the planes' first dimension; the last
        panel's rows past N are zero)."""
        return -(-self.out_features // 16)

    @classmethod
    def from_blocks(cls, qtype: str, blocks: np.ndarray, k: int) -> "GGUFWeight":
        """blocks: uint8 [N, row bytes] (gguf.GGUFReader's `data` for a quantized 2-D tensor) of type
        `qtype`; k input channels per row. Raises ValueError for a type without a native kernel."""
        if qtype not in PARSERS:
            raise ValueError(f"GGUF type {qtype} has no native kernel (native: {', '.join(NATIVE_TYPES)})")
        n = blocks.shape[0]
        f = gguf_blocks.parse(qtype, blocks, k)
        hb = {4: 0, 5: 1, 6: 2, 8: 4}[f.bits]
        planes = _panel_planes(f, hb)
        empty = {"lo": _EMPTY_U8, "hi": _EMPTY_U8, "d": torch.empty(0, dtype=torch.float16),
                 "sc": torch.empty(0, dtype=torch.int8), "dm": torch.empty(0, dtype=torch.float16), "mn": _EMPTY_U8}
        t = {name: torch.from_numpy(planes[name]) if name in planes else empty[name] for name in cls.TENSORS}
        return cls(qtype, n, k, t, f.group, f.superblock, hb, f.zero)

    def _geometry(self, name: str) -> tuple[int, int]:
        """A plane's panel as [X, 16 lanes, Y]."""
        k, g = self.in_features, self.group
        if name == "lo" or (name == "hi" and self.hb == 4):
            return k // 8, 4
        if name == "hi":
            return k // g, 4
        return (k // self.superblock if name in ("d", "dm") else k // g), 1

    def _rows(self, name: str) -> torch.Tensor:
        """A plane row by row: [N, X * Y]."""
        v = getattr(self, name)
        x, y = self._geometry(name)
        return v.view(self.panels, x, 16, y).permute(0, 2, 1, 3).reshape(self.panels * 16, x * y)[: self.out_features]

    @staticmethod
    def _from_rows(rows: torch.Tensor, x: int, y: int) -> torch.Tensor:
        n = rows.shape[0]
        npan = -(-n // 16)
        if npan * 16 > n:
            rows = torch.cat([rows, rows.new_zeros(npan * 16 - n, rows.shape[1])])
        return rows.view(npan, 16, x, y).permute(0, 2, 1, 3).reshape(npan, -1).contiguous()

    def _with_rows(self, planes: dict, n: int) -> "GGUFWeight":
        t = {name: self._from_rows(planes[name], *self._geometry(name)) if name in planes else getattr(self, name)
             for name in self.TENSORS}
        return GGUFWeight(self.qtype, n, self.in_features, t, self.group, self.superblock, self.hb, self.zero)

    @staticmethod
    def concat(parts: list["GGUFWeight"]) -> "GGUFWeight":
        """Parts of one type and input size stacked along the output rows. Raises ValueError for
        parts of different types or input sizes, or none."""
        if not parts or len({(p.qtype, p.in_features) for p in parts}) != 1:
            raise ValueError("GGUFWeight.concat: parts must share one GGUF type and input size, got "
                             + ", ".join(f"{p.qtype} [{p.out_features}, {p.in_features}]" for p in parts))
        a = parts[0]
        planes = {name: torch.cat([p._rows(name) for p in parts]) for name in GGUFWeight.TENSORS
                  if getattr(a, name).numel()}
        return a._with_rows(planes, sum(p.out_features for p in parts))

    def permute_rows(self, index: torch.Tensor) -> "GGUFWeight":
        """The same weight with its output rows reordered (w'[i] = w[index[i]]). index: an integer
        permutation of range(N); raises ValueError otherwise."""
        index = torch.as_tensor(index)
        n = self.out_features
        if (index.dtype.is_floating_point or index.dtype == torch.bool or index.dim() != 1 or index.numel() != n
                or not torch.equal(torch.sort(index.long()).values, torch.arange(n))):
            raise ValueError(f"permute_rows: index must be a permutation of range({n}) (integers, one dimension)")
        index = index.long()
        planes = {name: self._rows(name)[index] for name in self.TENSORS if getattr(self, name).numel()}
        return self._with_rows(planes, self.out_features)

    def nbytes(self) -> int:
        return sum(getattr(self, name).numel() * getattr(self, name).element_size() for name in self.TENSORS)

    def _args(self):
        return (self.lo, self.hi, self.d, self.sc, self.dm, self.mn, self.out_features, self.group, self.superblock,
                self.hb, float(self.zero))

    def matmul(self, x: torch.Tensor, levels: int = 1) -> torch.Tensor:
        """x [R, K] (any float dtype) -> float32 [R, N]: the effective weights times x quantized per
        32 channels to `levels` int8 levels (1-4; two make one int16 row, layers/gguf_src.py). float32
        and bfloat16 go in as they are (the kernel widens bfloat16 exactly: no float32 copy)."""
        x = x if x.dtype in (torch.float32, torch.bfloat16) else x.float()
        return torch.ops.mixserve.gguf_matmul(x.contiguous(), *self._args(), levels, self.prefetch,
                                              int(self.many) | int(self.passes) << 1)

    def dequantize(self, dtype: torch.dtype = torch.float32, rows: torch.Tensor | None = None,
                   out: torch.Tensor | None = None) -> torch.Tensor:
        """The effective weights [N, K] (or rows `rows`, int64 [M] -> [M, K]) in float32 or
        bfloat16: fma(q, s_g, m_g), in float32 equal to `gguf.quants.dequantize` of the file's
        blocks. `out`: a contiguous buffer of at least M * K elements to write into."""
        m = self.out_features if rows is None else rows.numel()
        if out is None:
            out = torch.empty(m, self.in_features, dtype=dtype)
        else:
            out = out.view(-1)[: m * self.in_features].view(m, self.in_features)
        if rows is not None and (rows.dtype.is_floating_point or rows.dtype == torch.bool):
            raise ValueError(f"dequantize: rows must be integer indices, got {rows.dtype}")
        idx = _NO_ROWS if rows is None else rows.reshape(-1).long().contiguous()
        torch.ops.mixserve.gguf_dequant(*self._args(), idx, rows is None, out)
        return out


class GGUFLinear(nn.Module):
    """y = x @ W^T + b with W the row-stack of GGUFWeight `parts` (one per GGUF type run).

    Few rows (decode): the native kernel (ACT_LEVELS int8 levels per activation row, two making one int16,
    layers/gguf_kernels.py). From
    `dense_rows` rows (None: never) the weight is dequantized to the compute dtype into a scratch
    buffer and the dense GEMM runs; where that pays is measured per machine
    (`gguf_candidates`, layers/kernel_choice.py). float_out (an LM head): float32 logits, from
    three-level int8 activations below `float_dense_rows` rows, else a float32 dequantization
    4,096 rows at a time and PyTorch's float32 GEMM.

    Args: parts: GGUFWeights with one in_features; bias [out] or None; dtype: compute dtype.
    Raises ValueError for parts of different input sizes.
    """

    def __init__(self, parts: list[GGUFWeight], bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        require_kernel()
        if len({p.in_features for p in parts}) != 1:
            raise ValueError("GGUFLinear: parts differ in input size")
        self.parts = parts
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        self.bias = bias.to(dtype).contiguous() if bias is not None else None
        self.dtype = dtype
        self.dense_rows: int | None = None
        self.float_out = False
        self.float_dense_rows: int | None = None

    @property
    def qtypes(self) -> str:
        return "+".join(p.qtype for p in self.parts)

    def weight_bytes(self) -> int:
        return sum(p.nbytes() for p in self.parts)

    def dense_weight(self, dtype: torch.dtype | None = None, reuse: bool = False) -> torch.Tensor:
        """The effective weight [out, in] in `dtype` (default the compute dtype); reuse=True writes
        it into the thread's scratch buffer, valid until the next such call."""
        dtype = dtype or self.dtype
        n = self.out_features * self.in_features
        out = scratch(n, dtype) if reuse and n <= SCRATCH_MAX_ELEMENTS else torch.empty(n, dtype=dtype)
        row = 0
        for p in self.parts:
            p.dequantize(dtype, out=out[row * self.in_features:(row + p.out_features) * self.in_features])
            row += p.out_features
        return out.view(self.out_features, self.in_features)

    def _kernel(self, x2: torch.Tensor, levels: int = 1) -> torch.Tensor:
        ys = [p.matmul(x2, levels) for p in self.parts]
        return ys[0] if len(ys) == 1 else torch.cat(ys, -1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.float_out:
            return self.forward_float(x)
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if rows == 0:
            return x.new_zeros(*x.shape[:-1], self.out_features, dtype=self.dtype)
        if self.dense_rows is None or rows < self.dense_rows:
            y = self._kernel(x.reshape(rows, -1), ACT_LEVELS).to(self.dtype).view(*x.shape[:-1], self.out_features)
            return y + self.bias if self.bias is not None else y
        return F.linear(x.to(self.dtype), self.dense_weight(reuse=True), self.bias)

    def forward_float(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> float32 [..., out], x @ W^T + b to ~1e-4 of the float32 product with the
        effective weights (three int8 levels), or exactly that product's float32 GEMM from
        `float_dense_rows` rows."""
        x2 = x.reshape(-1, self.in_features).float()
        if self.float_dense_rows is None or x2.shape[0] < self.float_dense_rows:
            y = self._kernel(x2, levels=HEAD_LEVELS)
        else:
            ys = []
            buf = torch.empty(min(F32_SLICE_ROWS, max(p.out_features for p in self.parts)) * self.in_features)
            for p in self.parts:
                for r0 in range(0, p.out_features, F32_SLICE_ROWS):
                    idx = torch.arange(r0, min(r0 + F32_SLICE_ROWS, p.out_features))
                    ys.append(x2 @ p.dequantize(torch.float32, rows=idx, out=buf).t())
            y = torch.cat(ys, -1)
        if self.bias is not None:
            y = y + self.bias.float()
        return y.view(*x.shape[:-1], self.out_features)


class GGUFEmbedding(nn.Module):
    """Token embedding looked up from a GGUF weight [vocab, hidden]: the ids' rows dequantized
    (exactly gguf's values) and cast to the compute dtype. input_ids int64 [...] -> [..., hidden]."""

    def __init__(self, weight: GGUFWeight, dtype: torch.dtype):
        super().__init__()
        require_kernel()
        self.weight_q, self.dtype = weight, dtype
        self.num_embeddings, self.embedding_dim = weight.out_features, weight.in_features

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = self.weight_q.dequantize(torch.float32, rows=input_ids.reshape(-1))
        return rows.to(self.dtype).view(*input_ids.shape, self.embedding_dim)


# where each block type's fp16 fields sit (bytes), and about |integer x sub-scale| of a typical
# weight: random fp16 scales divided by it give weights of ~0.05 (a model of them keeps its
# activations and logits of order one)
_HALF_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q8_0": (0,), "Q4_K": (0, 2), "Q6_K": (208,)}
_MAGNITUDE = {"Q4_0": 4, "Q4_1": 8, "Q5_0": 8, "Q8_0": 64, "Q4_K": 256, "Q6_K": 1000}


def random_blocks(qtype: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """uint8 [n, row bytes] of `qtype` blocks for n rows of k channels: every integer and scale bit
    random, the fp16 fields finite, of both signs, scaled for weights of ~0.05 (timing and tests)."""
    bs, ts = BLOCK_SIZES[qtype]
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, (n, k // bs, ts), dtype=np.uint8)
    for off in _HALF_FIELDS[qtype]:
        h = (rng.standard_normal((n, k // bs)) * 0.05 / _MAGNITUDE[qtype]).astype(np.float16)
        b[..., off:off + 2] = h[..., None].view(np.uint8)
    return b.reshape(n, -1)


def random_weight(qtype: str, n: int, k: int, seed: int = 0) -> GGUFWeight:
    """A GGUFWeight [n, k] of `qtype` from `random_blocks`. Raises RuntimeError as require_kernel."""
    require_kernel()
    return GGUFWeight.from_blocks(qtype, random_blocks(qtype, n, k, seed), k)


def weights_on_huge_pages(model: nn.Module) -> int:
    """Move every GGUFWeight plane of `model` (its GGUFLinear and GGUFEmbedding modules) of 2 MB or
    more onto transparent huge pages (host_memory.py: the 1.5B's one-row decode streams its weights
    faster there); a plane two weights share stays shared. Returns the bytes moved (0 where the OS
    grants no huge pages). Call before the kernels' timings, which should see the weights as served."""
    from mixserve.host_memory import on_huge_pages

    moved: dict[int, torch.Tensor] = {}
    weights = {id(w): w for m in model.modules()
               for w in (m.parts if isinstance(m, GGUFLinear) else [m.weight_q] if isinstance(m, GGUFEmbedding) else [])}
    total = 0
    for w in weights.values():
        for name in GGUFWeight.TENSORS:
            t = getattr(w, name)
            if id(t) not in moved:
                moved[id(t)] = on_huge_pages(t)
                total += t.nbytes if moved[id(t)] is not t else 0
            setattr(w, name, moved[id(t)])
    return total


def clone_weight(w: GGUFWeight) -> GGUFWeight:
    """A copy of `w` with its own tensors (timing on copies that rotate past the cache)."""
    c = GGUFWeight(w.qtype, w.out_features, w.in_features, {m: getattr(w, m).clone() for m in GGUFWeight.TENSORS},
                   w.group, w.superblock, w.hb, w.zero)
    c.prefetch, c.many, c.passes = w.prefetch, w.many, w.passes
    return c


def _copies(lin: GGUFLinear, **attrs) -> list:
    """GGUFLinears shaped like `lin` on random weights of its parts' types, rotating past the cache."""
    from mixserve.layers.kernel_choice import rotating_copies

    base = [random_weight(p.qtype, p.out_features, p.in_features) for p in lin.parts]
    for b, p in zip(base, lin.parts):
        b.prefetch, b.many, b.passes = p.prefetch, p.many, p.passes

    def make():
        m = GGUFLinear([clone_weight(b) for b in base], None, lin.dtype)
        for name, v in attrs.items():
            setattr(m, name, v)
        return m
    return rotating_copies(make, lin.weight_bytes())


# the `gguf_prefetch` candidates (GGUFWeight.prefetch): 64-byte lines ahead of the few-row kernel's
# stream (0: the hardware prefetcher alone)
PREFETCH_LINES = (0, 8, 32)


def _setting_candidates(w: GGUFWeight, dtype: torch.dtype, attr: str, values: dict, rows: int = 1,
                        levels: int = ACT_LEVELS) -> dict:
    """Timers for one of w's kernel settings (GGUFWeight `attr`: prefetch, many, passes): for each
    name -> value of `values`, seconds per `rows`-row call at `levels` int8 levels of the native kernel
    on random weights of w's type and shape (kernel_choice.time_calls over copies rotating past the
    cache, made once at the first timer's call) with that value set."""
    from mixserve.layers.kernel_choice import time_calls

    mods: list = []

    def timer(v):
        def run():
            if not mods:
                mods[:] = _copies(GGUFLinear([w], None, dtype))
            x = torch.randn(rows, w.in_features).to(dtype)
            for m in mods:
                setattr(m.parts[0], attr, v)
            return time_calls(mods, lambda m: m.parts[0].matmul(x, levels))
        return run
    return {name: timer(v) for name, v in values.items()}


def prefetch_candidates(w: GGUFWeight, dtype: torch.dtype) -> dict:
    """Timers for kernel_choice's `gguf_prefetch` choice: seconds per 1-row call of the native kernel
    on random weights of w's type and shape with each of PREFETCH_LINES (GGUFWeight.prefetch)."""
    return _setting_candidates(w, dtype, "prefetch", {str(pf): pf for pf in PREFETCH_LINES})


# the `gguf_many` candidates (GGUFWeight.many): the many-row kernel's variants, and the rows it is timed at:
# a prefill chunk's order of size, and for an LM head (three levels: two int16 rows a row) the few rows
# that want logits at once (a 256-row call of the 0.5B's 151,936-row head took 0.17 s a pass)
MANY_VARIANTS = {"vnni": 0, "amx": 1}
MANY_ROWS = 256
MANY_HEAD_ROWS = 16


def many_candidates(w: GGUFWeight, dtype: torch.dtype, rows: int = MANY_ROWS, levels: int = ACT_LEVELS) -> dict:
    """Timers for kernel_choice's `gguf_many` choice, where the AMX-INT8 variant is allowed
    (gguf_kernels.amx_allowed): seconds per `rows`-row call at `levels` int8 levels of the native
    kernel on random weights of w's type and shape, its many-row kernel on AVX512-VNNI and on AMX
    tiles."""
    return _setting_candidates(w, dtype, "many", MANY_VARIANTS, rows, levels)


# the `gguf_passes` candidates (GGUFWeight.passes) for the 16-channel-group types: one or two panels a
# pass of the few-row kernel, timed at one row. Two won at K = 1536 on the AMX Xeon (the Q6_K LM head
# 0.73-0.76x) and lost at that K on the Zen 5 (1.05-1.5x): a measured choice, not a rule
PASSES = {"one": 1, "two": 2}


def passes_candidates(w: GGUFWeight, dtype: torch.dtype, levels: int = ACT_LEVELS) -> dict:
    """Timers for kernel_choice's `gguf_passes` choice: seconds per 1-row call at `levels` int8 levels
    of the native kernel on random weights of w's type and shape, one and two panels a pass."""
    return _setting_candidates(w, dtype, "passes", PASSES, 1, levels)


# the native kernel's generation in the row switches' cache keys (issue 43's 16-row panels)
KERNEL_KEY = "p16"
# Row counts at which the native kernel and dequantize + dense GEMM are timed to place the switch
GGUF_ROWS = (1, 4, 16, 32, 64, 128, 512)


def dense_switch_candidates(lin: GGUFLinear) -> dict:
    """Timers for the `gguf_dense_rows` choice (kernel_choice.switch_candidates over GGUF_ROWS): the
    native kernel against dequantize + the dense GEMM in the compute dtype."""
    from mixserve.layers.kernel_choice import switch_candidates, time_calls

    mods: list = []

    def time_at(r, many):
        mods[:] = mods or _copies(lin)
        x = torch.randn(r, lin.in_features).to(lin.dtype)
        for m in mods:
            m.dense_rows = 0 if many else None
        return time_calls(mods, lambda m: m(x))
    return switch_candidates(GGUF_ROWS, time_at)


def float_head_candidates(lin: GGUFLinear) -> dict:
    """Timers for a GGUF LM head's float32 switch (`float_head_rows`): three-level int8 kernel
    against float32 dequantization + GEMM, over kernel_choice.FLOAT_HEAD_ROWS."""
    from mixserve.layers.kernel_choice import FLOAT_HEAD_ROWS, switch_candidates, time_calls

    mods: list = []

    def time_at(r, many):
        mods[:] = mods or _copies(lin, float_out=True)
        x = torch.randn(r, lin.in_features).to(lin.dtype)
        for m in mods:
            m.float_dense_rows = 0 if many else None
        return time_calls(mods, lambda m: m(x))
    return switch_candidates(FLOAT_HEAD_ROWS, time_at)


def choose(lin: GGUFLinear, chooser, switches: bool = True) -> None:
    """Set `lin`'s prefetch distances and row switch to the chooser's picks (measured once per
    machine and cached, layers/kernel_choice.py); switches=False (batch-invariant mode) leaves
    the row switches off: the integer kernel at every row count."""
    dt = str(lin.dtype).removeprefix("torch.")
    amx = gguf_kernels.enable_amx()  # where built, permitted and no ISA forced (engine and `hw probe` alike)
    for p in lin.parts:
        p.prefetch = int(chooser.choose(f"gguf_prefetch/{p.qtype}/{p.out_features}x{p.in_features}",
                                        prefetch_candidates(p, lin.dtype), "0"))
        # the AMX variant where allowed: timed against AVX512-VNNI per type and shape (it loses on
        # Q6_K, whose 16-channel groups fill a quarter of a tile's depth)
        timers = (many_candidates(p, lin.dtype, MANY_HEAD_ROWS, HEAD_LEVELS) if lin.float_out
                  else many_candidates(p, lin.dtype))
        key = f"gguf_many/{p.qtype}/{p.out_features}x{p.in_features}{'/head' if lin.float_out else ''}"
        p.many = MANY_VARIANTS[chooser.choose(key, timers, "vnni")] if amx else 0
        if p.group == 16:
            head = "/head" if lin.float_out else ""
            rule = "two" if p.in_features >= 4096 else "one"  # the kernel's own rule: the default to beat
            p.passes = PASSES[chooser.choose(f"gguf_passes/{p.qtype}/{p.out_features}x{p.in_features}{head}",
                                             passes_candidates(p, lin.dtype, HEAD_LEVELS if head else ACT_LEVELS),
                                             rule)]
    # the kernel's layout in the key: a new kernel (its row curve) is timed again, not read from the cache
    shape = f"{lin.qtypes}/{lin.out_features}x{lin.in_features}/{KERNEL_KEY}"
    if not switches:
        lin.dense_rows = lin.float_dense_rows = None
    elif lin.float_out:
        pick = chooser.choose(f"float_head_rows/gguf/{shape}", float_head_candidates(lin), "never")
        lin.float_dense_rows = None if pick == "never" else int(pick)
    else:
        pick = chooser.choose(f"gguf_dense_rows/{dt}/{shape}", dense_switch_candidates(lin), "never")
        lin.dense_rows = None if pick == "never" else int(pick)


def summarize(model: nn.Module) -> str | None:
    """Per GGUF block type in `model`: how many tensors, the kernel and the measured choices, e.g.
    "Q4_K x140: integer kernel below 32 rows (prefetch 0-8 lines ahead), dense GEMM from
    there"; None when the model holds no native GGUF weight."""
    per: dict[str, dict] = {}
    for m in model.modules():
        if isinstance(m, GGUFLinear):
            for p in m.parts:
                d = per.setdefault(p.qtype, {"n": 0, "pf": set(), "rows": set(), "head": False, "amx": 0})
                d["n"] += 1
                d["pf"].add(p.prefetch)
                d["amx"] += p.many == 1 and gguf_kernels.amx_allowed()
                d["rows"].add(m.float_dense_rows if m.float_out else m.dense_rows)
                d["head"] |= m.float_out
    if not per:
        return None

    def span(v):
        v = sorted(v)
        return str(v[0]) if len(v) == 1 else f"{v[0]}-{v[-1]}"
    out = []
    for t, d in sorted(per.items()):
        rows = sorted({r for r in d["rows"] if r is not None})
        where = (f"below {span(rows)} rows, dense GEMM from there" if rows and None not in d["rows"]
                 else "at every row count" if not rows else f"below {span(rows)} rows or at every row count")
        passes = f"prefetch {span(d['pf'])} lines ahead"
        if d["amx"]:
            on = "" if d["amx"] == d["n"] else f" for {d['amx']}"
            passes += f"; many rows on AMX tiles{on}"
        out.append(f"{t} x{d['n']}{' (with the LM head)' if d['head'] else ''}: integer kernel {where} "
                   f"({passes})")
    return "; ".join(out)
