"""Resident memory of PyTorch's oneDNN primitive caches under varying GEMM shapes (issue 15, soak).

A prefill's token count sets the row count of every linear in its step, so a server meets a new
GEMM shape most steps; PyTorch's oneDNN path caches a primitive per shape (ideep's
LRU_CACHE_CAPACITY and oneDNN's ONEDNN_PRIMITIVE_CACHE_CAPACITY, 1,024 entries each by default).
This script runs --calls rounds of the 0.5B's five bf16 linear shapes (qkv, o, gate/up, down at
hidden 896 / intermediate 4864) at random row counts 1-2048, in a fresh process per cache
capacity, and prints RSS every 100 rounds and the wall time: the default against the engine's cap
(kernel_choice.PRIMITIVE_CACHE_CAPACITY).

    python benchmarks/primitive_cache.py
"""
from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import time
from pathlib import Path


def rss_mib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS"):
            return int(line.split()[1]) // 1024
    return 0


def child(calls: int) -> None:
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    shapes = [(1152, 896), (896, 896), (9728, 896), (896, 4864)]
    ws = [torch.randn(n, k).to(torch.bfloat16) for n, k in shapes]
    rng = random.Random(0)
    start = rss_mib()
    t0 = time.perf_counter()
    for i in range(calls):
        m = rng.randint(1, 2048)
        for w in ws:
            F.linear(torch.randn(m, w.shape[1]).to(torch.bfloat16), w)
        if (i + 1) % 100 == 0:
            print(f"    {i + 1:5} rounds: RSS {rss_mib()} MiB (+{rss_mib() - start})", flush=True)
    print(f"    {calls} rounds in {time.perf_counter() - t0:.1f} s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=600)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.calls)
        return
    from mixserve.layers.kernel_choice import PRIMITIVE_CACHE_CAPACITY

    print(f"{time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cores")
    for cap in (None, PRIMITIVE_CACHE_CAPACITY):
        env = {k: v for k, v in os.environ.items() if k not in ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")}
        if cap is not None:
            env.update(LRU_CACHE_CAPACITY=str(cap), ONEDNN_PRIMITIVE_CACHE_CAPACITY=str(cap))
        print(f"  cache capacity: {cap or 'default (1024)'}")
        subprocess.run([sys.executable, __file__, "--child", "--calls", str(a.calls)], env=env, check=True)


if __name__ == "__main__":
    main()
