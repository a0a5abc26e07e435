"""Prefill of one 512-token prompt, int4 (RTN g128, int4 LM head) against bf16, in one run.

Both with the kernels chosen on this machine (kernels auto): int4 linears switch to dequantize +
dense GEMM at the measured row count, so a prefill pays the dequantization once per layer per step.
Both engines are loaded at once and their prefills alternate; the median of --repeats prefills each
(each a fresh request, aborted after its first token), and the spread of the per-pair ratios.

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
    engines = {}
    for name, kw in (("bf16", {}), ("int4", {"quantization": "rtn", "quant_group_size": 128})):
        engines[name] = LLMEngine(EngineArgs(model=a.model, kv_cache_memory="256MiB", progress=False,
                                             max_num_batched_tokens=max(2048, a.tokens), **kw))
    tok = engines["bf16"].tokenizer
    ids = tok.encode(synthetic_prompt(tok, a.tokens))[:a.tokens]
    ts = {name: [] for name in engines}
    # alternating prefills, so the host's drift over the run (±10% over minutes here) falls on both
    for _ in range(a.repeats + 1):  # the first pays oneDNN's primitive setup for the shape
        for name, eng in engines.items():
            rid = eng.add_request(ids, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
            t0 = time.perf_counter()
            eng.step()
            ts[name].append(time.perf_counter() - t0)
            eng.abort(rid)
    for name, eng in engines.items():
        med = statistics.median(ts[name][1:])
        res["runs"][name] = {"median_s": med, "seconds": ts[name][1:], "describe": eng.describe()}
        print(f"{name}: prefill {len(ids)} tokens {med * 1e3:.1f} ms; {eng.describe()}", flush=True)
    ratios = sorted(b / i for b, i in zip(ts["bf16"][1:], ts["int4"][1:]))
    res["pair_ratios"] = ratios
    print(f"per-pair int4/bf16 speed ratios: min {ratios[0]:.2f} median {statistics.median(ratios):.2f} "
          f"max {ratios[-1]:.2f}")
    del engines
    gc.collect()
    r = res["runs"]["bf16"]["median_s"] / res["runs"]["int4"]["median_s"]
    res["int4_vs_bf16"] = r
    print(f"int4 prefill speed / bf16: {r:.2f}x ({res['machine']['cpu']}, {res['machine']['date']})")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
