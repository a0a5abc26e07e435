"""RMSNorm (Zhang & Sennrich 2019), computed in float32 like the reference implementations; and the
opaque ops batch invariance puts in eager steps and compiled graphs alike (RMSNorm, SwiGLU's product).

In batch-invariant mode a norm is one op whose arithmetic does not depend on the row count. Where
the C++ kernels build, that op is `mixserve::rms_norm_rows` (below): one call, a row's sum of
squares in 16 float32 lanes (fused multiply-adds, channel c in lane c mod 16) added in a fixed tree,
then x * (1 / sqrt(mean + eps)) rounded to the dtype and multiplied by the weight, rounded again.
It replaced the aten composite (six ops, ~26 us a 896-channel row; 49 of them a 0.5B decode step:
~1.1 ms of ~14, issue 43). SwiGLU's product is one C++ op the same way (`silu_mul_rows`). Eager
steps take both ops in either mode (the composites' bf16 ops are slow on many rows); without the
kernels the opaque ops are the composites themselves.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mixserve.layers.cpp_build import Kernel, build_extension

_SRC = r"""
#include <torch/extension.h>
#include <algorithm>
#include <cmath>
#include <cstring>

static inline float from_bf16(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; std::memcpy(&f, &u, 4); return f; }
// c10::BFloat16's rounding: to nearest even, a NaN to the quiet 0x7FC0
static inline uint16_t to_bf16(float f) {
  uint32_t u; std::memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
  return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
template <typename T> static inline float ld(const T* p, int64_t i) {
  if constexpr (std::is_same<T, float>::value) return p[i]; else return from_bf16(p[i]);
}
template <typename T> static inline T st(float f) {
  if constexpr (std::is_same<T, float>::value) return f; else return to_bf16(f);
}

template <typename T>
static void norm_rows(const T* x, const T* w, T* y, int64_t R, int64_t H, float eps) {
  at::parallel_for(0, R, 8, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * H;
      T* yr = y + r * H;
      float acc[16] = {0.f};
      int64_t i = 0;
      for (; i + 16 <= H; i += 16)
        for (int l = 0; l < 16; ++l) { const float v = ld(xr, i + l); acc[l] = std::fma(v, v, acc[l]); }
      for (int l = 0; i + l < H; ++l) { const float v = ld(xr, i + l); acc[l] = std::fma(v, v, acc[l]); }
      for (int h = 8; h >= 1; h /= 2)
        for (int l = 0; l < h; ++l) acc[l] += acc[l + h];
      const float inv = 1.0f / std::sqrt(acc[0] / (float)H + eps);
      for (int64_t j = 0; j < H; ++j) {
        const T n = st<T>(ld(xr, j) * inv);  // the normalized value, rounded to the dtype first
        yr[j] = st<T>(ld(w, j) * ld(&n, 0));
      }
    }
  });
}

// x [..., H] and weight [H] of one dtype (float32 or bfloat16), contiguous -> y like x
torch::Tensor rms_norm_rows(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && weight.dim() == 1 && x.dim() >= 1 &&
              x.size(-1) == weight.size(0) && x.scalar_type() == weight.scalar_type() &&
              (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "rms_norm_rows: x [..., H] and weight [H], contiguous, one dtype (float32 or bfloat16)");
  auto y = torch::empty_like(x);
  const int64_t H = weight.size(0), R = H ? x.numel() / H : 0;
  if (R == 0) return y;
  if (x.scalar_type() == at::kFloat)
    norm_rows<float>(x.data_ptr<float>(), weight.data_ptr<float>(), y.data_ptr<float>(), R, H, (float)eps);
  else
    norm_rows<uint16_t>((const uint16_t*)x.data_ptr(), (const uint16_t*)weight.data_ptr(), (uint16_t*)y.data_ptr(),
                        R, H, (float)eps);
  return y;
}

// e^x for x in float32: x = n ln2 + r, |r| <= ln2 / 2, e^r by its degree-6 Taylor polynomial
// (relative error < 2e-7), times 2^n by the exponent bits; no calls, so loops of it vectorize
static inline float exp_poly(float x) {
  x = std::min(88.0f, std::max(-87.0f, x));
  const float n = std::nearbyint(x * 1.44269504f);
  const float r = std::fma(n, -0.693145752f, std::fma(n, -1.42860677e-6f, x));
  float p = 1.0f / 720;
  p = std::fma(p, r, 1.0f / 120); p = std::fma(p, r, 1.0f / 24); p = std::fma(p, r, 1.0f / 6);
  p = std::fma(p, r, 0.5f); p = std::fma(p, r, 1.0f); p = std::fma(p, r, 1.0f);
  const int32_t e = ((int32_t)n + 127) << 23;
  float s; std::memcpy(&s, &e, 4);
  return p * s;
}

template <typename T>
static void silu_rows(const T* g, const T* u, T* y, int64_t R, int64_t I, int64_t gs, int64_t us) {
  at::parallel_for(0, R, 8, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* gr = g + r * gs;
      const T* ur = u + r * us;
      T* yr = y + r * I;
      for (int64_t j = 0; j < I; ++j) {
        const float a = ld(gr, j);
        const float sl = a != a ? a : a / (1.0f + exp_poly(-a));  // a NaN stays NaN
        const T sr = st<T>(sl);  // silu rounded to the dtype, then the product rounded again
        yr[j] = st<T>(ld(&sr, 0) * ld(ur, j));
      }
    }
  });
}

// SwiGLU's silu(gate) * up: gate and up [..., I] of one dtype (float32 or bfloat16), each row's I
// values contiguous (rows may be strided: the halves of one gate_up output) -> y [..., I] contiguous
torch::Tensor silu_mul_rows(torch::Tensor gate, torch::Tensor up) {
  TORCH_CHECK(gate.sizes() == up.sizes() && gate.dim() >= 1 && gate.scalar_type() == up.scalar_type() &&
              (gate.scalar_type() == at::kFloat || gate.scalar_type() == at::kBFloat16),
              "silu_mul_rows: gate and up of one shape [..., I] and dtype (float32 or bfloat16)");
  const int64_t I = gate.size(-1), R = I ? gate.numel() / I : 0;
  auto g2 = gate.reshape({R, I}), u2 = up.reshape({R, I});
  TORCH_CHECK((I <= 1 || (g2.stride(1) == 1 && u2.stride(1) == 1)), "silu_mul_rows: rows must be contiguous");
  auto y = torch::empty(gate.sizes(), gate.options());
  if (R == 0 || I == 0) return y;
  if (gate.scalar_type() == at::kFloat)
    silu_rows<float>(g2.data_ptr<float>(), u2.data_ptr<float>(), y.data_ptr<float>(), R, I, g2.stride(0), u2.stride(0));
  else
    silu_rows<uint16_t>((const uint16_t*)g2.data_ptr(), (const uint16_t*)u2.data_ptr(), (uint16_t*)y.data_ptr(),
                        R, I, g2.stride(0), u2.stride(0));
  return y;
}

TORCH_LIBRARY_FRAGMENT(mixserve, m) {
  m.def("rms_norm_rows(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul_rows(Tensor gate, Tensor up) -> Tensor");
}
TORCH_LIBRARY_IMPL(mixserve, CPU, m) {
  m.impl("rms_norm_rows", &rms_norm_rows);
  m.impl("silu_mul_rows", &silu_mul_rows);
}
"""
_state: dict = {}


def kernel() -> Kernel:
    """This kernel as cpp_build builds it (one of cpp_build.BUNDLED)."""
    return Kernel("mixserve_rms_norm_v1", _SRC, ("rms_norm_rows", "silu_mul_rows"))


def build():
    """The built library (cpp_build.build_extension), nothing registered: what may run on another thread."""
    k = kernel()
    return build_extension(k.name, k.source, list(k.functions))


def rows_kernel() -> bool:
    """True where `mixserve::rms_norm_rows` is built and registered (a C++ compiler and PyTorch's
    headers; not under MIXSERVE_NO_CPP_KERNELS): the opaque norm's implementation, decided once."""
    if "ok" not in _state:
        mod = build()
        if mod is not None:
            torch.library.register_fake("mixserve::rms_norm_rows")(lambda x, w, eps: torch.empty_like(x))
            torch.library.register_fake("mixserve::silu_mul_rows")(lambda g, u: g.new_empty(g.shape))
        _state["ok"] = mod is not None
    return _state["ok"]


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row of x [..., H] (float32 or bfloat16, contiguous) with weight [H] of x's dtype
    through the C++ op (module doc: its arithmetic and order, the same at every row count). Returns a
    tensor like x. Raises RuntimeError where `rows_kernel()` is False or the shapes or dtypes disagree."""
    if not rows_kernel():
        raise RuntimeError("rms_norm_rows: the C++ kernel is not available on this machine")
    return torch.ops.mixserve.rms_norm_rows(x, weight, eps)


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


def silu_mul(gate: torch.Tensor, up: torch.Tensor, opaque: bool) -> torch.Tensor:
    """SwiGLU's silu(gate) * up, gate and up [..., I] of one dtype -> [..., I]. Eager steps on the
    CPU take the C++ `mixserve::silu_mul_rows` (one call: silu in float32 with a polynomial e^x,
    rounded to the dtype, times up, rounded again) where it is built, for float32 and bfloat16;
    a compiled graph takes it too where `opaque` (batch-invariant mode: eager's arithmetic at every
    row count), else lets Inductor fuse F.silu(gate) * up. Without the kernels: F.silu(gate) * up,
    opaque in a graph as `silu_mul_op`."""
    fast = gate.dtype in (torch.float32, torch.bfloat16) and gate.dtype == up.dtype
    if torch.compiler.is_compiling():
        if opaque:
            return torch.ops.mixserve.silu_mul_rows(gate, up) if fast and rows_kernel() \
                else torch.ops.mixserve.silu_mul(gate, up)
    elif fast and gate.device.type == "cpu" and rows_kernel():
        return torch.ops.mixserve.silu_mul_rows(gate, up)
    return F.silu(gate) * up


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
        one_call = x.dtype == self.weight.dtype and x.dtype in (torch.float32, torch.bfloat16) \
            and x.device.type == "cpu" and rows_kernel()
        if torch.compiler.is_compiling():
            if self.opaque:
                # no .contiguous() here: whether a view is contiguous can depend on a row count of 1,
                # a guard that specialises the graph (the op checks; x is an add's output)
                return torch.ops.mixserve.rms_norm_rows(x, self.weight, self.eps) if one_call \
                    else torch.ops.mixserve.rms_norm(x, self.weight, self.eps)
            # Inductor fuses the composite below into one loop of its own
        elif one_call:
            # eager steps in either mode: one C++ call, where the composite's bf16 ops took ~2 ms
            # for a 512 x 1536 chunk (float32: 0.13 ms)
            return torch.ops.mixserve.rms_norm_rows(x.contiguous(), self.weight, self.eps)
        # one fused op for x * rsqrt(mean(x^2) + eps) in float32 instead of five; also the opaque
        # op's own arithmetic where the C++ kernels are off: a custom op's first call imports
        # torch._dynamo (1.4 s of a warm start, issue 32)
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)
