"""The two few-row int4 kernels side by side on a model's int4 shapes (issue 14): PyTorch's
`_weight_int4pack_mm_for_cpu` (bf16 activations) against ours, int4 x int8 with AVX512-VNNI
(layers/int4_vnni.py), at 1, 2, 4 and 8 rows, timed as the kernel chooser times them (weights
rotating past the last-level cache, `kernel_choice.time_calls`). Prints ms per call and GB/s of
int4 weight read.

    python benchmarks/int4_kernels.py            # the 1.5B's gate/up, down and LM head, bf16, g128
"""
from __future__ import annotations

import argparse

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="17920x1536,1536x8960,151936x1536", help="OUTxIN,... (int4 linears)")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--rows", default="1,2,4,8")
    a = ap.parse_args()

    from mixserve.env import machine_info
    from mixserve.layers import int4_vnni
    from mixserve.layers.kernel_choice import cap_threads, time_calls
    from mixserve.layers.linear import _int4_copies

    cap_threads()
    info = machine_info()
    print(f"{info['cpu']}, {torch.get_num_threads()} threads, torch {info['torch']}, {info['date']}")
    kernels = ["torch"] + (["vnni"] if int4_vnni.available() else [])
    rows = [int(r) for r in a.rows.split(",")]
    print("| shape (int4 g%d) | kernel | " % a.group_size + " | ".join(f"{r} rows" for r in rows) + " |")
    print("|---|---|" + "---|" * len(rows))
    for shape in a.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        for kern in kernels:
            mods = _int4_copies(n, k, a.group_size, torch.bfloat16, kern)
            cells = []
            for r in rows:
                x = torch.randn(r, k).to(torch.bfloat16)
                t = time_calls(mods, lambda m: m(x))
                cells.append(f"{t * 1e3:.3f} ({n * k / 2 / t / 1e9:.1f} GB/s)")
            print(f"| {shape} | {kern} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
