"""How fast the native GGUF kernel streams its weights at one activation row (decode), per block type (issue 43).

For each type, random weights of a 1.5B shape in the native layout (layers/gguf_linear.random_weight),
one activation row at the engine's int8 levels (ACT_LEVELS), timed three ways (kernel_choice.time_calls:
the median of passes over the copies, as the engine's kernel choices time):
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

import torch

from mixserve.env import machine_info
from mixserve.layers import gguf_kernels, gguf_linear
from mixserve.layers.gguf_linear import random_weight
from mixserve.layers.kernel_choice import time_calls

SHAPES = (("Q4_K", 17920, 1536), ("Q6_K", 1536, 8960), ("Q8_0", 8960, 1536), ("Q5_0", 8960, 1536))
COPIES = 6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefetch", default="0,8")
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

        def call(w):
            w.matmul(x, levels=gguf_linear.ACT_LEVELS)
        row = {"type": qt, "shape": f"{n}x{k}", "bytes": nbytes}
        for pf in (int(p) for p in a.prefetch.split(",")):
            for w in ws:
                w.prefetch = pf
            row[f"dram_GBps_pf{pf}"] = nbytes / time_calls(ws, call) / 1e9
            row[f"cached_GBps_pf{pf}"] = nbytes / time_calls([ws[0], ws[0]], call) / 1e9
        bufs = [torch.ones(nbytes // 4) for _ in range(COPIES)]
        row["sum_GBps"] = nbytes / time_calls(bufs, lambda b: b.sum()) / 1e9
        del ws, bufs
        print(json.dumps({k2: round(v, 1) if isinstance(v, float) else v for k2, v in row.items()}), flush=True)
        rows.append(row)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"machine": info, "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
