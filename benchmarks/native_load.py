"""A native GGUF load, phase by phase, in one process (issue 32): the header's parse, the repack of
every quantized tensor (models/weights.read_gguf_native), and the read of the kept layout
(models/native_store.load) that replaces both at a later start; then a whole `LLM(...,
gguf_weights="native")` from the file and from the store, alternated.

    python benchmarks/native_load.py --model qwen2.5-coder-0.5b-instruct [--rounds 2]

Needs the native kernel (AVX2, FMA, F16C). Writes the store to a temporary folder, removed at exit.
"""
from __future__ import annotations

import argparse
import os
import platform
import shutil
import tempfile
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    store_dir = tempfile.mkdtemp(prefix="native-load-")
    os.environ["MIXSERVE_NATIVE_CACHE"] = store_dir
    try:
        from mixserve.llm import LLM
        from mixserve.models import native_store, packed_weights
        from mixserve.models.gguf_file import open_gguf
        from mixserve.models.registry import pull
        from mixserve.models.weights import gguf_config, read_gguf_native

        path = str(pull(a.model, progress=False))
        cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
                   platform.machine())
        isa = sorted({f for ln in open("/proc/cpuinfo") if ln.startswith("flags") for f in ln.split()
                      if f.startswith(("avx512_vnni", "avx2", "amx"))})
        print(f"machine: {cpu} ({' '.join(isa)}), {os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}; {a.model}")
        for r in range(a.rounds):
            t0 = time.perf_counter()
            gguf_config(open_gguf(path))
            t1 = time.perf_counter()
            cfg, _, weights, types = read_gguf_native(path, progress=False)
            t2 = time.perf_counter()
            store = native_store.store_path(path)
            native_store.save_in_background(store, path, cfg, weights, types).join()
            t3 = time.perf_counter()
            assert native_store.load(store, path) is not None
            t4 = time.perf_counter()
            print(f"round {r + 1}: header parse {t1 - t0:.2f} s, header + repack {t2 - t1:.2f} s, "
                  f"store write {t3 - t2:.2f} s, store read + checks {t4 - t3:.2f} s")
            llms = {}
            for how in ("file", "store"):
                if how == "file":
                    shutil.rmtree(store, ignore_errors=True)
                t = time.perf_counter()
                llms[how] = LLM(path, gguf_weights="native", progress=False, graph_warmup="off")
                llms[how] = time.perf_counter() - t
                packed_weights.finish_writing()  # the file's load kept the store for the next
            print(f"round {r + 1}: LLM(gguf_weights='native') from the file {llms['file']:.2f} s, "
                  f"from the kept layout {llms['store']:.2f} s ({llms['file'] / llms['store']:.1f}x)")
    finally:
        shutil.rmtree(store_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
