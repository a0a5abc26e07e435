"""A dense GEMM whose every output row is computed the same way whatever the row count: the
batch-invariant linear.

PyTorch's CPU GEMMs (MKL's sgemm, oneDNN) pick a different kernel by the number of rows M: on
this project's AVX2 EPYC, F.linear in float32 gives row 0 one set of bits at M = 1, another at
M = 2-3 and a third from M = 4 on, and oneDNN one at M = 1 and another from 2. So a request's logits
changed with the number of rows beside it in the step (shared/cases/seeded-output-depends-on-batch.md;
the problem named in "Defeating Nondeterminism in LLM Inference", Thinking Machines, 2025). Here
every output y[m, n] = sum_k x[m, k] w[n, k] is one chain of fused multiply-adds over k in order,
from 0, then + bias: the same operations whatever M, the row's place in its tile, the tile shapes at
the edges, the K blocking or the thread that runs it.

The weight is held packed (`pack`): panels of 16 output columns, k-major, [ceil(N/16), K, 16], so an
8-lane register holds 8 columns at one k and the inner loop is an outer product (a broadcast of
x[m, k] times two weight vectors), the register tile of BLIS's AVX2 kernels: 6 rows x 16 columns
(12 accumulators of the 16 registers). Fewer rows take more panels at once (3 x 32, 2 x 48,
1 x 96), so a decode step of one row still has 12 chains in flight and streams the weight at the
memory's rate. From 7 rows the weight is walked in blocks of 8 panels x 512 k (in the L2 cache,
bf16 blocks widened once into float32), each block read by every tile of 6 rows; the accumulators
go to the output and back between k blocks, which float32 stores exactly. The former dot-product
kernel (an 8-lane chain per output, 4 x 3 tiles) ran at 25 GMAC/s a core from L1 against this
one's 39 here, and at 512 rows 1.7x oneDNN's time against 1.2x.

Weights float32 or bfloat16 (widened exactly), activations float32, output float32 (the caller
rounds to its dtype once). Built with AVX2 + FMA, which every machine kind of this project has
(AVX-512 machines run the same instructions, so the bits are the same there too); where it does
not build the engine says so at start and runs PyTorch's kernels (layers/batch_invariance.py).
"""
from __future__ import annotations

import torch

from mixserve.layers.cpp_build import Kernel, build_extension

_SRC = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#define INV_AVX2 1
static inline void loadw(const float* p, __m256& a, __m256& b) { a = _mm256_loadu_ps(p); b = _mm256_loadu_ps(p + 8); }
static inline void loadw(const at::BFloat16* p, __m256& a, __m256& b) {
  const __m256i h = _mm256_loadu_si256((const __m256i*)p);
  a = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(h)), 16));
  b = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(h, 1)), 16));
}

struct Args {
  const float* x; int64_t lda;   // x[r * lda + k]
  float* y; int64_t N;           // y[r * N + c], c < N
  const float* bias;
  int64_t kb, ke;                // k range
  bool first, last;
  // many rows: the cache lines [pf0, pf1) of the next weight block to prefetch while this call
  // runs, one line a k step (pf: its panel's first line, 64 bytes each); none where pf is null
  const char* pf; int64_t pf0, pf1;
};

// rows r < MR, panels j < NP (columns c0 + 16 j + 0..15): acc = fma(x[r, k], w[c, k], acc) for k
// in order, from 0 (first) or from y; at the end (last) + bias; only columns < N stored
template <int MR, int NP, typename W>
__attribute__((noinline)) static void micro(const Args& a, const W* w, int64_t ldp, int64_t c0) {
  __m256 acc[MR][NP][2];
  __m256i mask[NP][2];
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
#pragma GCC unroll 8
  for (int j = 0; j < NP; ++j)
    for (int h = 0; h < 2; ++h) {
      const int64_t c = c0 + j * 16 + h * 8;
      mask[j][h] = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)std::max<int64_t>(0, std::min<int64_t>(8, a.N - c))), lane);
    }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < NP; ++j)
      for (int h = 0; h < 2; ++h)
        acc[r][j][h] = a.first ? _mm256_setzero_ps() : _mm256_maskload_ps(a.y + r * a.N + c0 + j * 16 + h * 8, mask[j][h]);
  auto step = [&](int64_t k) __attribute__((always_inline)) {
    __m256 wv[NP][2];
#pragma GCC unroll 8
    for (int j = 0; j < NP; ++j) loadw(w + j * ldp + k * 16, wv[j][0], wv[j][1]);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m256 xv = _mm256_broadcast_ss(a.x + r * a.lda + k);
#pragma GCC unroll 8
      for (int j = 0; j < NP; ++j) {
        acc[r][j][0] = _mm256_fmadd_ps(xv, wv[j][0], acc[r][j][0]);
        acc[r][j][1] = _mm256_fmadd_ps(xv, wv[j][1], acc[r][j][1]);
      }
    }
  };
  // the next block's lines come in during this tile's first k steps (one a step, in a loop of
  // their own so that the rest pay no test): that block's first tile would otherwise wait on
  // memory for every line (a 6-row tile asks for 64 bytes every ~6 cycles, more than the memory's
  // rate): 1.4x MKL's time at 64 rows of the 0.5B's gate, 1.0x with it
  int64_t k = a.kb;
  if (a.pf) {
    const char* line = a.pf + a.pf0 * 64;
    const int64_t ke = std::min<int64_t>(a.ke, a.kb + (a.pf1 - a.pf0));
    for (; k < ke; ++k, line += 64) {
      _mm_prefetch(line, _MM_HINT_T1);
      step(k);
    }
  }
#pragma GCC unroll 4
  for (; k < a.ke; ++k) step(k);
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < NP; ++j)
      for (int h = 0; h < 2; ++h) {
        __m256 v = acc[r][j][h];
        if (a.last && a.bias) v = _mm256_add_ps(v, _mm256_maskload_ps(a.bias + c0 + j * 16 + h * 8, mask[j][h]));
        _mm256_maskstore_ps(a.y + r * a.N + c0 + j * 16 + h * 8, mask[j][h], v);
      }
}

// rows of one tile over panels [0, np) of w (panel stride ldp), the first column c0
template <int MR, typename W>
static inline void row_tile(const Args& a, const W* w, int64_t ldp, int64_t np, int64_t c0) {
  constexpr int NP = MR >= 4 ? 1 : (MR == 3 ? 2 : (MR == 2 ? 3 : 6));
  int64_t p = 0;
  for (; p + NP <= np; p += NP) micro<MR, NP>(a, w + p * ldp, ldp, c0 + p * 16);
  for (; p < np; ++p) micro<MR, 1>(a, w + p * ldp, ldp, c0 + p * 16);
}

// the next weight block as the many-row path prefetches it: panel p's lines from base + p * ldp
struct Pf { const char* base; int64_t ldp, np, lines; };

template <typename W>
static void all_rows(Args a, int64_t M, const W* w, int64_t ldp, int64_t np, int64_t c0, const Pf& pf) {
  const float* x = a.x; float* y = a.y;
  // full tiles share the next block's lines (the first tile reads this block from memory, so it
  // fetches nothing where others can); the remainder tile fetches none
  const int64_t T6 = M / 6, t_first = T6 >= 2 ? 1 : 0, users = T6 - t_first;
  int64_t m = 0;
  for (int64_t t = 0; t < T6; ++t, m += 6) {
    a.x = x + m * a.lda; a.y = y + m * a.N;
    const bool fetch = pf.base != nullptr && t >= t_first;
    a.pf0 = fetch ? (t - t_first) * pf.lines / users : 0;
    a.pf1 = fetch ? (t - t_first + 1) * pf.lines / users : 0;
    for (int64_t p = 0; p < np; ++p) {
      a.pf = fetch && p < pf.np ? pf.base + p * pf.ldp : nullptr;
      micro<6, 1>(a, w + p * ldp, ldp, c0 + p * 16);
    }
  }
  a.pf = nullptr;
  a.x = x + m * a.lda; a.y = y + m * a.N;
  switch (M - m) {
    case 5: row_tile<5>(a, w, ldp, np, c0); break;
    case 4: row_tile<4>(a, w, ldp, np, c0); break;
    case 3: row_tile<3>(a, w, ldp, np, c0); break;
    case 2: row_tile<2>(a, w, ldp, np, c0); break;
    case 1: row_tile<1>(a, w, ldp, np, c0); break;
    default: break;
  }
}

template <typename W>
static void run(const float* x, const W* wp, const float* bias, float* y, int64_t M, int64_t N, int64_t K) {
  const int64_t Np = (N + 15) / 16;
  // few rows: each panel streamed whole; more: blocks that stay in L2 while every row tile reads them
  const int64_t KC = M <= 6 ? K : 512, NG = M <= 6 ? Np : 8;
  at::parallel_for(0, Np, 4, [&](int64_t q0, int64_t q1) {
    std::vector<float> buf;
    for (int64_t ga = q0; ga < q1; ga += NG) {
      const int64_t np = std::min<int64_t>(q1, ga + NG) - ga;
      for (int64_t k0 = 0; k0 < K; k0 += KC) {
        const int64_t k1 = std::min<int64_t>(K, k0 + KC);
        Args a{x, K, y, N, bias, k0, k1, k0 == 0, k1 == K};
        // the block after this one in this thread's order (its source: bf16 blocks are widened from it)
        Pf pf{nullptr, 0, 0, 0};
        if (M > 6) {
          const int64_t gn = k1 < K ? ga : ga + NG, kn = k1 < K ? k1 : 0;
          if (gn < q1) {
            const int64_t kcn = std::min<int64_t>(K, kn + KC) - kn;
            pf = Pf{(const char*)(wp + (gn * K + kn) * 16), (int64_t)(K * 16 * sizeof(W)),
                    std::min<int64_t>(q1, gn + NG) - gn, (int64_t)((kcn * 16 * sizeof(W) + 63) / 64)};
          }
        }
        if (std::is_same<W, float>::value || M <= 6) {
          all_rows(a, M, wp + ga * K * 16, K * 16, np, ga * 16, pf);
          continue;
        }
        // bf16 at many rows: the chunk widened (exactly) once into float32 panels [np][kc][16]
        const int64_t kc = k1 - k0;
        buf.resize(np * kc * 16);
        for (int64_t p = 0; p < np; ++p) {
          const W* src = wp + ((ga + p) * K + k0) * 16;
          float* dst = buf.data() + p * kc * 16;
          for (int64_t i = 0; i < kc * 16; i += 16) {
            __m256 u, v; loadw(src + i, u, v);
            _mm256_storeu_ps(dst + i, u); _mm256_storeu_ps(dst + i + 8, v);
          }
        }
        a.x = x + k0; a.kb = 0; a.ke = kc;
        all_rows(a, M, (const float*)buf.data(), kc * 16, np, ga * 16, pf);
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

torch::Tensor inv_linear(torch::Tensor x, torch::Tensor wp, int64_t n, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(), "inv_linear: x float32 [M, K] contiguous");
  TORCH_CHECK((wp.scalar_type() == at::kFloat || wp.scalar_type() == at::kBFloat16) && wp.dim() == 3 && wp.size(2) == 16 &&
              wp.is_contiguous(), "inv_linear: packed weight float32/bfloat16 [ceil(N/16), K, 16] contiguous (pack())");
  TORCH_CHECK(wp.size(1) == x.size(1), "inv_linear: x has ", x.size(1), " input channels, the weight ", wp.size(1));
  TORCH_CHECK(n >= 0 && (n + 15) / 16 == wp.size(0), "inv_linear: ", n, " outputs do not fit ", wp.size(0), " panels");
  const int64_t M = x.size(0), N = n, K = wp.size(1);
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
      for (int64_t j = 0; j < N; ++j) y.data_ptr<float>()[m * N + j] = b ? b[j] : 0.f;
    return y;
  }
  if (wp.scalar_type() == at::kFloat) run(x.data_ptr<float>(), wp.data_ptr<float>(), b, y.data_ptr<float>(), M, N, K);
  else run(x.data_ptr<float>(), wp.data_ptr<at::BFloat16>(), b, y.data_ptr<float>(), M, N, K);
#else
  TORCH_CHECK(false, "inv_linear: built without AVX2/FMA");
#endif
  return y;
}

TORCH_LIBRARY_FRAGMENT(mixserve, m) {
  m.def("inv_linear(Tensor x, Tensor wp, int n, Tensor? bias) -> Tensor");
}
TORCH_LIBRARY_IMPL(mixserve, CPU, m) { m.impl("inv_linear", &inv_linear); }
"""

_state: dict = {}


def kernel() -> Kernel:
    """This kernel as cpp_build builds it (one of cpp_build.BUNDLED)."""
    return Kernel("mixserve_inv_linear_v5", _SRC, ("available",))


def build():
    """The built library (cpp_build.build_extension), nothing registered: what may run on another thread."""
    k = kernel()
    return build_extension(k.name, k.source, list(k.functions))


def _load():
    # a dispatcher op, so a captured decode graph calls it without a graph break
    if "mod" not in _state:
        mod = build()
        if mod is not None:
            torch.library.register_fake("mixserve::inv_linear")(
                lambda x, wp, n, b: x.new_empty(x.shape[0], n, dtype=torch.float32))
        _state["mod"] = mod if mod is not None and mod.available() else None
    return _state["mod"]


def available() -> bool:
    """True where the kernel builds for this CPU (AVX2 and FMA) and loads."""
    return _load() is not None


PANEL = 16  # output columns per panel of the packed layout


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] float32/bfloat16 -> the kernel's layout [ceil(N/16), K, 16], same dtype: panel
    p holds columns 16p .. 16p+15 k-major, the last panel padded with zeros. One copy, made at
    load (or per call by a caller that dequantizes per call)."""
    n, k = weight.shape
    panels = -(-n // PANEL)
    w = weight.contiguous()
    if panels * PANEL != n:
        w = torch.cat([w, w.new_zeros(panels * PANEL - n, k)])
    return w.view(panels, PANEL, k).transpose(1, 2).contiguous()


def matches(packed: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `packed` is `pack(weight)` by its shape, dtype and three sampled panels (the first,
    the middle and the last, padding included), each compared bit for bit: the check of a packed
    copy kept on disk (models/packed_weights.py) against the weight it stands for."""
    n, k = weight.shape
    panels = -(-n // PANEL)
    if packed.dtype != weight.dtype or tuple(packed.shape) != (panels, k, PANEL):
        return False
    for p in sorted({0, panels // 2, panels - 1}):
        if not torch.equal(packed[p], pack(weight[p * PANEL:(p + 1) * PANEL])[0]):
            return False
    return True


def unpack(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of `pack`: [ceil(n/16), K, 16] -> [n, K], contiguous."""
    return packed.transpose(1, 2).reshape(packed.shape[0] * PANEL, packed.shape[1])[:n].contiguous()


def linear(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] (any float dtype) @ W^T + bias, W [n, in] held as `pack(W)` -> float32 [..., n],
    each row computed by the same operations whatever the row count (module docstring). The caller
    has checked `available()`. Raises RuntimeError (from the op) for other dtypes or shapes."""
    if "mod" not in _state:  # registers the op (the engine has loaded it at start)
        _load()
    rows = 1
    for d in x.shape[:-1]:
        rows *= d
    x2 = x.reshape(rows, x.shape[-1]).float().contiguous()  # reshape(-1, 0) cannot infer the rows
    b = bias.float().contiguous() if bias is not None else None
    y = torch.ops.mixserve.inv_linear(x2, packed, n, b)
    return y.view(*x.shape[:-1], n)
