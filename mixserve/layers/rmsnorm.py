"""RMSNorm (Zhang & Sennrich 2019), computed in float32 like the reference implementations."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """y = w * x / sqrt(mean(x^2) + eps) over the last dim.

    Input [..., hidden] in any float dtype; the statistic is computed in float32 and the result
    cast back before the weight multiply (as HF Llama/Qwen2 do), so bf16 outputs match them.
    """

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # one fused op for x * rsqrt(mean(x^2) + eps) in float32 instead of five
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)
