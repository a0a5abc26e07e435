"""Streaming rate of each dense bf16 kernel by rows, on weights rotating past the last-level cache.

The candidates of the dense-linear choice (layers/kernel_choice.py): plain F.linear, oneDNN's
prepacked GEMM and our AVX512-BF16 gemv (layers/bf16_gemv.py), each timed as the chooser times
it (rotating_copies + time_calls) but reported per row count, for the 0.5B's gate/up, LM head and
qkv shapes. GB/s = weight bytes / seconds per call.

    python benchmarks/dense_kernels.py [--shapes 9728x896,151936x896,1152x896] [--rows 1,2,4,16,128]
"""
from __future__ import annotations

import argparse

import torch

from mixserve.env import machine_info
from mixserve.layers import bf16_gemv
from mixserve.layers.kernel_choice import llc_bytes, rotating_copies, time_calls
from mixserve.layers.linear import DenseLinear


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="9728x896,151936x896,1152x896", help="OUTxIN,...")
    ap.add_argument("--rows", default="1,2,4,16,128")
    a = ap.parse_args()
    torch.set_num_threads(2)
    print(machine_info(), f"LLC {llc_bytes() / 2**20:.0f} MiB")
    rows = [int(r) for r in a.rows.split(",")]
    impls = ["plain", "onednn"] + (["gemv"] if bf16_gemv.available() else [])
    print("| shape | kernel | " + " | ".join(f"{r} row{'s' if r > 1 else ''}" for r in rows) + " |")
    print("|---|---|" + "---|" * len(rows))
    for shape in a.shapes.split(","):
        o, i = (int(v) for v in shape.split("x"))
        base = torch.randn(o, i).to(torch.bfloat16)
        for impl in impls:
            def make():
                m = DenseLinear(base.clone())
                m.set_impl(impl)
                return m
            mods = rotating_copies(make, o * i * 2)
            cells = []
            for r in rows:
                x = torch.randn(r, i).to(torch.bfloat16)
                t = time_calls(mods, lambda m: m(x))
                cells.append(f"{t * 1e3:.3f} ms ({o * i * 2 / t / 1e9:.1f} GB/s)")
            print(f"| {shape} | {impl} | " + " | ".join(cells) + " |", flush=True)
            del mods


if __name__ == "__main__":
    main()
