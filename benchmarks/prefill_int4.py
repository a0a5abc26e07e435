"""Prefill of one 512-token prompt, int4 (RTN g128, int4 LM head) against bf16, in one run.

Both with the kernels chosen on this machine (kernels auto): int4 linears switch to dequantize +
dense GEMM at the measured row count, so a prefill pays the dequantization once per layer per step.
The median of --repeats prefills (each a fresh request, aborted after its first token).

    python benchmarks/prefill_int4.py --model qwen2.5-coder-0.5b-instruct [--tokens 512] [--repeats 5]
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import torch


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="results/prefill_int4.json")
    a = ap.parse_args()

    from mixserve.data.datasets import synthetic_prompt
    from mixserve.engine.args import EngineArgs
    from mixserve.engine.llm_engine import LLMEngine
    from mixserve.env import machine_info
    from mixserve.sampling_params import SamplingParams

    torch.set_num_threads(2)
    res = {"machine": machine_info(), "config": vars(a), "runs": {}}
    for name, kw in (("bf16", {}), ("int4", {"quantization": "rtn", "quant_group_size": 128})):
        eng = LLMEngine(EngineArgs(model=a.model, kv_cache_memory="256MiB", progress=False,
                                   max_num_batched_tokens=max(2048, a.tokens), **kw))
        ids = eng.tokenizer.encode(synthetic_prompt(eng.tokenizer, a.tokens))[:a.tokens]
        ts = []
        for _ in range(a.repeats + 1):  # the first pays oneDNN's primitive setup for the shape
            rid = eng.add_request(ids, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
            t0 = time.perf_counter()
            eng.step()
            ts.append(time.perf_counter() - t0)
            eng.abort(rid)
        res["runs"][name] = {"median_s": statistics.median(ts[1:]), "seconds": ts[1:], "describe": eng.describe()}
        print(f"{name}: prefill {len(ids)} tokens {statistics.median(ts[1:]) * 1e3:.1f} ms; {eng.describe()}",
              flush=True)
        del eng
        gc.collect()
    r = res["runs"]["bf16"]["median_s"] / res["runs"]["int4"]["median_s"]
    res["int4_vs_bf16"] = r
    print(f"int4 prefill speed / bf16: {r:.2f}x ({res['machine']['cpu']}, {res['machine']['date']})")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
