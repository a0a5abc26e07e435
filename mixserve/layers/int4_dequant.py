"""Dequantizing a weight held in PyTorch's CPU int4 layout, for the large-row (prefill) path.

PyTorch ships the int4 matmul for few rows but no fast way back to a dense weight, and a chain of
eager ops (unpack, transpose, convert, scale) costs more than the bf16 GEMM it feeds at 512 rows
(benchmarks/kernel_choices.py --int4). This is one pass over the packed bytes in C++ (compiled once with
torch.utils.cpp_extension and cached; without a compiler the eager chain in linear.py is used).

Layout read (found by probing `_convert_weight_to_int4pack_for_cpu`; tests/unit/test_quant.py
checks it): rows in blocks of B store rows r and r + B / 2 of a block as the low and high nibble of
byte [k, r]; the remaining rows (a multiple of 16) form one block whose rows 2j and 2j + 1 are the
low and high nibble of byte [k, j]. Output w[n, k] = (q - 8) * scale[n, k / g] + zero[n, k / g].
B follows the vector width PyTorch dispatches to (64 with AVX-512, 32 with AVX2), so it is probed
(`int4pack_block`); the C++ below reads B = 64, and other machines take the eager path.
"""
from __future__ import annotations

import functools
import threading

import torch

from mixserve.layers.cpp_build import build_extension

_SRC = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cstring>
#include <vector>

// float -> bfloat16 by round-to-nearest-even on the bits: a branch-free form the compiler
// vectorizes (c10::BFloat16's constructor checks for NaN per element, which it does not);
// dequantized weights are finite
static inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
static inline void put(float v, float* o) { *o = v; }
static inline void put(float v, uint16_t* o) { *o = to_bf16(v); }

// S: stored scale/zero type (float or bf16 bits read via c10), O: float or uint16_t (bf16 bits)
template <typename S, typename O>
static void run(const uint8_t* p, const S* sc, const S* zp, O* out, int64_t n, int64_t k, int64_t g) {
  const int64_t n64 = n / 64, ng = k / g;
  at::parallel_for(0, n64 + 1, 1, [&](int64_t b0, int64_t b1) {
    std::vector<uint8_t> tb;
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t rows = b < n64 ? 64 : n - n64 * 64, half = rows / 2, base = b * 64;
      if (rows == 0) continue;
      const uint8_t* blk = p + base * k / 2;
      // transpose the block's bytes to [half][k] so the inner loop reads and writes contiguously
      tb.resize(half * k);
      for (int64_t kk = 0; kk < k; ++kk)
        for (int64_t j = 0; j < half; ++j) tb[j * k + kk] = blk[kk * half + j];
      for (int64_t j = 0; j < half; ++j) {
        // main blocks: row j low nibble, row j + 32 high; tail: rows 2j and 2j + 1
        const int64_t r0 = b < n64 ? base + j : base + 2 * j;
        const int64_t r1 = b < n64 ? base + j + 32 : base + 2 * j + 1;
        O* __restrict o0 = out + r0 * k; O* __restrict o1 = out + r1 * k;
        const S* s0 = sc + r0 * ng; const S* s1 = sc + r1 * ng;
        const S* z0 = zp + r0 * ng; const S* z1 = zp + r1 * ng;
        const uint8_t* __restrict row = tb.data() + j * k;
        for (int64_t gi = 0; gi < ng; ++gi) {
          const float a0 = (float)s0[gi], c0 = (float)z0[gi] - 8.f * a0;
          const float a1 = (float)s1[gi], c1 = (float)z1[gi] - 8.f * a1;
          const int64_t e = (gi + 1) * g;
#pragma omp simd
          for (int64_t kk = gi * g; kk < e; ++kk) {
            const uint8_t v = row[kk];
            put((float)(v & 15) * a0 + c0, o0 + kk);
            put((float)(v >> 4) * a1 + c1, o1 + kk);
          }
        }
      }
    }
  });
}

// The transposed form, out[k][n] (the weight as [in, out]), for the many-row GEMM: a 64-row block
// stores both nibbles of its rows side by side per input channel, so each channel's 64 outputs are one
// contiguous run and the loop vectorizes without a byte transpose (a GEMM reads W^T as fast as W).
// Non-temporal stores: the weight goes to memory without its lines being read first (write-allocate)
// and without evicting the activations the next elementwise ops read; the GEMM then reads it from
// memory as the bf16 path reads its own weight (a 512-token int4 prefill of the 0.5B went from 0.89x
// to 0.92-0.93x bf16 with them). They need `out` 64-byte aligned, checked below.
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
static inline void store16(float* o, __m512 v) { _mm512_stream_ps(o, v); }
static inline void store16(uint16_t* o, __m512 v) {
#if defined(__AVX512BF16__)
  _mm256_stream_si256((__m256i*)o, (__m256i)_mm512_cvtneps_pbh(v));
#else
  __m512i u = _mm512_castps_si512(v);
  u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF),
                                           _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
  _mm256_stream_si256((__m256i*)o, _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
#endif
}
#endif

template <typename S, typename O>
static void run_kn(const uint8_t* p, const S* sc, const S* zp, O* out, int64_t n, int64_t k, int64_t g) {
  const int64_t n64 = n / 64, nt = n - n64 * 64, ng = k / g;
  at::parallel_for(0, (k + 31) / 32, 1, [&](int64_t t0, int64_t t1) {
    // one group's scale and offset for every output row, gathered when the tile's group changes
    // (a tile of 32 channels lies in one group: g is a multiple of 32)
    std::vector<float> sf(n), mf(n);
    int64_t cur = -1;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t k0 = t * 32, k1 = std::min<int64_t>(k, k0 + 32);
      if (k0 / g != cur) {
        cur = k0 / g;
        for (int64_t r = 0; r < n; ++r) {
          const float a = (float)sc[r * ng + cur];
          sf[r] = a;
          mf[r] = (float)zp[r * ng + cur] - 8.f * a;
        }
      }
      for (int64_t b = 0; b < n64; ++b) {
        const uint8_t* blk = p + b * 64 * k / 2;
        const float* s = sf.data() + b * 64; const float* m = mf.data() + b * 64;
        for (int64_t kk = k0; kk < k1; ++kk) {
          const uint8_t* src = blk + kk * 32;
          O* o = out + kk * n + b * 64;
#if defined(__AVX512F__) && defined(__AVX512BW__)
          const __m256i v = _mm256_loadu_si256((const __m256i*)src);
          const __m256i lo = _mm256_and_si256(v, _mm256_set1_epi8(15));
          const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(15));
          const __m128i part[4] = {_mm256_castsi256_si128(lo), _mm256_extracti128_si256(lo, 1),
                                   _mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1)};
          for (int i = 0; i < 4; ++i) {
            const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(part[i]));
            store16(o + 16 * i, _mm512_fmadd_ps(q, _mm512_loadu_ps(s + 16 * i), _mm512_loadu_ps(m + 16 * i)));
          }
#else
          for (int j = 0; j < 32; ++j) {
            put((float)(src[j] & 15) * s[j] + m[j], o + j);
            put((float)(src[j] >> 4) * s[32 + j] + m[32 + j], o + 32 + j);
          }
#endif
        }
      }
      if (nt) {  // tail block: rows 2j and 2j + 1 are the low and high nibble of byte [k, j]
        const uint8_t* blk = p + n64 * 64 * k / 2;
        const int64_t base = n64 * 64;
        const float* s = sf.data() + base; const float* m = mf.data() + base;
        for (int64_t kk = k0; kk < k1; ++kk) {
          O* o = out + kk * n + base;
          for (int64_t j = 0; j < nt / 2; ++j) {
            const uint8_t v = blk[kk * (nt / 2) + j];
            put((float)(v & 15) * s[2 * j] + m[2 * j], o + 2 * j);
            put((float)(v >> 4) * s[2 * j + 1] + m[2 * j + 1], o + 2 * j + 1);
          }
        }
      }
    }
#if defined(__AVX512F__) && defined(__AVX512BW__)
    _mm_sfence();
#endif
  });
}

torch::Tensor dequant_kn(torch::Tensor packed, torch::Tensor scales, torch::Tensor zeros, torch::Tensor out,
                         int64_t n, int64_t k, int64_t g) {
  TORCH_CHECK(g % 32 == 0 && k % g == 0, "dequant_kn: group size must divide k and be a multiple of 32");
  TORCH_CHECK(out.scalar_type() == scales.scalar_type(), "dequant_kn: out in the scales' dtype");
  TORCH_CHECK(n % 16 == 0 && (reinterpret_cast<uintptr_t>(out.data_ptr()) & 63) == 0,
              "dequant_kn: out must be 64-byte aligned and n a multiple of 16 (streaming stores)");
  if (scales.scalar_type() == at::kBFloat16) {
    run_kn<at::BFloat16, uint16_t>(packed.data_ptr<uint8_t>(), scales.data_ptr<at::BFloat16>(),
                                   zeros.data_ptr<at::BFloat16>(),
                                   reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), n, k, g);
  } else {
    run_kn<float, float>(packed.data_ptr<uint8_t>(), scales.data_ptr<float>(), zeros.data_ptr<float>(),
                         out.data_ptr<float>(), n, k, g);
  }
  return out;
}

// writes into `out` (n * k elements of scales' dtype): the caller reuses one buffer, since a
// fresh allocation this large is mmap-ed and its page faults cost more than the dequantization
torch::Tensor dequant(torch::Tensor packed, torch::Tensor scales, torch::Tensor zeros, torch::Tensor out, int64_t n,
                      int64_t k, int64_t g) {
  if (scales.scalar_type() == at::kBFloat16) {
    run<at::BFloat16, uint16_t>(packed.data_ptr<uint8_t>(), scales.data_ptr<at::BFloat16>(),
                                zeros.data_ptr<at::BFloat16>(), reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()),
                                n, k, g);
  } else {
    run<float, float>(packed.data_ptr<uint8_t>(), scales.data_ptr<float>(), zeros.data_ptr<float>(),
                      out.data_ptr<float>(), n, k, g);
  }
  return out;
}
"""

def _unpack_int4pack_cpu(packed: torch.Tensor, n: int, k: int, block: int | None = None) -> torch.Tensor:
    """Integers [n, k] (uint8, 0..15) from `_convert_weight_to_int4pack_for_cpu`'s layout, found by
    probing it (tests/unit/test_quant.py checks it against the kernel): rows in blocks of `block`
    (int4pack_block(): 64 where PyTorch's CPU kernels are built for AVX-512, 32 for AVX2) store row
    r and r + block / 2 of a block as the low and high nibble of byte [k, r]; a tail of 16-row
    blocks stores rows 2j and 2j + 1 as the low and high nibble of byte [k, j]."""
    b = block or int4pack_block()
    flat = packed.reshape(-1)
    nb = n // b
    main = flat[: nb * b * k // 2].view(nb, k, b // 2)
    parts = [torch.cat([main & 15, main >> 4], -1).permute(0, 2, 1).reshape(nb * b, k)]
    nt = n - nb * b
    if nt:
        tail = flat[nb * b * k // 2:].view(k, nt // 2)
        parts.append(torch.stack([tail & 15, tail >> 4], -1).reshape(k, nt).t())
    return torch.cat(parts) if len(parts) > 1 else parts[0]


@functools.cache
def int4pack_block() -> int:
    """Rows per block of PyTorch's CPU int4 layout on this machine, found by packing a known
    matrix: the layout follows the vector width PyTorch dispatches to (4 x floats per vector: 64
    with AVX-512, 32 with AVX2), so it is read off the kernel, never assumed.
    Raises RuntimeError when no candidate reproduces the matrix (a layout this code does not know)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (80, 64), generator=g, dtype=torch.int32)  # 80 = blocks + a 16-row tail
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    for b in (64, 32, 16, 128):
        if torch.equal(_unpack_int4pack_cpu(packed, 80, 64, b).to(torch.int32), q):
            return b
    raise RuntimeError("PyTorch's CPU int4 weight layout is not one this code reads (blocks of 16-128 rows)")


def _load():
    return build_extension("mixserve_int4_dequant_v7", _SRC, ["dequant", "dequant_kn"])


_local = threading.local()


def scratch(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A flat buffer of at least `numel` elements, shared by every caller on this thread and
    overwritten by the next call: for a weight consumed at once (layers run one after another on
    the engine's thread). Reusing it saves the page faults of a fresh multi-MB allocation each
    call, which (probed once, for the 1.5B's fused gate/up) cost more than the dequantization itself."""
    bufs = _local.__dict__.setdefault("bufs", {})
    buf = bufs.get(dtype)
    if buf is None or buf.numel() < numel:
        buf = bufs[dtype] = torch.empty(numel, dtype=dtype)
    return buf[:numel]


def dequantize_int4pack(packed: torch.Tensor, scale_rows: torch.Tensor, zero_rows: torch.Tensor, n: int, k: int,
                        group_size: int, out: torch.Tensor | None = None,
                        transposed: bool = False) -> torch.Tensor | None:
    """Dense [n, k] weight in scale_rows' dtype (float32 or bfloat16) from the kernel's packed
    uint8 weight and [n, k / group_size] scales and zeros (zero = (8 - z) * scale), written into
    `out` (contiguous, n * k elements of that dtype) or a new tensor; None when the compiled
    kernel is unavailable or PyTorch's layout here is not the 64-row one it reads (the caller
    falls back to eager ops).

    transposed=True writes W^T instead, [k, n] contiguous: the layout's 64-row blocks hold each
    input channel's 64 outputs side by side, so this form is written with contiguous (non-temporal)
    vector stores, for the many-row GEMM, which reads W^T as fast as W; `out` must then be 64-byte
    aligned, as PyTorch's CPU allocations are (RuntimeError otherwise)."""
    mod = _load()
    # the C++ reads the 64-row blocks of PyTorch's AVX-512 build; other layouts take the eager path
    if mod is None or scale_rows.dtype not in (torch.float32, torch.bfloat16) or int4pack_block() != 64:
        return None
    shape = (k, n) if transposed else (n, k)
    if out is None:
        out = torch.empty(shape, dtype=scale_rows.dtype)
    elif out.numel() != n * k or out.dtype != scale_rows.dtype or not out.is_contiguous():
        raise ValueError(f"out: needs {n * k} contiguous {scale_rows.dtype} elements")
    fn = mod.dequant_kn if transposed else mod.dequant
    fn(packed.contiguous(), scale_rows.contiguous(), zero_rows.contiguous(), out, n, k, group_size)
    return out.view(shape)
