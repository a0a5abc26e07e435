"""RMSNorm (Zhang & Sennrich 2019), computed in float32 like the reference implementations; and the
opaque ops batch invariance puts in eager steps and compiled graphs alike (RMSNorm, SwiGLU's product)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


@torch.library.custom_op("mixserve::rms_norm", mutates_args=())
def rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm.forward's eager arithmetic as one dispatcher op: opaque to torch.compile, so a
    compiled decode graph normalizes with exactly the eager reduction (Inductor's own fused
    reduction rounds the mean of squares differently: batch-invariant mode, layers/batch_invariance.py)."""
    return weight * F.rms_norm(x.float(), weight.shape, eps=eps).to(x.dtype)


@rms_norm_op.register_fake
def _(x, weight, eps):
    return torch.empty_like(x)


@torch.library.custom_op("mixserve::silu_mul", mutates_args=())
def silu_mul_op(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's F.silu(gate) * up (Shazeer 2020) as one dispatcher op with eager's arithmetic, gate
    and up [..., I] of one dtype -> [..., I]: opaque to torch.compile, whose vectorized loop rounds
    the last I mod 16 columns unlike eager's scalar tail (batch-invariant mode, layers/batch_invariance.py)."""
    return F.silu(gate) * up


@silu_mul_op.register_fake
def _(gate, up):
    return torch.empty_like(gate)


class RMSNorm(nn.Module):
    """y = w * x / sqrt(mean(x^2) + eps) over the last dim.

    Input [..., hidden] in any float dtype; the statistic is computed in float32 and the result
    cast back before the weight multiply (as HF Llama/Qwen2 do), so bf16 outputs match them.
    """

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps
        self.opaque = False  # batch-invariant mode: the same op in eager steps and compiled graphs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.opaque and torch.compiler.is_compiling():
            return torch.ops.mixserve.rms_norm(x, self.weight, self.eps)
        # one fused op for x * rsqrt(mean(x^2) + eps) in float32 instead of five; also the opaque
        # op's own arithmetic, called here directly in eager steps: a custom op's first call
        # imports torch._dynamo (1.4 s of a warm start, issue 32)
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)
