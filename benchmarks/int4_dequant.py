"""Speed of the many-row int4 path's dequantization alone, per layout, against the eager chain.

For each shape (the 0.5B's gate/up and down, the 1.5B's gate/up), bf16 and float32: the old
scalar kernel (PyTorch's layout to [out, in]), the vector kernel writing W^T from PyTorch's layout
(`dequantize_int4pack(..., transposed=True)`), and the VNNI layout's kernel; median of 20 calls
into one reused buffer (hot in cache, as the microbenchmark it is; a prefill sees it cold), and
a check that each output equals the reference exactly.

    python benchmarks/int4_dequant.py
"""
from __future__ import annotations


import torch

from mixserve.env import machine_info
from mixserve.layers import int4_vnni
from mixserve.layers.int4_dequant import dequantize_int4pack
from mixserve.layers.linear import Int4Linear
from mixserve.plan.hardware import _time


def median_ms(fn, n: int = 20) -> float:
    return _time(fn, n) * 1e3  # the probe's own timer: median of n calls after one warm-up


def main():
    torch.set_num_threads(2)
    m = machine_info()
    print(f"{m['cpu']}, {m['cores']} cores, torch {m['torch']}, {m['date']}")
    for n, k in ((9728, 896), (896, 4864), (17920, 1536)):
        for dt in (torch.bfloat16, torch.float32):
            q = torch.randint(0, 16, (n, k), dtype=torch.int32)
            lin = Int4Linear(q, torch.rand(n, k // 128) * 0.01, torch.randint(0, 16, (n, k // 128), dtype=torch.int32),
                             128, None, dt)
            buf = torch.empty(n * k, dtype=dt)
            ref = lin.dense_weight().clone()
            old = median_ms(lambda: dequantize_int4pack(lin.packed, lin.scale_rows, lin.zero_rows, n, k, 128, buf))
            kn = median_ms(lambda: dequantize_int4pack(lin.packed, lin.scale_rows, lin.zero_rows, n, k, 128, buf,
                                                       transposed=True))
            exact_kn = torch.equal(lin.gemm_weight(), ref)
            line = f"{n}x{k} {str(dt)[6:]}: scalar [out, in] {old:.2f} ms, vector W^T {kn:.2f} ms (exact {exact_kn})"
            if int4_vnni.available():
                lin.set_kernel("vnni")
                vn = median_ms(lambda: int4_vnni.dequantize(lin.vq, lin.vs, lin.vm, 128, buf))
                line += f", VNNI layout {vn:.2f} ms"
            print(line, flush=True)


if __name__ == "__main__":
    main()
