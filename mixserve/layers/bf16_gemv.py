"""A bf16 matrix-vector kernel for decode rows on CPUs with AVX512-BF16 (`vdpbf16ps`).

Decode multiplies one to a few activation rows by every weight: the step is bound by how fast the
weights stream from memory. On the project's AVX-512/AMX Xeon, PyTorch's bf16 GEMM (oneDNN or
plain) streams one-row weights at about 10 GB/s against about 20 GB/s for float32, half the
machine's read bandwidth; this kernel reads the plain [out, in] weight once, row by row, with
bf16 pair dot products into float32 accumulators (Intel's AVX512_BF16 `_mm512_dpbf16_ps`), and
rounds the result to bf16 once, as oneDNN does.

It is one candidate of the dense-linear choice (layers/kernel_choice.py), used only where it is
measured faster on the machine at hand; it builds only where the compiler targets AVX512-BF16.
"""
from __future__ import annotations

import torch

from mixserve.layers.cpp_build import build_extension

MAX_ROWS = 4  # rows handled per call; more rows reuse each weight load enough for GEMM kernels

_SRC = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#ifndef NB1
#define NB1 16
#endif

#if defined(__AVX512BF16__) && defined(__AVX512F__)
static inline float bf16_to_float(uint16_t b) {
  uint32_t u = (uint32_t)b << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// y[r, n] = sum_k x[r, k] w[n, k] (+ b[n]) for R rows of x (R <= 4), NB weight rows per pass, K in
// chunks of 32; Out is at::BFloat16 (rounded once, as oneDNN does) or float (the accumulator as is)
template <int R, int NB, typename Out>
static inline void block(const uint16_t* x, const uint16_t* w, const uint16_t* bias, Out* y, int64_t ldy,
                         int64_t n0, int64_t nn, int64_t K) {
  __m512 acc[R][NB];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_setzero_ps();
  // a short last block reads its first row in place of the missing ones (not stored), so the
  // loops have constant trip counts and the accumulators stay in registers
  const uint16_t* wr[NB];
  for (int j = 0; j < NB; ++j) wr[j] = w + (n0 + (j < nn ? j : 0)) * K;
  for (int64_t k = 0; k < K; k += 32) {
    const __mmask32 m = K - k >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << (K - k)) - 1);
    __m512i xv[R];
    for (int r = 0; r < R; ++r) xv[r] = _mm512_maskz_loadu_epi16(m, x + r * K + k);
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) {
      const __m512i wv = _mm512_maskz_loadu_epi16(m, wr[j] + k);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
        acc[r][j] = _mm512_dpbf16_ps(acc[r][j], (__m512bh)xv[r], (__m512bh)wv);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < nn; ++j) {
      float v = _mm512_reduce_add_ps(acc[r][j]);
      if (bias) v += bf16_to_float(bias[n0 + j]);
      y[r * ldy + n0 + j] = Out(v);
    }
}

// all rows: each block of NB weight rows is read from memory once and then from L1 by every
// group of 4 activation rows, so more rows cost compute, not bandwidth
template <int NB, typename Out>
static void run(const uint16_t* x, const uint16_t* w, const uint16_t* bias, Out* y, int64_t R, int64_t N, int64_t K) {
  const int64_t nb = (N + NB - 1) / NB;
  at::parallel_for(0, nb, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * NB, nn = std::min<int64_t>(NB, N - n0);
      int64_t r = 0;
      for (; r + 4 <= R; r += 4) block<4, NB>(x + r * K, w, bias, y + r * N, N, n0, nn, K);
      switch (R - r) {
        case 1: block<1, NB>(x + r * K, w, bias, y + r * N, N, n0, nn, K); break;
        case 2: block<2, NB>(x + r * K, w, bias, y + r * N, N, n0, nn, K); break;
        case 3: block<3, NB>(x + r * K, w, bias, y + r * N, N, n0, nn, K); break;
        default: break;
      }
    }
  });
}
#endif

bool available() {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

torch::Tensor gemv(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias, bool out_float) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "bf16 only");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "x [R, K] and w [N, K], contiguous");
  const int64_t R = x.size(0), N = w.size(0), K = w.size(1);
  auto y = torch::empty({R, N}, x.options().dtype(out_float ? at::kFloat : at::kBFloat16));
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  const uint16_t* b = bias.has_value() ? reinterpret_cast<const uint16_t*>(bias->data_ptr<at::BFloat16>()) : nullptr;
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  if (out_float) run<4>(xp, wp, b, y.data_ptr<float>(), R, N, K);
  else run<4>(xp, wp, b, y.data_ptr<at::BFloat16>(), R, N, K);
#else
  TORCH_CHECK(false, "built without AVX512-BF16");
#endif
  return y;
}

TORCH_LIBRARY_FRAGMENT(mixserve, m) {
  m.def("bf16_gemv(Tensor x, Tensor w, Tensor? bias, bool out_float) -> Tensor");
}
TORCH_LIBRARY_IMPL(mixserve, CPU, m) { m.impl("bf16_gemv", &gemv); }
"""

_state: dict = {}
NEEDS = frozenset({"avx512_bf16", "avx512f"})  # the kernel's instructions, as /proc/cpuinfo names them


def _load():
    # a dispatcher op, so a captured decode graph calls it without a graph break
    if "mod" not in _state:
        mod = build_extension("mixserve_bf16_gemv_v3", _SRC, ["available"], needs=NEEDS)
        if mod is not None:
            torch.library.register_fake("mixserve::bf16_gemv")(
                lambda x, w, b, f: x.new_empty(x.shape[0], w.shape[0], dtype=torch.float32 if f else x.dtype))
        _state["mod"] = mod if mod is not None and mod.available() else None
    return _state["mod"]


def available() -> bool:
    """True where the kernel is built for this CPU (AVX512-BF16) and loads."""
    return _load() is not None


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """x [R, K] bf16 times weight [N, K] bf16 (bias [N] bf16 or None) -> [R, N] in out_dtype,
    float32 accumulation: bfloat16 (rounded once) or float32 (the accumulator, for float32
    logits). Any R; past MAX_ROWS rows it costs compute rather than bandwidth. Raises
    RuntimeError where the kernel is unavailable (check `available()`)."""
    mod = _load()
    if mod is None:
        raise RuntimeError("bf16 gemv kernel unavailable on this machine")
    return torch.ops.mixserve.bf16_gemv(x.contiguous(), weight, bias, out_dtype == torch.float32)
