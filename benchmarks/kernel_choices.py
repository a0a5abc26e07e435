"""Kernel choices, side by side in one run (2 threads, bf16 unless stated):

1. Dense linear: F.linear vs oneDNN-prepacked weights (torch.ops.mkldnn._linear_pointwise), over 24
   distinct 9728x896 matrices (the 0.5B's gate/up) so weights stream from memory, not cache.
2. Decode attention, one query per row: PyTorch's fused CPU SDPA vs plain batched matmuls
   (layers/attention.py `_decode_attention`), 16 rows x 320 context, 14 heads / 2 KV heads, d=64.
3. With --int4: weight-only int4 (layers/linear.py Int4Linear: PyTorch's CPU int4 kernel below the
   row threshold, dequantize + bf16 GEMM above it) against the bf16 prepacked GEMM, over 8
   distinct 17920x1536 matrices (the 1.5B's fused gate/up), by rows: where the threshold belongs.

    python benchmarks/kernel_choices.py [--int4]
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from mixserve.layers.attention import _decode_attention


def timeit(f, n=10):
    for _ in range(3):
        f()
    t = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t) / n


def int4_crossover():
    from mixserve.layers.linear import DenseLinear, Int4Linear
    from mixserve.quant.groupwise import quantize_groupwise

    dt = torch.bfloat16
    ws = [torch.randn(17920, 1536) * 0.02 for _ in range(8)]
    dense = [DenseLinear(w.to(dt)) for w in ws]
    int4 = []
    for w in ws:
        q, s, z = quantize_groupwise(w, 128)
        int4.append(Int4Linear(q, s, z, 128, None, dt))
    del ws
    for rows in (1, 2, 4, 8, 12, 16, 24, 32, 64, 512):
        x = torch.randn(rows, 1536).to(dt)
        n = 3 if rows >= 64 else 10
        b = timeit(lambda: [m(x) for m in dense], n)
        k = timeit(lambda: [torch.ops.aten._weight_int4pack_mm_for_cpu(x, m.packed, 128, m.scales_and_zeros)
                            for m in int4], n)
        d = timeit(lambda: [F.linear(x, m.dense_weight()) for m in int4], n)
        print(f"int4 rows={rows:4d}: bf16 prepacked {b * 1e3:8.1f} ms, int4 kernel {k * 1e3:8.1f} ms "
              f"({b / k:.2f}x of bf16), dequantize+GEMM {d * 1e3:8.1f} ms ({b / d:.2f}x)", flush=True)


def main():
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--int4", action="store_true", help="int4 kernel vs dequantize + GEMM by rows")
    a = ap.parse_args()
    torch.set_num_threads(2)
    print(f"threads {torch.get_num_threads()}, torch {torch.__version__}")
    if a.int4:
        int4_crossover()
        return
    for dt in (torch.bfloat16, torch.float32):
        ws = [torch.randn(9728, 896).to(dt) for _ in range(24)]
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, batch_size=1) for w in ws]
        for rows in (1, 16, 64):
            x = torch.randn(rows, 896).to(dt)
            a = timeit(lambda: [F.linear(x, w) for w in ws], 5)
            b = timeit(lambda: [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for p in packed], 5)
            print(f"linear {str(dt):15s} rows={rows:3d}: F.linear {a * 1e3:7.1f} ms, prepacked {b * 1e3:7.1f} ms, "
                  f"ratio {a / b:.2f}x")
    B, H, KV, d, L = 16, 14, 2, 64, 320
    dt = torch.bfloat16
    q = torch.randn(B, H, d, dtype=dt)
    k = torch.randn(B, L, KV, d, dtype=dt)
    v = torch.randn(B, L, KV, d, dtype=dt)
    ctx = torch.randint(200, L + 1, (B,), generator=torch.Generator().manual_seed(0))
    mask = torch.arange(L)[None] < ctx[:, None]
    bias = torch.zeros(B, L).masked_fill(~mask, float("-inf"))
    sdpa = timeit(lambda: F.scaled_dot_product_attention(q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2),
                                                         attn_mask=mask[:, None, None, :], enable_gqa=True,
                                                         scale=0.125), 20)
    ours = timeit(lambda: _decode_attention(q, k, v, bias, 0.125), 20)
    print(f"decode attention B={B} L={L}: SDPA {sdpa * 1e3:.2f} ms, batched matmuls {ours * 1e3:.2f} ms, "
          f"ratio {sdpa / ours:.1f}x")


if __name__ == "__main__":
    main()
