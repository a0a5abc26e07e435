"""Dequantizing a weight held in PyTorch's CPU int4 layout, for the large-row (prefill) path.

PyTorch ships the int4 matmul for few rows but no fast way back to a dense weight, and a chain of
eager ops (unpack, transpose, convert, scale) costs more than the bf16 GEMM it feeds at 512 rows
(benchmarks/kernels.py --int4). This is one pass over the packed bytes in C++ (compiled once with
torch.utils.cpp_extension and cached; without a compiler the eager chain in linear.py is used).

Layout read (found by probing `_convert_weight_to_int4pack_for_cpu`; tests/unit/test_quant.py
checks it): rows in blocks of 64 store rows r and r + 32 of a block as the low and high nibble of
byte [k, r]; the remaining rows (a multiple of 16) form one block whose rows 2j and 2j + 1 are the
low and high nibble of byte [k, j]. Output w[n, k] = (q - 8) * scale[n, k / g] + zero[n, k / g].
"""
from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger("mixserve")

_SRC = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <vector>

template <typename T>
static void run(const uint8_t* p, const T* sc, const T* zp, T* out, int64_t n, int64_t k, int64_t g) {
  const int64_t n64 = n / 64, ng = k / g;
  at::parallel_for(0, n64 + 1, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t rows = b < n64 ? 64 : n - n64 * 64, half = rows / 2, base = b * 64;
      if (rows == 0) continue;
      const uint8_t* blk = p + base * k / 2;
      // transpose the block's bytes to [half][k] so the inner loop reads and writes contiguously
      std::vector<uint8_t> tb(half * k);
      for (int64_t kk = 0; kk < k; ++kk)
        for (int64_t j = 0; j < half; ++j) tb[j * k + kk] = blk[kk * half + j];
      for (int64_t j = 0; j < half; ++j) {
        // main blocks: row j low nibble, row j + 32 high; tail: rows 2j and 2j + 1
        const int64_t r0 = b < n64 ? base + j : base + 2 * j;
        const int64_t r1 = b < n64 ? base + j + 32 : base + 2 * j + 1;
        T* o0 = out + r0 * k; T* o1 = out + r1 * k;
        const T* s0 = sc + r0 * ng; const T* s1 = sc + r1 * ng;
        const T* z0 = zp + r0 * ng; const T* z1 = zp + r1 * ng;
        const uint8_t* row = tb.data() + j * k;
        for (int64_t gi = 0; gi < ng; ++gi) {
          const float a0 = (float)s0[gi], c0 = (float)z0[gi] - 8.f * a0;
          const float a1 = (float)s1[gi], c1 = (float)z1[gi] - 8.f * a1;
          const int64_t e = (gi + 1) * g;
          for (int64_t kk = gi * g; kk < e; ++kk) {
            const uint8_t v = row[kk];
            o0[kk] = (T)((float)(v & 15) * a0 + c0);
            o1[kk] = (T)((float)(v >> 4) * a1 + c1);
          }
        }
      }
    }
  });
}

torch::Tensor dequant(torch::Tensor packed, torch::Tensor scales, torch::Tensor zeros, int64_t n, int64_t k,
                      int64_t g) {
  auto out = torch::empty({n, k}, scales.options());
  if (scales.scalar_type() == at::kBFloat16) {
    run<at::BFloat16>(packed.data_ptr<uint8_t>(), scales.data_ptr<at::BFloat16>(), zeros.data_ptr<at::BFloat16>(),
                      out.data_ptr<at::BFloat16>(), n, k, g);
  } else {
    run<float>(packed.data_ptr<uint8_t>(), scales.data_ptr<float>(), zeros.data_ptr<float>(),
               out.data_ptr<float>(), n, k, g);
  }
  return out;
}
"""

_module = None
_failed = False


def _load():
    global _module, _failed
    if _module is not None or _failed:
        return _module
    if os.environ.get("MIXSERVE_NO_CPP_KERNELS"):
        _failed = True
        return None
    try:
        from torch.utils.cpp_extension import load_inline

        from mixserve.models.registry import cache_root

        build = cache_root() / "kernels" / f"torch-{torch.__version__}"
        build.mkdir(parents=True, exist_ok=True)
        _module = load_inline("mixserve_int4_dequant_v3", cpp_sources=_SRC,
                              functions=["dequant"], extra_cflags=["-O3", "-march=native", "-fopenmp"],
                              extra_ldflags=["-fopenmp"], build_directory=str(build), verbose=False)
    except Exception as e:  # no compiler, no headers: the eager path still works
        log.warning("int4 dequantization kernel unavailable (%s); using eager ops", e)
        _failed = True
    return _module


def dequantize_int4pack(packed: torch.Tensor, scale_rows: torch.Tensor, zero_rows: torch.Tensor, n: int, k: int,
                        group_size: int) -> torch.Tensor | None:
    """Dense [n, k] weight in scale_rows' dtype (float32 or bfloat16) from the kernel's packed
    uint8 weight and [n, k / group_size] scales and zeros (zero = (8 - z) * scale); None when the
    compiled kernel is unavailable (the caller falls back to eager ops)."""
    mod = _load()
    if mod is None or scale_rows.dtype not in (torch.float32, torch.bfloat16):
        return None
    return mod.dequant(packed.contiguous(), scale_rows.contiguous(), zero_rows.contiguous(), n, k, group_size)
