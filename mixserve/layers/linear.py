"""Linear layers. Dense weights use oneDNN's prepacked GEMM on CPU; int4 kinds plug in here."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


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
