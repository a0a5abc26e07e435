"""Which ops round a row differently with the number of rows beside it, and what the invariant
kernels cost per 0.5B layer at prefill, on the machine at hand (layers/batch_invariance.py).

Part 1: for each op, row 0's result at row counts M = 1 .. 2048 (random inputs, the 0.5B's shapes),
grouped into classes of M with equal bits: one class means row-invariant. Part 2: one 0.5B layer's
linears at 512 rows, the invariant GEMM against oneDNN (the measured float32 choice here), and its
attention over a 512-token prompt, `paged_rows` against SDPA (milliseconds, median of 3 calls).

    python benchmarks/row_invariance.py
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from mixserve.env import machine_info
from mixserve.layers import invariant_linear
from mixserve.layers.linear import DenseLinear
from mixserve.layers.paged_decode import paged_rows

SHAPES = [(1152, 896), (896, 896), (9728, 896), (896, 4864)]  # 0.5B: qkv, o, gate/up, down
MS = [1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 33, 64, 65, 129, 300, 513, 1024, 2048]


def classes(fn, x: torch.Tensor) -> list[list[int]]:
    """Row counts grouped by the bits fn gives row 0."""
    out: list[tuple[torch.Tensor, list[int]]] = []
    for m in MS:
        y = fn(x[:m])[:1]
        for ref, ms in out:
            if torch.equal(ref, y):
                ms.append(m)
                break
        else:
            out.append((y, [m]))
    return [ms for _, ms in out]


def ms_of(fn) -> float:
    fn()
    ts = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def main() -> None:
    print(machine_info(), flush=True)
    torch.manual_seed(0)
    for n, k in SHAPES:
        w = torch.randn(n, k) * 0.05
        x = torch.randn(MS[-1], k)
        onednn = DenseLinear(w.clone())
        onednn.set_impl("onednn")
        wp = invariant_linear.pack(w)
        print(f"{n}x{k}: F.linear f32 {classes(lambda a: F.linear(a, w), x)}; oneDNN {classes(onednn, x)}; "
              f"F.linear bf16 {classes(lambda a: F.linear(a, w.bfloat16()), x.bfloat16())}; "
              f"invariant {classes(lambda a: invariant_linear.linear(a, wp, n), x)}", flush=True)
    v = torch.randn(300, 151936) * 4
    MS[:] = [m for m in MS if m <= 300]
    for name, fn in (("rms_norm", lambda a: F.rms_norm(a, (151936,), eps=1e-6)),
                     ("softmax", lambda a: torch.softmax(a, -1)), ("log_softmax", lambda a: torch.log_softmax(a, -1)),
                     ("topk 20", lambda a: torch.topk(a, 20, -1).values), ("silu", F.silu)):
        print(f"{name}: {classes(fn, v)}", flush=True)
    total = {"invariant": 0.0, "onednn": 0.0}
    for n, k in SHAPES:
        w = torch.randn(n, k) * 0.05
        x = torch.randn(512, k)
        onednn = DenseLinear(w.clone())
        onednn.set_impl("onednn")
        wp = invariant_linear.pack(w)
        a, b = ms_of(lambda: invariant_linear.linear(x, wp, n)), ms_of(lambda: onednn(x))
        total["invariant"] += a
        total["onednn"] += b
        print(f"512 rows x {n}x{k}: invariant {a:.1f} ms, oneDNN {b:.1f} ms", flush=True)
    print(f"one layer's linears at 512 rows: invariant {total['invariant']:.1f} ms, oneDNN {total['onednn']:.1f} ms")
    bs, L = 16, 512
    kc, vc = torch.randn(L // bs, bs, 2, 64), torch.randn(L // bs, bs, 2, 64)
    q = torch.randn(L, 14, 64)
    table = torch.arange(L // bs).view(1, -1)
    rows = ms_of(lambda: paged_rows(q, kc, vc, table, torch.zeros(L, dtype=torch.long), torch.arange(1, L + 1), 0.125))
    ks, vs = kc.view(1, L, 2, 64).transpose(1, 2), vc.view(1, L, 2, 64).transpose(1, 2)
    sdpa = ms_of(lambda: F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), ks, vs, is_causal=True,
                                                        enable_gqa=True))
    print(f"one layer's attention over a 512-token prompt: paged_rows {rows:.1f} ms, SDPA {sdpa:.1f} ms")


if __name__ == "__main__":
    main()
