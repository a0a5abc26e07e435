"""What this CPU's vector units can do per core: the ceiling every GEMM here is held against (issue 43).

Times each multiply-accumulate instruction the kernels use, in a loop of 12 independent chains (so
throughput, not latency, bounds it), on every core at once (the clock the kernels run at), and
prints its multiply-adds per ns per core:

- `vpdpbusd` zmm (AVX512-VNNI, the native GGUF kernel's u8 x s8: 64 multiply-adds) and ymm (AVX-VNNI);
- `vpmaddubsw` + `vpmaddwd` ymm (the AVX2 variant's pair: 32 multiply-adds for two instructions);
- `vdpbf16ps` zmm (AVX512-BF16, what oneDNN's bf16 GEMM runs on these CPUs: 32);
- `vfmadd231ps` zmm and ymm (float32: 16 and 8).

The native kernel feeds each activation row in as ACT_LEVELS int8 rows (layers/gguf_linear.py), so
its ceiling is the int8 rate over the levels; `on / off` in issue 43 compares it with the bf16 GEMM
(`off` above its switch). The line `two int8 levels / bf16` is that ratio of ceilings: 1.0 means a
perfect two-level int8 kernel only draws level with a perfect bf16 GEMM.

    flock /tmp/heavy.lock python benchmarks/isa_rates.py [--out results/isa-rates.json]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from mixserve.env import machine_info
from mixserve.layers.cpp_build import build_extension

_SRC = r"""
#include <torch/extension.h>
#include <immintrin.h>
#include <chrono>

// 12 independent accumulators; the empty asm keeps each one a register the compiler must update
#define X12(M) M(0) M(1) M(2) M(3) M(4) M(5) M(6) M(7) M(8) M(9) M(10) M(11)
#define KEEP(i) asm volatile("" : "+v"(a##i));

template <typename V, typename Step>
static double loop(int64_t iters, V init, Step step) {
#define DECL(i) V a##i = init;
  X12(DECL)
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t it = 0; it < iters; ++it) {
#define STEP(i) a##i = step(a##i);
    X12(STEP)
    X12(KEEP)
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
#define SINK(i) asm volatile("" : : "v"(a##i));
  X12(SINK)
  return s * 1e9 / (iters * 12.0);
}

// ns per instruction (per pair for op 2) of op on one thread, -1 where this build lacks it;
// every thread of at::parallel_for runs it at once, the mean of their times returned
double ns_per_op(int64_t op, int64_t iters) {
  const int64_t n = at::get_num_threads();
  std::vector<double> t(n, -1.0);
  at::parallel_for(0, n, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t k = t0; k < t1; ++k) {
      double r = -1.0;
      switch (op) {
#if defined(__AVX512VNNI__)
        case 0: { const __m512i x = _mm512_set1_epi8(1), y = _mm512_set1_epi8(2);
          r = loop(iters, _mm512_setzero_si512(), [&](__m512i a) { return _mm512_dpbusd_epi32(a, x, y); }); break; }
#endif
#if defined(__AVXVNNI__)
        case 1: { const __m256i x = _mm256_set1_epi8(1), y = _mm256_set1_epi8(2);
          r = loop(iters, _mm256_setzero_si256(), [&](__m256i a) { return _mm256_dpbusd_avx_epi32(a, x, y); }); break; }
#endif
#if defined(__AVX2__)
        case 2: { const __m256i y = _mm256_set1_epi8(2), one = _mm256_set1_epi16(1);
          // the accumulator is the unsigned operand too, so that the pair cannot leave the loop
          r = loop(iters, _mm256_setzero_si256(), [&](__m256i a) {
            return _mm256_add_epi32(a, _mm256_madd_epi16(_mm256_maddubs_epi16(a, y), one)); }); break; }
#endif
#if defined(__AVX512BF16__)
        case 3: { const __m512bh x = (__m512bh)_mm512_set1_epi16(0x3f80), y = x;
          r = loop(iters, _mm512_setzero_ps(), [&](__m512 a) { return _mm512_dpbf16_ps(a, x, y); }); break; }
#endif
#if defined(__AVX512F__)
        case 4: { const __m512 x = _mm512_set1_ps(1.f), y = _mm512_set1_ps(1e-9f);
          r = loop(iters, _mm512_setzero_ps(), [&](__m512 a) { return _mm512_fmadd_ps(a, x, y); }); break; }
#endif
#if defined(__FMA__)
        case 5: { const __m256 x = _mm256_set1_ps(1.f), y = _mm256_set1_ps(1e-9f);
          r = loop(iters, _mm256_setzero_ps(), [&](__m256 a) { return _mm256_fmadd_ps(a, x, y); }); break; }
#endif
        default: break;
      }
      t[k] = r;
    }
  });
  double s = 0;
  for (double v : t) { if (v < 0) return -1.0; s += v; }
  return s / n;
}
"""

# (name, multiply-adds per instruction: per pair for the AVX2 int8 pair)
OPS = [("vpdpbusd zmm (int8)", 64), ("vpdpbusd ymm (int8, AVX-VNNI)", 32),
       ("vpmaddubsw+vpmaddwd ymm (int8, AVX2)", 32), ("vdpbf16ps zmm (bf16)", 32),
       ("vfmadd231ps zmm (fp32)", 16), ("vfmadd231ps ymm (fp32)", 8)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=50_000_000)
    ap.add_argument("--out")
    a = ap.parse_args()
    info = machine_info()
    print(json.dumps(info))
    mod = build_extension("mixserve_isa_rates", _SRC, ["ns_per_op"])
    if mod is None:
        raise SystemExit("isa_rates: the C++ build failed (see the warning above)")
    rates = {}
    for op, (name, macs) in enumerate(OPS):
        mod.ns_per_op(op, a.iters // 10)  # warm the clocks
        ns = mod.ns_per_op(op, a.iters)
        if ns < 0:
            print(f"{name:40s} not on this CPU")
            continue
        rates[name] = macs / ns
        print(f"{name:40s} {ns:6.3f} ns each, {macs / ns:6.1f} multiply-adds/ns per core ({torch.get_num_threads()} "
              f"threads at once)")
    # the native kernel's two variants against what `off`'s GEMM runs beside each (bf16 where the CPU
    # has it, else float32)
    rows = {}
    for variant, int8 in (("VNNI", rates.get(OPS[0][0])), ("AVX2", rates.get(OPS[2][0]))):
        for ref in (OPS[3][0], OPS[4][0], OPS[5][0]):
            if int8 and ref in rates:
                for levels in (1, 2, 3):
                    rows[f"{variant} int8, {levels} level(s) / {ref.split(' (')[0]}"] = round(int8 / levels / rates[ref], 2)
    for k, v in rows.items():
        print(f"ceiling, {k}: {v}")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)  # a fresh clone has no results/
        with open(a.out, "w") as f:
            json.dump({"machine": info, "multiply_adds_per_ns_per_core": rates, "ceiling_ratios": rows}, f, indent=1)


if __name__ == "__main__":
    main()
