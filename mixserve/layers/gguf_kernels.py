"""GGUF block-quantized weights held as they are: one int8-activation kernel for every type.

Two variants of the kernel, chosen by the build's instruction set: AVX512-VNNI (`vpdpbusd`) and
AVX2 (`vpmaddubsw` + `vpmaddwd`, issue 43; `MIXSERVE_ISA=avx2` forces it). They compute the same
integer group sums and then the same float steps in the same order (written at the top of `_SRC`),
so they give the same bits; above 4 activation rows each variant's many-row kernel unpacks each
weight tile once, with the same steps, so a row's bits do not depend on the row count.

Every GGUF weight type mixserve runs natively (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K; formats in
ggml's `ggml-common.h` and the GGUF spec, https://github.com/ggml-org/ggml/blob/master/docs/gguf.md)
is a set of unsigned integers q (4, 5, 6 or 8 bits) with, per group g of G input channels (32, or
16 for Q6_K), an affine map w = s_g * q + m_g. The file's integers and scale fields are kept as they
are, repacked once at load (layers/gguf_linear.py, layers/gguf_blocks.py), per output row:

- the integers in blocks of 16 groups, in "step" order: the kernel's vector for step i of a block
  holds, in 32-bit lane l, channels l*G + 4i .. l*G + 4i + 3. So each `vpdpbusd` (u8 x s8, four
  products summed per lane) adds four channels to each of 16 groups' integer sums, and one block's
  G/4 steps leave every lane with one group's exact sum: the group scales are then applied once per
  group (a float multiply per 16 groups), not once per 4 channels. A last block of t < 16 groups
  is stored compact (4t bytes a step). `lo` uint8 [N, K/2]: the low 4 bits, step p in the low
  nibble and step p + G/8 in the high nibble of one 64-byte vector;
- `hi`: the bits above, HB = 0, 1, 2 or 4 of them: a second nibble plane like `lo` (Q8_0, HB 4),
  or per step and bit a 64-bit mask (Q5_0 1 bit, Q6_K 2 bits);
- `d` float16 [N, K/S]: the scale per super-block of S channels (S = G for the 32-blocks, 256 for
  the K-quants), `sc` int8 [N, K/G]: the K-quants' integer sub-block scales (s_g = d * sc_g);
- the offset, one of: m_g = -z * s_g (the symmetric types: z = 8, 16, 32 or 128), m_g = dm_g
  (Q4_1's stored min), or m_g = dm * mn_g (Q4_K: dm = -dmin, mn the 6-bit mins).
Every product d * sc and dm * mn is exact in float32 and s * q + m is one fused multiply-add of
exact operands, so the effective weights (`dequantize`) equal gguf's float32 dequantization
bit for bit (tests/unit/test_gguf_native.py).

The matmul quantizes each activation row to int8 with one scale per 32 channels (llama.cpp's Q8_0
granularity), and adds the offsets as sum_g m_g * dx * sum_(k in g) xq[k]: the result is the
exact effective weights times the int8-quantized activations, accumulated in float32. `levels` > 1
feeds each row in as its quantization and the quantizations of what that left over (float32
logits from an LM head). The few-row kernel runs two weight rows a pass (sharing each activation
load) or one (a single stream through the weights: `prefetch` < 0), and
prefetches the weight rows `prefetch` (or -prefetch - 1) row pairs ahead; both chosen by timing
per machine and shape (0 / -1: the hardware prefetcher alone).
"""
from __future__ import annotations

import logging
import os

import torch

from mixserve.env import cpu_flags, forced_isa
from mixserve.layers.cpp_build import QUANTIZE_ROW_SRC, Kernel, build_extension


_SRC = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define GGUF_VNNI 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define GGUF_AVX2 1
#endif
#if defined(GGUF_VNNI) || defined(GGUF_AVX2)
#define GGUF_NATIVE 1
#endif

#ifdef GGUF_NATIVE
// The float order every variant shares (so that they give the same bits): per 16-group block, lane l
// (group 16b + l) does acc_l = fma(float(isum_l), s_l * dx_l, fma(m_l, xs_l, acc_l)); a row's result
// is then the 16 lanes summed as h_i = acc_i + acc_(i+8), q_i = h_i + h_(i+4), s_i = q_i + q_(i+2),
// s_0 + s_1 (GCC's _mm512_reduce_add_ps, written out so that no compiler reorders it).
static inline float sum8_tree(__m256 h) {
  const __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  const __m128 s = _mm_add_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(s) + _mm_cvtss_f32(_mm_shuffle_ps(s, s, 1));
}
#endif

// the most activation rows the VNNI variant runs by streaming passes through the weights (`run`,
// `run_wide`) before its many-row kernel; gguf_wide_rows(n) sets it (n >= 4; else only reads it) and
// returns the value before (benchmarks/gguf_wide_rows.py times both ways; they give the same bits).
// The AVX2 variant keeps 4 (16 vector registers hold no 8-row pass).
static int64_t g_wide_rows = 16;

int64_t wide_rows(int64_t n) {
  const int64_t old = g_wide_rows;
  if (n >= 4) g_wide_rows = n;
  return old;
}

struct Layout {
  const uint8_t* lo; const uint8_t* hi; const at::Half* d; const int8_t* sc; const at::Half* dm;
  const uint8_t* mn; int64_t N, K, G, S, HB, ng, nb, hib; float z;
};

static Layout layout(torch::Tensor lo, torch::Tensor hi, torch::Tensor d, torch::Tensor sc, torch::Tensor dm,
                     torch::Tensor mn, int64_t G, int64_t S, int64_t HB, double z) {
  Layout L;
  TORCH_CHECK(lo.scalar_type() == at::kByte && lo.dim() == 2 && lo.is_contiguous(), "gguf: lo uint8 [N, K/2]");
  L.N = lo.size(0); L.K = lo.size(1) * 2; L.G = G; L.S = S; L.HB = HB; L.z = (float)z;
  // K a multiple of 32 (the activations' quantization blocks); a super-block of 1, 8 or 16 groups
  // (the scale lanes are spread for those alone)
  TORCH_CHECK((G == 16 || G == 32) && L.K % 32 == 0 && S % G == 0 && L.K % S == 0 &&
              (S / G == 1 || S / G == 8 || S / G == 16), "gguf: unsupported group sizes");
  TORCH_CHECK(HB == 0 || HB == 1 || HB == 2 || HB == 4, "gguf: HB in 0, 1, 2, 4");
  L.ng = L.K / G; L.nb = (L.ng + 15) / 16;
  L.hib = HB == 4 ? L.K / 2 : L.nb * (G / 4) * HB * 8;  // hi bytes per row
  TORCH_CHECK(HB == 0 || (hi.scalar_type() == at::kByte && hi.numel() == L.N * L.hib && hi.is_contiguous()), "gguf: hi");
  TORCH_CHECK(d.scalar_type() == at::kHalf && d.numel() == L.N * (L.K / S) && d.is_contiguous(), "gguf: d");
  const bool ks = S != G;
  TORCH_CHECK(!ks || (sc.scalar_type() == at::kChar && sc.numel() == L.N * L.ng && sc.is_contiguous()), "gguf: sc");
  const bool has_dm = dm.numel() > 0, has_mn = mn.numel() > 0;
  TORCH_CHECK(!has_dm || (dm.scalar_type() == at::kHalf && dm.numel() == d.numel() && dm.is_contiguous()), "gguf: dm");
  TORCH_CHECK(!has_mn || (has_dm && ks && mn.scalar_type() == at::kByte && mn.numel() == sc.numel() &&
              mn.is_contiguous()), "gguf: mn");
  L.lo = lo.data_ptr<uint8_t>();
  L.hi = HB ? hi.data_ptr<uint8_t>() : nullptr;
  L.d = d.data_ptr<at::Half>();
  L.sc = ks ? sc.data_ptr<int8_t>() : nullptr;
  L.dm = has_dm ? dm.data_ptr<at::Half>() : nullptr;
  L.mn = has_mn ? mn.data_ptr<uint8_t>() : nullptr;
  return L;
}

#ifdef GGUF_NATIVE
// step p of block b of the row pair PF pairs after row n (PF chosen by timing): the hardware
// prefetcher alone left the loads exposed (on the project's Xeon, 12.6 -> 16.4 GB/s on the 1.5B's gate)
template <int G, int HB>
static inline void prefetch_pair(const Layout& L, int64_t n, int64_t N, int64_t PF, int64_t b, int64_t p, int64_t t) {
  const int64_t off = b * 8 * G + p * 4 * t, ahead = std::max<int64_t>(0, std::min<int64_t>(n + 2 * PF, N - 2));
  for (int64_t row = ahead; row < ahead + 2; ++row) {
    _mm_prefetch((const char*)(L.lo + row * (L.K / 2) + off), _MM_HINT_T0);
    if constexpr (HB == 4) {
      _mm_prefetch((const char*)(L.hi + row * (L.K / 2) + off), _MM_HINT_T0);
    } else if constexpr (HB > 0) {
      if (p == 0) _mm_prefetch((const char*)(L.hi + row * L.hib + b * (G / 4) * HB * 8), _MM_HINT_T0);
    }
    if (p == 0) {  // the block's scales: streams of their own, too slow-moving for the hardware prefetcher
      const int64_t ns = L.K / L.S, sb = 16 * b * L.G / L.S;
      _mm_prefetch((const char*)(L.d + row * ns + sb), _MM_HINT_T0);
      if (L.sc) _mm_prefetch((const char*)(L.sc + row * L.ng + 16 * b), _MM_HINT_T0);
      if (L.dm) _mm_prefetch((const char*)(L.dm + row * ns + sb), _MM_HINT_T0);
      if (L.mn) _mm_prefetch((const char*)(L.mn + row * L.ng + 16 * b), _MM_HINT_T0);
    }
  }
}
#endif

// f(std::integral_constant<int, R>()) for R = min(4, rr): the row count of a pass as the kernels'
// template argument
template <typename F>
static inline void with_rows(int64_t rr, F&& f) {
  switch (std::min<int64_t>(4, rr)) {
    case 1: f(std::integral_constant<int, 1>()); break;
    case 2: f(std::integral_constant<int, 2>()); break;
    case 3: f(std::integral_constant<int, 3>()); break;
    default: f(std::integral_constant<int, 4>()); break;
  }
}

// weight rows per tile of the many-row kernels: as many as ~192 KB of unpacked rows hold (the
// activation rows are read once per tile, so a 16-row tile read a 512-row prefill's 2.5 MB of
// activations 600 times for the 1.5B's gate and up), in L2 beside four activation rows on every
// CPU this project meets (512 KB and up), and at least 4 tiles per thread, so the threads share them
static inline int64_t tile_width(int64_t N, int64_t K) {
  const int64_t by_cache = (192 * 1024) / std::max<int64_t>(K, 1);
  const int64_t by_threads = N / (4 * std::max<int64_t>(at::get_num_threads(), 1));
  return std::max<int64_t>(2, std::min(by_cache, by_threads) & ~(int64_t)1);
}

// the many-row kernels' frame: the weight rows in tiles of tile_width(N, K), the tiles split over the
// threads; per tile, fill(scratch, w0, nw) unpacks weight rows w0 .. w0 + nw - 1 once into the thread's
// scratch (make(TW) gives it), then rows(scratch, r0, w0, nw) runs activation rows r0 .. r0 + 3 against it
template <typename Make, typename Fill, typename Rows>
static void over_tiles(int64_t N, int64_t K, int64_t RQ, Make&& make, Fill&& fill, Rows&& rows) {
  const int64_t TW = tile_width(N, K);
  at::parallel_for(0, (N + TW - 1) / TW, 1, [&](int64_t t0, int64_t t1) {
    auto scratch = make(TW);
    for (int64_t tile = t0; tile < t1; ++tile) {
      const int64_t w0 = tile * TW, nw = std::min<int64_t>(TW, N - w0);
      fill(scratch, w0, nw);
      for (int64_t r0 = 0; r0 < RQ; r0 += 4) rows(scratch, r0, w0, nw);
    }
  });
}

#ifdef GGUF_VNNI
static inline float sum16(__m512 v) {
  return sum8_tree(_mm256_add_ps(_mm512_castps512_ps256(v),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))));
}

// whole blocks with plain loads (the masked ones kept this CPU's prefetchers behind, see `unpack`)
static inline __m512 halves16(const at::Half* p, __mmask16 k) {
  return _mm512_cvtph_ps(k == 0xFFFF ? _mm256_loadu_si256((const __m256i*)p) : _mm256_maskz_loadu_epi16(k, p));
}

static inline __m128i bytes16(const void* p, __mmask16 k) {
  return k == 0xFFFF ? _mm_loadu_si128((const __m128i*)p) : _mm_maskz_loadu_epi8(k, p);
}

// the super-block scales of lanes 0-7 (p[0]) and 8-15 (p[1], or p[0] again for 16-group super-blocks):
// two scalar half-to-float conversions, exact as cvtph's
static inline __m512 super_scales(const at::Half* p, int64_t nsb, int64_t gps) {
  const float d0 = (float)p[0], d1 = gps == 8 && nsb > 1 ? (float)p[1] : (gps == 8 ? 0.f : d0);
  return _mm512_mask_blend_ps((__mmask16)0xFF00, _mm512_set1_ps(d0), _mm512_set1_ps(d1));
}

// row n's s_g and m_g for the 16 groups of block b (lanes past the row's groups are zero)
static inline void block_scales(const Layout& L, int64_t n, int64_t b, __m512& sv, __m512& mv) {
  const int64_t g0 = 16 * b, cnt = std::min<int64_t>(16, L.ng - g0), ns = L.K / L.S, gps = L.S / L.G;
  const __mmask16 k = (__mmask16)((1u << cnt) - 1);
  const at::Half* d = L.d + n * ns;
  if (gps == 1) {
    sv = halves16(d + g0, k);
    mv = L.dm ? halves16(L.dm + n * ns + g0, k) : _mm512_mul_ps(sv, _mm512_set1_ps(-L.z));
    return;
  }
  // K-quants: s_g = d[g / gps] * sc_g, lanes spread from the block's one or two super-blocks
  const int64_t sb = g0 / gps, nsb = std::min<int64_t>((cnt + gps - 1) / gps, ns - sb);
  const __m512 dv = super_scales(d + sb, nsb, gps);
  sv = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes16(L.sc + n * L.ng + g0, k))));
  if (L.mn) {
    const __m512 dmv = super_scales(L.dm + n * ns + sb, nsb, gps);
    mv = _mm512_mul_ps(dmv, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes16(L.mn + n * L.ng + g0, k))));
  } else {
    mv = _mm512_mul_ps(sv, _mm512_set1_ps(-L.z));
  }
}

static inline __mmask64 mask_at(const uint8_t* p) {
  uint64_t u;
  std::memcpy(&u, p, 8);
  return _cvtu64_mask64(u);
}

// whether a 64-byte load anywhere in row n of the integer planes (lo, and hi where HB == 4) stays
// inside its tensor: at least 64 bytes of rows after it
static inline bool may_read_past(const Layout& L, int64_t n) { return (L.N - 1 - n) * (L.K / 2) >= 64; }

// steps p and p + G/8 of row n's block b: the unsigned integers, lane l byte j = channel l*G + 4*step + j.
// past: a last block of t < 16 groups may be read whole too, its lanes from t on holding the bytes
// after it (where may_read_past(L, n)): the matmul's activations are zero in those lanes,
// so their integer sums are exactly zero whatever the bytes (the dequantization asks for zeros)
template <int G, int HB>
static inline void unpack(const Layout& L, int64_t n, int64_t b, int64_t p, __mmask64 km, int64_t t,
                          __m512i& qa, __m512i& qb, bool past = false) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  const int64_t off = b * 8 * G + p * 4 * t;
  // plain loads wherever they may read: masked loads left this CPU's hardware prefetcher behind (a
  // Zen 5 EPYC streamed the 1.5B's weights at ~11 GB/s of its ~50; the 0.5B's K = 896 rows are 12
  // of 28 groups in a last block; issue 43)
  // (the types without high bits, Q4_0/Q4_1/Q4_K, keep the masked load: read whole, the 0.5B's Q4_K
  // 896x4864 ran at 15-16 GB/s against 22-29 masked, Q5_0 9728x896 at 36-37 against 14-25, timed by
  // hand on one Zen 5 EPYC: a rule, not a per-machine choice)
  const bool whole = t == 16 || (past && HB != 0);
  const uint8_t* lp = L.lo + n * (L.K / 2) + off;
  const __m512i v = whole ? _mm512_loadu_si512(lp) : _mm512_maskz_loadu_epi8(km, lp);
  qa = _mm512_and_si512(v, low);
  qb = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
  if constexpr (HB == 4) {
    const uint8_t* hp = L.hi + n * (L.K / 2) + off;
    const __m512i h = whole ? _mm512_loadu_si512(hp) : _mm512_maskz_loadu_epi8(km, hp);
    const __m512i top = _mm512_set1_epi8((char)0xF0);
    qa = _mm512_or_si512(qa, _mm512_and_si512(_mm512_slli_epi16(h, 4), top));
    qb = _mm512_or_si512(qb, _mm512_and_si512(h, top));
  } else if constexpr (HB > 0) {
    const uint8_t* hp = L.hi + n * L.hib + b * (G / 4) * HB * 8;
    for (int h = 0; h < HB; ++h) {
      const __m512i bit = _mm512_set1_epi8((char)(16 << h));
      qa = _mm512_or_si512(qa, _mm512_maskz_mov_epi8(mask_at(hp + (p * HB + h) * 8), bit));
      qb = _mm512_or_si512(qb, _mm512_maskz_mov_epi8(mask_at(hp + ((p + G / 8) * HB + h) * 8), bit));
    }
  }
}

// R activation rows' steps p and p + G/8 (x: the block's first byte in row 0) against two weight rows'
// unpacked steps: each row's integer sums, the two steps in chains of their own
template <int R, int G>
static inline void rows_dot(const int8_t* x, int64_t xrow, int64_t p, __m512i qa0, __m512i qb0, __m512i qa1,
                            __m512i qb1, __m512i* ia0, __m512i* ib0, __m512i* ia1, __m512i* ib1) {
  for (int r = 0; r < R; ++r) {
    const int8_t* xr = x + r * xrow;
    const __m512i xa = _mm512_loadu_si512(xr + p * 64), xb = _mm512_loadu_si512(xr + (p + G / 8) * 64);
    ia0[r] = _mm512_dpbusd_epi32(ia0[r], qa0, xa);
    ib0[r] = _mm512_dpbusd_epi32(ib0[r], qb0, xb);
    ia1[r] = _mm512_dpbusd_epi32(ia1[r], qa1, xa);
    ib1[r] = _mm512_dpbusd_epi32(ib1[r], qb1, xb);
  }
}

// block b's float step for R activation rows and W (two, or one: row 1's arguments unused) weight
// rows (s, m per weight row), in the order written at the top of this source:
// acc = fma(float(ia + ib), s * dx, fma(m, xs, acc))
template <int R, int W = 2>
static inline void block_steps(const __m512i* ia0, const __m512i* ib0, const __m512i* ia1, const __m512i* ib1,
                               __m512 sv0, __m512 mv0, __m512 sv1, __m512 mv1, const __m512* dxv,
                               const __m512* xsv, int64_t nb, int64_t b, __m512* acc0, __m512* acc1) {
  for (int r = 0; r < R; ++r) {
    const __m512 dx = dxv[r * nb + b], xs = xsv[r * nb + b];
    acc0[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(ia0[r], ib0[r])), _mm512_mul_ps(sv0, dx),
                              _mm512_fmadd_ps(mv0, xs, acc0[r]));
    if constexpr (W == 2)
      acc1[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(ia1[r], ib1[r])), _mm512_mul_ps(sv1, dx),
                                _mm512_fmadd_ps(mv1, xs, acc1[r]));
  }
}

// R activation rows against every weight row, W weight rows a pass: 2 share each activation load; 1
// reads the weights as one stream (two rows a pass are two streams a row apart, which a Zen 5 EPYC's
// prefetchers followed poorly from 1 KB rows on: the 1.5B's Q4_K 17920x1536 at 13 GB/s against 43;
// issue 43). The same integer sums and float steps per row either way, so the same bits.
// xp int8 [R, nb * 16G] in step order (lane l of step i = channels l*G + 4i .. + 3 of the block);
// dxv, xsv [R, nb] vectors: per group lane, the activation scale and dx * sum of the group's xq
template <int R, int G, int HB, int W>
static void run(const Layout& L, const int8_t* xp, const __m512* dxv, const __m512* xsv, float* y, int64_t ystride,
                int64_t PF) {
  const int64_t N = L.N, nb = L.nb, xrow = nb * 16 * G;
  at::parallel_for(0, (N + W - 1) / W, 8 / W, [&](int64_t p0, int64_t p1) {
    for (int64_t pr = p0; pr < p1; ++pr) {
      const int64_t n = W * pr, nn = std::min<int64_t>(W, N - n), n1 = nn > 1 ? n + 1 : n;
      const bool past0 = may_read_past(L, n), past1 = may_read_past(L, n1);
      __m512 acc0[R], acc1[R];
      for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm512_setzero_ps();
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t t = std::min<int64_t>(16, L.ng - 16 * b);
        const __mmask64 km = t == 16 ? ~(__mmask64)0 : (__mmask64)((1ull << (4 * t)) - 1);
        __m512i ia0[R], ib0[R], ia1[R], ib1[R];
        for (int r = 0; r < R; ++r) ia0[r] = ib0[r] = ia1[r] = ib1[r] = _mm512_setzero_si512();
        const int8_t* x = xp + b * 16 * G;
        for (int64_t p = 0; p < G / 8; ++p) {
          if (PF) prefetch_pair<G, HB>(L, n, N, PF, b, p, t);
          __m512i qa0, qb0;
          unpack<G, HB>(L, n, b, p, km, t, qa0, qb0, past0);
          if constexpr (W == 2) {
            __m512i qa1, qb1;
            unpack<G, HB>(L, n1, b, p, km, t, qa1, qb1, past1);
            rows_dot<R, G>(x, xrow, p, qa0, qb0, qa1, qb1, ia0, ib0, ia1, ib1);
          } else {
            for (int r = 0; r < R; ++r) {
              ia0[r] = _mm512_dpbusd_epi32(ia0[r], qa0, _mm512_loadu_si512(x + r * xrow + p * 64));
              ib0[r] = _mm512_dpbusd_epi32(ib0[r], qb0, _mm512_loadu_si512(x + r * xrow + (p + G / 8) * 64));
            }
          }
        }
        __m512 sv0, mv0, sv1, mv1;
        block_scales(L, n, b, sv0, mv0);
        if constexpr (W == 2) block_scales(L, n1, b, sv1, mv1);
        else sv1 = mv1 = _mm512_setzero_ps();  // unused
        block_steps<R, W>(ia0, ib0, ia1, ib1, sv0, mv0, sv1, mv1, dxv, xsv, nb, b, acc0, acc1);
      }
      for (int r = 0; r < R; ++r) {
        y[r * ystride + n] = sum16(acc0[r]);
        if (W == 2 && nn > 1) y[r * ystride + n + 1] = sum16(acc1[r]);
      }
    }
  });
}

// The many-row kernel on AVX512-VNNI (issue 43: prefill and wide decode steps), run_many2's tiling:
// a tile of TW weight rows is unpacked once (U: per row, block and step, the 64-byte vector `unpack`
// gives, qa at step p and qb at p + G/8; S: per row and block, s then m) and every activation row
// runs against it, four at a time. Each (activation row, weight row) result is `run`'s: the same
// integer sums and the same float steps in the same order, so a row's output is the same bits at
// every row count.
template <int R, int G, int HB>
static void tile_rows(const Layout& L, const __m512i* U, const __m512* S, int64_t nw, const int8_t* xp,
                      const __m512* dxv, const __m512* xsv, float* y, int64_t ystride) {
  const int64_t nb = L.nb, xrow = nb * 16 * G, urow = nb * (G / 4);
  for (int64_t i = 0; i < nw; i += 2) {
    const int64_t j = std::min<int64_t>(i + 1, nw - 1);
    __m512 acc0[R], acc1[R];
    for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const __m512i* u0 = U + i * urow + b * (G / 4);
      const __m512i* u1 = U + j * urow + b * (G / 4);
      __m512i ia0[R], ib0[R], ia1[R], ib1[R];
      for (int r = 0; r < R; ++r) ia0[r] = ib0[r] = ia1[r] = ib1[r] = _mm512_setzero_si512();
      for (int64_t p = 0; p < G / 8; ++p)
        rows_dot<R, G>(xp + b * 16 * G, xrow, p, u0[p], u0[p + G / 8], u1[p], u1[p + G / 8], ia0, ib0, ia1, ib1);
      block_steps<R>(ia0, ib0, ia1, ib1, S[(i * nb + b) * 2], S[(i * nb + b) * 2 + 1], S[(j * nb + b) * 2],
                     S[(j * nb + b) * 2 + 1], dxv, xsv, nb, b, acc0, acc1);
    }
    for (int r = 0; r < R; ++r) {
      y[r * ystride + i] = sum16(acc0[r]);
      if (j > i) y[r * ystride + j] = sum16(acc1[r]);
    }
  }
}

template <int G, int HB>
static void run_many(const Layout& L, const int8_t* xp, const __m512* dxv, const __m512* xsv, float* y, int64_t RQ) {
  const int64_t N = L.N, nb = L.nb, xrow = nb * 16 * G, urow = nb * (G / 4);
  struct Tile { std::vector<__m512i> U; std::vector<__m512> S; };
  over_tiles(N, L.K, RQ,
    [&](int64_t TW) { return Tile{std::vector<__m512i>(TW * urow), std::vector<__m512>(TW * nb * 2)}; },
    [&](Tile& T, int64_t w0, int64_t nw) {
      for (int64_t i = 0; i < nw; ++i)
        for (int64_t b = 0; b < nb; ++b) {
          const int64_t t = std::min<int64_t>(16, L.ng - 16 * b);
          const __mmask64 km = t == 16 ? ~(__mmask64)0 : (__mmask64)((1ull << (4 * t)) - 1);
          block_scales(L, w0 + i, b, T.S[(i * nb + b) * 2], T.S[(i * nb + b) * 2 + 1]);
          for (int64_t p = 0; p < G / 8; ++p)
            unpack<G, HB>(L, w0 + i, b, p, km, t, T.U[i * urow + b * (G / 4) + p],
                          T.U[i * urow + b * (G / 4) + p + G / 8], may_read_past(L, w0 + i));
        }
    },
    [&](Tile& T, int64_t r0, int64_t w0, int64_t nw) {
      const int8_t* a = xp + r0 * xrow; const __m512* b = dxv + r0 * nb; const __m512* c = xsv + r0 * nb;
      float* o = y + r0 * N + w0;
      with_rows(RQ - r0, [&](auto R) {
        tile_rows<decltype(R)::value, G, HB>(L, T.U.data(), T.S.data(), nw, a, b, c, o, N);
      });
    });
}

// 5-8 activation rows (a 2-4-row step's two levels: speculative verification, small decode batches;
// issue 34) in one stream through the weights, as `run` streams 1-4: each weight vector is read from
// memory once and dotted with every row, where the many-row kernel unpacked a tile into a scratch
// buffer first (a 4-row step of the 0.5B's gate+up took 3.2x a 1-row one). One integer accumulator per
// row holds both steps' products (the integer sum `run` forms as ia + ib, the same exact value) so the
// 8 rows fit the 32 vector registers; then `run`'s float step in its order: the same bits.
template <int R, int G, int HB>
static void run_wide(const Layout& L, const int8_t* xp, const __m512* dxv, const __m512* xsv, float* y, int64_t ystride,
                     int64_t PF) {
  const int64_t N = L.N, nb = L.nb, xrow = nb * 16 * G;
  at::parallel_for(0, N, 8, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const bool past = may_read_past(L, n);
      __m512 acc[R];
      for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t t = std::min<int64_t>(16, L.ng - 16 * b);
        const __mmask64 km = t == 16 ? ~(__mmask64)0 : (__mmask64)((1ull << (4 * t)) - 1);
        __m512i is[R];
        for (int r = 0; r < R; ++r) is[r] = _mm512_setzero_si512();
        const int8_t* x = xp + b * 16 * G;
        for (int64_t p = 0; p < G / 8; ++p) {
          if (PF) prefetch_pair<G, HB>(L, n, N, PF, b, p, t);
          __m512i qa, qb;
          unpack<G, HB>(L, n, b, p, km, t, qa, qb, past);
          for (int r = 0; r < R; ++r) {
            is[r] = _mm512_dpbusd_epi32(is[r], qa, _mm512_loadu_si512(x + r * xrow + p * 64));
            is[r] = _mm512_dpbusd_epi32(is[r], qb, _mm512_loadu_si512(x + r * xrow + (p + G / 8) * 64));
          }
        }
        __m512 sv, mv;
        block_scales(L, n, b, sv, mv);
        for (int r = 0; r < R; ++r) {
          const __m512 dx = dxv[r * nb + b], xs = xsv[r * nb + b];
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is[r]), _mm512_mul_ps(sv, dx), _mm512_fmadd_ps(mv, xs, acc[r]));
        }
      }
      for (int r = 0; r < R; ++r) y[r * ystride + n] = sum16(acc[r]);
    }
  });
}

// one: one weight row a pass, else two (`run`'s W); chosen by timing per shape (gguf_linear.choose)
template <int G, int HB>
static void run_rows(const Layout& L, const int8_t* xp, const __m512* dxv, const __m512* xsv, float* y, int64_t RQ,
                     int64_t PF, bool one) {
  // a streaming pass keeps its P rows' int8 activations (P * K bytes) in L1 beside the weight stream:
  // at most 32 KB of them (L1d is 32-48 KB on the x86 this project meets). Past that, or past two
  // passes, the many-row kernel's single unpack wins: on a Zen 5 EPYC the 0.5B's down projection
  // (K = 4864) at 8 rows took 3.9x a 1-row call streamed, 3.1x many-row; its gate (K = 896) 1.9x
  // against 3.5x (benchmarks/gguf_wide_rows.py, BENCHMARKS.md "Issue 34")
  const int64_t P = std::min<int64_t>(8, std::max<int64_t>(4, 32768 / L.K));
  const int64_t passes = (RQ + P - 1) / P;
  if (RQ > 4 && RQ <= g_wide_rows && passes <= (P == 8 ? 2 : 1)) {
    const int64_t xrow = L.nb * 16 * G;
    for (int64_t r0 = 0; r0 < RQ; r0 += P) {
      const int64_t rr = std::min<int64_t>(P, RQ - r0);
      const int8_t* a = xp + r0 * xrow; const __m512* b = dxv + r0 * L.nb; const __m512* c = xsv + r0 * L.nb;
      float* o = y + r0 * L.N;
      switch (rr) {
        case 1: run<1, G, HB, 1>(L, a, b, c, o, L.N, PF); break;
        case 2: run<2, G, HB, 1>(L, a, b, c, o, L.N, PF); break;
        case 3: run<3, G, HB, 1>(L, a, b, c, o, L.N, PF); break;
        case 4: run<4, G, HB, 1>(L, a, b, c, o, L.N, PF); break;
        case 5: run_wide<5, G, HB>(L, a, b, c, o, L.N, PF); break;
        case 6: run_wide<6, G, HB>(L, a, b, c, o, L.N, PF); break;
        case 7: run_wide<7, G, HB>(L, a, b, c, o, L.N, PF); break;
        default: run_wide<8, G, HB>(L, a, b, c, o, L.N, PF); break;
      }
    }
    return;
  }
  if (RQ > 4) return run_many<G, HB>(L, xp, dxv, xsv, y, RQ);
  const int64_t xrow = L.nb * 16 * G;
  for (int64_t r0 = 0; r0 < RQ; r0 += 4) {
    const int64_t rr = std::min<int64_t>(4, RQ - r0);
    const int8_t* a = xp + r0 * xrow; const __m512* b = dxv + r0 * L.nb; const __m512* c = xsv + r0 * L.nb;
    float* o = y + r0 * L.N;
    with_rows(rr, [&](auto R) {
      if (one) run<decltype(R)::value, G, HB, 1>(L, a, b, c, o, L.N, PF);
      else run<decltype(R)::value, G, HB, 2>(L, a, b, c, o, L.N, PF);
    });
  }
}
// dequantization's two variant parts: steps p and p + G/8 of row n's block b into st (64 bytes
// each, at p and p + G/8), and the block's 16 lanes of s and m
template <int G, int HB>
static inline void unpack_to(const Layout& L, int64_t n, int64_t b, int64_t p, int64_t t, uint8_t* st) {
  const __mmask64 km = t == 16 ? ~(__mmask64)0 : (__mmask64)((1ull << (4 * t)) - 1);
  __m512i qa, qb;
  unpack<G, HB>(L, n, b, p, km, t, qa, qb);
  _mm512_store_si512((void*)(st + p * 64), qa);
  _mm512_store_si512((void*)(st + (p + G / 8) * 64), qb);
}

static inline void scales_to(const Layout& L, int64_t n, int64_t b, float* s, float* m) {
  __m512 sv, mv;
  block_scales(L, n, b, sv, mv);
  _mm512_store_ps(s, sv);
  _mm512_store_ps(m, mv);
}
#endif

#ifdef GGUF_NATIVE
static inline __m128i to_bf16_8(__m256 v) {  // round to nearest even on the bits (the weights are finite)
  __m256i u = _mm256_castps_si256(v);
  u = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF),
                                           _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1))));
  u = _mm256_srli_epi32(u, 16);
  return _mm_packus_epi32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1));
}
#endif

#ifdef GGUF_AVX2
// The same layout and the same float order on AVX2 (issue 43): a 64-byte step vector is two 32-byte
// halves (lanes 0-7 and 8-15), and vpmaddubsw + vpmaddwd stand in for vpdpbusd. Their int16 pair
// sums stay below 32,767 for q < 64 and |x| <= 127; Q8_0's unsigned q (up to 255) would not, so it
// runs as (q - 128) * x through the sign trick (|q - 128| * sign(x)), and 128 * sum(x) is added back
// in int32: the group sums are the VNNI kernel's integers exactly.
static inline __m256 halves8(const at::Half* p, int64_t cnt) {  // p[0, cnt) of 8, zero past
  if (cnt >= 8) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
  alignas(16) uint16_t t[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  if (cnt > 0) std::memcpy(t, p, 2 * cnt);
  return _mm256_cvtph_ps(_mm_load_si128((const __m128i*)t));
}

static inline __m256 half1(const at::Half* p) {  // one half-precision value in every lane
  return _mm256_cvtph_ps(_mm_set1_epi16((short)p->x));
}

template <bool SIGNED>
static inline __m256 bytes8(const void* p, int64_t cnt) {  // 8 (u)int8 as floats, zero past cnt
  int64_t u = 0;
  if (cnt > 0) std::memcpy(&u, p, std::min<int64_t>(8, cnt));
  const __m128i v = _mm_cvtsi64_si128(u);
  return _mm256_cvtepi32_ps(SIGNED ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v));
}

// the VNNI kernel's block_scales, lane for lane, as two halves
static inline void block_scales2(const Layout& L, int64_t n, int64_t b, __m256* sv, __m256* mv) {
  const int64_t g0 = 16 * b, cnt = std::min<int64_t>(16, L.ng - g0), ns = L.K / L.S, gps = L.S / L.G;
  const at::Half* d = L.d + n * ns;
  if (gps == 1) {
    for (int h = 0; h < 2; ++h) {
      const int64_t c = std::max<int64_t>(0, std::min<int64_t>(8, cnt - 8 * h));
      sv[h] = c ? halves8(d + g0 + 8 * h, c) : _mm256_setzero_ps();
      mv[h] = !L.dm ? _mm256_mul_ps(sv[h], _mm256_set1_ps(-L.z))
                    : c ? halves8(L.dm + n * ns + g0 + 8 * h, c) : _mm256_setzero_ps();
    }
    return;
  }
  // K-quants: lanes 0-7 take super-block sb's d; lanes 8-15 sb + 1's where a super-block has 8
  // groups (zero where the block has no second), else sb's
  const int64_t sb = g0 / gps, nsb = std::min<int64_t>((cnt + gps - 1) / gps, ns - sb);
  for (int h = 0; h < 2; ++h) {
    const int64_t j = gps == 8 ? h : 0, c = cnt - 8 * h;
    const __m256 dv = j < nsb ? half1(d + sb + j) : _mm256_setzero_ps();
    sv[h] = _mm256_mul_ps(dv, bytes8<true>(L.sc + n * L.ng + g0 + 8 * h, c));
    if (L.mn) {
      const __m256 dmv = j < nsb ? half1(L.dm + n * ns + sb + j) : _mm256_setzero_ps();
      mv[h] = _mm256_mul_ps(dmv, bytes8<false>(L.mn + n * L.ng + g0 + 8 * h, c));
    } else {
      mv[h] = _mm256_mul_ps(sv[h], _mm256_set1_ps(-L.z));
    }
  }
}

// half h of a step of t groups (4t bytes). A tail step's bytes past 4t belong to the next step or
// row: they meet zero activations (the activation rows are padded to whole blocks), so only the
// tensor's last rows, where they would lie past its end (`last`), copy what they have instead.
static inline __m256i load_half(const uint8_t* p, int64_t t, int h, bool last) {
  if (t == 16 || !last) return _mm256_loadu_si256((const __m256i*)(p + 32 * h));
  alignas(32) uint8_t buf[32] = {0};
  const int64_t c = std::max<int64_t>(0, std::min<int64_t>(32, 4 * t - 32 * h));
  if (c > 0) std::memcpy(buf, p + 32 * h, c);
  return _mm256_load_si256((const __m256i*)buf);
}

static inline __m256i mask_bytes(const uint8_t* word, int h) {  // bits 32h .. 32h + 31 of a 64-bit mask -> 0xFF bytes
  uint32_t m;
  std::memcpy(&m, word + 4 * h, 4);
  const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)m),
      _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ull);
  return _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
}

// half h of steps p and p + G/8 of row n's block b (unpack's bytes 32h .. 32h + 31)
template <int G, int HB>
static inline void unpack2(const Layout& L, int64_t n, int64_t b, int64_t p, int64_t t, int h, __m256i& qa, __m256i& qb) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  const int64_t off = b * 8 * G + p * 4 * t;
  // a tail step's loads reach up to 64 bytes past row n's end: safe where the rows after hold them
  const bool last = (L.N - 1 - n) * (L.K / 2) < 64;
  const __m256i v = load_half(L.lo + n * (L.K / 2) + off, t, h, last);
  qa = _mm256_and_si256(v, low);
  qb = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
  if constexpr (HB == 4) {
    const __m256i hh = load_half(L.hi + n * (L.K / 2) + off, t, h, last);
    const __m256i top = _mm256_set1_epi8((char)0xF0);
    qa = _mm256_or_si256(qa, _mm256_and_si256(_mm256_slli_epi16(hh, 4), top));
    qb = _mm256_or_si256(qb, _mm256_and_si256(hh, top));
  } else if constexpr (HB > 0) {
    const uint8_t* hp = L.hi + n * L.hib + b * (G / 4) * HB * 8;
    for (int k = 0; k < HB; ++k) {
      const __m256i bit = _mm256_set1_epi8((char)(16 << k));
      qa = _mm256_or_si256(qa, _mm256_and_si256(mask_bytes(hp + (p * HB + k) * 8, h), bit));
      qb = _mm256_or_si256(qb, _mm256_and_si256(mask_bytes(hp + ((p + G / 8) * HB + k) * 8, h), bit));
    }
  }
}

// per 32-bit lane, the sum of its four q * x products (vpdpbusd's integers)
template <int HB>
static inline __m256i dot4(__m256i q, __m256i x) {
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (HB == 4) {  // (q - 128) * x: |q - 128| <= 128 and |x| <= 127 keep the pair sums in int16
    const __m256i s = _mm256_xor_si256(q, _mm256_set1_epi8((char)0x80));
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(s), _mm256_sign_epi8(x, s)), ones);
  } else {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(q, x), ones);
  }
}

// steps p and p + G/8 at once: vpdpbusd's integers for both, summed. Below 8 bits two vpmaddubsw
// results add in int16 before one vpmaddwd (|sum| <= 4 * 63 * 128 = 32,256 < 32,767): exact.
template <int HB>
static inline __m256i dot8(__m256i qa, __m256i xa, __m256i qb, __m256i xb) {
  if constexpr (HB == 4) {
    return _mm256_add_epi32(dot4<HB>(qa, xa), dot4<HB>(qb, xb));
  } else {
    return _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(qa, xa), _mm256_maddubs_epi16(qb, xb)),
                             _mm256_set1_epi16(1));
  }
}

// one block half's float step, the same in every kernel: acc = fma(isum, s * dx, fma(m, xs, acc))
template <int HB>
static inline __m256 block_step(__m256i isum, const int32_t* xsi, const float* dxf, const float* xsf, __m256 sv,
                                __m256 mv, __m256 acc) {
  if constexpr (HB == 4)  // 128 * sum(x): the offset the sign trick took out
    isum = _mm256_add_epi32(isum, _mm256_slli_epi32(_mm256_loadu_si256((const __m256i*)xsi), 7));
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(sv, _mm256_loadu_ps(dxf)),
                         _mm256_fmadd_ps(mv, _mm256_loadu_ps(xsf), acc));
}

// R activation rows' step p (x: the block half's first byte in row 0) against two weight rows'
// unpacked step: each row's integer sums for both
template <int R, int G, int HB>
static inline void rows_dot(const int8_t* x, int64_t xrow, int64_t p, __m256i qa0, __m256i qb0, __m256i qa1,
                            __m256i qb1, __m256i* i0, __m256i* i1) {
  for (int r = 0; r < R; ++r) {
    const int8_t* xr = x + r * xrow;
    const __m256i xa = _mm256_loadu_si256((const __m256i*)(xr + p * 64));
    const __m256i xb = _mm256_loadu_si256((const __m256i*)(xr + (p + G / 8) * 64));
    i0[r] = _mm256_add_epi32(i0[r], dot8<HB>(qa0, xa, qb0, xb));
    i1[r] = _mm256_add_epi32(i1[r], dot8<HB>(qa1, xa, qb1, xb));
  }
}

// `run` on AVX2: dxf, xsf float [R, nb, 16] and xsi int32 [R, nb, 16] (per group lane: the
// activation scale, dx * sum(xq), sum(xq)); W weight rows a pass (2: sharing each activation load;
// 1: one stream through the weights, `run`'s reason), the same bits either way
template <int R, int G, int HB, int W>
static void run2(const Layout& L, const int8_t* xp, const float* dxf, const float* xsf, const int32_t* xsi, float* y,
                 int64_t ystride, int64_t PF) {
  const int64_t N = L.N, nb = L.nb, xrow = nb * 16 * G;
  at::parallel_for(0, (N + W - 1) / W, 8 / W, [&](int64_t p0, int64_t p1) {
    for (int64_t pr = p0; pr < p1; ++pr) {
      const int64_t n = W * pr, nn = std::min<int64_t>(W, N - n), n1 = nn > 1 ? n + 1 : n;
      __m256 acc0[R][2], acc1[R][2];
      for (int r = 0; r < R; ++r) acc0[r][0] = acc0[r][1] = acc1[r][0] = acc1[r][1] = _mm256_setzero_ps();
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t t = std::min<int64_t>(16, L.ng - 16 * b);
        __m256 sv0[2], mv0[2], sv1[2], mv1[2];
        block_scales2(L, n, b, sv0, mv0);
        if constexpr (W == 2) block_scales2(L, n1, b, sv1, mv1);
        for (int h = 0; h < 2; ++h) {
          // a tail block's empty half: no integers, but its lanes' float step still runs (with
          // zeros, as the VNNI kernel's masked lanes do: it can turn a -0 lane into +0)
          const bool empty = 16 * b + 8 * h >= L.ng;
          __m256i i0[R], i1[R];
          for (int r = 0; r < R; ++r) i0[r] = i1[r] = _mm256_setzero_si256();
          for (int64_t p = 0; p < (empty ? 0 : G / 8); ++p) {
            if (PF && h == 0) prefetch_pair<G, HB>(L, n, N, PF, b, p, t);
            __m256i qa0, qb0;
            unpack2<G, HB>(L, n, b, p, t, h, qa0, qb0);
            if constexpr (W == 2) {
              __m256i qa1, qb1;
              unpack2<G, HB>(L, n1, b, p, t, h, qa1, qb1);
              rows_dot<R, G, HB>(xp + b * 16 * G + 32 * h, xrow, p, qa0, qb0, qa1, qb1, i0, i1);
            } else {
              const int8_t* x = xp + b * 16 * G + 32 * h;
              for (int r = 0; r < R; ++r) {
                const __m256i xa = _mm256_loadu_si256((const __m256i*)(x + r * xrow + p * 64));
                const __m256i xb = _mm256_loadu_si256((const __m256i*)(x + r * xrow + (p + G / 8) * 64));
                i0[r] = _mm256_add_epi32(i0[r], dot8<HB>(qa0, xa, qb0, xb));
              }
            }
          }
          for (int r = 0; r < R; ++r) {
            const int64_t at = (r * nb + b) * 16 + 8 * h;
            acc0[r][h] = block_step<HB>(i0[r], xsi + at, dxf + at, xsf + at, sv0[h], mv0[h], acc0[r][h]);
            if constexpr (W == 2)
              acc1[r][h] = block_step<HB>(i1[r], xsi + at, dxf + at, xsf + at, sv1[h], mv1[h], acc1[r][h]);
          }
        }
      }
      for (int r = 0; r < R; ++r) {
        y[r * ystride + n] = sum8_tree(_mm256_add_ps(acc0[r][0], acc0[r][1]));
        if (W == 2 && nn > 1) y[r * ystride + n + 1] = sum8_tree(_mm256_add_ps(acc1[r][0], acc1[r][1]));
      }
    }
  });
}

// The many-row kernel (issue 43: prefill and wide decode steps): a tile of TW weight rows is
// unpacked once (U: per row, block, half and step, qa then qb, 32 bytes each; S: per row and block,
// s and m as two halves each) and every activation row runs against it, four at a time. Each
// (activation row, weight row) result is made by the same integer sums and the same float steps in
// the same order as `run2`'s, so a row's output is the same bits at every row count.
template <int R, int G, int HB>
static void tile_rows(const Layout& L, const uint8_t* U, const __m256* S, int64_t nw, const int8_t* xp,
                      const float* dxf, const float* xsf, const int32_t* xsi, float* y, int64_t ystride) {
  const int64_t nb = L.nb, xrow = nb * 16 * G, urow = nb * 16 * G;
  for (int64_t i = 0; i < nw; i += 2) {
    const int64_t j = std::min<int64_t>(i + 1, nw - 1);
    __m256 acc0[R][2], acc1[R][2];
    for (int r = 0; r < R; ++r) acc0[r][0] = acc0[r][1] = acc1[r][0] = acc1[r][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const __m256* s0 = S + (i * nb + b) * 4; const __m256* s1 = S + (j * nb + b) * 4;
      for (int h = 0; h < 2; ++h) {
        const bool empty = 16 * b + 8 * h >= L.ng;  // run2's reason
        const uint8_t* u0 = U + i * urow + (b * 2 + h) * (G / 8) * 64;
        const uint8_t* u1 = U + j * urow + (b * 2 + h) * (G / 8) * 64;
        __m256i i0[R], i1[R];
        for (int r = 0; r < R; ++r) i0[r] = i1[r] = _mm256_setzero_si256();
        for (int64_t p = 0; p < (empty ? 0 : G / 8); ++p) {
          const __m256i qa0 = _mm256_loadu_si256((const __m256i*)(u0 + p * 64));
          const __m256i qb0 = _mm256_loadu_si256((const __m256i*)(u0 + p * 64 + 32));
          const __m256i qa1 = _mm256_loadu_si256((const __m256i*)(u1 + p * 64));
          const __m256i qb1 = _mm256_loadu_si256((const __m256i*)(u1 + p * 64 + 32));
          rows_dot<R, G, HB>(xp + b * 16 * G + 32 * h, xrow, p, qa0, qb0, qa1, qb1, i0, i1);
        }
        for (int r = 0; r < R; ++r) {
          const int64_t at = (r * nb + b) * 16 + 8 * h;
          acc0[r][h] = block_step<HB>(i0[r], xsi + at, dxf + at, xsf + at, s0[h], s0[2 + h], acc0[r][h]);
          acc1[r][h] = block_step<HB>(i1[r], xsi + at, dxf + at, xsf + at, s1[h], s1[2 + h], acc1[r][h]);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      y[r * ystride + i] = sum8_tree(_mm256_add_ps(acc0[r][0], acc0[r][1]));
      if (j > i) y[r * ystride + j] = sum8_tree(_mm256_add_ps(acc1[r][0], acc1[r][1]));
    }
  }
}

template <int G, int HB>
static void run_many2(const Layout& L, const int8_t* xp, const float* dxf, const float* xsf, const int32_t* xsi,
                      float* y, int64_t RQ) {
  const int64_t N = L.N, nb = L.nb, urow = nb * 16 * G, xrow = nb * 16 * G, v = nb * 16;
  struct Tile { std::vector<uint8_t> U; std::vector<__m256> S; };
  over_tiles(N, L.K, RQ,
    [&](int64_t TW) { return Tile{std::vector<uint8_t>(TW * urow), std::vector<__m256>(TW * nb * 4)}; },
    [&](Tile& T, int64_t w0, int64_t nw) {
      for (int64_t i = 0; i < nw; ++i)
        for (int64_t b = 0; b < nb; ++b) {
          const int64_t t = std::min<int64_t>(16, L.ng - 16 * b);
          block_scales2(L, w0 + i, b, &T.S[(i * nb + b) * 4], &T.S[(i * nb + b) * 4 + 2]);
          for (int h = 0; h < 2; ++h)
            for (int64_t p = 0; p < G / 8; ++p) {
              __m256i qa, qb;
              unpack2<G, HB>(L, w0 + i, b, p, t, h, qa, qb);
              uint8_t* u = T.U.data() + i * urow + ((b * 2 + h) * (G / 8) + p) * 64;
              _mm256_storeu_si256((__m256i*)u, qa);
              _mm256_storeu_si256((__m256i*)(u + 32), qb);
            }
        }
    },
    [&](Tile& T, int64_t r0, int64_t w0, int64_t nw) {
      const int8_t* a = xp + r0 * xrow;
      const float* b = dxf + r0 * v; const float* c = xsf + r0 * v; const int32_t* e = xsi + r0 * v;
      float* o = y + r0 * N + w0;
      with_rows(RQ - r0, [&](auto R) {
        tile_rows<decltype(R)::value, G, HB>(L, T.U.data(), T.S.data(), nw, a, b, c, e, o, N);
      });
    });
}

template <int G, int HB>
static void run_rows2(const Layout& L, const int8_t* xp, const float* dxf, const float* xsf, const int32_t* xsi,
                      float* y, int64_t RQ, int64_t PF, bool one) {
  if (RQ > 4) return run_many2<G, HB>(L, xp, dxf, xsf, xsi, y, RQ);
  const int64_t xrow = L.nb * 16 * G, v = L.nb * 16;
  for (int64_t r0 = 0; r0 < RQ; r0 += 4) {
    const int64_t rr = std::min<int64_t>(4, RQ - r0);
    const int8_t* a = xp + r0 * xrow;
    const float* b = dxf + r0 * v; const float* c = xsf + r0 * v; const int32_t* e = xsi + r0 * v;
    float* o = y + r0 * L.N;
    with_rows(rr, [&](auto R) {
      if (one) run2<decltype(R)::value, G, HB, 1>(L, a, b, c, e, o, L.N, PF);
      else run2<decltype(R)::value, G, HB, 2>(L, a, b, c, e, o, L.N, PF);
    });
  }
}

template <int G, int HB>
static inline void unpack_to(const Layout& L, int64_t n, int64_t b, int64_t p, int64_t t, uint8_t* st) {
  for (int h = 0; h < 2; ++h) {
    __m256i qa, qb;
    unpack2<G, HB>(L, n, b, p, t, h, qa, qb);
    _mm256_store_si256((__m256i*)(st + p * 64 + 32 * h), qa);
    _mm256_store_si256((__m256i*)(st + (p + G / 8) * 64 + 32 * h), qb);
  }
}

static inline void scales_to(const Layout& L, int64_t n, int64_t b, float* s, float* m) {
  __m256 sv[2], mv[2];
  block_scales2(L, n, b, sv, mv);
  _mm256_store_ps(s, sv[0]); _mm256_store_ps(s + 8, sv[1]);
  _mm256_store_ps(m, mv[0]); _mm256_store_ps(m + 8, mv[1]);
}
#endif

bool available() {
#ifdef GGUF_NATIVE
  return true;
#else
  return false;
#endif
}

// which variant this build holds: 2 AVX512-VNNI, 1 AVX2, 0 none
int64_t isa_level() {
#if defined(GGUF_VNNI)
  return 2;
#elif defined(GGUF_AVX2)
  return 1;
#else
  return 0;
#endif
}

@QUANTIZE_ROW@

#ifdef GGUF_NATIVE
static inline int32_t hsum8(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_hadd_epi32(s, s);
  return _mm_cvtsi128_si32(_mm_hadd_epi32(s, s));
}

// quantize_row<32> eight channels at a time (AVX2, which both variants have): the same operations on
// each channel (|x|, the block's max, x * inv rounded half to even, NaN to 0, the clamp to +-127,
// the rest as fma(-q, d, x)), so the same bits; and s16, the sum of q over each 16 channels (exact).
// A channel at a time it was ~40% of a 512-row call's time on a Zen 5 EPYC (issue 43).
static void quantize_row32(const float* xr, int64_t K, int8_t* q, float* d, float* rest, int32_t* s16) {
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)), inf = _mm256_set1_ps(INFINITY);
  const __m256 lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t c = 0; c < K / 32; ++c) {
    const float* xc = xr + c * 32;
    __m256 v[4], m = _mm256_setzero_ps();
    int finite = 0xFF;
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(xc + 8 * i);
      const __m256 a = _mm256_and_ps(v[i], absmask);
      finite &= _mm256_movemask_ps(_mm256_cmp_ps(a, inf, _CMP_LT_OQ));  // false for inf and NaN
      m = _mm256_max_ps(m, a);
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    const float amax = std::max(_mm_cvtss_f32(h), _mm_cvtss_f32(_mm_shuffle_ps(h, h, 1)));
    float dc = finite == 0xFF ? amax / 127.f : NAN, inv = dc > 0.f ? 1.f / dc : 0.f;
    if (std::isinf(inv)) dc = inv = 0.f;  // quantize_row's reason
    d[c] = dc;
    const __m256 iv = _mm256_set1_ps(inv), dv = _mm256_set1_ps(dc);
    __m256i qi[4];
    for (int i = 0; i < 4; ++i) {
      __m256 f = _mm256_round_ps(_mm256_mul_ps(v[i], iv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      f = _mm256_and_ps(f, _mm256_cmp_ps(f, f, _CMP_ORD_Q));
      f = _mm256_min_ps(_mm256_max_ps(f, lo), hi);
      qi[i] = _mm256_cvtps_epi32(f);
      if (rest) _mm256_storeu_ps(rest + c * 32 + 8 * i, _mm256_fnmadd_ps(f, dv, v[i]));
    }
    const __m256i b8 = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3])), order);
    _mm256_storeu_si256((__m256i*)(q + c * 32), b8);
    s16[2 * c] = hsum8(_mm256_add_epi32(qi[0], qi[1]));
    s16[2 * c + 1] = hsum8(_mm256_add_epi32(qi[2], qi[3]));
  }
}
#endif

// x float [R, K] -> y float [R, N]
torch::Tensor matmul(torch::Tensor x, torch::Tensor lo, torch::Tensor hi, torch::Tensor d, torch::Tensor sc,
                     torch::Tensor dm, torch::Tensor mn, int64_t G, int64_t S, int64_t HB, double z, int64_t levels,
                     int64_t prefetch) {
  const Layout L = layout(lo, hi, d, sc, dm, mn, G, S, HB, z);
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous() && x.size(1) == L.K,
              "gguf matmul: x float32 [R, K] contiguous");
  TORCH_CHECK(levels >= 1 && levels <= 4, "gguf matmul: levels in 1..4");
  // prefetch >= 0: two weight rows a pass, prefetching that many row pairs ahead; < 0: one row a pass,
  // prefetching -prefetch - 1 pairs ahead
  const bool one = prefetch < 0;
  const int64_t PF = one ? -prefetch - 1 : prefetch;
  (void)one;
  const int64_t R = x.size(0), K = L.K, nb = L.nb, RQ = levels * R, xrow = nb * 16 * G;
  auto y = torch::empty({RQ, L.N}, x.options());
#ifdef GGUF_NATIVE
  const float* xsrc = x.data_ptr<float>();
  // 64-byte aligned (a row is whole blocks of 256 or 512 bytes): each step vector one cache line
  struct alignas(64) Line { int8_t b[64]; };
  std::vector<Line> xbuf((RQ * xrow + 63) / 64, Line{});
  int8_t* const xq8 = (int8_t*)xbuf.data();
  // per row, block and group lane: the activation scale, dx * sum(xq) and sum(xq)
  std::vector<float> dxf(RQ * nb * 16, 0.f), xsf(RQ * nb * 16, 0.f);
  std::vector<int32_t> xsi(RQ * nb * 16, 0);
  // rows are quantized independently: on every thread (a 512-token prefill's rows took ~0.5 s on one)
  at::parallel_for(0, R, 16, [&](int64_t r0, int64_t r1) {
  std::vector<int8_t> xq(K);
  std::vector<float> dx(K / 32), rest(2 * K);
  std::vector<int32_t> s16(K / 16);
  for (int64_t r = r0; r < r1; ++r) {
    const float* src = xsrc + r * K;
    for (int64_t i = 0; i < levels; ++i) {
      const int64_t row = levels * r + i;
      float* left = rest.data() + (i % 2) * K;
      quantize_row32(src, K, xq.data(), dx.data(), i + 1 < levels ? left : nullptr, s16.data());
      src = left;
      int8_t* out = xq8 + row * xrow;
      for (int64_t b = 0; b < nb; ++b) {
        for (int l = 0; l < 16; ++l) {
          const int64_t g = 16 * b + l, at = (row * nb + b) * 16 + l;
          if (g >= L.ng) continue;
          // word s (channels 4s .. 4s + 3) of group g -> step s, lane l
          for (int64_t w = 0; w < G / 4; ++w) std::memcpy(out + b * 16 * G + w * 64 + 4 * l, xq.data() + g * G + 4 * w, 4);
          const int32_t sum = G == 32 ? s16[2 * g] + s16[2 * g + 1] : s16[g];
          dxf[at] = dx[g * G / 32];
          xsf[at] = dxf[at] * (float)sum;
          xsi[at] = sum;
        }
      }
    }
  }
  });
  float* yp = y.data_ptr<float>();
#ifdef GGUF_VNNI
  std::vector<__m512> dxv(RQ * nb), xsv(RQ * nb);
  for (int64_t i = 0; i < RQ * nb; ++i) {
    dxv[i] = _mm512_loadu_ps(dxf.data() + 16 * i);
    xsv[i] = _mm512_loadu_ps(xsf.data() + 16 * i);
  }
#define GGUF_CASE(g, hb) if (G == g && HB == hb) { run_rows<g, hb>(L, xq8, dxv.data(), xsv.data(), yp, RQ, PF, one); } else
#else
#define GGUF_CASE(g, hb) if (G == g && HB == hb) { run_rows2<g, hb>(L, xq8, dxf.data(), xsf.data(), xsi.data(), yp, RQ, PF, one); } else
#endif
  GGUF_CASE(32, 0) GGUF_CASE(32, 1) GGUF_CASE(32, 2) GGUF_CASE(32, 4)
  GGUF_CASE(16, 0) GGUF_CASE(16, 1) GGUF_CASE(16, 2) GGUF_CASE(16, 4)
  { TORCH_CHECK(false, "gguf matmul: no kernel for this layout"); }
#undef GGUF_CASE
#else
  TORCH_CHECK(false, "gguf matmul: built without AVX2 or AVX512-VNNI");
#endif
  return levels > 1 ? y.view({R, levels, L.N}).sum(1) : y;
}

// the effective weights of rows `rows` (int64 [M], or all rows when empty) -> out [M, K] float32 or
// bfloat16, w = fma(q, s_g, m_g)
template <int G, int HB, typename O>
static void dequant_impl(const Layout& L, const int64_t* rows, int64_t M, O* out) {
#ifdef GGUF_NATIVE
  at::parallel_for(0, M, 16, [&](int64_t i0, int64_t i1) {
    alignas(64) uint8_t st[16 * G], nat[16 * G];
    alignas(64) float s[16], m[16];
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t n = rows ? rows[i] : i;
      O* o = out + i * L.K;
      for (int64_t b = 0; b < L.nb; ++b) {
        const int64_t t = std::min<int64_t>(16, L.ng - 16 * b);
        for (int64_t p = 0; p < G / 8; ++p) unpack_to<G, HB>(L, n, b, p, t, st);
        for (int64_t l = 0; l < t; ++l)  // step-major words -> group-major
          for (int64_t c = 0; c < G / 4; ++c) std::memcpy(nat + l * G + 4 * c, st + c * 64 + 4 * l, 4);
        scales_to(L, n, b, s, m);
        // 8 channels at a time on both variants (AVX2 runs on AVX-512 CPUs): one fma each
        for (int64_t u = 0; u < t * G / 8; ++u) {
          const int64_t g = u * 8 / G;
          const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(nat + 8 * u))));
          const __m256 w = _mm256_fmadd_ps(f, _mm256_set1_ps(s[g]), _mm256_set1_ps(m[g]));
          O* dst = o + b * 16 * G + 8 * u;
          if constexpr (std::is_same<O, float>::value) _mm256_storeu_ps(dst, w);
          else _mm_storeu_si128((__m128i*)dst, to_bf16_8(w));
        }
      }
    }
  });
#endif
}

template <typename O>
static void dequant_any(const Layout& L, const int64_t* rows, int64_t M, O* out) {
#define GGUF_DQ(g, hb) if (L.G == g && L.HB == hb) { dequant_impl<g, hb, O>(L, rows, M, out); } else
  GGUF_DQ(32, 0) GGUF_DQ(32, 1) GGUF_DQ(32, 2) GGUF_DQ(32, 4)
  GGUF_DQ(16, 0) GGUF_DQ(16, 1) GGUF_DQ(16, 2) GGUF_DQ(16, 4)
  { TORCH_CHECK(false, "gguf dequantize: no kernel for this layout"); }
#undef GGUF_DQ
}

void dequant(torch::Tensor lo, torch::Tensor hi, torch::Tensor d, torch::Tensor sc, torch::Tensor dm,
             torch::Tensor mn, int64_t G, int64_t S, int64_t HB, double z, torch::Tensor rows, bool all_rows,
             torch::Tensor out) {
#ifndef GGUF_NATIVE
  TORCH_CHECK(false, "gguf dequantize: built without AVX2 or AVX512-VNNI");
#endif
  const Layout L = layout(lo, hi, d, sc, dm, mn, G, S, HB, z);
  TORCH_CHECK(out.is_contiguous() && out.dim() == 2 && out.size(1) == L.K, "gguf dequantize: out [M, K] contiguous");
  const int64_t M = out.size(0);
  TORCH_CHECK(all_rows ? M == L.N : (rows.scalar_type() == at::kLong && rows.is_contiguous() && rows.numel() == M),
              "gguf dequantize: rows int64 [M] contiguous");
  const int64_t* rp = all_rows ? nullptr : rows.data_ptr<int64_t>();
  if (rp)
    for (int64_t i = 0; i < M; ++i) TORCH_CHECK(rp[i] >= 0 && rp[i] < L.N, "gguf dequantize: row out of range");
  if (out.scalar_type() == at::kFloat) dequant_any(L, rp, M, out.data_ptr<float>());
  else if (out.scalar_type() == at::kBFloat16) dequant_any(L, rp, M, out.data_ptr<at::BFloat16>());
  else TORCH_CHECK(false, "gguf dequantize: out float32 or bfloat16");
}

TORCH_LIBRARY_FRAGMENT(mixserve, lib) {
  lib.def("gguf_matmul(Tensor x, Tensor lo, Tensor hi, Tensor d, Tensor sc, Tensor dm, Tensor mn, int G, int S, "
          "int HB, float z, int levels=1, int prefetch=0) -> Tensor");
  lib.def("gguf_dequant(Tensor lo, Tensor hi, Tensor d, Tensor sc, Tensor dm, Tensor mn, int G, int S, int HB, "
          "float z, Tensor rows, bool all_rows, Tensor(a!) out) -> ()");
  lib.def("gguf_wide_rows(int n) -> int", &wide_rows);  // no tensor to dispatch on: one kernel for all
}
TORCH_LIBRARY_IMPL(mixserve, CPU, lib) {
  lib.impl("gguf_matmul", &matmul);
  lib.impl("gguf_dequant", &dequant);
}
""".replace("@QUANTIZE_ROW@", QUANTIZE_ROW_SRC)

_state: dict = {}
log = logging.getLogger("mixserve")
# the least the kernel needs (its AVX2 variant), as /proc/cpuinfo names them; AVX512-VNNI and
# AVX512-BW, where -march=native turns them on, build the VNNI variant instead
NEEDS = frozenset({"avx2", "fma", "f16c"})
ISA_NAMES = {2: "avx512-vnni", 1: "avx2"}


def kernel() -> Kernel:
    """This kernel as this process builds it (one of cpp_build.BUNDLED): its variant is decided by
    $MIXSERVE_ISA at the first call and kept, since both variants register the same ops and a second
    library of them would abort the process (a later change is logged and has no effect)."""
    isa = forced_isa()
    if "kernel" not in _state:
        if isa == "avx2":  # -march=native less AVX-512: the AVX2 variant, in a build of its own
            _state["kernel"] = Kernel("mixserve_gguf_v5_avx2", _SRC, ("available", "isa_level"), NEEDS,
                                      ("-mno-avx512f",))
        else:
            _state["kernel"] = Kernel("mixserve_gguf_v5", _SRC, ("available", "isa_level"), NEEDS)
        _state["isa"] = isa
    elif isa != _state["isa"]:
        log.warning("MIXSERVE_ISA changed to %r after the native GGUF kernel was chosen (%r): kept for this process",
                    isa, _state["isa"])
        _state["isa"] = isa  # said once per change
    return _state["kernel"]


def bundled() -> bool:
    """Whether this kernel is built with the others of cpp_build.BUNDLED: where GGUF files load
    natively by default (may_default_native). Elsewhere (an AVX2-only CPU, MIXSERVE_ISA=avx2) a
    start dequantizes by default and would compile it for nothing; `--gguf-weights native` builds
    it alone."""
    return may_default_native()


def build():
    """The built library (cpp_build.build_extension), nothing registered: what may run on another thread."""
    k = kernel()
    return build_extension(k.name, k.source, list(k.functions), needs=k.needs, extra_flags=k.extra_flags)


VNNI_NEEDS = frozenset({"avx512_vnni", "avx512bw"})  # what -march=native needs to build the VNNI variant


def may_default_native() -> bool:
    """False where default_native() is false for certain without building anything: MIXSERVE_ISA=avx2,
    or a CPU whose flags lack AVX512-VNNI or AVX512-BW."""
    if forced_isa() == "avx2":
        return False
    flags = cpu_flags()
    return not flags or VNNI_NEEDS <= flags


def default_native() -> bool:
    """Whether a GGUF file loads natively when --gguf-weights is not given: where the AVX512-VNNI
    variant runs. The AVX2 variant (asked for by --gguf-weights native) decodes one stream faster
    than the float32 dequantized copy but prefills and decodes wide batches slower, with batch
    invariance's two int8 levels at every row count (BENCHMARKS.md, issue 43). Builds the kernel
    only where may_default_native()."""
    return may_default_native() and available() and isa() == "avx512-vnni"


def why_not_native() -> str:
    """The start-up line's reason a GGUF file was dequantized by default (default_native false)."""
    flags = cpu_flags()
    if flags and not NEEDS <= flags:
        return "no native kernel here: it needs AVX2, FMA and F16C"
    if not may_default_native():
        return ("the native kernel here is its AVX2 variant, slower than float32 at prefill and wide batches; "
                "--gguf-weights native runs it")
    if os.environ.get("MIXSERVE_NO_CPP_KERNELS"):
        return "no native kernel here: MIXSERVE_NO_CPP_KERNELS turns the C++ kernels off"
    if not available():
        return "no native kernel here: its C++ build failed (its warning above says why)"
    return f"the native kernel here is its {isa()} variant; --gguf-weights native runs it"


def isa() -> str | None:
    """The instruction set the loaded kernel runs ("avx512-vnni" or "avx2"); None where there is none."""
    mod = _load()
    return ISA_NAMES.get(int(mod.isa_level())) if mod is not None else None


def _load():
    if "mod" not in _state:
        mod = build()
        mod = mod if mod is not None and mod.available() else None
        if mod is not None:
            torch.library.register_fake("mixserve::gguf_matmul")(
                lambda x, lo, hi, d, sc, dm, mn, G, S, HB, z, levels=1, prefetch=0: x.new_empty(x.shape[0], lo.shape[0]))
            torch.library.register_fake("mixserve::gguf_dequant")(
                lambda lo, hi, d, sc, dm, mn, G, S, HB, z, rows, all_rows, out: None)
        _state["mod"] = mod
    return _state["mod"]


def available() -> bool:
    """True where the kernel builds for this CPU (AVX2, FMA and F16C at least) and loads."""
    return _load() is not None


# int8 activation rows (rows x levels) the VNNI variant runs by streaming passes through the weights,
# up to 8 rows a pass and 32 KB of activations, before its many-row kernel (the C++ g_wide_rows'
# default; issue 34)
DEFAULT_WIDE_ROWS = 16


def set_wide_rows(n: int) -> int:
    """Run up to `n` (>= 4) int8 activation rows by streaming passes through the weights (above it:
    the many-row kernel); returns the value before. Both give the same bits; this only moves time
    (benchmarks/gguf_wide_rows.py). The AVX2 variant streams 4. Raises RuntimeError without the kernel."""
    if _load() is None:
        raise RuntimeError(f"the native GGUF kernel is not available here: {why_not_native()}")
    return int(torch.ops.mixserve.gguf_wide_rows(int(n)))
