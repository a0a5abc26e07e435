"""The native GGUF kernel's C++ source (layers/gguf_kernels.py builds it; issue 43's panel layout).

Layout. A weight [N, K] is held in panels of 16 output rows (the last one padded with zero rows),
each plane [panels, bytes a panel], so that one vector's 16 lanes are 16 output rows: no
horizontal sums, no empty lanes, the same arithmetic at every row count. Every type is unsigned
integers q (4, 5, 6 or 8 bits) with, per group g of G input channels (32, or 16 for Q6_K), an
affine map w = s_g * q + m_g (layers/gguf_blocks.py). A group's channels run in "steps" of 4
(step i: channels gG + 4i .. gG + 4i + 3); per panel:

- `lo` [panels, 8K]: per group and step pair j (0 .. G/8 - 1) 64 bytes, byte 4l + c holding row l's
  channel c of step j in its low nibble and of step j + G/8 in its high nibble (q's low 4 bits);
- `hi`: q's bits above: Q8_0 (HB 4) a second plane like `lo` of bits 4-7; Q5_0 (HB 1, G 32) and
  Q6_K (HB 2, G 16) 64 bytes a group, byte 4l + c holding, from bit HB * i up, bits 4 .. 3 + HB of
  row l's channel c of step i;
- `d` float16 [panels, K/S * 16] per super-block of S channels and lane, `sc` int8 [panels, K/G * 16]
  (the K-quants' sub-block scales, s_g = d * sc_g), `dm` float16 like d and `mn` uint8 like sc
  (m_g = dm_g, Q4_1, or dm * mn_g, Q4_K). The symmetric types (m_g = -z * s_g) keep no offset.

Activations. Each activation row is quantized per 32 channels to a 16-bit integer x16 = round(256 *
x / dx), dx = max|x| / 127, |x16| <= 32512, with the scale e = dx / 256 (one int16 row; `levels`
2); where 1 / dx overflows (max|x| below ~1e-37) dx = 0, so the block's x16 and e are 0, and where a
value is not finite dx is NaN (the row's outputs are NaN). Its two bytes are the two int8 levels of earlier kernels, combined exactly: x16 = 256 * x1 + x2
with x1 = (x16 + 128) >> 8 in [-127, 127] and x2 in [-128, 127]. Odd `levels` make the last row
x16 = 256 * round(x / dx) (one int8 level); 3 and 4 add a row for what the first left over
(fma(-x16, e, x), quantized the same way), the rows' outputs summed in float32.

The float order every kernel shares (AVX512-VNNI and AVX2, few rows and many: the same bits):
per output (activation row r, weight row n), acc = 0, then for each group g in order:
    [the types with an offset: acc = fma(m_g, xs_g, acc), xs_g = e_g * float(sum of x16 in g)]
    acc = fma(float(isum_g), s_g * e_g, acc)
with isum_g the exact integer sum over the group of (q - z) * x16 (symmetric types) or q * x16.
The few-row kernel forms isum from `vpdpbusd` on the two bytes (256 * sum(q * x1) + sum(q * x2)
- z * sum(x16)); the many-row kernel unpacks a tile of panels to int16 (q - z) once and forms it
with `vpdpwssd` (AVX2: `vpmaddwd`): the same integer, |isum| < 2^28, so the same float. Where the CPU
has AMX-INT8 (and the weight's timed choice asks for it), the many-row kernel forms it on tiles instead:
`tdpbssd` on each byte level against the weights' q - z as signed bytes, 256 * level 1 + level 2.
"""

SRC = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
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
#if defined(GGUF_VNNI) && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define GGUF_AMX 1
#endif

// int16 activation rows run by streaming passes through the weights (the few-row kernel, up to
// 4 rows a pass, or 5 where 5 are left: run_rows) before the many-row kernel; gguf_wide_rows(n)
// sets it (n >= 1; else only reads it) and returns the value before (both give the same bits)
static int64_t g_wide_rows = 8;
// whether the many-row kernel may run on AMX-INT8 tiles (built where the compiler targets AMX; the
// caller allows it only where the process may use AMX, Linux's per-process permission), for the
// weights whose `many` asks for it: gguf_amx(1 / 0) sets it, -1 only reads; returns the value
// before, or -1 where this build has no AMX kernel
static bool g_amx = false;
int64_t amx(int64_t n) {
#ifdef GGUF_AMX
  const bool old = g_amx;
  if (n >= 0) g_amx = n > 0;
  return old;
#else
  return -1;
#endif
}

int64_t wide_rows(int64_t n) {
  const int64_t old = g_wide_rows;
  if (n >= 1) g_wide_rows = n;
  return old;
}

struct Layout {
  const uint8_t* lo; const uint8_t* hi; const at::Half* d; const int8_t* sc; const at::Half* dm;
  const uint8_t* mn; int64_t N, NP, K, G, S, HB, ng, nsb, lpp, hpp; int32_t z;
  // group g's super-block is g >> sbs (S / G a power of two): a shift, where g * G / S compiled to a
  // 64-bit division in every group's scales (the VNNI Q6_K and Q5_0 kernels ~12% slower at one row)
  int sbs;
};

static Layout layout(torch::Tensor lo, torch::Tensor hi, torch::Tensor d, torch::Tensor sc, torch::Tensor dm,
                     torch::Tensor mn, int64_t N, int64_t G, int64_t S, int64_t HB, double z) {
  Layout L;
  TORCH_CHECK(lo.scalar_type() == at::kByte && lo.dim() == 2 && lo.is_contiguous() && lo.size(1) % 8 == 0,
              "gguf: lo uint8 [panels, 8K]");
  L.NP = lo.size(0); L.K = lo.size(1) / 8; L.N = N; L.G = G; L.S = S; L.HB = HB; L.z = (int32_t)z;
  TORCH_CHECK(N >= 0 && N > (L.NP - 1) * 16 && N <= L.NP * 16, "gguf: N rows do not fill the panels");
  TORCH_CHECK((G == 16 || G == 32) && L.K % 32 == 0 && S % G == 0 && L.K % S == 0, "gguf: unsupported group sizes");
  L.sbs = 0;
  while ((G << L.sbs) < S) ++L.sbs;
  TORCH_CHECK((G << L.sbs) == S, "gguf: a super-block of S channels holds a power of two of groups");
  TORCH_CHECK(HB == 0 || HB == 4 || (HB == 1 && G == 32) || (HB == 2 && G == 16), "gguf: HB 0, 4, 1 (G 32), 2 (G 16)");
  L.ng = L.K / G; L.nsb = L.K / S; L.lpp = 8 * L.K; L.hpp = HB == 4 ? 8 * L.K : HB * 2 * L.K;
  TORCH_CHECK(HB == 0 || (hi.scalar_type() == at::kByte && hi.numel() == L.NP * L.hpp && hi.is_contiguous()), "gguf: hi");
  TORCH_CHECK(d.scalar_type() == at::kHalf && d.numel() == L.NP * L.nsb * 16 && d.is_contiguous(), "gguf: d");
  const bool ks = S != G, has_dm = dm.numel() > 0, has_mn = mn.numel() > 0;
  TORCH_CHECK(!ks || (sc.scalar_type() == at::kChar && sc.numel() == L.NP * L.ng * 16 && sc.is_contiguous()), "gguf: sc");
  TORCH_CHECK(!has_dm || (dm.scalar_type() == at::kHalf && dm.numel() == d.numel() && dm.is_contiguous()), "gguf: dm");
  TORCH_CHECK(!has_mn || (has_dm && ks && mn.scalar_type() == at::kByte && mn.numel() == L.NP * L.ng * 16 &&
              mn.is_contiguous()), "gguf: mn");
  TORCH_CHECK(!has_dm || z == 0, "gguf: an offset type has no zero point");
  L.lo = lo.data_ptr<uint8_t>();
  L.hi = HB ? hi.data_ptr<uint8_t>() : nullptr;
  L.d = d.data_ptr<at::Half>();
  L.sc = ks ? sc.data_ptr<int8_t>() : nullptr;
  L.dm = has_dm ? dm.data_ptr<at::Half>() : nullptr;
  L.mn = has_mn ? mn.data_ptr<uint8_t>() : nullptr;
  return L;
}

// the quantized activations: RQ int16 rows of K channels
struct Act {
  int64_t RQ = 0, K = 0, ng = 0;
  std::vector<int16_t> x16;        // [RQ, K] (not written where the VNNI many-row kernel runs: it reads xp)
  std::vector<int8_t> x1, x2;      // [RQ, K] the two bytes (the few-row kernel's; empty otherwise)
  // the AMX kernel's copy of the two bytes: rows in blocks of 16, per block and group [16 rows][2G]
  // (x1's G bytes, then x2's), the last block's rows past RQ zero
  std::vector<int8_t> xa;
  std::vector<float> ea, xsa;      // the AMX kernel's e and xs: per block of 16 rows [K/32 or ng][16 rows]
  std::vector<float> e, xs;        // [RQ, K/32] scales; [RQ, ng] e * sum of x16 over the group
  std::vector<int32_t> gs;         // [RQ, ng] sum of x16 over the group
  // the many-row kernel's copy of x16: rows in blocks of PACK_ROWS, per block [K/2 channel pairs]
  // [PACK_ROWS] (one base address for a block's broadcasts; rows past RQ zero)
  std::vector<int32_t> xp;
};
static constexpr int64_t PACK_ROWS = 6;

#ifdef GGUF_NATIVE
// one row to int16 per 32 channels (AVX2, which both variants have): dx = max|x| / 127 (NaN where a
// value is not finite: the row's outputs are then NaN, and only its own), x16 = round(256 * x / dx)
// half to even (full) or 256 * round(x / dx) (one int8 level), clamped to +-32512; rest (if asked)
// = fma(-x16, e, x); s16[h] = the exact sum of x16 over channels 16h .. 16h + 15. T: float, or
// at::BFloat16 (widened exactly: the same values as the caller's .float(), without its pass)
static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const at::BFloat16* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

template <typename T>
static void quantize16(const T* xr, int64_t K, bool full, int16_t* q, float* e, float* rest, int32_t* s16) {
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)), inf = _mm256_set1_ps(INFINITY);
  const __m256 lo = _mm256_set1_ps(-32512.f), hi = _mm256_set1_ps(32512.f), k256 = _mm256_set1_ps(256.f);
  for (int64_t c = 0; c < K / 32; ++c) {
    const T* xc = xr + c * 32;
    __m256 v[4], m = _mm256_setzero_ps();
    int finite = 0xFF;
    for (int i = 0; i < 4; ++i) {
      v[i] = load8(xc + 8 * i);
      const __m256 a = _mm256_and_ps(v[i], absmask);
      finite &= _mm256_movemask_ps(_mm256_cmp_ps(a, inf, _CMP_LT_OQ));  // false for inf and NaN
      m = _mm256_max_ps(m, a);
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    const float amax = std::max(_mm_cvtss_f32(h), _mm_cvtss_f32(_mm_shuffle_ps(h, h, 1)));
    float dc = finite == 0xFF ? amax / 127.f : NAN, inv = dc > 0.f ? 1.f / dc : 0.f;
    if (std::isinf(inv)) dc = inv = 0.f;  // a subnormal scale: x16 = 0 and the rest carries x
    const float ec = dc * (1.f / 256.f);
    e[c] = ec;
    const __m256 iv = _mm256_set1_ps(inv), ev = _mm256_set1_ps(ec);
    __m256i qi[4];
    for (int i = 0; i < 4; ++i) {
      const __m256 t = _mm256_mul_ps(v[i], iv);
      __m256 f = full ? _mm256_round_ps(_mm256_mul_ps(t, k256), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
                      : _mm256_mul_ps(_mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), k256);
      f = _mm256_and_ps(f, _mm256_cmp_ps(f, f, _CMP_ORD_Q));  // NaN -> 0
      f = _mm256_min_ps(_mm256_max_ps(f, lo), hi);
      qi[i] = _mm256_cvtps_epi32(f);
      if (rest) _mm256_storeu_ps(rest + c * 32 + 8 * i, _mm256_fnmadd_ps(f, ev, v[i]));
    }
    // |x16| <= 32512: 16 of them sum exactly in int32, and packs_epi32 below keeps each
    for (int h = 0; h < 2; ++h) {
      const __m256i t = _mm256_add_epi32(qi[2 * h], qi[2 * h + 1]);
      __m128i u = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
      u = _mm_add_epi32(u, _mm_shuffle_epi32(u, 0x4E));
      u = _mm_add_epi32(u, _mm_shuffle_epi32(u, 0xB1));
      s16[2 * c + h] = _mm_cvtsi128_si32(u);
    }
    const __m256i a = _mm256_permute4x64_epi64(_mm256_packs_epi32(qi[0], qi[1]), 0xD8);
    const __m256i b = _mm256_permute4x64_epi64(_mm256_packs_epi32(qi[2], qi[3]), 0xD8);
    _mm256_storeu_si256((__m256i*)(q + c * 32), a);
    _mm256_storeu_si256((__m256i*)(q + c * 32 + 16), b);
  }
}

// x [R, K] (float32 or bfloat16) -> A: R * ceil(levels / 2) int16 rows, their group sums, and (bytes) the two int8
// planes the few-row kernel broadcasts, or (packed) only the many-row kernel's copy of them (xp)
template <typename T>
static void quantize_act(const T* x, int64_t R, int64_t K, int64_t G, int64_t levels, bool bytes, bool packed,
                         Act& A, bool amx = false) {
  const int64_t per = (levels + 1) / 2;
  // every element below is written: resize keeps a reused buffer's pages (fresh ones fault in,
  // ~20% of a 512-row call's time when allocated per call)
  A.RQ = R * per; A.K = K; A.ng = K / G;
  // amx: the AMX kernel's copy (xa) only, rows in blocks of 16, rows RQ .. RP - 1 zeros (their
  // scales too: the kernel runs whole blocks and stores only real rows)
  const int64_t RP = amx ? (A.RQ + 15) / 16 * 16 : A.RQ;
  const int64_t K2 = K / 2, nb = (A.RQ + PACK_ROWS - 1) / PACK_ROWS;
  if (packed) A.xp.resize(nb * K2 * PACK_ROWS);
  else if (!amx) A.x16.resize(A.RQ * K);
  A.e.resize(A.RQ * (K / 32));
  A.gs.resize(A.RQ * A.ng); A.xs.resize(A.RQ * A.ng);
  if (bytes) { A.x1.resize(A.RQ * K); A.x2.resize(A.RQ * K); }
  if (amx) {
    A.xa.resize(RP * K * 2);
    A.ea.resize(RP * (K / 32));
    A.xsa.resize(RP * A.ng);
    // rows past RQ sit in the last block, among its real rows: the block is zeroed here, the real rows
    // written below
    if (RP > A.RQ) {
      const int64_t last = A.RQ / 16 * 16;
      std::fill(A.xa.begin() + last * K * 2, A.xa.end(), (int8_t)0);
      std::fill(A.ea.begin() + last * (K / 32), A.ea.end(), 0.f);
      std::fill(A.xsa.begin() + last * A.ng, A.xsa.end(), 0.f);
    }
  }
  // rows are quantized independently, on every thread (a 512-token prefill's rows took ~0.5 s on
  // one); packed, a task is whole blocks of PACK_ROWS int16 rows (PACK_ROWS / per source rows), so
  // no two threads write one block's interleaved words
  const int64_t unit = packed ? PACK_ROWS / per : 1, units = (R + unit - 1) / unit;
  at::parallel_for(0, units, packed ? 1 : 16, [&](int64_t u0, int64_t u1) {
    std::vector<float> rest(2 * K);
    std::vector<int16_t> own(packed || amx ? K : 0);
    std::vector<int32_t> s16(K / 16);
    for (int64_t r = u0 * unit; r < std::min(R, u1 * unit); ++r) {
      const float* src = nullptr;  // the level before's rest, from the second level on
      for (int64_t i = 0; i < per; ++i) {
        const int64_t row = per * r + i;
        const bool full = 2 * (i + 1) <= levels;
        float* left = rest.data() + (i % 2) * K;
        int16_t* q = packed || amx ? own.data() : A.x16.data() + row * K;
        float* e = A.e.data() + row * (K / 32);
        float* keep = i + 1 < per ? left : nullptr;
        if (i == 0) quantize16(x + r * K, K, full, q, e, keep, s16.data());
        else quantize16(src, K, full, q, e, keep, s16.data());
        src = left;
        for (int64_t g = 0; g < A.ng; ++g) {
          const int32_t sg = G == 16 ? s16[g] : s16[2 * g] + s16[2 * g + 1];
          A.gs[row * A.ng + g] = sg;
          A.xs[row * A.ng + g] = A.e[row * (K / 32) + g * G / 32] * (float)sg;
        }
        if (packed) {  // the many-row kernel's layout: per block [K/2 channel pairs][PACK_ROWS]
          const int32_t* w = (const int32_t*)q;
          int32_t* dst = A.xp.data() + (row / PACK_ROWS) * K2 * PACK_ROWS + row % PACK_ROWS;
          for (int64_t t = 0; t < K2; ++t) dst[t * PACK_ROWS] = w[t];
        }
        if (amx) {  // the AMX kernel's copy: scales per block of 16 rows, a column of 16 rows at a time
          float* ea = A.ea.data() + (row / 16) * 16 * (K / 32) + row % 16;
          for (int64_t j = 0; j < K / 32; ++j) ea[16 * j] = e[j];
          float* xsa = A.xsa.data() + (row / 16) * 16 * A.ng + row % 16;
          for (int64_t g = 0; g < A.ng; ++g) xsa[16 * g] = A.xs[row * A.ng + g];
          // the bytes: per block of 16 rows and group, [16 rows][x1's G bytes, x2's G]
          int8_t* base = A.xa.data() + (row / 16) * 16 * K * 2 + (row % 16) * 2 * G;
          for (int64_t g = 0; g < A.ng; ++g) {
            int8_t* d = base + g * 32 * G;
            for (int64_t c = 0; c < G; c += 16) {
#ifdef GGUF_VNNI
              const __m256i v = _mm256_loadu_si256((const __m256i*)(q + g * G + c));
              const __m256i h = _mm256_srai_epi16(_mm256_add_epi16(v, _mm256_set1_epi16(128)), 8);
              const __m256i l = _mm256_sub_epi16(v, _mm256_slli_epi16(h, 8));
              _mm_storeu_si128((__m128i*)(d + c), _mm256_cvtepi16_epi8(h));
              _mm_storeu_si128((__m128i*)(d + G + c), _mm256_cvtepi16_epi8(l));
#endif
            }
          }
        }
        if (bytes) {
          int8_t* b1 = A.x1.data() + row * K; int8_t* b2 = A.x2.data() + row * K;
          for (int64_t c = 0; c < K; ++c) {
            const int32_t h = (q[c] + 128) >> 8;
            b1[c] = (int8_t)h;
            b2[c] = (int8_t)(q[c] - (h << 8));
          }
        }
      }
    }
  });
  if (packed)  // the last block's rows past RQ read as zeros
    for (int64_t row = A.RQ; row < nb * PACK_ROWS; ++row) {
      int32_t* dst = A.xp.data() + (row / PACK_ROWS) * K2 * PACK_ROWS + row % PACK_ROWS;
      for (int64_t t = 0; t < K2; ++t) dst[t * PACK_ROWS] = 0;
    }
}

// the many-row kernels' blocking: channels in blocks of `kc` (K itself up to 1024, else 1024), panels
// in tiles of `tp` (the tile's int16 weights, 32 bytes a channel a panel: ~256 KB for an unblocked K,
// ~128 KB with blocks, at most 8 panels), sized so that the threads' shares of panels are as even as
// tiles allow (parallel_for gives each thread a run of ceil(tiles / threads) tiles: the 0.5B's
// 56-panel o_proj in 8-panel tiles split 32 / 24 panels, in 4-panel tiles 28 / 28); every
// activation row runs against a tile's block before the next block is unpacked (the float
// accumulators wait in y between blocks, so each output still adds its groups in order). Timed by
// hand on a Zen 5 EPYC, 512 rows: blocks of 512 channels and 14-panel tiles ran the 0.5B's down
// projection (896 x 4864) at ~300 GMAC/s, 1024 and 4 panels at ~355, the gate (4864 x 896, unblocked) at ~410
static inline int64_t block_channels(int64_t K) { return K <= 1024 ? K : 1024; }

static inline int64_t tile_panels(int64_t NP, int64_t kc) {
  const int64_t by_cache = std::max<int64_t>(1, (kc < 1024 ? 256 * 1024 : 128 * 1024) / (32 * kc));
  const int64_t nt = std::max<int64_t>(1, at::get_num_threads()), cap = std::min<int64_t>(by_cache, 8);
  int64_t best = 1, load = NP;  // the busiest thread's panels
  for (int64_t tp = cap; tp >= 1; --tp) {
    if (tp > 1 && tp % 2) continue;  // the micro-kernels take panels in pairs
    const int64_t tiles = (NP + tp - 1) / tp, l = std::min<int64_t>(NP, (tiles + nt - 1) / nt * tp);
    if (l < load) { best = tp; load = l; }
  }
  return best;
}

// the int16 tile of the many-row kernels (both variants): per panel [channel pairs of the block][16
// lanes] of (q - z) pairs, then per group the 16 lanes' s and m; one per thread, kept between calls.
// Q: the AMX kernel's bytes instead of W (fill_amx)
struct Tile { std::vector<int32_t> W; std::vector<float> S, M; std::vector<uint8_t> Q; };

__attribute__((noinline)) static Tile& thread_tile() {  // noinline: see thread_act
  static thread_local Tile T;  // every element a call uses is written by its fill_tile
  return T;
}

// rows of activations a chunk of the many-row kernels' loop: about CHUNK_BYTES of int16 activations
// (all K channels), a multiple of 6 (both variants' row blocks). Timed by hand on a Zen 5 EPYC, 2048
// rows of the 0.5B's down projection (896 x 4864, Q4_K): all rows at once 252 GMAC/s, chunks of 4, 2
// and 1 MB 294, 302 and 297, 512 KB 278; the gate+up (K 896) ~400 either way
static constexpr int64_t CHUNK_BYTES = 2 << 20;

static inline int64_t row_chunk(int64_t K, int64_t RQ, int64_t unit = 6) {
  const int64_t rc = std::max<int64_t>(1, CHUNK_BYTES / (2 * K) / unit) * unit;
  return std::min<int64_t>(rc, RQ);
}

// the many-row kernels' frame: per chunk of rows, block of groups and tile of panels (each thread its
// own tiles), fill(T, p0, np, g0, g1) unpacks the tile's block, then rows(T, p0, np, g0, g1, q0, q1)
// runs the chunk's activation rows q0 .. q1 - 1 against it: the chunk's activations stay in cache
// across the thread's tiles (all rows at once re-read every row from memory for every tile)
template <typename Fill, typename Rows, typename Begin>
static void over_tiles(const Layout& L, int64_t RQ, Fill&& fill, Rows&& rows, int64_t unit, Begin&& begin) {
  const int64_t kc = block_channels(L.K), TP = tile_panels(L.NP, kc), kg = kc / L.G, RC = row_chunk(L.K, RQ, unit);
  at::parallel_for(0, (L.NP + TP - 1) / TP, 1, [&](int64_t t0, int64_t t1) {
    Tile& T = thread_tile();
    auto done = begin();  // a thread's set-up (AMX: its tile configuration), undone when the task ends
    T.W.resize(TP * (kc / 2) * 16); T.S.resize(TP * kg * 16); T.M.resize(TP * kg * 16);
    for (int64_t q0 = 0; q0 < RQ; q0 += RC) {
      const int64_t q1 = std::min<int64_t>(RQ, q0 + RC);
      for (int64_t g0 = 0; g0 < L.ng; g0 += kg) {
        const int64_t g1 = std::min<int64_t>(L.ng, g0 + kg);
        for (int64_t t = t0; t < t1; ++t) {
          const int64_t p0 = t * TP, np = std::min<int64_t>(TP, L.NP - p0);
          fill(T, p0, np, g0, g1);
          rows(T, p0, np, g0, g1, q0, q1);
        }
      }
    }
    done();
  });
}

template <typename Fill, typename Rows>
static void over_tiles(const Layout& L, int64_t RQ, Fill&& fill, Rows&& rows) {
  over_tiles(L, RQ, fill, rows, 6, [] { return [] {}; });
}


static inline __m128i to_bf16_8(__m256 v) {  // round to nearest even on the bits (the weights are finite)
  __m256i u = _mm256_castps_si256(v);
  u = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF),
                                           _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1))));
  u = _mm256_srli_epi32(u, 16);
  return _mm_packus_epi32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1));
}

static inline __m256i shift16h(__m256i v, int s) {
  return s >= 0 ? _mm256_sll_epi16(v, _mm_cvtsi32_si128(s)) : _mm256_srl_epi16(v, _mm_cvtsi32_si128(-s));
}

// panel p's unsigned integers of group g in step order: st[s * 64 + 4 l + c] = row l's channel
// gG + 4s + c (AVX2 on both variants: each step's 16 lanes unpacked as two 32-byte halves)
static void panel_steps(const Layout& L, int64_t p, int64_t g, uint8_t* st) {
  const int64_t G = L.G, h = G / 8, HB = L.HB;
  const uint8_t* lg = L.lo + p * L.lpp + g * h * 64;
  const uint8_t* hg = HB == 4 ? L.hi + p * L.hpp + g * h * 64 : (HB ? L.hi + p * L.hpp + g * 64 : nullptr);
  const __m256i low = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8((char)0xF0);
  const __m256i mk = _mm256_set1_epi8(HB == 1 ? 0x10 : 0x30);
  for (int half = 0; half < 2; ++half) {
    const __m256i hv = (HB == 1 || HB == 2) ? _mm256_loadu_si256((const __m256i*)(hg + 32 * half)) : _mm256_setzero_si256();
    for (int64_t j = 0; j < h; ++j) {
      const __m256i v = _mm256_loadu_si256((const __m256i*)(lg + j * 64 + 32 * half));
      __m256i qa = _mm256_and_si256(v, low), qb = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      if (HB == 4) {
        const __m256i t = _mm256_loadu_si256((const __m256i*)(hg + j * 64 + 32 * half));
        qa = _mm256_or_si256(qa, _mm256_and_si256(_mm256_slli_epi16(t, 4), top));
        qb = _mm256_or_si256(qb, _mm256_and_si256(t, top));
      } else if (HB) {
        qa = _mm256_or_si256(qa, _mm256_and_si256(shift16h(hv, 4 - (int)(HB * j)), mk));
        qb = _mm256_or_si256(qb, _mm256_and_si256(shift16h(hv, 4 - (int)(HB * (j + h))), mk));
      }
      _mm256_storeu_si256((__m256i*)(st + j * 64 + 32 * half), qa);
      _mm256_storeu_si256((__m256i*)(st + (j + h) * 64 + 32 * half), qb);
    }
  }
}

// panel p's unsigned integers of group g, row-major: q[l * G + c] = row l's channel gG + c (the
// step order's 4-byte words moved to their rows)
static void panel_group(const Layout& L, int64_t p, int64_t g, uint8_t* q) {
  alignas(64) uint8_t st[8 * 64];
  panel_steps(L, p, g, st);
  for (int64_t l = 0; l < 16; ++l)
    for (int64_t s = 0; s < L.G / 4; ++s) std::memcpy(q + l * L.G + 4 * s, st + s * 64 + 4 * l, 4);
}

// panel p's s_g and m_g of group g for its 16 rows (m = -z * s for the symmetric types; AVX2, F16C)
static inline void scales_panel(const Layout& L, int64_t p, int64_t g, float* s, float* m) {
  const int64_t sb = g >> L.sbs;
  for (int h = 0; h < 2; ++h) {
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(L.d + (p * L.nsb + sb) * 16 + 8 * h)));
    const __m256 sv = L.sc ? _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                 _mm_loadl_epi64((const __m128i*)(L.sc + (p * L.ng + g) * 16 + 8 * h))))) : d;
    __m256 mv;
    if (L.dm) {
      const __m256 dm = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(L.dm + (p * L.nsb + sb) * 16 + 8 * h)));
      mv = L.mn ? _mm256_mul_ps(dm, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                      _mm_loadl_epi64((const __m128i*)(L.mn + (p * L.ng + g) * 16 + 8 * h))))) : dm;
    } else {
      mv = _mm256_mul_ps(sv, _mm256_set1_ps((float)(-L.z)));
    }
    _mm256_storeu_ps(s + 8 * h, sv);
    _mm256_storeu_ps(m + 8 * h, mv);
  }
}
#endif

#ifdef GGUF_VNNI
static inline __m512 h16(const at::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }

// panel p's s_g and (offset types) m_g for group g, 16 lanes
static inline void scales16(const Layout& L, int64_t p, int64_t g, __m512& s, __m512& m) {
  const int64_t sb = g >> L.sbs;
  const __m512 d = h16(L.d + (p * L.nsb + sb) * 16);
  s = L.sc ? _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                 _mm_loadu_si128((const __m128i*)(L.sc + (p * L.ng + g) * 16))))) : d;
  if (L.dm) {
    const __m512 dm = h16(L.dm + (p * L.nsb + sb) * 16);
    m = L.mn ? _mm512_mul_ps(dm, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                   _mm_loadu_si128((const __m128i*)(L.mn + (p * L.ng + g) * 16))))) : dm;
  } else {
    m = _mm512_setzero_ps();
  }
}

// a 16-bit shift left (s > 0) or right (s < 0) of every lane
static inline __m512i shift16(__m512i v, int s) {
  return s >= 0 ? _mm512_sll_epi16(v, _mm_cvtsi32_si128(s)) : _mm512_srl_epi16(v, _mm_cvtsi32_si128(-s));
}

// steps j and j + G/8 of a group: the unsigned integers, lane l byte c = row l's channel c of the step.
// lg: the group's `lo` bytes, hg: its `hi` bytes (HB 4: like lo; HB 1, 2: 64 bytes, in hv)
template <int G, int HB>
static inline void unpack(const uint8_t* lg, const uint8_t* hg, __m512i hv, int64_t j, __m512i& qa, __m512i& qb) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  const __m512i v = _mm512_loadu_si512(lg + j * 64);
  qa = _mm512_and_si512(v, low);
  qb = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
  if constexpr (HB == 4) {
    const __m512i h = _mm512_loadu_si512(hg + j * 64), top = _mm512_set1_epi8((char)0xF0);
    qa = _mm512_or_si512(qa, _mm512_and_si512(_mm512_slli_epi16(h, 4), top));
    qb = _mm512_or_si512(qb, _mm512_and_si512(h, top));
  } else if constexpr (HB > 0) {
    const __m512i mk = _mm512_set1_epi8(HB == 1 ? 0x10 : 0x30);
    qa = _mm512_or_si512(qa, _mm512_and_si512(shift16(hv, 4 - HB * (int)j), mk));
    qb = _mm512_or_si512(qb, _mm512_and_si512(shift16(hv, 4 - HB * (int)(j + G / 8)), mk));
  }
}

static inline __m512i bcast4(const void* p) { int32_t u; std::memcpy(&u, p, 4); return _mm512_set1_epi32(u); }

// R int16 rows (A's rows r0 ..) against every panel, streaming the weights once: per group, the
// integer sums of both bytes with vpdpbusd, combined exactly, then the documented float step. ALT
// (three levels: r0 even, every odd row the last level's 256 * round(x / dx)): an odd row's low byte
// is 0, so its sums skip it (the same integers, a quarter fewer vpdpbusd for the LM head)
template <int R, int G, int HB, bool ALT = false>
static void few(const Layout& L, const Act& A, int64_t r0, float* y, int64_t PF) {
  const int64_t K = L.K, ng = L.ng, nk = K / 32;
  const bool off = L.dm != nullptr;
  at::parallel_for(0, L.NP, 4, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const uint8_t* lo = L.lo + p * L.lpp;
      const uint8_t* hi = HB ? L.hi + p * L.hpp : nullptr;
      __m512 acc[R];
      for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
      for (int64_t g = 0; g < ng; ++g) {
        const uint8_t* lg = lo + g * (G / 8) * 64;
        const uint8_t* hg = HB == 4 ? hi + g * (G / 8) * 64 : (HB ? hi + g * 64 : nullptr);
        if (PF) {
          _mm_prefetch((const char*)(lg + PF * 64), _MM_HINT_T0);
          if (HB) _mm_prefetch((const char*)(hg + PF * 64), _MM_HINT_T0);
        }
        const __m512i hv = (HB == 1 || HB == 2) ? _mm512_loadu_si512(hg) : _mm512_setzero_si512();
        __m512i a1[R], a2[R];
        for (int r = 0; r < R; ++r) a1[r] = a2[r] = _mm512_setzero_si512();
        const int64_t c0 = g * G;
#pragma GCC unroll 4
        for (int64_t j = 0; j < G / 8; ++j) {
          __m512i qa, qb;
          unpack<G, HB>(lg, hg, hv, j, qa, qb);
#pragma GCC unroll 4
          for (int r = 0; r < R; ++r) {
            const int8_t* x1 = A.x1.data() + (r0 + r) * K + c0;
            const int8_t* x2 = A.x2.data() + (r0 + r) * K + c0;
            a1[r] = _mm512_dpbusd_epi32(a1[r], qa, bcast4(x1 + 4 * j));
            a1[r] = _mm512_dpbusd_epi32(a1[r], qb, bcast4(x1 + 4 * (j + G / 8)));
            if (!ALT || r % 2 == 0) {
              a2[r] = _mm512_dpbusd_epi32(a2[r], qa, bcast4(x2 + 4 * j));
              a2[r] = _mm512_dpbusd_epi32(a2[r], qb, bcast4(x2 + 4 * (j + G / 8)));
            }
          }
        }
        __m512 s, m;
        scales16(L, p, g, s, m);
        for (int r = 0; r < R; ++r) {
          const int64_t row = r0 + r;
          __m512i is = _mm512_add_epi32(_mm512_slli_epi32(a1[r], 8), a2[r]);
          if (!off) is = _mm512_sub_epi32(is, _mm512_set1_epi32(L.z * A.gs[row * ng + g]));
          else acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(A.xs[row * ng + g]), acc[r]);
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is), _mm512_mul_ps(s, _mm512_set1_ps(A.e[row * nk + c0 / 32])),
                                   acc[r]);
        }
      }
      const int64_t left = L.N - 16 * p;
      const __mmask16 k = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
      for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + (r0 + r) * L.N + 16 * p, k, acc[r]);
    }
  });
}


// few() over two panels at a time: each activation broadcast (and each row's float-step operands)
// feeds both panels, the same integers and float steps per output, so the same bits. Each thread
// reads its panels as two halves side by side (two sequential streams: adjacent pairs, a stride of
// two panels, ran a K = 1536 weight 1.2-1.5x slower at one row). Where it pays is measured: fewp()
template <int R, int G, int HB, bool ALT = false>
static void few2(const Layout& L, const Act& A, int64_t r0, float* y, int64_t PF) {
  const int64_t K = L.K, ng = L.ng, nk = K / 32;
  const bool off = L.dm != nullptr;
  at::parallel_for(0, L.NP, 4, [&](int64_t pa, int64_t pb) {
    // the thread's panels in two halves read side by side: two sequential streams
    const int64_t half = (pb - pa + 1) / 2;
    for (int64_t q = 0; q < half; ++q) {
      const int64_t p = pa + q, p1 = pa + half + q;
      const bool two = p1 < pb;
      const uint8_t* lo0 = L.lo + p * L.lpp;
      const uint8_t* lo1 = two ? L.lo + p1 * L.lpp : lo0;
      const uint8_t* hi0 = HB ? L.hi + p * L.hpp : nullptr;
      const uint8_t* hi1 = HB ? (two ? L.hi + p1 * L.hpp : hi0) : nullptr;
      __m512 acc0[R], acc1[R];
      for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm512_setzero_ps();
      for (int64_t g = 0; g < ng; ++g) {
        const uint8_t* lg0 = lo0 + g * (G / 8) * 64;
        const uint8_t* lg1 = lo1 + g * (G / 8) * 64;
        const uint8_t* hg0 = HB == 4 ? hi0 + g * (G / 8) * 64 : (HB ? hi0 + g * 64 : nullptr);
        const uint8_t* hg1 = HB == 4 ? hi1 + g * (G / 8) * 64 : (HB ? hi1 + g * 64 : nullptr);
        const __m512i hv0 = (HB == 1 || HB == 2) ? _mm512_loadu_si512(hg0) : _mm512_setzero_si512();
        const __m512i hv1 = (HB == 1 || HB == 2) ? _mm512_loadu_si512(hg1) : _mm512_setzero_si512();
        __m512i a10[R], a20[R], a11[R], a21[R];
        for (int r = 0; r < R; ++r) a10[r] = a20[r] = a11[r] = a21[r] = _mm512_setzero_si512();
        const int64_t c0 = g * G;
#pragma GCC unroll 4
        for (int64_t j = 0; j < G / 8; ++j) {
          __m512i qa0, qb0, qa1, qb1;
          unpack<G, HB>(lg0, hg0, hv0, j, qa0, qb0);
          unpack<G, HB>(lg1, hg1, hv1, j, qa1, qb1);
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) {
            const int8_t* x1 = A.x1.data() + (r0 + r) * K + c0;
            const int8_t* x2 = A.x2.data() + (r0 + r) * K + c0;
            __m512i b = bcast4(x1 + 4 * j);
            a10[r] = _mm512_dpbusd_epi32(a10[r], qa0, b);
            a11[r] = _mm512_dpbusd_epi32(a11[r], qa1, b);
            b = bcast4(x1 + 4 * (j + G / 8));
            a10[r] = _mm512_dpbusd_epi32(a10[r], qb0, b);
            a11[r] = _mm512_dpbusd_epi32(a11[r], qb1, b);
            if (!ALT || r % 2 == 0) {
              b = bcast4(x2 + 4 * j);
              a20[r] = _mm512_dpbusd_epi32(a20[r], qa0, b);
              a21[r] = _mm512_dpbusd_epi32(a21[r], qa1, b);
              b = bcast4(x2 + 4 * (j + G / 8));
              a20[r] = _mm512_dpbusd_epi32(a20[r], qb0, b);
              a21[r] = _mm512_dpbusd_epi32(a21[r], qb1, b);
            }
          }
        }
        __m512 s0, m0, s1, m1;
        scales16(L, p, g, s0, m0);
        scales16(L, two ? p1 : p, g, s1, m1);
        for (int r = 0; r < R; ++r) {
          const int64_t row = r0 + r;
          __m512i i0 = _mm512_add_epi32(_mm512_slli_epi32(a10[r], 8), a20[r]);
          __m512i i1 = _mm512_add_epi32(_mm512_slli_epi32(a11[r], 8), a21[r]);
          if (!off) {
            const __m512i zg = _mm512_set1_epi32(L.z * A.gs[row * ng + g]);
            i0 = _mm512_sub_epi32(i0, zg);
            i1 = _mm512_sub_epi32(i1, zg);
          } else {
            const __m512 xs = _mm512_set1_ps(A.xs[row * ng + g]);
            acc0[r] = _mm512_fmadd_ps(m0, xs, acc0[r]);
            acc1[r] = _mm512_fmadd_ps(m1, xs, acc1[r]);
          }
          const __m512 e = _mm512_set1_ps(A.e[row * nk + c0 / 32]);
          acc0[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i0), _mm512_mul_ps(s0, e), acc0[r]);
          acc1[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i1), _mm512_mul_ps(s1, e), acc1[r]);
        }
      }
      for (int h = 0; h < (two ? 2 : 1); ++h) {
        const int64_t pp = h ? p1 : p;
        const int64_t left = L.N - 16 * pp;
        const __mmask16 k = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
        for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + (r0 + r) * L.N + 16 * pp, k, h ? acc1[r] : acc0[r]);
      }
    }
  });
}

// an unsigned byte vector (lane l: 4 channels) -> its channel pairs (0, 1) and (2, 3) as int16 pairs, less z
static inline void widen(__m512i q, __m512i zz, __m512i& p01, __m512i& p23) {
  const __m512i b0 = _mm512_set1_epi32(0xFF), b1 = _mm512_set1_epi32(0xFF00);
  const __m512i u = _mm512_srli_epi32(q, 16);
  p01 = _mm512_sub_epi16(_mm512_or_si512(_mm512_and_si512(q, b0), _mm512_slli_epi32(_mm512_and_si512(q, b1), 8)), zz);
  p23 = _mm512_sub_epi16(_mm512_or_si512(_mm512_and_si512(u, b0), _mm512_slli_epi32(_mm512_and_si512(u, b1), 8)), zz);
}

// panels p0 .. p0 + np - 1, groups g0 .. g1 - 1 into the tile: per panel [channel pairs of the block][16
// lanes], then per group the lanes' s and m
template <int G, int HB>
static void fill_tile(const Layout& L, Tile& T, int64_t p0, int64_t np, int64_t g0, int64_t g1) {
  const int64_t nbg = g1 - g0, ws = nbg * (G / 2) * 16;
  const __m512i zz = _mm512_set1_epi16((short)L.z);
  for (int64_t i = 0; i < np; ++i) {
    const int64_t p = p0 + i;
    const uint8_t* lo = L.lo + p * L.lpp;
    const uint8_t* hi = HB ? L.hi + p * L.hpp : nullptr;
    int32_t* W = T.W.data() + i * ws;
    for (int64_t g = g0; g < g1; ++g) {
      const uint8_t* lg = lo + g * (G / 8) * 64;
      const uint8_t* hg = HB == 4 ? hi + g * (G / 8) * 64 : (HB ? hi + g * 64 : nullptr);
      const __m512i hv = (HB == 1 || HB == 2) ? _mm512_loadu_si512(hg) : _mm512_setzero_si512();
      for (int64_t j = 0; j < G / 8; ++j) {
        __m512i qa, qb, a01, a23, b01, b23;
        unpack<G, HB>(lg, hg, hv, j, qa, qb);
        widen(qa, zz, a01, a23);
        widen(qb, zz, b01, b23);
        const int64_t ta = ((g - g0) * G + 4 * j) / 2, tb = ((g - g0) * G + 4 * (j + G / 8)) / 2;
        _mm512_storeu_si512(W + ta * 16, a01);
        _mm512_storeu_si512(W + (ta + 1) * 16, a23);
        _mm512_storeu_si512(W + tb * 16, b01);
        _mm512_storeu_si512(W + (tb + 1) * 16, b23);
      }
      __m512 s, m;
      scales16(L, p, g, s, m);
      _mm512_storeu_ps(T.S.data() + (i * nbg + g - g0) * 16, s);
      _mm512_storeu_ps(T.M.data() + (i * nbg + g - g0) * 16, m);
    }
  }
}

// MR int16 rows x NPAN panels of the tile, groups g0 .. g1 - 1 (first: the accumulators start at
// zero, else from y): the integer sums with vpdpwssd (broadcast channel pairs of the activations),
// then few()'s float steps in its order
template <int MR, int NPAN, int G>
static inline void micro(const Layout& L, const Tile& T, int64_t i0, const Act& A, int64_t r0, float* y, int64_t p,
                         int64_t g0, int64_t g1) {
  const int64_t K = L.K, ng = L.ng, nk = K / 32, nbg = g1 - g0, ws = nbg * (G / 2) * 16;
  const bool off = L.dm != nullptr;
  __mmask16 k[NPAN];
  for (int c = 0; c < NPAN; ++c) {
    const int64_t left = L.N - 16 * (p + c);
    k[c] = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
  }
  __m512 F[MR][NPAN];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 2
    for (int c = 0; c < NPAN; ++c)
      F[r][c] = g0 == 0 ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(k[c], y + (r0 + r) * L.N + 16 * (p + c));
  const int32_t* W = T.W.data() + i0 * ws;
  const int32_t* X = A.xp.data() + (r0 / PACK_ROWS) * (K / 2) * PACK_ROWS;  // r0 starts a block
  for (int64_t g = g0; g < g1; ++g) {
    __m512i I[MR][NPAN];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 2
      for (int c = 0; c < NPAN; ++c) I[r][c] = _mm512_setzero_si512();
    const int32_t* wg = W + (g - g0) * (G / 2) * 16;
    const int32_t* xg = X + g * (G / 2) * PACK_ROWS;
#pragma GCC unroll 16
    for (int t = 0; t < G / 2; ++t) {
      __m512i w[NPAN];
#pragma GCC unroll 2
      for (int c = 0; c < NPAN; ++c) w[c] = _mm512_loadu_si512(wg + c * ws + t * 16);
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        const __m512i xb = _mm512_set1_epi32(xg[t * PACK_ROWS + r]);
#pragma GCC unroll 2
        for (int c = 0; c < NPAN; ++c) I[r][c] = _mm512_dpwssd_epi32(I[r][c], w[c], xb);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const int64_t row = r0 + r;
      const __m512 ev = _mm512_set1_ps(A.e[row * nk + g * G / 32]);
      const __m512 xv = _mm512_set1_ps(A.xs[row * ng + g]);
#pragma GCC unroll 2
      for (int c = 0; c < NPAN; ++c) {
        const int64_t at = ((i0 + c) * nbg + g - g0) * 16;
        if (off) F[r][c] = _mm512_fmadd_ps(_mm512_loadu_ps(T.M.data() + at), xv, F[r][c]);
        F[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(I[r][c]), _mm512_mul_ps(_mm512_loadu_ps(T.S.data() + at), ev),
                                  F[r][c]);
      }
    }
  }
#pragma GCC unroll 2
  for (int c = 0; c < NPAN; ++c)
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) _mm512_mask_storeu_ps(y + (r0 + r) * L.N + 16 * (p + c), k[c], F[r][c]);
}

template <int MR, int G>
static inline void micro_panels(const Layout& L, const Tile& T, int64_t i, int64_t np, const Act& A, int64_t r0,
                                float* y, int64_t p, int64_t g0, int64_t g1) {
  if (i + 1 < np) micro<MR, 2, G>(L, T, i, A, r0, y, p, g0, g1);
  else micro<MR, 1, G>(L, T, i, A, r0, y, p, g0, g1);
}

template <int G, int HB>
static void many(const Layout& L, const Act& A, float* y) {
  over_tiles(L, A.RQ, [&](Tile& T, int64_t p0, int64_t np, int64_t g0, int64_t g1) { fill_tile<G, HB>(L, T, p0, np, g0, g1); },
    [&](Tile& T, int64_t p0, int64_t np, int64_t g0, int64_t g1, int64_t q0, int64_t q1) {
      constexpr int MR = PACK_ROWS;
      for (int64_t r0 = q0; r0 < q1; r0 += MR) {
        const int64_t rr = std::min<int64_t>(MR, q1 - r0);
        for (int64_t i = 0; i < np; i += 2) {
          switch (rr) {
            case 1: micro_panels<1, G>(L, T, i, np, A, r0, y, p0 + i, g0, g1); break;
            case 2: micro_panels<2, G>(L, T, i, np, A, r0, y, p0 + i, g0, g1); break;
            case 3: micro_panels<3, G>(L, T, i, np, A, r0, y, p0 + i, g0, g1); break;
            case 4: micro_panels<4, G>(L, T, i, np, A, r0, y, p0 + i, g0, g1); break;
            case 5: micro_panels<5, G>(L, T, i, np, A, r0, y, p0 + i, g0, g1); break;
            default: micro_panels<6, G>(L, T, i, np, A, r0, y, p0 + i, g0, g1); break;
          }
        }
      }
    });
}

#ifdef GGUF_AMX
// The AMX-INT8 many-row kernel: the same integers and float steps as few(), so the same bits. Per
// group, tdpbssd multiplies 16 activation rows' signed bytes (A: 16 x G, one tile per byte level)
// by a panel's q - z as signed bytes in step order (B: G/4 rows x 64 bytes, row s holding the 16
// weight rows' channels 4s .. 4s + 3: the layout's step order is AMX's VNNI layout), giving 16 x 16
// int32 sums per level; isum = 256 * sum((q - z) * x1) + sum((q - z) * x2), the integer few() forms,
// then its float steps per activation row, 16 weight rows a vector. The sums of every group leave
// the tiles for those float steps (the scales are per group): that round trip through memory, not
// the multiplies, bounds it (BENCHMARKS.md, issue 43's tenth round).
struct TileConfig { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; };

// tmm0, tmm1: 16 activation rows x G bytes (the two levels); tmm2, tmm3: a panel's group (G/4 x 64);
// tmm4 .. tmm7: 16 x 16 int32 sums. Per thread: a task's first act (AMX's state is the thread's)
static void amx_configure(int64_t G) {
  alignas(64) TileConfig c;
  std::memset(&c, 0, sizeof c);
  c.palette = 1;
  for (int t = 0; t < 2; ++t) { c.rows[t] = 16; c.colsb[t] = (uint16_t)G; }
  for (int t = 2; t < 4; ++t) { c.rows[t] = (uint8_t)(G / 4); c.colsb[t] = 64; }
  for (int t = 4; t < 8; ++t) { c.rows[t] = 16; c.colsb[t] = 64; }
  _tile_loadconfig(&c);
}

// panels p0 .. p0 + np - 1, groups g0 .. g1 - 1 into the tile's bytes: per panel, per group its G/4
// steps x 64 bytes of q - z as signed bytes (Q8_0's q - 128 included; the offset types' z is 0 and
// their q < 16), then per group the lanes' s and m
template <int G, int HB>
static void fill_amx(const Layout& L, Tile& T, int64_t p0, int64_t np, int64_t g0, int64_t g1) {
  const int64_t nbg = g1 - g0;
  const __m512i zz = _mm512_set1_epi8((char)L.z);
  for (int64_t i = 0; i < np; ++i) {
    const int64_t p = p0 + i;
    const uint8_t* lo = L.lo + p * L.lpp;
    const uint8_t* hi = HB ? L.hi + p * L.hpp : nullptr;
    for (int64_t g = g0; g < g1; ++g) {
      const uint8_t* lg = lo + g * (G / 8) * 64;
      const uint8_t* hg = HB == 4 ? hi + g * (G / 8) * 64 : (HB ? hi + g * 64 : nullptr);
      const __m512i hv = (HB == 1 || HB == 2) ? _mm512_loadu_si512(hg) : _mm512_setzero_si512();
      uint8_t* st = T.Q.data() + (i * nbg + g - g0) * 16 * G;
      for (int64_t j = 0; j < G / 8; ++j) {
        __m512i qa, qb;
        unpack<G, HB>(lg, hg, hv, j, qa, qb);
        _mm512_storeu_si512(st + j * 64, _mm512_sub_epi8(qa, zz));
        _mm512_storeu_si512(st + (j + G / 8) * 64, _mm512_sub_epi8(qb, zz));
      }
      __m512 s, m;
      scales16(L, p, g, s, m);
      _mm512_storeu_ps(T.S.data() + (i * nbg + g - g0) * 16, s);
      _mm512_storeu_ps(T.M.data() + (i * nbg + g - g0) * 16, m);
    }
  }
}

// one group's integer sums for 16 activation rows x NP2 panels: the two levels' activation tiles
// (tmm0, tmm1) against each panel's bytes (tmm2, tmm3), into tmm4 .. tmm7, stored to c[panel][level][256]
template <int G, int NP2>
static inline void amx_sums(const int8_t* a, const uint8_t* b0, const uint8_t* b1, int32_t* c) {
  _tile_loadd(0, a, 2 * G);
  _tile_loadd(1, a + G, 2 * G);
  _tile_loadd(2, b0, 64);
  _tile_zero(4);
  _tile_zero(5);
  _tile_dpbssd(4, 0, 2);
  _tile_dpbssd(5, 1, 2);
  if constexpr (NP2 == 2) {
    _tile_loadd(3, b1, 64);
    _tile_zero(6);
    _tile_zero(7);
    _tile_dpbssd(6, 0, 3);
    _tile_dpbssd(7, 1, 3);
  }
  _tile_stored(4, c, 64);
  _tile_stored(5, c + 256, 64);
  if constexpr (NP2 == 2) {
    _tile_stored(6, c + 512, 64);
    _tile_stored(7, c + 768, 64);
  }
}

// one group's float steps for 16 activation rows and one panel: the panel's s (S) and, offset types,
// m (M, else null) of the group, the rows' e and xs (16 each), its sums c[level][256], the
// accumulators in f[16][16]
template <int G>
static inline void amx_float(const float* __restrict S, const float* __restrict M, const float* __restrict e,
                             const float* __restrict xs, const int32_t* __restrict c, float* __restrict f) {
  const __m512 s = _mm512_loadu_ps(S);
  if (M != nullptr) {
    const __m512 m = _mm512_loadu_ps(M);
#pragma GCC unroll 16
    for (int r = 0; r < 16; ++r) {
      const __m512i is = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(c + 16 * r), 8),
                                          _mm512_load_si512(c + 256 + 16 * r));
      __m512 F = _mm512_fmadd_ps(m, _mm512_set1_ps(xs[r]), _mm512_load_ps(f + 16 * r));
      F = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is), _mm512_mul_ps(s, _mm512_set1_ps(e[r])), F);
      _mm512_store_ps(f + 16 * r, F);
    }
  } else {
#pragma GCC unroll 16
    for (int r = 0; r < 16; ++r) {
      const __m512i is = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(c + 16 * r), 8),
                                          _mm512_load_si512(c + 256 + 16 * r));
      const __m512 F = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is), _mm512_mul_ps(s, _mm512_set1_ps(e[r])),
                                       _mm512_load_ps(f + 16 * r));
      _mm512_store_ps(f + 16 * r, F);
    }
  }
}

// 16 activation rows (r0 .. r0 + 15; rows past RQ are quantize_act's zero padding, not stored) x
// panels i, i + 1 of the tile (NP2 of them), groups g0 .. g1 - 1 (the accumulators start at zero, or
// from y). Software-pipelined: group g's sums are issued to the tile unit before group g - 1's float
// steps run on the vector units, into the other of two buffers
template <int G, int NP2>
static void amx_panels(const Layout& L, const Tile& T, int64_t i, int64_t nbg, const Act& A, int64_t r0, int64_t rr,
                       float* y, int64_t p, int64_t g0, int64_t g1) {
  const int64_t K = L.K;  // a block of 16 rows holds 16 * 2K bytes
  alignas(64) float f[NP2][256];
  __mmask16 k[NP2];
  for (int c = 0; c < NP2; ++c) {
    const int64_t left = L.N - 16 * (p + c);
    k[c] = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
    for (int r = 0; r < 16; ++r)
      _mm512_store_ps(f[c] + 16 * r, (g0 == 0 || r >= rr) ? _mm512_setzero_ps()
                                      : _mm512_maskz_loadu_ps(k[c], y + (r0 + r) * L.N + 16 * (p + c)));
  }
  alignas(64) int32_t cs[2][NP2 * 512];
  const int8_t* a = A.xa.data() + r0 * K * 2;  // r0 starts a block of 16 rows; group g at a + g * 32G
  const float* ea = A.ea.data() + r0 * (K / 32);
  const float* xsa = A.xsa.data() + r0 * L.ng;
  const bool off = L.dm != nullptr;
  const uint8_t* q0 = T.Q.data() + i * nbg * 16 * G;
  const uint8_t* q1 = q0 + nbg * 16 * G;
  amx_sums<G, NP2>(a + g0 * 32 * G, q0, q1, cs[0]);
  for (int64_t g = g0; g < g1; ++g) {
    const int64_t u = g - g0;
    if (g + 1 < g1) amx_sums<G, NP2>(a + (g + 1) * 32 * G, q0 + (u + 1) * 16 * G, q1 + (u + 1) * 16 * G, cs[(u + 1) & 1]);
    const float* e = ea + (g * G / 32) * 16;
    const float* xs = xsa + g * 16;
    for (int c = 0; c < NP2; ++c) {
      const int64_t at = ((i + c) * nbg + u) * 16;
      amx_float<G>(T.S.data() + at, off ? T.M.data() + at : nullptr, e, xs, cs[u & 1] + 512 * c, f[c]);
    }
  }
  for (int c = 0; c < NP2; ++c)
    for (int r = 0; r < 16 && r < rr; ++r)
      _mm512_mask_storeu_ps(y + (r0 + r) * L.N + 16 * (p + c), k[c], _mm512_load_ps(f[c] + 16 * r));
}

template <int G, int HB>
static void many_amx(const Layout& L, const Act& A, float* y) {
  over_tiles(L, A.RQ,
    [&](Tile& T, int64_t p0, int64_t np, int64_t g0, int64_t g1) {
      T.Q.resize(T.W.size() * 4 / 2);  // int8 where the int16 tile holds (q - z) pairs: half its bytes
      fill_amx<G, HB>(L, T, p0, np, g0, g1);
    },
    [&](Tile& T, int64_t p0, int64_t np, int64_t g0, int64_t g1, int64_t q0, int64_t q1) {
      for (int64_t r0 = q0; r0 < q1; r0 += 16)
        for (int64_t i = 0; i < np; i += 2) {
          const int64_t rr = std::min<int64_t>(16, q1 - r0);
          if (i + 1 < np) amx_panels<G, 2>(L, T, i, g1 - g0, A, r0, rr, y, p0 + i, g0, g1);
          else amx_panels<G, 1>(L, T, i, g1 - g0, A, r0, rr, y, p0 + i, g0, g1);
        }
    },
    16, [&] { amx_configure(G); return [] { _tile_release(); }; });
}
#endif  // GGUF_AMX

// few() or few2() for a weight: two panels a pass where the group is 16 channels (Q6_K: twice the
// float steps and broadcasts per byte of the 32-channel types) and K >= 4096. Timed by hand on a
// Zen 5 EPYC, median of 30 passes over 6 copies, 1 / 2 / 3 / 4 rows against few(): Q6_K 1536 x 8960
// (the 1.5B's down) 0.99 / 0.79 / 0.77 / 0.68, Q6_K 896 x 4864 (the 0.5B's) 0.84 / 0.72 / 0.82 / 0.98;
// Q6_K at K = 1536 (8960 x 1536, and the 1.5B's LM head) 1.05-1.5x slower at 1-2 rows, and the 32-channel
// types (Q4_K, Q8_0) 0.95-1.1x either way, so they keep few(). A fixed rule; on an Intel AMX Xeon
// (2026-12-07, by hand, alternated processes) Q6_K 1536 x 8960 at 2 / 3 / 4 rows 0.83-0.87x few()'s
// time, 1 row 0.75x and 1.11x in two runs, 896 x 4864 0.9-1.0x: it holds there too (the AVX2 variant
// has no few2). That rule is the default (passes 0); on the same Xeon the Q6_K LM head (151,936 x 1536)
// ran in 0.73-0.76x the time with two panels at 1-2 rows, against 1.05-1.5x slower on the Zen 5: the
// caller may time both per weight (passes 1: one panel a pass, 2: two; gguf_linear's `gguf_passes`)
template <int R, int G, int HB, bool ALT = false>
static inline void fewp(const Layout& L, const Act& A, int64_t r0, float* y, int64_t PF, int passes) {
  // two panels hold 4 rows' accumulators in registers at most: more rows take one panel a pass
  if constexpr (R <= 4) {
    if (G == 16 && (passes == 2 || (passes == 0 && L.K >= 4096))) return few2<R, G, HB, ALT>(L, A, r0, y, PF);
  }
  few<R, G, HB, ALT>(L, A, r0, y, PF);
}

template <int G, int HB>
static void run_rows(const Layout& L, const Act& A, float* y, int64_t PF, int64_t wide, bool alt, bool amx,
                     int passes) {
#ifdef GGUF_AMX
  if (A.RQ > wide && amx) return many_amx<G, HB>(L, A, y);
#endif
  if (A.RQ > wide) return many<G, HB>(L, A, y);
  // passes of 4 rows, but 5 rows left (a speculative verification of k = 4) in one pass, and the LM
  // head's three levels in passes of 3 pairs where 3 are left (k = 2's 3 rows, 6 int8 rows): a second
  // pass for the last one row or pair read the whole weight again. The 1.5B's weights on the AMX Xeon
  // (benchmarks/gguf_wide_rows.py, 2026-12-07): 5 rows 0.62-0.95x the time of 4 + 1 (gate/up Q4_K
  // 0.61-0.68x), the Q6_K head at 3 rows 0.86x of 4 + 2; 6 rows in one pass (18 accumulators) ran
  // 0.97-1.24x the time of 4 + 2, so they keep two passes. A fixed rule, timed on that CPU only: the
  // single pass runs the same vpdpbusd and float steps per row and drops the second pass's weight
  // loads and unpacking, and 5 rows' 15 accumulators fit AVX-512's 32 registers on every CPU that
  // has it (6 rows' spill); the Zen 5 should time it at its next start there (gguf_wide_rows.py)
  if (alt) {  // three levels: rows in pairs (an int16 row, its rest's int8 row)
    for (int64_t r0 = 0; r0 < A.RQ;) {
      const int64_t left = A.RQ - r0;
      if (left == 6) { fewp<6, G, HB, true>(L, A, r0, y, PF, passes); r0 += 6; }
      else if (left >= 4) { fewp<4, G, HB, true>(L, A, r0, y, PF, passes); r0 += 4; }
      else { fewp<2, G, HB, true>(L, A, r0, y, PF, passes); r0 += 2; }
    }
    return;
  }
  for (int64_t r0 = 0; r0 < A.RQ;) {
    const int64_t left = A.RQ - r0;
    const int64_t n = left == 5 ? 5 : std::min<int64_t>(4, left);
    switch (n) {
      case 1: fewp<1, G, HB>(L, A, r0, y, PF, passes); break;
      case 2: fewp<2, G, HB>(L, A, r0, y, PF, passes); break;
      case 3: fewp<3, G, HB>(L, A, r0, y, PF, passes); break;
      case 5: fewp<5, G, HB>(L, A, r0, y, PF, passes); break;
      default: fewp<4, G, HB>(L, A, r0, y, PF, passes); break;
    }
    r0 += n;
  }
}
#endif  // GGUF_VNNI

@AVX2@

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

#ifdef GGUF_NATIVE
// the calling thread's activations, kept between calls. Reached through a call the compiler keeps:
// a thread_local named in matmul was propagated as a constant into the kernels it calls, and in a
// shared library every use of it then called __tls_get_addr (17-38 calls in the kernels' loops)
__attribute__((noinline)) static Act& thread_act() {
  static thread_local Act A;
  return A;
}
#endif

// x float32 or bfloat16 [R, K] -> y float32 [R, N]
torch::Tensor matmul(torch::Tensor x, torch::Tensor lo, torch::Tensor hi, torch::Tensor d, torch::Tensor sc,
                     torch::Tensor dm, torch::Tensor mn, int64_t N, int64_t G, int64_t S, int64_t HB, double z,
                     int64_t levels, int64_t prefetch, int64_t variant) {
  const Layout L = layout(lo, hi, d, sc, dm, mn, N, G, S, HB, z);
  const bool bf = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK((bf || x.scalar_type() == at::kFloat) && x.dim() == 2 && x.is_contiguous(),
              "gguf matmul: x float32 or bfloat16 [R, K] contiguous");
  TORCH_CHECK(x.size(1) == L.K, "gguf matmul: x has ", x.size(1), " channels, the weight ", L.K);
  TORCH_CHECK(levels >= 1 && levels <= 4, "gguf matmul: levels in 1..4");
  const int64_t R = x.size(0), per = (levels + 1) / 2, PF = std::max<int64_t>(0, prefetch);
  auto y = torch::empty({R * per, L.N}, x.options().dtype(at::kFloat));
#ifdef GGUF_NATIVE
  if (R == 0 || L.N == 0) return y.view({R, per, L.N}).sum(1);
  Act& A = thread_act();  // kept between calls (see quantize_act)
  // read once: another thread's gguf_wide_rows between the reads would leave the planes a kernel reads unbuilt
  const int64_t wide = g_wide_rows;
  // variant bit 0: the many-row kernel on AMX-INT8 tiles where allowed (gguf_amx), else AVX512-VNNI;
  // bits 1-2: the few-row kernel's passes (0 fewp's rule, 1 one panel a pass, 2 two; the same bits)
  const bool amx = g_amx && (variant & 1) && R * per > wide;
  const int passes = (int)((variant >> 1) & 3);
#ifdef GGUF_VNNI
  const bool packed = R * per > wide && !amx;  // the VNNI many-row kernel reads only the packed copy
#else
  const bool packed = false;
#endif
  const bool bytes = R * per <= wide;
  if (bf) quantize_act(x.data_ptr<at::BFloat16>(), R, L.K, G, levels, bytes, packed, A, amx);
  else quantize_act(x.data_ptr<float>(), R, L.K, G, levels, bytes, packed, A, amx);
  float* yp = y.data_ptr<float>();
#define GGUF_CASE(g, hb) if (G == g && HB == hb) { run_rows<g, hb>(L, A, yp, PF, wide, levels == 3, amx, passes); } else
  GGUF_CASE(32, 0) GGUF_CASE(32, 1) GGUF_CASE(32, 4) GGUF_CASE(16, 0) GGUF_CASE(16, 2) GGUF_CASE(16, 4)
  { TORCH_CHECK(false, "gguf matmul: no kernel for this layout"); }
#undef GGUF_CASE
#else
  TORCH_CHECK(false, "gguf matmul: built without AVX2 or AVX512-VNNI");
#endif
  return per > 1 ? y.view({R, per, L.N}).sum(1) : y;
}

#ifdef GGUF_NATIVE
// the effective weights of rows `rows` (int64 [M], or all rows when null) -> out [M, K] float32 or
// bfloat16, w = fma(q, s_g, m_g): a panel's group at a time, its rows 8 channels at a time
template <typename O>
static void dequant_any(const Layout& L, const int64_t* rows, int64_t M, O* out) {
  const int64_t G = L.G;
  auto one = [&](int64_t l, O* o, const uint8_t* q, const float* s, const float* m, int64_t g) {
    const __m256 sv = _mm256_set1_ps(s[l]), mv = _mm256_set1_ps(m[l]);
    for (int64_t u = 0; u < G / 8; ++u) {
      const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(q + l * G + 8 * u))));
      const __m256 w = _mm256_fmadd_ps(f, sv, mv);
      O* dst = o + g * G + 8 * u;
      if constexpr (std::is_same<O, float>::value) _mm256_storeu_ps(dst, w);
      else _mm_storeu_si128((__m128i*)dst, to_bf16_8(w));
    }
  };
  if (!rows) {
    at::parallel_for(0, L.NP, 1, [&](int64_t p0, int64_t p1) {
      alignas(64) uint8_t q[16 * 32];
      alignas(32) float s[16], m[16];
      for (int64_t p = p0; p < p1; ++p)
        for (int64_t g = 0; g < L.ng; ++g) {
          panel_group(L, p, g, q);
          scales_panel(L, p, g, s, m);
          for (int64_t l = 0; l < 16 && 16 * p + l < L.N; ++l) one(l, out + (16 * p + l) * L.K, q, s, m, g);
        }
    });
    return;
  }
  at::parallel_for(0, M, 4, [&](int64_t i0, int64_t i1) {
    alignas(64) uint8_t q[16 * 32];
    alignas(32) float s[16], m[16];
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t n = rows[i], p = n / 16, l = n % 16;
      for (int64_t g = 0; g < L.ng; ++g) {
        panel_group(L, p, g, q);
        scales_panel(L, p, g, s, m);
        one(l, out + i * L.K, q, s, m, g);
      }
    }
  });
}
#endif

void dequant(torch::Tensor lo, torch::Tensor hi, torch::Tensor d, torch::Tensor sc, torch::Tensor dm,
             torch::Tensor mn, int64_t N, int64_t G, int64_t S, int64_t HB, double z, torch::Tensor rows,
             bool all_rows, torch::Tensor out) {
#ifndef GGUF_NATIVE
  TORCH_CHECK(false, "gguf dequantize: built without AVX2 or AVX512-VNNI");
#else
  const Layout L = layout(lo, hi, d, sc, dm, mn, N, G, S, HB, z);
  TORCH_CHECK(out.is_contiguous() && out.dim() == 2 && out.size(1) == L.K, "gguf dequantize: out [M, K] contiguous");
  const int64_t M = out.size(0);
  TORCH_CHECK(all_rows ? M == L.N : (rows.scalar_type() == at::kLong && rows.is_contiguous() && rows.numel() == M),
              "gguf dequantize: rows int64 [M] contiguous");
  if (!all_rows && M == 0) return;  // no rows asked for (an empty tensor's data pointer is null: not "all")
  const int64_t* rp = all_rows ? nullptr : rows.data_ptr<int64_t>();
  if (rp)
    for (int64_t i = 0; i < M; ++i) TORCH_CHECK(rp[i] >= 0 && rp[i] < L.N, "gguf dequantize: row out of range");
  if (out.scalar_type() == at::kFloat) dequant_any(L, rp, M, out.data_ptr<float>());
  else if (out.scalar_type() == at::kBFloat16) dequant_any(L, rp, M, out.data_ptr<at::BFloat16>());
  else TORCH_CHECK(false, "gguf dequantize: out float32 or bfloat16");
#endif
}

TORCH_LIBRARY_FRAGMENT(mixserve, lib) {
  lib.def("gguf_matmul(Tensor x, Tensor lo, Tensor hi, Tensor d, Tensor sc, Tensor dm, Tensor mn, int N, int G, "
          "int S, int HB, float z, int levels=2, int prefetch=0, int variant=0) -> Tensor");
  lib.def("gguf_dequant(Tensor lo, Tensor hi, Tensor d, Tensor sc, Tensor dm, Tensor mn, int N, int G, int S, "
          "int HB, float z, Tensor rows, bool all_rows, Tensor(a!) out) -> ()");
  lib.def("gguf_wide_rows(int n) -> int", &wide_rows);  // no tensor to dispatch on: one kernel for all
  lib.def("gguf_amx(int n) -> int", &amx);
}
TORCH_LIBRARY_IMPL(mixserve, CPU, lib) {
  lib.impl("gguf_matmul", &matmul);
  lib.impl("gguf_dequant", &dequant);
}
"""

# The AVX2 variant (issue 43): the same layout, integers and float order on 8-lane halves of a panel.
# AVX2 has no vpdpbusd: the few-row kernel multiplies each byte plane with vpmaddubsw (u8 x s8 pairs
# into int16: below 32,767 for q < 64; Q8_0's 8-bit q runs as its two nibbles, 16 * hi + lo, summed
# in int32) and vpmaddwd; the many-row kernel multiplies the int16 tile by the int16 activations with
# vpmaddwd. Both give the exact group sums, so the same bits as the VNNI variant.
AVX2_SRC = r"""
#ifdef GGUF_AVX2
static inline __m256 h8(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }

// lanes 8h .. 8h + 7 of panel p's s_g and m_g
static inline void scales8(const Layout& L, int64_t p, int64_t g, int h, __m256& s, __m256& m) {
  const int64_t sb = g >> L.sbs;
  const __m256 d = h8(L.d + (p * L.nsb + sb) * 16 + 8 * h);
  s = L.sc ? _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                 _mm_loadl_epi64((const __m128i*)(L.sc + (p * L.ng + g) * 16 + 8 * h))))) : d;
  if (L.dm) {
    const __m256 dm = h8(L.dm + (p * L.nsb + sb) * 16 + 8 * h);
    m = L.mn ? _mm256_mul_ps(dm, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                   _mm_loadl_epi64((const __m128i*)(L.mn + (p * L.ng + g) * 16 + 8 * h))))) : dm;
  } else {
    m = _mm256_setzero_ps();
  }
}

static inline __m256i shift16x(__m256i v, int s) {
  return s >= 0 ? _mm256_sll_epi16(v, _mm_cvtsi32_si128(s)) : _mm256_srl_epi16(v, _mm_cvtsi32_si128(-s));
}

// half h of steps j and j + G/8: the low 4 bits (qa, qb) and the bits above (ha, hb: HB 4, the high
// nibble; HB 1, 2: already shifted into bits 4-5 and or-ed into qa, qb)
template <int G, int HB>
static inline void unpack8(const uint8_t* lg, const uint8_t* hg, __m256i hv, int64_t j, int h, __m256i& qa,
                           __m256i& qb, __m256i& ha, __m256i& hb) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i v = _mm256_loadu_si256((const __m256i*)(lg + j * 64 + 32 * h));
  qa = _mm256_and_si256(v, low);
  qb = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
  if constexpr (HB == 4) {
    const __m256i t = _mm256_loadu_si256((const __m256i*)(hg + j * 64 + 32 * h));
    ha = _mm256_and_si256(t, low);
    hb = _mm256_and_si256(_mm256_srli_epi16(t, 4), low);
  } else if constexpr (HB > 0) {
    const __m256i mk = _mm256_set1_epi8(HB == 1 ? 0x10 : 0x30);
    qa = _mm256_or_si256(qa, _mm256_and_si256(shift16x(hv, 4 - HB * (int)j), mk));
    qb = _mm256_or_si256(qb, _mm256_and_si256(shift16x(hv, 4 - HB * (int)(j + G / 8)), mk));
  }
}

static inline __m256i bcast4x(const void* p) { int32_t u; std::memcpy(&u, p, 4); return _mm256_set1_epi32(u); }

// How many vpmaddubsw outputs add up in int16 without overflow: each is two products q * x with
// |x| <= 128 (x1 in [-127, 127], x2 in [-128, 127]), so n * 2 * qmax * 128 <= 32767: 8 for q < 16
// (the 4-bit types, and Q8_0's two nibbles), 4 for Q5_0's q < 32, 2 for Q6_K's q < 64. A single
// output never saturates (2 * 63 * 128 = 16128).
template <int HB>
constexpr int cap16() { return HB == 1 ? 4 : (HB == 2 ? 2 : 8); }

// A group's float step for one row and half panel, in the float order written at the top: the offset
// term (fma(m_g, xs_g), the types with one) or the zero point out of the integer sum (z * sum of x16),
// then fma(float(isum), s_g * e). Both few-row paths below end a group with it.
static inline __m256 group_step(__m256 acc, __m256i is, __m256 s, __m256 m, bool off, int32_t z, int32_t gs,
                                float xs, float e) {
  if (!off) is = _mm256_sub_epi32(is, _mm256_set1_epi32(z * gs));
  else acc = _mm256_fmadd_ps(m, _mm256_set1_ps(xs), acc);
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(is), _mm256_mul_ps(s, _mm256_set1_ps(e)), acc);
}

// The few-row kernel: per group and half panel, the exact integer sum 256 * sum(q * x1) + sum(q * x2)
// (Q8_0: q = 16 * hi + lo). vpmaddubsw's int16 outputs are summed in int16 up to cap16 of them, then
// widened once with vpmaddwd against 256 or 1 (4096 or 16 for Q8_0's high nibble): a quarter of the
// vpmaddwd of widening every output (a few-row step runs at the instruction rate, not memory's,
// BENCHMARKS "fewer instructions per weight"). The integers are the same, so the same bits.
template <int R, int G, int HB, bool ALT = false>  // ALT: as the VNNI variant's few()
static void few(const Layout& L, const Act& A, int64_t r0, float* y, int64_t PF) {
  const int64_t K = L.K, ng = L.ng, nk = K / 32;
  constexpr int JF = cap16<HB>() / 2;  // step pairs per int16 sum (two outputs a pair and level)
  at::parallel_for(0, L.NP, 4, [&](int64_t p0, int64_t p1) {
    // locals, not reads through L and A: through the references the compiler reloaded every field and
    // recomputed every row's address at each group (scalar work that outran the vector work at G = 16)
    const Layout M = L;
    const bool off = M.dm != nullptr;
    const int8_t* X1[R];
    const int8_t* X2[R];
    const float* E[R];
    const float* XS[R];
    const int32_t* GS[R];
    for (int r = 0; r < R; ++r) {
      X1[r] = A.x1.data() + (r0 + r) * K;
      X2[r] = A.x2.data() + (r0 + r) * K;
      E[r] = A.e.data() + (r0 + r) * nk;
      XS[r] = A.xs.data() + (r0 + r) * ng;
      GS[r] = A.gs.data() + (r0 + r) * ng;
    }
    const __m256i k1 = _mm256_set1_epi16(1), k256 = _mm256_set1_epi16(256);
    const __m256i k16 = _mm256_set1_epi16(16), k4096 = _mm256_set1_epi16(4096);
    for (int64_t p = p0; p < p1; ++p) {
      const uint8_t* lo = M.lo + p * M.lpp;
      const uint8_t* hi = HB ? M.hi + p * M.hpp : nullptr;
      __m256 acc[R][2];
      for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
      for (int64_t g = 0; g < ng; ++g) {
        const uint8_t* lg = lo + g * (G / 8) * 64;
        const uint8_t* hg = HB == 4 ? hi + g * (G / 8) * 64 : (HB ? hi + g * 64 : nullptr);
        if (PF) _mm_prefetch((const char*)(lg + PF * 64), _MM_HINT_T0);
        const int64_t c0 = g * G;
        if constexpr (R == 1 && HB != 4 && !ALT) {
          // one row: both halves of a step pair under one set of broadcasts (the same integers, so
          // the same bits; a quarter fewer instructions than a half at a time)
          const __m256i hv0 = (HB == 1 || HB == 2) ? _mm256_loadu_si256((const __m256i*)hg) : _mm256_setzero_si256();
          const __m256i hv1 = (HB == 1 || HB == 2) ? _mm256_loadu_si256((const __m256i*)(hg + 32)) : _mm256_setzero_si256();
          const int8_t* x1 = X1[0] + c0;
          const int8_t* x2 = X2[0] + c0;
          __m256i is0 = _mm256_setzero_si256(), is1 = _mm256_setzero_si256();
#pragma GCC unroll 4
          for (int64_t j0 = 0; j0 < G / 8; j0 += JF) {
            __m256i a1 = _mm256_setzero_si256(), a2 = a1, b1 = a1, b2 = a1;  // half 0 / 1, level 1 / 2
#pragma GCC unroll 4
            for (int64_t j = j0; j < j0 + JF; ++j) {
              const __m256i u = bcast4x(x1 + 4 * j), v = bcast4x(x1 + 4 * (j + G / 8));
              const __m256i u2 = bcast4x(x2 + 4 * j), v2 = bcast4x(x2 + 4 * (j + G / 8));
              __m256i qa, qb, ha, hb;
              unpack8<G, HB>(lg, hg, hv0, j, 0, qa, qb, ha, hb);
              a1 = _mm256_add_epi16(a1, _mm256_add_epi16(_mm256_maddubs_epi16(qa, u), _mm256_maddubs_epi16(qb, v)));
              a2 = _mm256_add_epi16(a2, _mm256_add_epi16(_mm256_maddubs_epi16(qa, u2), _mm256_maddubs_epi16(qb, v2)));
              unpack8<G, HB>(lg, hg, hv1, j, 1, qa, qb, ha, hb);
              b1 = _mm256_add_epi16(b1, _mm256_add_epi16(_mm256_maddubs_epi16(qa, u), _mm256_maddubs_epi16(qb, v)));
              b2 = _mm256_add_epi16(b2, _mm256_add_epi16(_mm256_maddubs_epi16(qa, u2), _mm256_maddubs_epi16(qb, v2)));
            }
            is0 = _mm256_add_epi32(is0, _mm256_add_epi32(_mm256_madd_epi16(a1, k256), _mm256_madd_epi16(a2, k1)));
            is1 = _mm256_add_epi32(is1, _mm256_add_epi32(_mm256_madd_epi16(b1, k256), _mm256_madd_epi16(b2, k1)));
          }
          const __m256i isv[2] = {is0, is1};
          for (int h = 0; h < 2; ++h) {
            __m256 s, m;
            scales8(M, p, g, h, s, m);
            acc[0][h] = group_step(acc[0][h], isv[h], s, m, off, M.z, GS[0][g], XS[0][g], E[0][c0 / 32]);
          }
          continue;
        }
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          const __m256i hv = (HB == 1 || HB == 2) ? _mm256_loadu_si256((const __m256i*)(hg + 32 * h))
                                                  : _mm256_setzero_si256();
          __m256i is[R];
          for (int r = 0; r < R; ++r) is[r] = _mm256_setzero_si256();
#pragma GCC unroll 4
          for (int64_t j0 = 0; j0 < G / 8; j0 += JF) {
            __m256i s1[R], s2[R], t1[R], t2[R];  // int16 sums per level (t: Q8_0's high nibbles)
            for (int r = 0; r < R; ++r) s1[r] = s2[r] = t1[r] = t2[r] = _mm256_setzero_si256();
#pragma GCC unroll 4
            for (int64_t j = j0; j < j0 + JF; ++j) {
              __m256i qa, qb, ha = _mm256_setzero_si256(), hb = _mm256_setzero_si256();
              unpack8<G, HB>(lg, hg, hv, j, h, qa, qb, ha, hb);
#pragma GCC unroll 4
              for (int r = 0; r < R; ++r) {
                const int8_t* x1 = X1[r] + c0;
                const int8_t* x2 = X2[r] + c0;
                const __m256i u = bcast4x(x1 + 4 * j), v = bcast4x(x1 + 4 * (j + G / 8));
                s1[r] = _mm256_add_epi16(s1[r], _mm256_add_epi16(_mm256_maddubs_epi16(qa, u), _mm256_maddubs_epi16(qb, v)));
                if constexpr (HB == 4)
                  t1[r] = _mm256_add_epi16(t1[r], _mm256_add_epi16(_mm256_maddubs_epi16(ha, u), _mm256_maddubs_epi16(hb, v)));
                if (!ALT || r % 2 == 0) {
                  const __m256i u2 = bcast4x(x2 + 4 * j), v2 = bcast4x(x2 + 4 * (j + G / 8));
                  s2[r] = _mm256_add_epi16(s2[r], _mm256_add_epi16(_mm256_maddubs_epi16(qa, u2), _mm256_maddubs_epi16(qb, v2)));
                  if constexpr (HB == 4)
                    t2[r] = _mm256_add_epi16(t2[r], _mm256_add_epi16(_mm256_maddubs_epi16(ha, u2), _mm256_maddubs_epi16(hb, v2)));
                }
              }
            }
            for (int r = 0; r < R; ++r) {
              is[r] = _mm256_add_epi32(is[r], _mm256_madd_epi16(s1[r], k256));
              if (!ALT || r % 2 == 0) is[r] = _mm256_add_epi32(is[r], _mm256_madd_epi16(s2[r], k1));
              if constexpr (HB == 4) {
                is[r] = _mm256_add_epi32(is[r], _mm256_madd_epi16(t1[r], k4096));
                if (!ALT || r % 2 == 0) is[r] = _mm256_add_epi32(is[r], _mm256_madd_epi16(t2[r], k16));
              }
            }
          }
          __m256 s, m;
          scales8(M, p, g, h, s, m);
          for (int r = 0; r < R; ++r)
            acc[r][h] = group_step(acc[r][h], is[r], s, m, off, M.z, GS[r][g], XS[r][g], E[r][c0 / 32]);
        }
      }
      const int64_t left = M.N - 16 * p;
      for (int r = 0; r < R; ++r) {
        float* o = y + (r0 + r) * M.N + 16 * p;
        if (left >= 16) {
          _mm256_storeu_ps(o, acc[r][0]);
          _mm256_storeu_ps(o + 8, acc[r][1]);
        } else {
          alignas(32) float t[16];
          _mm256_store_ps(t, acc[r][0]);
          _mm256_store_ps(t + 8, acc[r][1]);
          std::memcpy(o, t, 4 * left);
        }
      }
    }
  });
}

// per panel, the same int16 tile as the VNNI variant's (lanes 0-15 of each channel pair), less z:
// each step's unsigned bytes (panel_steps) widened to its two channel pairs, 8 lanes at a time
static inline void widen8(__m256i q, __m256i zz, __m256i& p01, __m256i& p23) {
  const __m256i b0 = _mm256_set1_epi32(0xFF), b1 = _mm256_set1_epi32(0xFF00);
  const __m256i u = _mm256_srli_epi32(q, 16);
  p01 = _mm256_sub_epi16(_mm256_or_si256(_mm256_and_si256(q, b0), _mm256_slli_epi32(_mm256_and_si256(q, b1), 8)), zz);
  p23 = _mm256_sub_epi16(_mm256_or_si256(_mm256_and_si256(u, b0), _mm256_slli_epi32(_mm256_and_si256(u, b1), 8)), zz);
}

template <int G, int HB>
static void fill_tile(const Layout& L, Tile& T, int64_t p0, int64_t np, int64_t g0, int64_t g1) {
  const int64_t nbg = g1 - g0, ws = nbg * (G / 2) * 16;
  const __m256i zz = _mm256_set1_epi16((short)L.z);
  alignas(64) uint8_t st[8 * 64];
  for (int64_t i = 0; i < np; ++i) {
    const int64_t p = p0 + i;
    int32_t* W = T.W.data() + i * ws;
    for (int64_t g = g0; g < g1; ++g) {
      panel_steps(L, p, g, st);
      for (int64_t s = 0; s < G / 4; ++s) {
        const int64_t t = ((g - g0) * G + 4 * s) / 2;
        for (int half = 0; half < 2; ++half) {
          __m256i p01, p23;
          widen8(_mm256_load_si256((const __m256i*)(st + s * 64 + 32 * half)), zz, p01, p23);
          _mm256_storeu_si256((__m256i*)(W + t * 16 + 8 * half), p01);
          _mm256_storeu_si256((__m256i*)(W + (t + 1) * 16 + 8 * half), p23);
        }
      }
      for (int h = 0; h < 2; ++h) {
        __m256 s, m;
        scales8(L, p, g, h, s, m);
        _mm256_storeu_ps(T.S.data() + (i * nbg + g - g0) * 16 + 8 * h, s);
        _mm256_storeu_ps(T.M.data() + (i * nbg + g - g0) * 16 + 8 * h, m);
      }
    }
  }
}

template <int MR, int G>
static inline void micro(const Layout& L, const Tile& T, int64_t i, const Act& A, int64_t r0, float* y, int64_t p,
                         int64_t g0, int64_t g1) {
  const int64_t K = L.K, ng = L.ng, nk = K / 32, nbg = g1 - g0, ws = nbg * (G / 2) * 16;
  const bool off = L.dm != nullptr;
  const int64_t left = std::min<int64_t>(16, L.N - 16 * p);
  __m256 F[MR][2];
  for (int r = 0; r < MR; ++r) {
    if (g0 == 0) {
      F[r][0] = F[r][1] = _mm256_setzero_ps();
    } else {
      alignas(32) float t[16] = {0};
      std::memcpy(t, y + (r0 + r) * L.N + 16 * p, 4 * left);
      F[r][0] = _mm256_load_ps(t);
      F[r][1] = _mm256_load_ps(t + 8);
    }
  }
  const int32_t* W = T.W.data() + i * ws;
  for (int64_t g = g0; g < g1; ++g) {
    __m256i I[MR][2];
    for (int r = 0; r < MR; ++r) I[r][0] = I[r][1] = _mm256_setzero_si256();
    const int32_t* wg = W + (g - g0) * (G / 2) * 16;
#pragma GCC unroll 16
    for (int t = 0; t < G / 2; ++t) {
      const __m256i w0 = _mm256_loadu_si256((const __m256i*)(wg + t * 16));
      const __m256i w1 = _mm256_loadu_si256((const __m256i*)(wg + t * 16 + 8));
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) {
        const __m256i xb = bcast4x(A.x16.data() + (r0 + r) * K + g * G + 2 * t);
        I[r][0] = _mm256_add_epi32(I[r][0], _mm256_madd_epi16(w0, xb));
        I[r][1] = _mm256_add_epi32(I[r][1], _mm256_madd_epi16(w1, xb));
        // the sums in registers, added in this order: integer adds reassociate, and GCC made the
        // unrolled loop one tree of 96 products, most of them spilled to the stack and read back
        asm("" : "+x"(I[r][0]), "+x"(I[r][1]));
      }
    }
    for (int r = 0; r < MR; ++r) {
      const int64_t row = r0 + r;
      const __m256 ev = _mm256_set1_ps(A.e[row * nk + g * G / 32]);
      const __m256 xv = _mm256_set1_ps(A.xs[row * ng + g]);
      for (int h = 0; h < 2; ++h) {
        const int64_t at = (i * nbg + g - g0) * 16 + 8 * h;
        if (off) F[r][h] = _mm256_fmadd_ps(_mm256_loadu_ps(T.M.data() + at), xv, F[r][h]);
        F[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(I[r][h]), _mm256_mul_ps(_mm256_loadu_ps(T.S.data() + at), ev),
                                  F[r][h]);
      }
    }
  }
  for (int r = 0; r < MR; ++r) {
    alignas(32) float t[16];
    _mm256_store_ps(t, F[r][0]);
    _mm256_store_ps(t + 8, F[r][1]);
    std::memcpy(y + (r0 + r) * L.N + 16 * p, t, 4 * left);
  }
}

template <int G, int HB>
static void many(const Layout& L, const Act& A, float* y) {
  over_tiles(L, A.RQ, [&](Tile& T, int64_t p0, int64_t np, int64_t g0, int64_t g1) { fill_tile<G, HB>(L, T, p0, np, g0, g1); },
    [&](Tile& T, int64_t p0, int64_t np, int64_t g0, int64_t g1, int64_t q0, int64_t q1) {
      constexpr int MR = 3;
      for (int64_t r0 = q0; r0 < q1; r0 += MR) {
        const int64_t rr = std::min<int64_t>(MR, q1 - r0);
        for (int64_t i = 0; i < np; ++i) {
          if (rr == 1) micro<1, G>(L, T, i, A, r0, y, p0 + i, g0, g1);
          else if (rr == 2) micro<2, G>(L, T, i, A, r0, y, p0 + i, g0, g1);
          else micro<3, G>(L, T, i, A, r0, y, p0 + i, g0, g1);
        }
      }
    });
}

template <int G, int HB>
static void run_rows(const Layout& L, const Act& A, float* y, int64_t PF, int64_t wide, bool alt, bool, int) {
  if (A.RQ > std::min<int64_t>(wide, 4)) return many<G, HB>(L, A, y);
  for (int64_t r0 = 0; r0 < A.RQ; r0 += 2) {
    if (alt) few<2, G, HB, true>(L, A, r0, y, PF);  // RQ is even: pairs of an int16 row and an int8 row
    else if (A.RQ - r0 >= 2) few<2, G, HB>(L, A, r0, y, PF);
    else few<1, G, HB>(L, A, r0, y, PF);
  }
}
#endif  // GGUF_AVX2
"""
