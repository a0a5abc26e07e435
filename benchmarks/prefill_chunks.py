"""Does a `hw probe` profile predict one prefill step? Each profile's prediction against the engine.

One engine (the model's default weights: a GGUF natively; batch invariance on; prefix caching off,
so nothing is served from the cache) runs single prefill steps of N random tokens (--tokens, a chunk
budget of 4096 so each prompt up to it is one step; the median of --repeats after a first); each
--profiles profile predicts the same steps with the planner's step model (plan/step_time.py). Issue
34: a profile that timed attention on SDPA and linears only to 512 rows predicted 2048 tokens 35% short.

    python benchmarks/prefill_chunks.py --profiles results/hw-05b.json,results/hw-05b-v2.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--profiles", required=True, help="comma-separated hw probe profiles of this model")
    ap.add_argument("--tokens", default="256,1024,2048,3000")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out")
    a = ap.parse_args()

    from mixserve.engine.args import EngineArgs
    from mixserve.engine.llm_engine import LLMEngine
    from mixserve.env import machine_info
    from mixserve.models.registry import resolve_model
    from mixserve.plan.cost_model import BF16, gguf_format
    from mixserve.plan.hardware import engine_format, load_step_model
    from mixserve.plan.step_time import StepBatch
    from mixserve.sampling_params import SamplingParams

    info = machine_info()
    print(json.dumps(info))
    eng = LLMEngine(EngineArgs(model=a.model, kv_cache_memory="512MiB", progress=False, max_num_batched_tokens=4096,
                               graph_warmup="off", enable_prefix_caching=False))
    r = resolve_model(a.model)
    fmt = engine_format(eng.model, r.path) if r.kind == "gguf" else BF16
    models = {p: load_step_model(p, eng.cfg)[0] for p in a.profiles.split(",")}
    g = torch.Generator().manual_seed(0)
    sp = SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0)
    rows = []
    for n in (int(x) for x in a.tokens.split(",")):
        ts = []
        for _ in range(a.repeats + 1):
            rid = eng.add_request(torch.randint(0, eng.cfg.vocab_size, (n,), generator=g).tolist(), sp)
            t0 = time.perf_counter()
            eng.step()
            ts.append(time.perf_counter() - t0)
            eng.abort(rid)
        row = {"tokens": n, "measured_s": statistics.median(ts[1:])}
        for p, sm in models.items():
            b = StepBatch([], [(n, n)], 1)
            row[p] = {"predicted_s": sm.step_time(b, fmt), "error_pct": 100 * (sm.step_time(b, fmt) / row["measured_s"] - 1),
                      "breakdown_s": sm.breakdown(b, fmt)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)  # a fresh clone has no results/
        with open(a.out, "w") as f:
            json.dump({"machine": info, "model": a.model, "format": fmt.name, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
