"""Where a step-time model goes wrong, step by step: runs a trace through the real engine and, for
every step, feeds its shape (decode contexts, prefill spans, sampled rows) to the step model of a
`hw probe` profile. Prints measured against predicted step time by batch size, with the predicted
parts (linear, LM head, attention, overhead). Used to find round 4's attention error (BENCHMARKS.md).

    python benchmarks/plan_step_check.py --profile results/hw-qwen05-r4.json --dataset sharegpt --num-prompts 64
"""
from __future__ import annotations

import argparse
import statistics
import time


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--profile", required=True)
    ap.add_argument("--dataset", default="sharegpt")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--kv-cache-memory", default="512MiB")
    ap.add_argument("--max-model-len", type=int, default=4096)
    a = ap.parse_args()

    from mixserve.data.datasets import load_dataset
    from mixserve.engine.args import EngineArgs
    from mixserve.engine.llm_engine import LLMEngine
    from mixserve.plan.hardware import load_step_model
    from mixserve.plan.step_time import StepBatch
    from mixserve.sampling_params import SamplingParams

    eng = LLMEngine(EngineArgs(model=a.model, kv_cache_memory=a.kv_cache_memory, max_model_len=a.max_model_len,
                               progress=False))
    sm, _ = load_step_model(a.profile, eng.cfg, block_size=eng.args.block_size)
    for r in load_dataset(a.dataset, eng.tokenizer, a.num_prompts, seed=0, output_len_cap=256, max_prompt_len=1024):
        eng.add_request(r.prompt, SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True))
    last = {}
    schedule = eng.scheduler.schedule

    def keep(*args, **kw):  # the step's schedule, to read its shape after the step
        last["out"] = schedule(*args, **kw)
        return last["out"]

    eng.scheduler.schedule = keep
    rows = []
    while eng.has_unfinished():
        t0 = time.perf_counter()
        eng.step()
        dt = time.perf_counter() - t0
        b = StepBatch()
        for s in last["out"].scheduled:
            q = s.end - s.start
            (b.decode_contexts.append(s.end) if q == 1 else b.spans.append((q, s.end)))
            b.sampled_rows += int(s.samples)
        rows.append((dt, sm.breakdown(b), len(b.decode_contexts), len(b.spans)))
    decode = [r for r in rows if r[3] == 0 and r[2] > 0]
    print(f"{len(rows)} steps, {len(decode)} pure decode")
    for lo, hi in ((1, 16), (16, 40), (40, 257)):
        sel = [r for r in decode if lo <= r[2] < hi]
        if sel:
            parts = {k: statistics.median(r[1][k] for r in sel) * 1e3 for k in sel[0][1]}
            print(f"decode steps of {lo}-{hi - 1} rows (n={len(sel)}): measured {statistics.median(r[0] for r in sel) * 1e3:.1f} ms, "
                  f"predicted {statistics.median(sum(r[1].values()) for r in sel) * 1e3:.1f} ms = "
                  + " + ".join(f"{k} {v:.1f}" for k, v in parts.items()))
    print(f"all steps: measured {sum(r[0] for r in rows):.2f} s, predicted {sum(sum(r[1].values()) for r in rows):.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
