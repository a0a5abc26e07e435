"""int4 weights times int8 activations with AVX512-VNNI, for decode rows (as llama.cpp's Q4 x Q8 dot).

PyTorch's CPU int4 kernel (`_weight_int4pack_mm_for_cpu`) streamed the 1.5B's int4 weights at about
half the machine's read bandwidth on the project's AVX-512 Xeon (BENCHMARKS.md, issue 14). This
kernel reads a layout of our own: per output row, each chunk of 128 input channels is 64 bytes,
byte j holding channel j (low nibble) and channel 64 + j (high nibble), so one 64-byte load gives two
vectors of 64 unsigned 4-bit weights. The activation row is quantized once per call to int8, one
scale per 128-channel chunk (max |x| / 127); `vpdpbusd` (u8 x s8 -> s32) multiplies and sums four
products a lane, and each chunk's integer sums are scaled into float32 accumulators.

With w = q * s + m per group (q in 0..15; this project's zero form: m = zero' - 8 s),
    y[n] = sum_g s[n,g] * sum_(k in g) q[n,k] x[k]  +  sum_g m[n,g] * sum_(k in g) x[k],
the first sum with x in int8, the second with x exact. The int8 activations are the one
approximation beyond the int4 weights (llama.cpp makes the same one); its effect on quality is
measured (`mixserve eval-ppl`), and the kernel is used only where it is chosen by timing
(`int4_kernel` in layers/kernel_choice.py) and the group size is a multiple of 128.
"""
from __future__ import annotations

import torch

from mixserve.layers.cpp_build import QUANTIZE_ROW_SRC, build_extension

CHUNK = 128  # input channels per 64-byte chunk (and per activation scale)

_SRC = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>
#include <vector>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// R rows: xq int8 [R, K], dx float [R, K/128]; w uint8 [N, K/2]; s, m half [N, ng]; xs float [R, ng]
// float16 [n] -> float [n] with F16C, 16 at a time (a scalar c10::Half conversion per group cost
// more than the group's integer dot products)
static inline void halves_to_float(const at::Half* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(src + i))));
  if (i < n) {
    const __mmask16 k = (__mmask16)((1u << (n - i)) - 1);
    _mm512_mask_storeu_ps(dst + i, k, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, src + i)));
  }
}

// Two output rows n per pass share each activation load; per (n, row, chunk) the integer sums are
// converted, multiplied by the row's chunk scale (a vector kept broadcast) and accumulated with the
// weight's group scale (broadcast once per (n, chunk), shared by all rows).
template <int R>
static void run(const int8_t* xq, const float* dx, const float* xs, const uint8_t* w, const at::Half* s,
                const at::Half* m, float* y, int64_t N, int64_t K, int64_t G) {
  const int64_t nc = K / 128, ng = K / G, cpg = G / 128;
  const __m512i low = _mm512_set1_epi8(0x0F);
  std::vector<__m512> dxv(R * nc);
  for (int64_t i = 0; i < R * nc; ++i) dxv[i] = _mm512_set1_ps(dx[i]);
  at::parallel_for(0, (N + 1) / 2, 8, [&](int64_t p0, int64_t p1) {
    std::vector<float> sf(2 * (ng + 16)), mf(2 * (ng + 16));
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n = 2 * p, nn = std::min<int64_t>(2, N - n);
      for (int64_t j = 0; j < nn; ++j) {
        halves_to_float(s + (n + j) * ng, sf.data() + j * (ng + 16), ng);
        halves_to_float(m + (n + j) * ng, mf.data() + j * (ng + 16), ng);
      }
      const uint8_t* w0 = w + n * (K / 2);
      const uint8_t* w1 = nn > 1 ? w0 + K / 2 : w0;  // an odd last row computes row n twice, stores once
      const float* s0 = sf.data();
      const float* s1 = nn > 1 ? sf.data() + (ng + 16) : s0;
      __m512 acc0[R], acc1[R];
      for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm512_setzero_ps();
      for (int64_t c = 0; c < nc; ++c) {
        const __m512i v0 = _mm512_loadu_si512(w0 + c * 64), v1 = _mm512_loadu_si512(w1 + c * 64);
        const __m512i lo0 = _mm512_and_si512(v0, low), hi0 = _mm512_and_si512(_mm512_srli_epi16(v0, 4), low);
        const __m512i lo1 = _mm512_and_si512(v1, low), hi1 = _mm512_and_si512(_mm512_srli_epi16(v1, 4), low);
        const __m512 sc0 = _mm512_set1_ps(s0[c / cpg]), sc1 = _mm512_set1_ps(s1[c / cpg]);
        for (int r = 0; r < R; ++r) {
          const int8_t* xr = xq + r * K + c * 128;
          const __m512i xa = _mm512_loadu_si512(xr), xb = _mm512_loadu_si512(xr + 64);
          const __m512i a0 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo0, xa), hi0, xb);
          const __m512i a1 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo1, xa), hi1, xb);
          const __m512 d = dxv[r * nc + c];
          acc0[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(a0), d), sc0, acc0[r]);
          acc1[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(a1), d), sc1, acc1[r]);
        }
      }
      for (int64_t j = 0; j < nn; ++j) {
        const float* mr = mf.data() + j * (ng + 16);
        for (int r = 0; r < R; ++r) {
          const float* xsr = xs + r * ng;
          __m512 t = j == 0 ? acc0[r] : acc1[r];
          int64_t g = 0;
          for (; g + 16 <= ng; g += 16) t = _mm512_fmadd_ps(_mm512_loadu_ps(mr + g), _mm512_loadu_ps(xsr + g), t);
          float tail = 0.f;
          for (; g < ng; ++g) tail += mr[g] * xsr[g];
          y[r * N + n + j] = _mm512_reduce_add_ps(t) + tail;
        }
      }
    }
  });
}
#endif

bool available() {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  return true;
#else
  return false;
#endif
}

@QUANTIZE_ROW@
// x float [R, K] -> y float [R, N]. levels > 1: each activation row goes in as `levels` int8 rows,
// its quantization, then the quantization of what that left over, and so on (rows
// levels * r + i, so they share every weight load), whose sum keeps about 7 more bits per level;
// the zero-point term uses x once, as is
torch::Tensor matmul(torch::Tensor x, torch::Tensor w, torch::Tensor s, torch::Tensor m, int64_t G, int64_t levels) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(), "x: float32 [R, K], contiguous");
  TORCH_CHECK(w.scalar_type() == at::kByte && s.scalar_type() == at::kHalf && m.scalar_type() == at::kHalf,
              "w uint8, s and m float16");
  const int64_t R = x.size(0), K = x.size(1), N = w.size(0), nc = K / 128, ng = K / G;
  TORCH_CHECK(K % 128 == 0 && G % 128 == 0 && K % G == 0 && w.size(1) == K / 2 && s.size(0) == N && s.size(1) == ng &&
              m.sizes() == s.sizes(), "int4_vnni: shapes do not agree");
  TORCH_CHECK(levels >= 1 && levels <= 4, "int4_vnni: levels in 1..4");
  const int64_t L = levels, RQ = L * R;  // int8 rows through the kernel
  auto y = torch::empty({RQ, N}, x.options());
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  const float* xp = x.data_ptr<float>();
  std::vector<int8_t> xq(RQ * K);
  std::vector<float> dx(RQ * nc), xs(RQ * ng, 0.f), rest(2 * K);
  for (int64_t r = 0; r < R; ++r) {
    const float* src = xp + r * K;
    for (int64_t i = 0; i < L; ++i) {
      float* left = rest.data() + (i % 2) * K;
      quantize_row<128>(src, K, xq.data() + (L * r + i) * K, dx.data() + (L * r + i) * nc, i + 1 < L ? left : nullptr);
      src = left;
    }
    for (int64_t k = 0; k < K; ++k) xs[L * r * ng + k / G] += xp[r * K + k];
  }
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const at::Half* sp = s.data_ptr<at::Half>();
  const at::Half* mp = m.data_ptr<at::Half>();
  float* yp = y.data_ptr<float>();
  for (int64_t r0 = 0; r0 < RQ; r0 += 4) {
    const int64_t rr = std::min<int64_t>(4, RQ - r0);
    const int8_t* a = xq.data() + r0 * K;
    const float* b = dx.data() + r0 * nc;
    const float* c = xs.data() + r0 * ng;
    float* o = yp + r0 * N;
    switch (rr) {
      case 1: run<1>(a, b, c, wp, sp, mp, o, N, K, G); break;
      case 2: run<2>(a, b, c, wp, sp, mp, o, N, K, G); break;
      case 3: run<3>(a, b, c, wp, sp, mp, o, N, K, G); break;
      default: run<4>(a, b, c, wp, sp, mp, o, N, K, G); break;
    }
  }
#else
  TORCH_CHECK(false, "int4_vnni: built without AVX512-VNNI");
#endif
  return L > 1 ? y.view({R, L, N}).sum(1) : y;
}

// dense weight for the many-row path: out [N, K] (float or bf16 bits) = q * s + m, with vector
// stores (a scalar bfloat16 conversion per weight ran at a third of the machine's write rate), and
// non-temporal ones, for the reason given in layers/int4_dequant.py (needs `out` 64-byte aligned)
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
static inline void store16(float* o, __m512 v) { _mm512_stream_ps(o, v); }
static inline void store16(at::BFloat16* o, __m512 v) {
#if defined(__AVX512BF16__)
  _mm256_stream_si256((__m256i*)o, (__m256i)_mm512_cvtneps_pbh(v));
#else
  __m512i u = _mm512_castps_si512(v);
  u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF),
                                           _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
  _mm256_stream_si256((__m256i*)o, _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
#endif
}

template <typename O>
static void dequant_rows(const uint8_t* wp, const at::Half* sp, const at::Half* mp, O* out, int64_t N, int64_t K,
                         int64_t G) {
  const int64_t ng = K / G;
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t c = 0; c < K / 128; ++c) {
        const int64_t g = c * 128 / G;
        const __m512 a = _mm512_set1_ps((float)sp[n * ng + g]), b = _mm512_set1_ps((float)mp[n * ng + g]);
        const __m512i v = _mm512_loadu_si512((const void*)(wp + n * (K / 2) + c * 64));
        const __m512i lo = _mm512_and_si512(v, _mm512_set1_epi8(15));
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(15));
        O* o = out + n * K + c * 128;
        alignas(64) uint8_t q[128];  // the 128 integers of the chunk, low nibbles then high
        _mm512_store_si512((void*)q, lo);
        _mm512_store_si512((void*)(q + 64), hi);
        for (int i = 0; i < 8; ++i) {
          const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_load_si128((const __m128i*)(q + 16 * i))));
          store16(o + 16 * i, _mm512_fmadd_ps(f, a, b));
        }
      }
    _mm_sfence();
  });
}
#endif

torch::Tensor dequant(torch::Tensor w, torch::Tensor s, torch::Tensor m, torch::Tensor out, int64_t G) {
  const int64_t N = w.size(0), K = w.size(1) * 2;
  TORCH_CHECK(out.is_contiguous() && out.numel() == N * K, "int4_vnni dequant: out needs N * K elements");
  const bool bf = out.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf || out.scalar_type() == at::kFloat, "int4_vnni dequant: float32 or bfloat16 out");
  TORCH_CHECK((reinterpret_cast<uintptr_t>(out.data_ptr()) & 63) == 0, "int4_vnni dequant: out must be 64-byte aligned");
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  if (bf) dequant_rows(w.data_ptr<uint8_t>(), s.data_ptr<at::Half>(), m.data_ptr<at::Half>(),
                       out.data_ptr<at::BFloat16>(), N, K, G);
  else dequant_rows(w.data_ptr<uint8_t>(), s.data_ptr<at::Half>(), m.data_ptr<at::Half>(), out.data_ptr<float>(),
                    N, K, G);
#else
  TORCH_CHECK(false, "int4_vnni: built without AVX512-VNNI");
#endif
  return out;
}

// y [R, N] = x [R, K] float @ W^T with W dequantized to float32 a slice of output rows at a time
// (a whole LM head in float32 would be a transient 0.5-1 GB), each slice's GEMM by PyTorch
torch::Tensor linear_f32(torch::Tensor x, torch::Tensor w, torch::Tensor s, torch::Tensor m, int64_t G) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2, "x: float32 [R, K]");
  const int64_t R = x.size(0), N = w.size(0), K = w.size(1) * 2, ng = K / G, S = 4096;
  TORCH_CHECK(x.size(1) == K, "int4_vnni linear_f32: shapes do not agree");
  auto yt = torch::empty({N, R}, x.options());
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  auto buf = torch::empty({std::min<int64_t>(S, N), K}, x.options());
  for (int64_t n0 = 0; n0 < N; n0 += S) {
    const int64_t nn = std::min<int64_t>(S, N - n0);
    dequant_rows(w.data_ptr<uint8_t>() + n0 * (K / 2), s.data_ptr<at::Half>() + n0 * ng,
                 m.data_ptr<at::Half>() + n0 * ng, buf.data_ptr<float>(), nn, K, G);
    auto out = yt.narrow(0, n0, nn);
    at::mm_out(out, buf.narrow(0, 0, nn), x.t());
  }
#else
  TORCH_CHECK(false, "int4_vnni: built without AVX512-VNNI");
#endif
  return yt.t().contiguous();
}

TORCH_LIBRARY_FRAGMENT(mixserve, lib) {
  lib.def("int4_vnni_matmul(Tensor x, Tensor w, Tensor s, Tensor m, int group_size, int levels=1) -> Tensor");
  lib.def("int4_vnni_linear_f32(Tensor x, Tensor w, Tensor s, Tensor m, int group_size) -> Tensor");
}
TORCH_LIBRARY_IMPL(mixserve, CPU, lib) {
  lib.impl("int4_vnni_matmul", &matmul);
  lib.impl("int4_vnni_linear_f32", &linear_f32);
}
""".replace("@QUANTIZE_ROW@", QUANTIZE_ROW_SRC)

_state: dict = {}
NEEDS = frozenset({"avx512_vnni", "avx512bw"})  # the kernel's instructions, as /proc/cpuinfo names them


def _load():
    if "mod" not in _state:
        mod = build_extension("mixserve_int4_vnni_v9", _SRC, ["available", "dequant"], needs=NEEDS)
        mod = mod if mod is not None and mod.available() else None
        if mod is not None:
            torch.library.register_fake("mixserve::int4_vnni_matmul")(
                lambda x, w, s, m, g, levels=1: x.new_empty(x.shape[0], w.shape[0]))
            torch.library.register_fake("mixserve::int4_vnni_linear_f32")(
                lambda x, w, s, m, g: x.new_empty(x.shape[0], w.shape[0]))
        _state["mod"] = mod
    return _state["mod"]


def available() -> bool:
    """True where the kernel is built for this CPU (AVX512-VNNI and AVX512-BW) and loads."""
    return _load() is not None


def supported(in_features: int, group_size: int) -> bool:
    """Whether this layout takes the shape: whole 128-channel chunks, groups of whole chunks."""
    return in_features % CHUNK == 0 and group_size % CHUNK == 0 and in_features % group_size == 0


def pack(q: torch.Tensor) -> torch.Tensor:
    """q int [N, K] in 0..15 -> uint8 [N, K / 2]: per 128-channel chunk, byte j = q[j] | q[64 + j] << 4."""
    n, k = q.shape
    c = q.to(torch.uint8).view(n, k // CHUNK, 2, CHUNK // 2)
    return (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def unpack(w: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack`: uint8 [N, K / 2] -> uint8 [N, K] in 0..15."""
    n, kh = w.shape
    c = w.view(n, kh // (CHUNK // 2), 1, CHUNK // 2)
    return torch.cat([c & 15, c >> 4], 2).reshape(n, kh * 2)


def int4_vnni_matmul(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, m: torch.Tensor,
                     group_size: int, levels: int = 1) -> torch.Tensor:
    """y = x @ W^T for W[n, k] = q * s[n, g] + m[n, g] (g = k // group_size).

    Args:
        x: [R, K] any float dtype (computed from float32). Rows go through the weights four at a time,
            so its lead is at 1-2 rows (decode); the caller's dense switch takes many rows.
        w: uint8 [N, K / 2] from `pack`; s, m: float16 [N, K / group_size].
        levels: int8 rows per activation row (1-4): the row's quantization, then that of what it
            left over, and so on; each level keeps about 7 more bits. 3 gives float32 logits from
            an int4 LM head within 1e-4 of the float32 product on the 0.5B's hidden states (2 left
            2e-3: their outlier channels set each chunk's scale); about the cost of 3 rows.
    Returns:
        float32 [R, N].
    Raises:
        RuntimeError: kernel not built (check `available()`) or shapes disagree.
    """
    if _load() is None:
        raise RuntimeError("int4_vnni: the kernel is not available on this machine")
    return torch.ops.mixserve.int4_vnni_matmul(x.float().contiguous(), w, s, m, group_size, levels)


def linear_f32(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, m: torch.Tensor, group_size: int) -> torch.Tensor:
    """y = x @ W^T in float32 throughout: W (layout as in `int4_vnni_matmul`) is dequantized to
    float32 4,096 output rows at a time, each slice multiplied by PyTorch's float32 GEMM. For many
    rows of float32 logits from an int4 head. x: [R, K] (computed in float32) -> float32 [R, N].
    The caller has checked `available()`."""
    return torch.ops.mixserve.int4_vnni_linear_f32(x.float().contiguous(), w, s, m, group_size)


def dequantize(w: torch.Tensor, s: torch.Tensor, m: torch.Tensor, group_size: int, out: torch.Tensor) -> torch.Tensor:
    """The dense weight [N, K] = q * s + m written into `out` (float32 or bfloat16, N * K elements,
    contiguous, 64-byte aligned as PyTorch's CPU allocations are; RuntimeError otherwise), for the
    many-row path. The caller has checked `available()`."""
    _load().dequant(w, s, m, out, group_size)
    return out.view(w.shape[0], w.shape[1] * 2)
