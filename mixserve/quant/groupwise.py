"""Group-wise asymmetric integer quantization of linear weights (the grid AWQ and RTN share).

Each run of `group_size` consecutive input channels of one output row has a scale and an integer
zero point: q = clamp(round(w / scale) + zero, 0, 2^bits - 1), w ≈ (q - zero) * scale, with
scale = (max - min) / (2^bits - 1) and zero = round(-min / scale) (Lin et al. 2024, §3; the grid
of AutoAWQ's `pseudo_quantize_tensor`). Scales are rounded to float16 first, since checkpoints
store them in float16 and the integers must be computed against the stored scale.
"""
from __future__ import annotations

import torch


def quantizable(in_features: int, out_features: int, group_size: int) -> str | None:
    """None if a [out, in] weight fits the int4 GEMM layout, else the reason it does not."""
    if in_features % group_size:
        return f"in_features {in_features} is not a multiple of group size {group_size}"
    if out_features % 8:
        return f"out_features {out_features} is not a multiple of 8 (eight nibbles per int32)"
    return None


def quantize_groupwise(w: torch.Tensor, group_size: int = 128, bits: int = 4):
    """Quantize a weight [out, in] (in % group_size == 0) group-wise along `in`.

    Returns (q int32 [out, in] in [0, 2^bits - 1], scales float16 [out, in / g],
    zeros int32 [out, in / g]). Raises ValueError when `in` is not a multiple of group_size, or
    when a group's range is too wide for a float16 scale (max - min > 15 x 65504 at 4 bits).
    """
    out_f, in_f = w.shape
    if in_f % group_size:
        raise ValueError(f"in_features {in_f} is not a multiple of group size {group_size}")
    qmax = 2 ** bits - 1
    g = w.float().reshape(out_f, in_f // group_size, group_size)
    lo, hi = g.amin(-1), g.amax(-1)
    scales = ((hi - lo).clamp(min=1e-5) / qmax).half()
    if not torch.isfinite(scales).all():
        raise ValueError(f"a group's range is too wide for a float16 scale (largest {(hi - lo).max().item():.3g}; "
                         f"the limit is {qmax} x 65504) or holds NaN/inf")
    s = scales.float()
    zeros = (-torch.round(lo / s)).clamp(0, qmax)
    q = (torch.round(g / s.unsqueeze(-1)) + zeros.unsqueeze(-1)).clamp(0, qmax)
    return q.to(torch.int32).reshape(out_f, in_f), scales, zeros.to(torch.int32)


def dequantize_groupwise(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(q - zero) * scale: q [out, in], scales/zeros [out, in / g] -> [out, in] in `dtype`."""
    out_f, in_f = q.shape
    ng = scales.shape[1]
    w = (q.view(out_f, ng, in_f // ng) - zeros.unsqueeze(-1)).to(dtype) * scales.to(dtype).unsqueeze(-1)
    return w.reshape(out_f, in_f)


def fake_quantize(w: torch.Tensor, group_size: int = 128, bits: int = 4) -> torch.Tensor:
    """Quantize then dequantize (same shape and dtype as w): the weight the int4 model computes with.

    For finite inputs, bit for bit dequantize_groupwise(*quantize_groupwise(w)) in float32 (a group
    whose float16 scale overflows gives NaN here, where quantize_groupwise refuses), computed in place in one
    weight-sized buffer: AWQ's α search calls this 20 times per linear group, and the two-step
    form makes eight temporaries the size of the weight, each a fresh, page-faulted allocation.
    Raises ValueError when `in` is not a multiple of group_size.
    """
    out_f, in_f = w.shape
    if in_f % group_size:
        raise ValueError(f"in_features {in_f} is not a multiple of group size {group_size}")
    qmax = 2 ** bits - 1
    g = w.float().reshape(out_f, in_f // group_size, group_size)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    s = ((hi - lo).clamp(min=1e-5) / qmax).half().float()
    z = (-torch.round(lo / s)).clamp(0, qmax)
    t = g / s
    t.round_().add_(z).clamp_(0, qmax).sub_(z).mul_(s)
    return t.reshape(out_f, in_f).to(w.dtype)
