"""Compile time of our C++ kernels' headers (issue 32): an empty translation unit with the headers
`<torch/types.h>` brought (the old head) and with layers/cpp_build.LITE_HEAD, then each kernel's
whole source with LITE_HEAD, then the three as one unit (cpp_build.bundle_source, what a start
builds), `g++ -O3 -march=native -fopenmp` as the builds run it, alternated.

    python benchmarks/cpp_headers.py [--rounds 2]
"""
from __future__ import annotations

import argparse
import os
import platform
import subprocess
import tempfile
import time

OLD_HEAD = "#include <torch/library.h>\n#include <torch/types.h>"


def compile_s(src: str, incs: list[str]) -> float:
    with tempfile.TemporaryDirectory() as d:
        f = os.path.join(d, "t.cpp")
        open(f, "w").write(src)
        t = time.perf_counter()
        subprocess.run(["g++", "-O3", "-march=native", "-fopenmp", "-std=c++17", "-fPIC", *incs, "-c", f,
                        "-o", os.path.join(d, "t.o")], check=True, capture_output=True)
        return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    from torch.utils.cpp_extension import include_paths

    from mixserve.layers import cpp_build, gguf_kernels, invariant_linear, paged_decode

    incs = [f"-I{p}" for p in include_paths()]
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
               platform.machine())
    isa = sorted({f for ln in open("/proc/cpuinfo") if ln.startswith("flags") for f in ln.split()
                  if f.startswith(("avx512_vnni", "avx2", "amx"))})
    print(f"machine: {cpu} ({' '.join(isa)}), {os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}; seconds")
    kernels = {"gguf": (gguf_kernels._SRC, ["available", "isa_level"]),
               "paged_decode": (paged_decode._SRC, ["paged_decode", "paged_rows"]),
               "invariant_linear": (invariant_linear._SRC, ["available"])}
    for r in range(a.rounds):
        old = compile_s(OLD_HEAD + "\nint x;\n", incs)
        lite = compile_s(cpp_build.LITE_HEAD + "\nint x;\n", incs)
        whole = {k: compile_s(cpp_build._lite_source("mixserve_x", src, fns), incs) for k, (src, fns) in kernels.items()}
        bundle = compile_s(cpp_build.bundle_source([cpp_build.Kernel(f"mixserve_{k}", src, tuple(fns))
                                                    for k, (src, fns) in kernels.items()]), incs)
        print(f"round {r + 1}: empty unit, old head {old:.1f}, LITE_HEAD {lite:.1f}; whole kernels with LITE_HEAD: "
              + ", ".join(f"{k} {v:.1f}" for k, v in whole.items())
              + f" (sum {sum(whole.values()):.1f}); the three as one unit {bundle:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
