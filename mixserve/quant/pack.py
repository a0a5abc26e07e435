"""AutoAWQ "GEMM" checkpoint layout: eight 4-bit values per int32.

Layout (AutoAWQ `awq/modules/linear/gemm.py`, also read by vLLM and transformers):
- qweight int32 [in_features, out_features / 8], qzeros int32 [in_features / group, out_features / 8],
  scales float16 [in_features / group, out_features];
- within one int32, nibble i (bits 4i..4i+3) holds output column 8j + AWQ_ORDER[i], with
  AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7);
- dequantized weight [in, out] = (q - zero) * scale, group-wise along `in`.
"""
from __future__ import annotations

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# column c of a group of eight sits in nibble AWQ_REVERSE_ORDER[c]
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def pack_awq(q: torch.Tensor) -> torch.Tensor:
    """Pack integers in [0, 15] of shape [rows, cols] (cols % 8 == 0) into int32 [rows, cols / 8].

    Raises ValueError for a column count not divisible by 8 or values outside [0, 15].
    """
    rows, cols = q.shape
    if cols % 8:
        raise ValueError(f"pack_awq: {cols} columns is not a multiple of 8")
    q = q.to(torch.int32)
    if q.numel() and (q.min() < 0 or q.max() > 15):
        raise ValueError("pack_awq: values must lie in [0, 15]")
    q = q.view(rows, cols // 8, 8)[..., list(AWQ_ORDER)]
    # nibbles occupy disjoint bits, so the sum is the bitwise or (int32 wraps for nibble 7 >= 8)
    return (q << _SHIFTS).sum(-1, dtype=torch.int32)


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_awq: int32 [rows, cols / 8] -> int32 [rows, cols] with values in [0, 15]."""
    rows, c8 = packed.shape
    nib = (packed.unsqueeze(-1) >> _SHIFTS) & 15
    return nib[..., list(AWQ_REVERSE_ORDER)].reshape(rows, c8 * 8)


def dequantize_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dense weight in HF layout [out_features, in_features] from an AWQ GEMM triple (shapes above)."""
    q = unpack_awq(qweight)  # [in, out]
    z = unpack_awq(qzeros)  # [in/g, out]
    s = scales.to(dtype)
    w = (q.view(-1, group_size, q.shape[1]) - z.unsqueeze(1)).to(dtype) * s.unsqueeze(1)
    return w.reshape(q.shape).t().contiguous()
