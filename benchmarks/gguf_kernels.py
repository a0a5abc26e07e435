"""The native GGUF kernel against the int4 x int8 VNNI kernel (RTN g128) and float32 on the models' own tensors.

For each (model, tensor kind, GGUF type) of --models, one real tensor from the file is repacked into
the native layout (layers/gguf_linear.py), given the prefetch distance the engine picks here, and timed
as the kernel chooser times (copies rotating past the last-level cache, median of passes) at 1, 2, 4
and 8 rows, the native kernel at every row count, with the int4 x int8 VNNI kernel
(layers/int4_vnni.py, RTN group 128 on the same shape, where the CPU has it) and a float32 nn.Linear
(the dequantized load's) beside it. GB/s = resident weight bytes per call / seconds.

    flock /tmp/heavy.lock python benchmarks/gguf_kernels.py --models qwen2.5-coder-1.5b-instruct
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import gguf
import numpy as np
import torch

from mixserve.env import machine_info
from mixserve.layers import gguf_kernels, int4_vnni
from mixserve.layers import gguf_linear
from mixserve.layers.gguf_linear import GGUFLinear, GGUFWeight, clone_weight
from mixserve.layers.kernel_choice import KernelChooser, rotating_copies, time_calls
from mixserve.layers.linear import _int4_copies
from mixserve.models.registry import resolve_model

ROWS = (1, 2, 4, 8)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="qwen2.5-coder-0.5b-instruct,qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.set_num_threads(2)
    print(json.dumps(machine_info()))
    assert gguf_kernels.available(), "the native kernel needs AVX2, FMA and F16C (or AVX512-VNNI)"
    print(f"native kernel variant: {gguf_kernels.isa()}")
    results = []
    chooser = KernelChooser()
    for model in a.models.split(","):
        rd = gguf.GGUFReader(str(resolve_model(model).path))
        seen = set()
        for t in rd.tensors:
            kind = t.name.split(".")[-2] if t.name.startswith("blk.") else t.name.split(".")[0]
            tt = t.tensor_type.name
            if tt == "F32" or kind == "token_embd" or (kind, tt) in seen:
                continue
            seen.add((kind, tt))
            k, n = int(t.shape[0]), int(t.shape[1])
            base = GGUFWeight.from_blocks(tt, np.asarray(t.data), k)
            # the prefetch distance the engine runs with here (the chooser's cached or measured pick)
            gguf_linear.choose(GGUFLinear([base], None, torch.bfloat16), chooser)

            def make(base=base):
                return GGUFLinear([clone_weight(base)], None, torch.bfloat16)  # dense_rows None: the kernel
            mods = rotating_copies(make, base.nbytes())
            row = {"model": model, "tensor": kind, "type": tt, "shape": f"{n}x{k}", "bytes": base.nbytes(),
                   "prefetch": base.prefetch}
            for r in ROWS:
                x = torch.randn(r, k).to(torch.bfloat16)
                row[f"native_ms_{r}"] = 1e3 * time_calls(mods, lambda m: m(x))
            del mods
            if int4_vnni.available() and int4_vnni.supported(k, 128):
                i4 = _int4_copies(n, k, 128, torch.bfloat16, "vnni")
                for r in ROWS:
                    x = torch.randn(r, k).to(torch.bfloat16)
                    row[f"int4_ms_{r}"] = 1e3 * time_calls(i4, lambda m: m(x))
                row["int4_bytes"] = i4[0].weight_bytes()
                del i4
            # the dequantized load's float32 linear on the same shape (what a CPU without the native
            # kernel ran before its AVX2 variant, issue 43)
            f32 = rotating_copies(lambda: torch.nn.Linear(k, n, bias=False), n * k * 4)
            for r in ROWS:
                x = torch.randn(r, k)
                with torch.inference_mode():
                    row[f"f32_ms_{r}"] = 1e3 * time_calls(f32, lambda m: m(x))
            del f32
            row["native_GBps_1"] = row["bytes"] / row["native_ms_1"] / 1e6
            row["f32_over_native_1"] = row["f32_ms_1"] / row["native_ms_1"]
            if "int4_ms_1" in row:
                row["int4_GBps_1"] = row["int4_bytes"] / row["int4_ms_1"] / 1e6
            print(json.dumps({k2: round(v, 3) if isinstance(v, float) else v for k2, v in row.items()}), flush=True)
            results.append(row)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)  # a fresh clone has no results/
        with open(a.out, "w") as f:
            json.dump({"machine": machine_info(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
