"""2-8-row steps of the native GGUF kernel: one stream through the weights against the many-row kernel
(issue 34: a speculative verification pass of k + 1 rows must cost what the row curve says).

For each (tensor kind, GGUF type) of the model's file, one real tensor is repacked into the native
layout (as many copies as make ~96 MB, taken in turn, so the weights come from memory as in a
decode step) and timed at --rows activation rows with the engine's int8 levels (ACT_LEVELS per
row; the LM head's three) both ways: the few-row kernel's streaming passes (4 int16 rows a pass) and
the many-row kernel (tiles unpacked to int16 in a scratch buffer), switched by
`gguf_kernels.set_wide_rows`; the two outputs are checked to be the same bits. Each point is
kernel_choice.time_calls' median; the two ways are alternated `--rounds` times in one process.

    flock /tmp/heavy.lock python benchmarks/gguf_wide_rows.py --model qwen2.5-coder-0.5b-instruct
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import gguf
import numpy as np
import torch

from mixserve.env import machine_info
from mixserve.layers import gguf_kernels, gguf_linear
from mixserve.layers.gguf_linear import GGUFWeight
from mixserve.layers.kernel_choice import time_calls
from mixserve.models.registry import resolve_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--rows", default="1,2,3,4,5,8")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out")
    a = ap.parse_args()
    torch.set_num_threads(2)
    info = machine_info()
    print(json.dumps(info))
    print(f"native kernel variant: {gguf_kernels.isa()}; int8 levels per row: {gguf_linear.ACT_LEVELS}", flush=True)
    rows = [int(r) for r in a.rows.split(",")]
    rd = gguf.GGUFReader(str(resolve_model(a.model).path))
    seen, results = set(), []
    # the LM head: the file's output tensor, or the embedding where the head is tied to it
    head = "output" if any(t.name == "output.weight" for t in rd.tensors) else "token_embd"
    for t in rd.tensors:
        kind = t.name.split(".")[-2] if t.name.startswith("blk.") else t.name.split(".")[0]
        tt = t.tensor_type.name
        if tt == "F32" or kind in ({"output", "token_embd"} - {head}) or (kind, tt) in seen:
            continue
        seen.add((kind, tt))
        levels = 3 if kind == head else gguf_linear.ACT_LEVELS  # the LM head's levels
        k, n = int(t.shape[0]), int(t.shape[1])
        w = GGUFWeight.from_blocks(tt, np.asarray(t.data), k)
        copies = [w] + [GGUFWeight.from_blocks(tt, np.asarray(t.data), k) for _ in range(max(0, int(96e6 // w.nbytes()) - 1))]
        for c in copies:
            c.prefetch = -1
        row = {"tensor": "lm_head" if kind == head else kind, "type": tt, "shape": f"{n}x{k}",
               "levels": levels, "copies": len(copies)}
        times = {}
        with torch.inference_mode():
            for r in rows:
                x = torch.randn(r, k)
                outs = {}
                for _ in range(a.rounds):
                    for way, lim in (("stream", 16), ("many", 4)):
                        gguf_kernels.set_wide_rows(lim)
                        times.setdefault((way, r), []).append(time_calls(copies, lambda m: m.matmul(x, levels)))
                        outs[way] = w.matmul(x, levels)
                gguf_kernels.set_wide_rows(gguf_kernels.DEFAULT_WIDE_ROWS)
                assert torch.equal(outs["stream"], outs["many"]), (kind, tt, r)
        base = statistics.median(times[("stream", 1)])
        for r in rows:
            for way in ("stream", "many"):
                ms = 1e3 * statistics.median(times[(way, r)])
                row[f"{way}_ms_{r}"] = ms
                row[f"{way}_x1row_{r}"] = ms / (1e3 * base)
        print(json.dumps({k2: round(v, 3) if isinstance(v, float) else v for k2, v in row.items()}), flush=True)
        results.append(row)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)  # a fresh clone has no results/
        with open(a.out, "w") as f:
            json.dump({"machine": info, "model": a.model, "rows": rows, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
