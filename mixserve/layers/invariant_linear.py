"""A dense GEMM whose every output row is computed the same way whatever the row count: the
batch-invariant linear.

PyTorch's CPU GEMMs (MKL's sgemm, oneDNN) pick a different kernel by the number of rows M: on
this project's AVX2 EPYC, F.linear in float32 gives row 0 one set of bits at M = 1, another at
M = 2-3 and a third from M = 4 on, and oneDNN one at M = 1 and another from 2. So a request's logits
changed with the number of rows beside it in the step (shared/cases/seeded-output-depends-on-batch.md;
the problem named in "Defeating Nondeterminism in LLM Inference", Thinking Machines, 2025). Here
every output y[m, n] = sum_k x[m, k] w[n, k] is one chain of 8-lane fused multiply-adds over k in
order (lane l takes k = l mod 8), one fixed tree over the 8 lanes, then the K mod 8 tail by `fma`
in order, then the bias: the same operations whatever M, the row's place in its tile, the tile
shapes at the edges or the thread that runs it. Tiles are 4 rows x 3 weight rows (12 accumulators
of the 16 AVX2 registers); the weight is streamed in blocks of about 192 KiB of rows, each block
read from memory once and then from the cache by every tile of 4 activation rows.

Weights float32 or bfloat16 (widened exactly), activations float32, output float32 (the caller
rounds to its dtype once). Built with AVX2 + FMA, which every machine kind of this project has
(AVX-512 machines run the same instructions, so the bits are the same there too); where it does
not build the engine says so at start and runs PyTorch's kernels (layers/batch_invariance.py).
"""
from __future__ import annotations

import torch

from mixserve.layers.cpp_build import build_extension

_SRC = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>

#if defined(__AVX2__) && defined(__FMA__)
#define INV_AVX2 1
static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const at::BFloat16* p) {  // bf16 -> float32 is exact: the bits shifted up
  const __m128i h = _mm_loadu_si128((const __m128i*)p);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
static inline float wval(float v) { return v; }
static inline float wval(at::BFloat16 v) { return static_cast<float>(v); }

// one fixed tree over the lanes: ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))
static inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

// y[r, n0 + j] for r < MR, j < NR; every accumulator is one chain in k order
template <int MR, int NR, typename W>
static inline void tile(const float* x, int64_t K, const W* w, const float* bias, float* y, int64_t ldy, int64_t n0) {
  __m256 acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) acc[r][j] = _mm256_setzero_ps();
  const int64_t K8 = K & ~(int64_t)7;
  const W* wr = w + n0 * K;
  for (int64_t k = 0; k < K8; k += 8) {
    __m256 wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = load8(wr + j * K + k);
    for (int r = 0; r < MR; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * K + k);
      for (int j = 0; j < NR; ++j) acc[r][j] = _mm256_fmadd_ps(xv, wv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) {
      float v = hsum(acc[r][j]);
      for (int64_t k = K8; k < K; ++k) v = std::fma(x[r * K + k], wval(wr[j * K + k]), v);
      if (bias) v = v + bias[n0 + j];
      y[r * ldy + n0 + j] = v;
    }
}

template <int MR, typename W>
static inline void tile_n(int nr, const float* x, int64_t K, const W* w, const float* bias, float* y, int64_t ldy,
                          int64_t n0) {
  if (nr == 3) tile<MR, 3>(x, K, w, bias, y, ldy, n0);
  else if (nr == 2) tile<MR, 2>(x, K, w, bias, y, ldy, n0);
  else tile<MR, 1>(x, K, w, bias, y, ldy, n0);
}

template <typename W>
static void run(const float* x, const W* w, const float* bias, float* y, int64_t M, int64_t N, int64_t K) {
  const int64_t NB = std::max<int64_t>(3, (192 * 1024 / (K * (int64_t)sizeof(W))) / 3 * 3);
  const int64_t nblocks = (N + NB - 1) / NB;
  at::parallel_for(0, nblocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * NB, n1 = std::min<int64_t>(N, n0 + NB);
      for (int64_t m0 = 0; m0 < M; m0 += 4) {
        const int64_t mr = std::min<int64_t>(4, M - m0);
        const float* xm = x + m0 * K;
        float* ym = y + m0 * N;
        for (int64_t n = n0; n < n1; n += 3) {
          const int nr = (int)std::min<int64_t>(3, n1 - n);
          switch (mr) {
            case 4: tile_n<4>(nr, xm, K, w, bias, ym, N, n); break;
            case 3: tile_n<3>(nr, xm, K, w, bias, ym, N, n); break;
            case 2: tile_n<2>(nr, xm, K, w, bias, ym, N, n); break;
            default: tile_n<1>(nr, xm, K, w, bias, ym, N, n); break;
          }
        }
      }
    }
  });
}
#endif

bool available() {
#ifdef INV_AVX2
  return true;
#else
  return false;
#endif
}

torch::Tensor inv_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(), "inv_linear: x float32 [M, K] contiguous");
  TORCH_CHECK((w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16) && w.dim() == 2 && w.is_contiguous(),
              "inv_linear: w float32/bfloat16 [N, K] contiguous");
  TORCH_CHECK(w.size(1) == x.size(1), "inv_linear: x has ", x.size(1), " input channels, w ", w.size(1));
  const int64_t M = x.size(0), N = w.size(0), K = w.size(1);
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N, "inv_linear: bias float32 [N]");
    b = bias->data_ptr<float>();
  }
  auto y = torch::empty({M, N}, x.options());
#ifdef INV_AVX2
  if (M == 0 || N == 0) return y;
  if (K == 0) {  // an empty sum: the bias alone
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) y.data_ptr<float>()[m * N + n] = b ? b[n] : 0.f;
    return y;
  }
  if (w.scalar_type() == at::kFloat) run(x.data_ptr<float>(), w.data_ptr<float>(), b, y.data_ptr<float>(), M, N, K);
  else run(x.data_ptr<float>(), w.data_ptr<at::BFloat16>(), b, y.data_ptr<float>(), M, N, K);
#else
  TORCH_CHECK(false, "inv_linear: built without AVX2/FMA");
#endif
  return y;
}

TORCH_LIBRARY_FRAGMENT(mixserve, m) {
  m.def("inv_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor");
}
TORCH_LIBRARY_IMPL(mixserve, CPU, m) { m.impl("inv_linear", &inv_linear); }
"""

_state: dict = {}


def _load():
    # a dispatcher op, so a captured decode graph calls it without a graph break
    if "mod" not in _state:
        mod = build_extension("mixserve_inv_linear_v3", _SRC, ["available"])
        if mod is not None:
            torch.library.register_fake("mixserve::inv_linear")(
                lambda x, w, b: x.new_empty(x.shape[0], w.shape[0], dtype=torch.float32))
        _state["mod"] = mod if mod is not None and mod.available() else None
    return _state["mod"]


def available() -> bool:
    """True where the kernel builds for this CPU (AVX2 and FMA) and loads."""
    return _load() is not None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] (any float dtype) @ weight [out, in] (float32 or bfloat16, contiguous) + bias
    -> float32 [..., out], each row computed by the same operations whatever the row count
    (module docstring). The caller has checked `available()`. Raises RuntimeError (from the op)
    for other dtypes or shapes."""
    if "mod" not in _state:  # registers the op (the engine has loaded it at start)
        _load()
    rows = 1
    for d in x.shape[:-1]:
        rows *= d
    x2 = x.reshape(rows, x.shape[-1]).float().contiguous()  # reshape(-1, 0) cannot infer the rows
    b = bias.float().contiguous() if bias is not None else None
    y = torch.ops.mixserve.inv_linear(x2, weight, b)
    return y.view(*x.shape[:-1], weight.shape[0])
