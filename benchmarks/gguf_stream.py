"""How fast the native GGUF kernel streams its weights at one activation row (decode), per block type (issue 43).

For each type, random weights of a 1.5B shape in the native layout (layers/gguf_linear.random_weight),
one activation row at the engine's int8 levels (ACT_LEVELS), timed three ways (kernel_choice.time_calls:
the median of passes over the copies, as the engine's kernel choices time):
  - dram: six copies in turn (past the last-level cache), so every call reads its weight from memory;
  - cached: the same copy every call (it stays in L2/L3): what the kernel's arithmetic allows;
  - sum: torch's `t.sum()` over float32 buffers of the same size, in turn: what a plain stream reads.
GB/s = the weight's resident bytes per call / seconds; --prefetch lists the kernel's prefetch distances
(64-byte lines ahead; 0: the hardware prefetcher alone). --model 0.5b takes the 0.5B's shapes instead
(K = 896 and 4864) and its LM head at three levels; --model 1.5b-step every weight call of a 1.5B
Q4_K_M decode step with its count, and their ms per token summed; the dram copies
are then as many as make ~96 MB, past this project's CPUs' last-level caches.

    flock /tmp/heavy.lock python benchmarks/gguf_stream.py [--model 0.5b]
Another checkout's kernel: `PYTHONPATH=/path/to/old python benchmarks/gguf_stream.py`.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from mixserve.env import machine_info
from mixserve.layers import gguf_kernels, gguf_linear
from mixserve.layers.gguf_linear import random_weight
from mixserve.layers.kernel_choice import time_calls

SHAPES = {"1.5b": (("Q4_K", 17920, 1536, None), ("Q6_K", 1536, 8960, None), ("Q8_0", 8960, 1536, None),
                   ("Q5_0", 8960, 1536, None)),
          # the 0.5B's gate+up, down (Q4_K and Q6_K layers), o_proj, and its tied Q8_0 LM head (float32 logits)
          "0.5b": (("Q5_0", 9728, 896, None), ("Q4_K", 896, 4864, None), ("Q6_K", 896, 4864, None),
                   ("Q5_0", 896, 896, None), ("Q8_0", 151936, 896, 3))}
# every weight call of one 1.5B Q4_K_M decode step (the engine fuses q, k, v where their types
# match, and gate with up): type, N, K, levels (None: the engine's), calls per token
STEP = {"1.5b-step": (("Q4_K", 2048, 1536, None, 14), ("Q4_K", 1792, 1536, None, 14), ("Q6_K", 256, 1536, None, 14),
                      ("Q4_K", 1536, 1536, None, 28), ("Q4_K", 17920, 1536, None, 28), ("Q4_K", 1536, 8960, None, 14),
                      ("Q6_K", 1536, 8960, None, 14), ("Q6_K", 151936, 1536, 3, 1))}
SHAPES.update({name: tuple(s[:4] for s in shapes) for name, shapes in STEP.items()})
COPIES = 6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefetch", default="0,8")
    ap.add_argument("--model", default="1.5b", choices=sorted(SHAPES),
                    help="1.5b-step: every weight call of a 1.5B decode step, with its ms per token")
    ap.add_argument("--out")
    a = ap.parse_args()
    torch.set_num_threads(2)
    info = machine_info()
    print(json.dumps(info))
    print(f"native kernel variant: {gguf_kernels.isa()}; int8 levels: {gguf_linear.ACT_LEVELS}", flush=True)
    rows = []
    per_token = {}
    for si, (qt, n, k, levels) in enumerate(SHAPES[a.model]):
        nbytes = random_weight(qt, 2, k).nbytes() * n // 2
        copies = COPIES if a.model == "1.5b" else max(2, -(-96_000_000 // nbytes))
        ws = [random_weight(qt, n, k, seed=i) for i in range(copies)]
        nbytes = ws[0].nbytes()
        x = torch.randn(1, k)
        lv = levels or gguf_linear.ACT_LEVELS

        def call(w):
            w.matmul(x, levels=lv)
        row = {"type": qt, "shape": f"{n}x{k}", "levels": lv, "bytes": nbytes}
        for pf in (int(p) for p in a.prefetch.split(",")):
            for w in ws:
                w.prefetch = pf
            t = time_calls(ws, call)
            row[f"dram_GBps_pf{pf}"] = nbytes / t / 1e9
            if a.model in STEP:
                row[f"ms_per_token_pf{pf}"] = 1e3 * t * STEP[a.model][si][4]
                per_token[pf] = per_token.get(pf, 0.0) + row[f"ms_per_token_pf{pf}"]
            row[f"cached_GBps_pf{pf}"] = nbytes / time_calls([ws[0], ws[0]], call) / 1e9
        bufs = [torch.ones(nbytes // 4) for _ in range(copies)]
        row["sum_GBps"] = nbytes / time_calls(bufs, lambda b: b.sum()) / 1e9
        del ws, bufs
        print(json.dumps({k2: round(v, 1) if isinstance(v, float) else v for k2, v in row.items()}), flush=True)
        rows.append(row)
    for pf, ms in per_token.items():
        print(f"prefetch {pf}: the step's weight calls take {ms:.1f} ms a token (from memory)")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)  # a fresh clone has no results/
        with open(a.out, "w") as f:
            json.dump({"machine": info, "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
