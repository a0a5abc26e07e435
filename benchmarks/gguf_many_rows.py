"""The native GGUF kernel at many rows (prefill, wide decode steps) against the dense GEMM (issue 43).

For each (tensor kind, GGUF type) of the model's file, one real tensor is repacked into the native
layout and timed at --rows activation rows (default 8, 64, 512) the two ways a GGUFLinear can run
them: the native integer kernel at the engine's levels (what `--batch-invariant on` runs at
every row count; ACT_LEVELS int8 rows per row) and the weight dequantized to bfloat16 once, then
F.linear (what `off` runs above its measured switch; the dequantization is not timed), each timed by
kernel_choice.time_calls on the same copy (the median of passes), in one process; a ratio > 1 means the
kernel is slower. Where the kernel has its AMX-INT8 many-row variant and the process may use AMX, the
kernel is timed both ways (`kernel_ms` the AVX512-VNNI variant, `amx_ms` the AMX one, `many_pick` the
engine's timed choice; `--amx off` skips it), and F.linear runs on oneDNN's AMX-BF16 as the engine's does.

    flock /tmp/heavy.lock python benchmarks/gguf_many_rows.py --model qwen2.5-coder-0.5b-instruct

Another checkout's kernel (the same script, that checkout's mixserve): `PYTHONPATH=/path/to/old python
benchmarks/gguf_many_rows.py ...`.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import gguf
import numpy as np
import torch
import torch.nn.functional as F

from mixserve.env import machine_info
from mixserve.host_memory import keep_freed_heap
from mixserve.layers import gguf_kernels, gguf_linear
from mixserve.layers.gguf_linear import GGUFLinear, GGUFWeight
from mixserve.layers.kernel_choice import KernelChooser, time_calls
from mixserve.models.registry import resolve_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--rows", default="8,64,512")
    ap.add_argument("--amx", choices=["on", "off"], default="on", help="time the AMX-INT8 variant too (where built)")
    ap.add_argument("--out")
    a = ap.parse_args()
    torch.set_num_threads(2)
    keep_freed_heap()  # as the engine: a call's output reuses freed memory, not fresh pages
    info = machine_info()
    print(json.dumps(info))
    amx = a.amx == "on" and gguf_kernels.enable_amx()  # oneDNN may use AMX too, as in the engine
    print(f"native kernel variant: {gguf_kernels.isa()}; AMX-INT8 many-row variant timed: {amx}; "
          f"int8 levels per row: {gguf_linear.ACT_LEVELS}", flush=True)
    rows = [int(r) for r in a.rows.split(",")]
    rd = gguf.GGUFReader(str(resolve_model(a.model).path))
    chooser, seen, results = KernelChooser(), set(), []
    for t in rd.tensors:
        kind = t.name.split(".")[-2] if t.name.startswith("blk.") else t.name.split(".")[0]
        tt = t.tensor_type.name
        if tt == "F32" or kind in ("token_embd", "output") or (kind, tt) in seen:
            continue
        seen.add((kind, tt))
        k, n = int(t.shape[0]), int(t.shape[1])
        lin = GGUFLinear([GGUFWeight.from_blocks(tt, np.asarray(t.data), k)], None, torch.bfloat16)
        gguf_linear.choose(lin, chooser)  # the engine's prefetch and many-row variant picks here
        lin.dense_rows = lin.float_dense_rows = None  # the kernel at every row count, as invariance runs it
        dense = lin.dense_weight(torch.bfloat16)
        pick = lin.parts[0].many
        row = {"tensor": kind, "type": tt, "shape": f"{n}x{k}", "many_pick": "amx" if pick else "vnni"}
        with torch.inference_mode():
            for r in rows:
                x = torch.randn(r, k).to(torch.bfloat16)
                lin.parts[0].many = 0
                row[f"kernel_ms_{r}"] = 1e3 * time_calls([lin, lin], lambda m: m(x))
                if amx:
                    lin.parts[0].many = 1
                    row[f"amx_ms_{r}"] = 1e3 * time_calls([lin, lin], lambda m: m(x))
                lin.parts[0].many = pick
                row[f"dense_ms_{r}"] = 1e3 * time_calls([dense, dense], lambda w: F.linear(x, w))
                row[f"kernel/dense_{r}"] = row[f"kernel_ms_{r}"] / row[f"dense_ms_{r}"]
                if amx:
                    row[f"amx/dense_{r}"] = row[f"amx_ms_{r}"] / row[f"dense_ms_{r}"]
        print(json.dumps({k2: round(v, 3) if isinstance(v, float) else v for k2, v in row.items()}), flush=True)
        results.append(row)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)  # a fresh clone has no results/
        with open(a.out, "w") as f:
            json.dump({"machine": info, "model": a.model, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
