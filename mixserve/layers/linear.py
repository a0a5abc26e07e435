"""Linear layers. Dense weights use oneDNN's prepacked GEMM on CPU; int4 kinds plug in here."""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from mixserve.layers.int4_dequant import dequantize_int4pack, scratch


def _can_prepack(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and torch.backends.mkldnn.is_available()
            and weight.dtype in (torch.float32, torch.bfloat16))


class DenseLinear(nn.Module):
    """y = x @ W^T + b, W [out_features, in_features] in the compute dtype.

    On CPU the weight is reordered once into oneDNN's blocked layout (the same prepacking
    PyTorch's Inductor uses for frozen CPU linears). `benchmarks/kernels.py` on the project's 2-core
    Zen 5, bf16, 24 gate/up matrices of 9728x896: 1 row 23.9 -> 17.4 ms, 16 rows 42.6 -> 26.1 ms,
    64 rows 96.1 -> 79.9 ms (float32: about 2x at 1-16 rows).
    The dense copy is not kept; `dense_weight()` reorders back when needed.

    Args: weight [out, in] float32/bfloat16; bias [out] or None.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.bias = bias.contiguous() if bias is not None else None
        self.packed = None
        self.weight = None
        if _can_prepack(weight):
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), batch_size=1)
            except RuntimeError:
                self.packed = None
        if self.packed is None:
            self.weight = weight

    def dense_weight(self) -> torch.Tensor:
        """The weight as a plain [out, in] tensor."""
        return self.weight if self.packed is None else self.packed.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


# Rows from which a bf16 GEMM over the dequantized weight beats PyTorch's int4 weight-only kernel
# on CPU: measured by `benchmarks/kernels.py --int4` (see BENCHMARKS.md); MIXSERVE_INT4_DENSE_ROWS
# overrides it for another machine.
INT4_DENSE_ROWS = int(os.environ.get("MIXSERVE_INT4_DENSE_ROWS", "16"))
# largest weight (elements) dequantized into the reused scratch buffer: a 1.5B's fused gate/up
# (27.5M) fits; larger ones get a fresh tensor per call
SCRATCH_MAX_ELEMENTS = 32 << 20


def _unpack_int4pack_cpu(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Integers [n, k] (uint8, 0..15) from `_convert_weight_to_int4pack_for_cpu`'s layout, found by
    probing it (tests/unit/test_quant.py checks it against the kernel): rows in blocks of 64 store
    row r and r + 32 of a block as the low and high nibble of byte [k, r]; a tail of 16-row blocks
    stores rows 2j and 2j + 1 as the low and high nibble of byte [k, j]."""
    flat = packed.reshape(-1)
    n64 = n // 64
    main = flat[: n64 * 64 * k // 2].view(n64, k, 32)
    parts = [torch.cat([main & 15, main >> 4], -1).permute(0, 2, 1).reshape(n64 * 64, k)]
    nt = n - n64 * 64
    if nt:
        tail = flat[n64 * 64 * k // 2:].view(k, nt // 2)
        parts.append(torch.stack([tail & 15, tail >> 4], -1).reshape(k, nt).t())
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def int4_supported(out_features: int, in_features: int, group_size: int) -> str | None:
    """None when PyTorch's CPU int4 kernel takes this shape, else why not."""
    if out_features % 16:
        return f"out_features {out_features} is not a multiple of 16 (int4 kernel)"
    if in_features % group_size or group_size % 32:
        return f"in_features {in_features} / group size {group_size} do not fit the int4 kernel"
    return None


class Int4Linear(nn.Module):
    """Weight-only int4 linear, y = x @ W^T + b with W = (q - zero) * scale group-wise along `in`.

    Few rows (decode): PyTorch's CPU int4 kernel `aten._weight_int4pack_mm_for_cpu`, which reads
    half a byte per weight. Its dequantization is w = (q - 8) * scale + zero', so AWQ's integer
    zero point z becomes zero' = (8 - z) * scale. From `dense_rows` rows (prefill, large batches)
    the weight is dequantized for the call and the ordinary dense GEMM runs, since the int4 kernel
    loses to it there. Only the packed integers stay resident (0.5 byte per weight plus scales).
    Off CPU the dense path is always used (no CUDA int4 kernel is wired yet).

    Args:
        q: int32 [out, in] in [0, 15]; scales: [out, in / group_size] (float16 from checkpoints);
        zeros: int32 [out, in / group_size]; group_size: input channels per group;
        bias: [out] or None; dtype: compute dtype (float32 or bfloat16).
    Raises:
        ValueError: a shape the int4 kernel cannot take (see int4_supported).
    """

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                 bias: torch.Tensor | None, dtype: torch.dtype, dense_rows: int | None = None):
        super().__init__()
        self.out_features, self.in_features = q.shape
        why = int4_supported(self.out_features, self.in_features, group_size)
        if why:
            raise ValueError(why)
        want = (self.out_features, self.in_features // group_size)
        for name, t in (("scales", scales), ("zeros", zeros)):
            if tuple(t.shape) != want:
                raise ValueError(f"{name}: shape {tuple(t.shape)} does not match weight {tuple(q.shape)} at group "
                                 f"size {group_size} (expected {want})")
        if q.numel() and (q.min() < 0 or q.max() > 15):
            raise ValueError("q: int4 values must lie in [0, 15]")
        self.group_size = group_size
        self.dtype = dtype
        self.dense_rows = INT4_DENSE_ROWS if dense_rows is None else dense_rows
        self.bias = bias.to(dtype).contiguous() if bias is not None else None
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
        s = scales.float()
        zero = (8 - zeros.float()) * s
        # [in/g, out, 2] as the kernel wants; [out, in/g] copies for the dense path
        self.scales_and_zeros = torch.stack([s.t(), zero.t()], -1).to(dtype).contiguous()
        self.scale_rows = s.to(dtype)
        self.zero_rows = zero.to(dtype)

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales_and_zeros, self.scale_rows,
                                                           self.zero_rows))

    def dense_weight(self, reuse: bool = False) -> torch.Tensor:
        """The dequantized weight [out, in] in the compute dtype. reuse=True writes it into the
        thread's scratch buffer (int4_dequant.scratch), valid only until the next such call."""
        n = self.out_features * self.in_features
        # an LM head (a quarter billion weights) would pin its size in scratch for good
        out = scratch(n, self.dtype) if reuse and n <= SCRATCH_MAX_ELEMENTS else None
        w = dequantize_int4pack(self.packed, self.scale_rows, self.zero_rows, self.out_features, self.in_features,
                                self.group_size, out)
        if w is not None:
            return w
        q = _unpack_int4pack_cpu(self.packed, self.out_features, self.in_features)
        ng = self.in_features // self.group_size
        q = q.view(self.out_features, ng, self.group_size).to(self.dtype)
        w = torch.addcmul(self.zero_rows.unsqueeze(-1), q - 8, self.scale_rows.unsqueeze(-1))
        return w.view(self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        x = x.to(self.dtype)
        if rows == 0:
            return x.new_zeros(*x.shape[:-1], self.out_features)
        if x.device.type == "cpu" and rows < self.dense_rows:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(rows, -1).contiguous(), self.packed,
                                                           self.group_size, self.scales_and_zeros)
            y = y.view(*x.shape[:-1], self.out_features)
            return y + self.bias if self.bias is not None else y
        return F.linear(x, self.dense_weight(reuse=True), self.bias)
