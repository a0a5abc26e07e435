"""Decode attention that reads K/V through the block table in place (Kwon et al., SOSP 2023, §4.1,
the PagedAttention kernel), compiled for the machine at hand.

The eager decode path gathers each row's blocks into a padded [rows, L, kv_heads, d] copy, then
runs SDPA or batched matmuls on it: at 64 rows that gather and the copy after it were 71 of the
0.5B's 81 ms of attention per step (BENCHMARKS.md, step profile). This kernel walks each row's
block table instead: one task per (row, KV head), the KV head's query heads together (grouped-
query attention reads each K/V row once), scores in float32, softmax, then the V sum in float32,
rounded to the cache dtype once at the end. Only real context positions are read, so there is no
padding and no mask.

Where AVX2 + FMA build and the head size is a multiple of 8, the loop is explicit AVX2 (scores as
FMA chains, one polynomial exp): a row's bits then depend on its own context alone, which the
batch-invariant mode needs (`paged_rows`), and a 512-token prefill's attention took 16 ms a 0.5B
layer against the scalar loop's 57 (BENCHMARKS.md). Elsewhere the portable scalar loop runs.
Consecutive rows reading one table row (a prefill chunk's) form groups of up to 16 whose K and V are
widened once; with AVX-512 such a group computes its scores 16 positions at a time from K transposed,
and the V sums take up to four heads a pass in 512-bit registers, each score and output element
with the very operations of the one-row loop (so the same bits: a 1536-row chunk of the 0.5B, one
layer, 59-64 -> 38-39 ms; issue 43, sixth round). The V sums keep their accumulators in registers
(templated head and register counts: with run-time counts GCC stored every accumulator after every
FMA), the scores take two query heads per K^T load, and the softmax's max and exps run 16 lanes
wide with the 8-lane sum's order: 1.3-1.65x faster prefill attention and 1.25-1.45x faster decode
attention on a Zen 4 EPYC, 1.1-1.5x with AVX2 forced, the same bits (BENCHMARKS.md, 2026-12-07).

It is one candidate of the decode-attention choice (`attention.decode_candidates`), used where it
is measured faster on the machine at hand.
"""
from __future__ import annotations

import torch

from mixserve.layers.cpp_build import Kernel, build_extension

_SRC = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>
#include <type_traits>
#include <vector>

// the row of task i of B: rows from both ends in turn (0, B-1, 1, B-2, ...), so that each thread's
// contiguous share of a prefill chunk (whose rows' contexts grow by one a row) holds as much work as
// the other's; rows are independent, so the order changes no value
static inline int64_t balanced(int64_t i, int64_t B) { return i % 2 == 0 ? i / 2 : B - 1 - i / 2; }

#if defined(__AVX2__) && defined(__FMA__)
// The AVX2 path (head size a multiple of 8): explicit instructions, so that a row's arithmetic is
// fixed by its own context alone, whichever rows, chunk or step it comes in (batch invariance):
// each score one FMA chain over the head in order and one lane tree; the softmax's exps from one
// polynomial (below), its sum in 8 lanes over the positions in order, then one lane tree; the V
// sum one FMA chain over the positions in order. About 5x the scalar loop's speed on a prefill.
static inline __m256 ld8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 ld8(const at::BFloat16* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
// The V sum of one query head, output elements 8 * i0 .. 8 * (i0 + N8) - 1: each one FMA chain over
// the positions in order (the 8-lane path). N8 a template argument and every loop over the
// accumulators unrolled, so that they stay in registers (with a run-time count GCC kept them in
// memory: a load and a store around every FMA)
template <int N8, typename T>
static inline void vsum8(const float* sj, int64_t L, const float* vf, const T* vc, const int64_t* slot, int64_t d,
                         int64_t i0, T* o) {
  __m256 acc[N8];
#pragma GCC unroll 8
  for (int i = 0; i < N8; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t p = 0; p < L; ++p) {
    const __m256 w = _mm256_set1_ps(sj[p]);
    const float* vr = (vf ? vf + p * d : reinterpret_cast<const float*>(vc + slot[p] * d)) + 8 * i0;
#pragma GCC unroll 8
    for (int i = 0; i < N8; ++i) acc[i] = _mm256_fmadd_ps(w, ld8(vr + 8 * i), acc[i]);
  }
#pragma GCC unroll 8
  for (int i = 0; i < N8; ++i) {
    alignas(32) float tmp[8];
    _mm256_store_ps(tmp, acc[i]);
    for (int l = 0; l < 8; ++l) o[8 * (i0 + i) + l] = static_cast<T>(tmp[l]);
  }
}

static inline float hsum8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}
// e^x for x <= 0 (a score minus the row's max): 2^n * p(r), x = n ln2 + r, |r| <= ln2 / 2, p the
// degree-6 Taylor polynomial (relative error < 2e-7); below -87.3 the result is 0. NaN stays NaN.
static inline __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.3f);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(lo, x);  // a NaN x passes through: max returns its second operand then
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

#ifdef __AVX512F__
// exp8 on 16 lanes: the same operations per lane, so the same bits
static inline __m512 exp16(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.3f);
  const __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_max_ps(lo, x);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(~under, p, _mm512_castsi512_ps(e));
}
#endif

// Consecutive rows that read one table row (a prefill chunk's rows of one sequence) form a group of
// at most GROUP rows; a task is (group, KV head): the group's K and V rows are widened once for all
// its rows, not once a row. Each row's arithmetic is the same in a group as alone.
constexpr int64_t GROUP = 16;

#ifdef __AVX512F__
// Scores of NH query heads of one row for 16 positions at once, from K transposed (kt[i * ld + p] =
// K[p][i]): lane p's score of head h is the arithmetic of the 8-lane loop below, bit for bit: 8 partial
// sums, the one for head element 8i + l an FMA chain over i (a product first), then hsum8's tree,
// ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7)), then the scale. NH 2: each K^T load feeds both heads'
// FMAs (loads, not FMAs, bound the one-head loop on a CPU with one 512-bit load a cycle), each head's
// lanes in the same order, so the same bits. q[h]: head h's d floats; out[h] + p: its 16 scores.
template <int NH>
static inline void scores16(const float* const* q, const float* kt, int64_t ld, int64_t D8, int64_t p, float scale,
                            float* const* out) {
  __m512 a[NH][8];
#pragma GCC unroll 8
  for (int l = 0; l < 8; ++l) {
    const __m512 k = _mm512_loadu_ps(kt + l * ld + p);
    for (int h = 0; h < NH; ++h) a[h][l] = _mm512_mul_ps(_mm512_set1_ps(q[h][l]), k);
  }
  for (int64_t i = 1; i < D8; ++i)
#pragma GCC unroll 8
    for (int l = 0; l < 8; ++l) {
      const __m512 k = _mm512_loadu_ps(kt + (8 * i + l) * ld + p);
      for (int h = 0; h < NH; ++h) a[h][l] = _mm512_fmadd_ps(_mm512_set1_ps(q[h][8 * i + l]), k, a[h][l]);
    }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int h = 0; h < NH; ++h) {
    const __m512 t = _mm512_add_ps(_mm512_add_ps(a[h][0], a[h][4]), _mm512_add_ps(a[h][2], a[h][6]));
    const __m512 u = _mm512_add_ps(_mm512_add_ps(a[h][1], a[h][5]), _mm512_add_ps(a[h][3], a[h][7]));
    _mm512_storeu_ps(out[h] + p, _mm512_mul_ps(_mm512_add_ps(t, u), sc));
  }
}
// V sums of H query heads (NZ 16-float registers a head) over positions 0..L-1 in order:
// out[j][e] = sum_p s[j * ld + p] * V[p][e], one FMA chain a element; V rows widened (vf) or the
// cache's own float rows (vf null: T is float). H is a template argument and every loop over the
// accumulators unrolled: with a run-time head count (or a rolled loop reading them at the end) GCC
// kept them in memory, a store after every FMA (1.2-1.5x the time of a 1024-token prefill's attention)
template <int NZ, int H, typename T>
static inline void vsum512h(const float* s, int64_t ld, int64_t L, const float* vf, const T* vc,
                            const int64_t* slot, int64_t d, T* out) {
  __m512 acc[H][NZ];
#pragma GCC unroll 16
  for (int j = 0; j < H; ++j)
#pragma GCC unroll 16
    for (int i = 0; i < NZ; ++i) acc[j][i] = _mm512_setzero_ps();
  for (int64_t p = 0; p < L; ++p) {
    const float* vr = vf ? vf + p * d : reinterpret_cast<const float*>(vc + slot[p] * d);
    __m512 v[NZ];
#pragma GCC unroll 16
    for (int i = 0; i < NZ; ++i) v[i] = _mm512_loadu_ps(vr + 16 * i);
#pragma GCC unroll 16
    for (int j = 0; j < H; ++j) {
      const __m512 w = _mm512_set1_ps(s[j * ld + p]);
#pragma GCC unroll 16
      for (int i = 0; i < NZ; ++i) acc[j][i] = _mm512_fmadd_ps(w, v[i], acc[j][i]);
    }
  }
#pragma GCC unroll 16
  for (int j = 0; j < H; ++j) {
    alignas(64) float tmp[16 * NZ];
#pragma GCC unroll 16
    for (int i = 0; i < NZ; ++i) _mm512_store_ps(tmp + 16 * i, acc[j][i]);
    for (int e = 0; e < 16 * NZ; ++e) out[j * d + e] = static_cast<T>(tmp[e]);
  }
}
// h <= 16 / NZ (4 where NZ < 4) query heads: vsum512h for h
template <int NZ, typename T>
static inline void vsum512(const float* s, int64_t ld, int64_t h, int64_t L, const float* vf, const T* vc,
                           const int64_t* slot, int64_t d, T* out) {
  constexpr int MH = NZ >= 4 ? 16 / NZ : 4;
  if (h >= MH) return vsum512h<NZ, MH>(s, ld, L, vf, vc, slot, d, out);
  if (h == 1) return vsum512h<NZ, 1>(s, ld, L, vf, vc, slot, d, out);
  if (h == 2) return vsum512h<NZ, (MH > 2 ? 2 : 1)>(s, ld, L, vf, vc, slot, d, out);  // MH > 2 here
  return vsum512h<NZ, (MH > 3 ? 3 : 1)>(s, ld, L, vf, vc, slot, d, out);              // h == 3 < MH = 4
}
#endif

template <typename T>
static void run_avx2(const T* q, const T* kc, const T* vc, const int64_t* tables, const int64_t* row_table,
                     const int64_t* lens, T* out, int64_t B, int64_t H, int64_t Hkv, int64_t d, int64_t bs,
                     int64_t M, float scale) {
  const int64_t g = H / Hkv, D8 = d / 8;
  std::vector<int64_t> group{0};  // group starts, then B
  for (int64_t b = 1; b <= B; ++b)
    if (b == B || !row_table || row_table[b] != row_table[group.back()] || b - group.back() == GROUP) group.push_back(b);
  const int64_t NG = (int64_t)group.size() - 1;
  at::parallel_for(0, NG * Hkv, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> s, qf, kf, vf, kt;
    std::vector<int64_t> slot;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t gi = balanced(t / Hkv, NG), kh = t % Hkv, b0 = group[gi], b1 = group[gi + 1];
      int64_t LM = 0;
      for (int64_t b = b0; b < b1; ++b) LM = std::max(LM, lens[b]);
      const int64_t* tab = tables + (row_table ? row_table[b0] : b0) * M;
      slot.resize(LM);
      for (int64_t p0 = 0; p0 < LM; p0 += bs) {
        const int64_t base = tab[p0 / bs] * bs;
        for (int64_t o = 0; o < bs && p0 + o < LM; ++o) slot[p0 + o] = (base + o) * Hkv + kh;
      }
      constexpr bool widen = !std::is_same<T, float>::value;
#ifdef __AVX512F__
      // K transposed for the 16-position scores where the group has rows enough to pay for it
      const bool trans = b1 - b0 >= 2;
#else
      constexpr bool trans = false;
#endif
      const int64_t LT = (LM + 15) / 16 * 16;
      if (trans) {
        kt.assign(d * LT, 0.f);
        for (int64_t p = 0; p < LM; ++p) {
          const T* kr = kc + slot[p] * d;
          for (int64_t i = 0; i < d; ++i) kt[i * LT + p] = static_cast<float>(kr[i]);
        }
      }
      // bf16 K and V rows widened to float32 once for the group's rows and query heads (exact: the
      // same values the loops below read, so the same bits)
      if (widen) {
        if (!trans) kf.resize(LM * d);
        vf.resize(LM * d);
        for (int64_t p = 0; p < LM; ++p)
          for (int64_t i = 0; i < D8; ++i) {
            if (!trans) _mm256_storeu_ps(kf.data() + p * d + 8 * i, ld8(kc + slot[p] * d + 8 * i));
            _mm256_storeu_ps(vf.data() + p * d + 8 * i, ld8(vc + slot[p] * d + 8 * i));
          }
      }
      for (int64_t b = b0; b < b1; ++b) {
      const int64_t L = lens[b], L8 = (L + 7) / 8 * 8, LS = (L + 15) / 16 * 16;
      s.assign(g * LS, 0.f);
      qf.resize(g * d);
      for (int64_t i = 0; i < g * d; ++i) qf[i] = static_cast<float>(q[(b * H + kh * g) * d + i]);
#ifdef __AVX512F__
      if (trans) {  // a 16-position block of K^T (d x 16 floats) stays in L1 for the g query heads
        for (int64_t p = 0; p < L; p += 16) {
          int64_t j = 0;
          for (; j < g; j += 2) {
            const float* qh[2] = {qf.data() + j * d, qf.data() + (j + 1) * d};
            float* oh[2] = {s.data() + j * LS, s.data() + (j + 1) * LS};
            if (j + 2 <= g) scores16<2>(qh, kt.data(), LT, D8, p, scale, oh);
            else scores16<1>(qh, kt.data(), LT, D8, p, scale, oh);
          }
        }
      }
#endif
      // a query head's vector stays in registers over the positions (per score: its K row's loads and
      // one FMA chain, in the same order as ever)
      for (int64_t j = 0; j < g && !trans; ++j) {
        const float* qj = qf.data() + j * d;
        if (D8 == 8) {
          __m256 qv[8];
          for (int i = 0; i < 8; ++i) qv[i] = ld8(qj + 8 * i);
          for (int64_t p = 0; p < L; ++p) {
            const float* kr = widen ? kf.data() + p * d : reinterpret_cast<const float*>(kc + slot[p] * d);
            __m256 acc = _mm256_mul_ps(qv[0], ld8(kr));
#pragma GCC unroll 7
            for (int i = 1; i < 8; ++i) acc = _mm256_fmadd_ps(qv[i], ld8(kr + 8 * i), acc);
            s[j * LS + p] = hsum8(acc) * scale;
          }
          continue;
        }
        for (int64_t p = 0; p < L; ++p) {
          const float* kr = widen ? kf.data() + p * d : reinterpret_cast<const float*>(kc + slot[p] * d);
          __m256 acc = _mm256_mul_ps(ld8(qj), ld8(kr));
          for (int64_t i = 1; i < D8; ++i) acc = _mm256_fmadd_ps(ld8(qj + 8 * i), ld8(kr + 8 * i), acc);
          s[j * LS + p] = hsum8(acc) * scale;
        }
      }
      for (int64_t j = 0; j < g; ++j) {
        float* sj = s.data() + j * LS;
        float m = -INFINITY;
        __m256 sum = _mm256_setzero_ps();
        int64_t p8 = 0;  // positions whose exps the 16-lane loop took
#ifdef __AVX512F__
        {  // the max 16 lanes at a time (a max is exact in any order; a NaN score is skipped either way),
           // the exps 16 at a time (exp16: exp8's bits), their sum still 8 lanes over the positions in order
          __m512 mx = _mm512_set1_ps(-INFINITY);
          int64_t p = 0;
          for (; p + 16 <= L; p += 16) mx = _mm512_max_ps(_mm512_loadu_ps(sj + p), mx);
          if (p < L)
            mx = _mm512_max_ps(_mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), (__mmask16)((1u << (L - p)) - 1), sj + p), mx);
          m = _mm512_reduce_max_ps(mx);
          const __m512 mz = _mm512_set1_ps(m);
          for (; p8 + 16 <= L8; p8 += 16) {  // lanes past L: exp of (0 - m) computed, then zeroed
            const int64_t left = L - p8;
            const __mmask16 live = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
            const __m512 e = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(_mm512_loadu_ps(sj + p8), mz)));
            _mm512_storeu_ps(sj + p8, e);
            sum = _mm256_add_ps(sum, _mm512_castps512_ps256(e));
            sum = _mm256_add_ps(sum, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1)));
          }
        }
#else
        for (int64_t p = 0; p < L; ++p) m = std::max(m, sj[p]);
#endif
        const __m256 mv = _mm256_set1_ps(m);
        for (int64_t p = p8; p < L8; p += 8) {  // lanes past L: exp of (0 - m) computed, then zeroed
          const __m256i idx = _mm256_add_epi32(_mm256_set1_epi32((int)p), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
          const __m256 live = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)L), idx));
          const __m256 e = _mm256_and_ps(live, exp8(_mm256_sub_ps(_mm256_loadu_ps(sj + p), mv)));
          _mm256_storeu_ps(sj + p, e);
          sum = _mm256_add_ps(sum, e);
        }
        const __m256 inv = _mm256_set1_ps(1.f / hsum8(sum));
        for (int64_t p = 0; p < L8; p += 8) _mm256_storeu_ps(sj + p, _mm256_mul_ps(_mm256_loadu_ps(sj + p), inv));
      }
#ifdef __AVX512F__
      // With AVX-512 and d a multiple of 16: the V sums of up to 16 / (d / 16) query heads a pass
      // (16 accumulators), each V row read once for them; every output element is still one FMA
      // chain over the positions in order, so the same bits as the 8-lane loop below
      int64_t j0 = 0;
      const int64_t nz = d / 16;  // 512-bit registers a head
      if (d % 16 == 0 && (nz == 1 || nz == 2 || nz == 4 || nz == 8)) {
        const float* vbase = widen ? vf.data() : nullptr;
        while (j0 < g) {
          const int64_t h = std::min<int64_t>(g - j0, nz >= 4 ? 16 / nz : 4);
          const float* sj = s.data() + j0 * LS;
          T* o = out + (b * H + kh * g + j0) * d;
          if (nz == 1) vsum512<1>(sj, LS, h, L, vbase, vc, slot.data(), d, o);
          else if (nz == 2) vsum512<2>(sj, LS, h, L, vbase, vc, slot.data(), d, o);
          else if (nz == 4) vsum512<4>(sj, LS, h, L, vbase, vc, slot.data(), d, o);
          else vsum512<8>(sj, LS, h, L, vbase, vc, slot.data(), d, o);
          j0 += h;
        }
      }
#else
      const int64_t j0 = 0;
#endif
      for (int64_t j = j0; j < g; ++j) {
        const float* sj = s.data() + j * LS;
        T* o = out + (b * H + kh * g + j) * d;
        for (int64_t i0 = 0; i0 < D8; i0 += 8) {  // 8 registers of the output at a time
          const float* vbase = widen ? vf.data() : nullptr;
          switch (std::min<int64_t>(8, D8 - i0)) {
            case 1: vsum8<1>(sj, L, vbase, vc, slot.data(), d, i0, o); break;
            case 2: vsum8<2>(sj, L, vbase, vc, slot.data(), d, i0, o); break;
            case 3: vsum8<3>(sj, L, vbase, vc, slot.data(), d, i0, o); break;
            case 4: vsum8<4>(sj, L, vbase, vc, slot.data(), d, i0, o); break;
            case 5: vsum8<5>(sj, L, vbase, vc, slot.data(), d, i0, o); break;
            case 6: vsum8<6>(sj, L, vbase, vc, slot.data(), d, i0, o); break;
            case 7: vsum8<7>(sj, L, vbase, vc, slot.data(), d, i0, o); break;
            default: vsum8<8>(sj, L, vbase, vc, slot.data(), d, i0, o); break;
          }
        }
      }
      }
    }
  });
}
#define PAGED_AVX2 1
#endif

template <typename T>
static inline void load_row(const T* src, float* dst, int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<float>(src[i]);
}

// q [B, H, d]; caches [NB, bs, Hkv, d]; tables [B, M] int64; lens [B] int64; out [B, H, d]
template <typename T>
static void run(const T* q, const T* kc, const T* vc, const int64_t* tables, const int64_t* row_table,
                const int64_t* lens, T* out, int64_t B, int64_t H, int64_t Hkv, int64_t d, int64_t bs, int64_t M,
                float scale) {
  const int64_t g = H / Hkv;
  at::parallel_for(0, B * Hkv, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> qf(g * d), acc(g * d), row(d), s;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = balanced(t / Hkv, B), kh = t % Hkv, L = lens[b];
      const int64_t* tab = tables + (row_table ? row_table[b] : b) * M;
      for (int64_t j = 0; j < g; ++j) load_row(q + (b * H + kh * g + j) * d, qf.data() + j * d, d);
      s.assign(g * L, 0.f);
      for (int64_t p = 0; p < L; ++p) {
        const int64_t slot = tab[p / bs] * bs + p % bs;
        load_row(kc + (slot * Hkv + kh) * d, row.data(), d);
        for (int64_t j = 0; j < g; ++j) {
          const float* qj = qf.data() + j * d;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t i = 0; i < d; ++i) dot += qj[i] * row[i];
          s[j * L + p] = dot * scale;
        }
      }
      for (int64_t j = 0; j < g; ++j) {
        float* sj = s.data() + j * L;
        float m = -INFINITY, sum = 0.f;
        for (int64_t p = 0; p < L; ++p) m = std::max(m, sj[p]);
        for (int64_t p = 0; p < L; ++p) { sj[p] = std::exp(sj[p] - m); sum += sj[p]; }
        const float inv = 1.f / sum;
        for (int64_t p = 0; p < L; ++p) sj[p] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t p = 0; p < L; ++p) {
        const int64_t slot = tab[p / bs] * bs + p % bs;
        load_row(vc + (slot * Hkv + kh) * d, row.data(), d);
        for (int64_t j = 0; j < g; ++j) {
          const float w = s[j * L + p];
          float* aj = acc.data() + j * d;
#pragma omp simd
          for (int64_t i = 0; i < d; ++i) aj[i] += w * row[i];
        }
      }
      for (int64_t j = 0; j < g; ++j) {
        T* o = out + (b * H + kh * g + j) * d;
        for (int64_t i = 0; i < d; ++i) o[i] = static_cast<T>(acc[j * d + i]);
      }
    }
  });
}

// row_table empty: row b reads table row b; else int64 [B], the table row of each query row (the
// rows of one prefill chunk share their sequence's table)
torch::Tensor paged_rows(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor tables,
                         torch::Tensor row_table, torch::Tensor lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && q.is_contiguous() && k_cache.is_contiguous() &&
              v_cache.is_contiguous(), "paged_decode: contiguous q [B, H, d] and caches [NB, bs, Hkv, d]");
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes(), "paged_decode: v_cache ", v_cache.sizes(), " is not k_cache's shape ",
              k_cache.sizes());
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "paged_decode: q and both caches must have one dtype (q ", q.scalar_type(), ", k_cache ",
              k_cache.scalar_type(), ", v_cache ", v_cache.scalar_type(), ")");
  TORCH_CHECK(tables.scalar_type() == at::kLong && lens.scalar_type() == at::kLong && tables.is_contiguous() &&
              lens.is_contiguous() && tables.dim() == 2 && lens.dim() == 1, "paged_decode: int64 block tables [S, max_blocks] and lengths [B]");
  const int64_t B = q.size(0), H = q.size(1), d = q.size(2), NB = k_cache.size(0), bs = k_cache.size(1),
                Hkv = k_cache.size(2), S = tables.size(0), MB = tables.size(1);
  const bool indirect = row_table.numel() > 0;
  TORCH_CHECK(bs > 0 && Hkv > 0, "paged_decode: block size and KV heads must be >= 1");
  TORCH_CHECK(H % Hkv == 0 && k_cache.size(3) == d && lens.size(0) == B && (indirect || S == B),
              "paged_decode: shapes do not agree");
  TORCH_CHECK(!indirect || (row_table.scalar_type() == at::kLong && row_table.is_contiguous() && row_table.numel() == B),
              "paged_decode: row_table int64 [B]");
  const int64_t* rt = indirect ? row_table.data_ptr<int64_t>() : nullptr;
  {  // every block a row reads must be in the cache: a bad table would read outside it
    const int64_t* ln = lens.data_ptr<int64_t>();
    const int64_t* tb = tables.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) {
      const int64_t r = rt ? rt[b] : b;
      TORCH_CHECK(r >= 0 && r < S, "paged_decode: row ", b, " reads table row ", r, " of ", S);
      TORCH_CHECK(ln[b] >= 1 && ln[b] <= MB * bs, "paged_decode: row ", b, " has context length ", ln[b],
                  " (1 .. ", MB * bs, " for ", MB, " blocks of ", bs, ")");
      for (int64_t i = 0; i < (ln[b] + bs - 1) / bs; ++i)
        TORCH_CHECK(tb[r * MB + i] >= 0 && tb[r * MB + i] < NB, "paged_decode: row ", b, "'s block ", i, " is ",
                    tb[r * MB + i], ", not one of the cache's ", NB);
    }
  }
  auto out = torch::empty_like(q);
#ifdef PAGED_AVX2
  if (d % 8 == 0 && (q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kFloat)) {
    if (q.scalar_type() == at::kBFloat16)
      run_avx2<at::BFloat16>(q.data_ptr<at::BFloat16>(), k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>(),
                             tables.data_ptr<int64_t>(), rt, lens.data_ptr<int64_t>(), out.data_ptr<at::BFloat16>(), B,
                             H, Hkv, d, bs, tables.size(1), (float)scale);
    else
      run_avx2<float>(q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), tables.data_ptr<int64_t>(),
                      rt, lens.data_ptr<int64_t>(), out.data_ptr<float>(), B, H, Hkv, d, bs, tables.size(1), (float)scale);
    return out;
  }
#endif
  if (q.scalar_type() == at::kBFloat16) {
    run<at::BFloat16>(q.data_ptr<at::BFloat16>(), k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>(),
                      tables.data_ptr<int64_t>(), rt, lens.data_ptr<int64_t>(), out.data_ptr<at::BFloat16>(), B, H,
                      Hkv, d, bs, tables.size(1), (float)scale);
  } else {
    TORCH_CHECK(q.scalar_type() == at::kFloat, "paged_decode: float32 or bfloat16");
    run<float>(q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), tables.data_ptr<int64_t>(),
               rt, lens.data_ptr<int64_t>(), out.data_ptr<float>(), B, H, Hkv, d, bs, tables.size(1), (float)scale);
  }
  return out;
}

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor tables,
                           torch::Tensor lens, double scale) {
  return paged_rows(q, k_cache, v_cache, tables, torch::empty({0}, tables.options()), lens, scale);
}

// the decode step's whole attention in one op: each row's new k/v written at its slot, then
// paged_decode; registered with the dispatcher (below) so that a compiled graph calls it
// without leaving C++ and without a graph break
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor k_cache,
                                     torch::Tensor v_cache, torch::Tensor slots, torch::Tensor tables,
                                     torch::Tensor lens, double scale) {
  const int64_t kv = k_cache.size(2), d = k_cache.size(3);
  TORCH_CHECK(k.dim() == 3 && k.size(1) == kv && k.size(2) == d && v.sizes() == k.sizes() && slots.size(0) == k.size(0),
              "paged_decode_attention: k, v [B, kv_heads, d] and slots [B]");
  k_cache.view({-1, kv, d}).index_copy_(0, slots, k);
  v_cache.view({-1, kv, d}).index_copy_(0, slots, v);
  return paged_decode(q.contiguous(), k_cache, v_cache, tables, lens, scale);
}

TORCH_LIBRARY_FRAGMENT(mixserve, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor slots, Tensor tables, Tensor lens, float scale) -> Tensor");
}
TORCH_LIBRARY_IMPL(mixserve, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
"""


_fake_registered = False


def kernel() -> Kernel:
    """This kernel as cpp_build builds it (one of cpp_build.BUNDLED)."""
    return Kernel("mixserve_paged_decode_v8", _SRC, ("paged_decode", "paged_rows"))


def build():
    """The built library (cpp_build.build_extension), nothing registered: what may run on another thread."""
    k = kernel()
    return build_extension(k.name, k.source, list(k.functions))


def _load():
    global _fake_registered
    mod = build()
    if mod is not None and not _fake_registered:
        # shapes for tracing (torch.compile): the output is q's
        torch.library.register_fake("mixserve::paged_decode_attention")(
            lambda q, k, v, k_cache, v_cache, slots, tables, lens, scale: q.new_empty(q.shape))
        _fake_registered = True
    return mod


def available() -> bool:
    """True where the kernel builds (a C++ compiler and PyTorch's headers)."""
    return _load() is not None


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """One query token per row attending to its whole context in the paged cache.

    Args:
        q: [B, H, d] float32 or bfloat16 (the cache's dtype).
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, d], contiguous.
        block_tables: int64 [B, max_blocks]; row b's context is positions 0..context_lens[b]-1,
            position p in block block_tables[b, p // block_size] at offset p % block_size.
        context_lens: int64 [B], each >= 1 and <= max_blocks * block_size.
        scale: softmax scale.
    Returns:
        [B, H, d] in q's dtype.
    Raises:
        RuntimeError: the kernel is not built (check `available()`), or shapes/dtypes disagree.
    """
    mod = _load()
    if mod is None:
        raise RuntimeError("paged_decode: the C++ kernel is not available on this machine")
    return mod.paged_decode(q.contiguous(), k_cache, v_cache, block_tables.contiguous(), context_lens, float(scale))


def paged_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                           v_cache: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """A decode-only step's attention for one layer as one dispatcher op
    (`torch.ops.mixserve.paged_decode_attention`, traceable by torch.compile): k, v [B, kv_heads, d]
    written into the caches at slot_mapping (int64 [B]), then `paged_decode`. The caller has
    checked `available()`. Returns [B, H, d]."""
    _load()
    return torch.ops.mixserve.paged_decode_attention(q, k, v, k_cache, v_cache, slot_mapping, block_tables,
                                                     context_lens, scale)


def paged_rows(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
               row_table: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """`paged_decode` for query rows that share block tables: row b reads table row row_table[b]
    (int64 [B]) of tables (int64 [S, max_blocks]) over positions 0..context_lens[b]-1. A prefill
    chunk's rows are query rows of one sequence, each with its own context (its position + 1):
    they get exactly the arithmetic a decode row at that position gets (batch-invariant mode,
    layers/batch_invariance.py). Returns [B, H, d]. Raises RuntimeError as paged_decode."""
    mod = _load()
    if mod is None:
        raise RuntimeError("paged_decode: the C++ kernel is not available on this machine")
    return mod.paged_rows(q.contiguous(), k_cache, v_cache, tables.contiguous(), row_table.contiguous(),
                          context_lens.contiguous(), float(scale))
