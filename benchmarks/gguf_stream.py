"""How fast the native GGUF kernel streams its weights at one activation row (decode), per block type (issue 43).

For each type, random weights of a 1.5B shape in the native layout (layers/gguf_linear.random_weight),
one activation row at the engine's int8 levels (ACT_LEVELS), timed three ways, median of --reps calls:
  - dram: six copies in turn (past the last-level cache), so every call reads its weight from memory;
  - cached: the same copy every call (it stays in L2/L3): what the kernel's arithmetic allows;
  - sum: torch's `t.sum()` over float32 buffers of the same size, in turn: what a plain stream reads.
GB/s = the weight's resident bytes per call / seconds; --prefetch lists the kernel's prefetch distances
(row pairs ahead; 0: the hardware prefetcher alone).

    flock /tmp/heavy.lock python benchmarks/gguf_stream.py
Another checkout's kernel: `PYTHONPATH=/path/to/old python benchmarks/gguf_stream.py`.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from mixserve.env import machine_info
from mixserve.layers import gguf_kernels, gguf_linear
from mixserve.layers.gguf_linear import random_weight

SHAPES = (("Q4_K", 17920, 1536), ("Q6_K", 1536, 8960), ("Q8_0", 8960, 1536), ("Q5_0", 8960, 1536))
COPIES = 6


def median_s(fn, reps: int) -> float:
    """Median seconds of `fn()` over `reps` calls after one warm-up call."""
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefetch", default="0,8")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out")
    a = ap.parse_args()
    torch.set_num_threads(2)
    info = machine_info()
    print(json.dumps(info))
    print(f"native kernel variant: {gguf_kernels.isa()}; int8 levels: {gguf_linear.ACT_LEVELS}", flush=True)
    rows = []
    for qt, n, k in SHAPES:
        ws = [random_weight(qt, n, k, seed=i) for i in range(COPIES)]
        nbytes = ws[0].nbytes()
        x = torch.randn(1, k)
        turn = [0]

        def rotating():
            turn[0] = (turn[0] + 1) % COPIES
            ws[turn[0]].matmul(x, levels=gguf_linear.ACT_LEVELS)
        row = {"type": qt, "shape": f"{n}x{k}", "bytes": nbytes}
        for pf in (int(p) for p in a.prefetch.split(",")):
            for w in ws:
                w.prefetch = pf
            row[f"dram_GBps_pf{pf}"] = nbytes / median_s(rotating, a.reps) / 1e9
            row[f"cached_GBps_pf{pf}"] = nbytes / median_s(lambda: ws[0].matmul(x, levels=gguf_linear.ACT_LEVELS),
                                                           a.reps) / 1e9
        bufs = [torch.ones(nbytes // 4) for _ in range(COPIES)]

        def summed():
            turn[0] = (turn[0] + 1) % COPIES
            bufs[turn[0]].sum()
        row["sum_GBps"] = nbytes / median_s(summed, a.reps) / 1e9
        del ws, bufs
        print(json.dumps({k2: round(v, 1) if isinstance(v, float) else v for k2, v in row.items()}), flush=True)
        rows.append(row)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"machine": info, "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
