"""Decode step time of two checkouts, alternated in one run: eager steps and the compiled decode graph,
at 1 and 8 rows (issue 32: a start-up change may not cost decode speed), or the rows --rows names.

Each round starts one fresh process per checkout (PYTHONPATH points at it), loads the model with the graph
forced (`--kernels decode_graph=compiled`; Inductor's cache makes later rounds load it), and times
`steps` decode steps per case on dummy rows at a 128-token context (engine/decode_graph.dummy_decode_steps),
the median of all but the first 4. Ratios within a round are what to read: the machines are noisy;
the order within a round alternates.

    python benchmarks/decode_graph_ab.py --old /tmp/old-checkout --new . [--rounds 2] [--gguf-weights native] [--dtype bfloat16]
    python benchmarks/decode_graph_ab.py --old /tmp/old-checkout --model qwen2.5-coder-1.5b-instruct --rows 1,2,3,4,5 --paths eager
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

_CHILD = r"""
import json, os, statistics, sys
import torch
from mixserve.llm import LLM
from mixserve.engine.decode_graph import dummy_decode_steps
llm = LLM(sys.argv[1], progress=False, kernels="decode_graph=compiled", **json.loads(sys.argv[3]))
r, g = llm.engine.runner, llm.engine.runner.graph
out = {}
with torch.inference_mode():
    for rows in json.loads(sys.argv[4]):
        for name, run in [x for x in (("eager", r.run_eager), ("compiled", g.run)) if x[0] in sys.argv[5]]:
            ts = dummy_decode_steps(r, rows, 128, int(sys.argv[2]), run)[4:]
            out[f"{name}@{rows}"] = round(statistics.median(ts) * 1e3, 1)
print(json.dumps(out))
"""


def run(code: str, model: str, steps: int, engine: dict, rows: list[int], paths: str) -> dict:
    env = {**os.environ, "PYTHONPATH": code, "MIXSERVE_KERNEL_TIMING": "prior",
           "MIXSERVE_KERNEL_CACHE": os.path.join(tempfile.mkdtemp(), "choices.json")}
    p = subprocess.run([sys.executable, "-c", _CHILD, model, str(steps), json.dumps(engine), json.dumps(rows),
                        paths], cwd=code, env=env,
                       capture_output=True,
                       text=True, timeout=900)
    if p.returncode:
        raise SystemExit(f"{code}: exit {p.returncode}\n{p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", required=True, help="the checkout to compare against")
    ap.add_argument("--new", default=".", help="this checkout (default)")
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--gguf-weights", default=None, choices=["native", "dequantize"],
                    help="how a GGUF loads (default: the engine's choice for this CPU)")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="compute dtype (default: the engine's)")
    ap.add_argument("--rows", default="1,8", help="rows a step, comma-separated (2-5 rows: a verification's shapes)")
    ap.add_argument("--paths", default="eager,compiled", help="eager, compiled or both")
    a = ap.parse_args()
    rows = [int(r) for r in a.rows.split(",")]
    engine = {"gguf_weights": a.gguf_weights} if a.gguf_weights else {}
    if a.dtype:
        engine["dtype"] = a.dtype
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
               platform.machine())
    isa = sorted({f for ln in open("/proc/cpuinfo") if ln.startswith("flags") for f in ln.split()
                  if f.startswith(("avx512", "avx2", "amx"))})
    print(f"machine: {cpu} ({' '.join(isa)}), {os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}; "
          "ms per decode step (median)")
    for i in range(a.rounds):
        # the order alternates (old first on odd rounds): the second process of a pair met a
        # warmer machine in earlier runs
        if i % 2 == 0:
            old = run(os.path.abspath(a.old), a.model, a.steps, engine, rows, a.paths)
            new = run(os.path.abspath(a.new), a.model, a.steps, engine, rows, a.paths)
        else:
            new = run(os.path.abspath(a.new), a.model, a.steps, engine, rows, a.paths)
            old = run(os.path.abspath(a.old), a.model, a.steps, engine, rows, a.paths)
        print(f"round {i + 1} ({'old' if i % 2 == 0 else 'new'} first): " + ", ".join(f"{k} {old[k]} -> {new[k]} ({new[k] / old[k]:.2f}x)" for k in old))
    return 0


if __name__ == "__main__":
    sys.exit(main())
