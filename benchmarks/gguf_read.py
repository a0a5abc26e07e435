"""Reading and dequantizing a GGUF file: the `gguf` package's own code against mixserve's faster paths,
side by side in one run (issue 32: a cold start and the suite paid both).

- read: `gguf.GGUFReader(path)` against `models/gguf_file.open_gguf(path)` (the same reader over a
  plain ndarray view of its memory map); both parse every metadata value, tensors' data stay mapped.
- dequantize: `gguf.quants.dequantize` against `layers/gguf_blocks.dequantize` (PyTorch, the same
  bits) over every 2-D tensor of a type mixserve parses, to float32.

Rounds alternate the two sides; read the ratios (the machines are noisy).

    python benchmarks/gguf_read.py [--model qwen2.5-coder-0.5b-instruct] [--rounds 2]
"""
from __future__ import annotations

import argparse
import datetime
import platform
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct", help="built-in name or GGUF path")
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()

    import gguf
    import numpy as np
    import torch

    from mixserve.env import cpu_flags
    from mixserve.layers import gguf_blocks
    from mixserve.models.gguf_file import open_gguf
    from mixserve.models.registry import resolve_model

    path = str(resolve_model(a.model).path)
    flags = cpu_flags()
    isa = "avx512_vnni" if "avx512_vnni" in flags else "avx512f" if "avx512f" in flags else \
        "avx2" if "avx2" in flags else "other"
    model = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
                 platform.processor())
    print(f"machine: {model} ({isa}), {torch.get_num_threads()} threads, {datetime.date.today()}; {path}")

    def timed(fn):
        t0 = time.perf_counter()
        out = fn()
        return time.perf_counter() - t0, out

    for r in range(1, a.rounds + 1):
        t_pkg, reader = timed(lambda: gguf.GGUFReader(path))
        t_fast, _ = timed(lambda: open_gguf(path))
        todo = [t for t in reader.tensors if t.tensor_type.name in gguf_blocks.PARSERS and len(t.shape) == 2]
        t_np, _ = timed(lambda: [gguf.quants.dequantize(t.data, t.tensor_type) for t in todo])
        t_torch, _ = timed(lambda: [gguf_blocks.dequantize(t.tensor_type.name, np.asarray(t.data), int(t.shape[0]))
                                    for t in todo])
        print(f"round {r}: read {t_pkg:.2f} -> {t_fast:.2f} s ({t_fast / t_pkg:.2f}x); dequantize {len(todo)} tensors "
              f"{t_np:.2f} -> {t_torch:.2f} s ({t_torch / t_np:.2f}x)")


if __name__ == "__main__":
    main()
