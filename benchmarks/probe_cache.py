"""Why `hw probe` underrates int4 for a lone stream: it times each linear over and over on one
weight, which then sits in the CPU cache, while a real decode step streams every layer's weights
from memory once. Side by side in one run, 1 row: the same linear called repeatedly (as the
probe does) against cycling through 24 copies (as a 24-layer decode step does).

    python benchmarks/probe_cache.py --out results/probe_cache.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--copies", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="results/probe_cache.json")
    a = ap.parse_args()

    from mixserve.env import machine_info
    from mixserve.layers.kernel_choice import KernelChooser
    from mixserve.plan.hardware import _make_linear

    rows = []
    chooser = KernelChooser()
    for fmt in ("bf16", "int4"):
        for o, i in ((9728, 896), (896, 4864), (1152, 896)):  # the 0.5B's gate_up, down, qkv
            lins = [_make_linear(fmt, o, i, torch.bfloat16, 128, chooser) for _ in range(a.copies)]
            x = torch.randn(1, i, dtype=torch.bfloat16)
            with torch.inference_mode():
                for lin in lins:
                    lin(x)
                hot, cold = [], []
                for _ in range(a.copies * a.rounds):
                    t0 = time.perf_counter()
                    lins[0](x)
                    hot.append(time.perf_counter() - t0)
                for _ in range(a.rounds):
                    for lin in lins:
                        t0 = time.perf_counter()
                        lin(x)
                        cold.append(time.perf_counter() - t0)
            r = {"format": fmt, "shape": [o, i], "hot_ms": 1e3 * statistics.median(hot),
                 "cycling_ms": 1e3 * statistics.median(cold)}
            r["ratio"] = r["cycling_ms"] / r["hot_ms"]
            rows.append(r)
            print(f"{fmt} {o}x{i}: one weight {r['hot_ms']:.3f} ms, cycling {a.copies} copies "
                  f"{r['cycling_ms']:.3f} ms ({r['ratio']:.1f}x)", flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"machine": machine_info(), "config": vars(a), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
