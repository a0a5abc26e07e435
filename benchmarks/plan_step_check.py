"""Where a step-time model goes wrong, step by step: runs a trace through the real engine and, for
every step, feeds its shape (decode contexts, prefill spans, sampled rows) to the step model of a
`hw probe` profile. Prints measured against predicted step time by batch size, with the predicted
parts (linear, LM head, attention, overhead). Used to find round 4's attention error (BENCHMARKS.md).

    python benchmarks/plan_step_check.py --profile results/hw-qwen05-r4.json --dataset sharegpt --num-prompts 64
    python benchmarks/plan_step_check.py --profile results/hw-05b-s8b.json \
        --dataset results/prefix_cache_s8b.multiturn.jsonl --conversations-at-once 8 --kv-cache-memory 1GiB

A trace file replays as `mixserve bench` does (run_offline; a multi-turn one closed-loop). The model is
planned in the engine's default weight format (cost_model.default_format: a GGUF natively). Steps
with prefill chunks are reported by chunk size, and by whether the chunk follows a cached prefix.
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
    ap.add_argument("--num-prompts", type=int, default=64, help="a trace file: 0 for all of it")
    ap.add_argument("--kv-cache-memory", default="512MiB")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--conversations-at-once", type=int, default=None, help="multi-turn traces, as bench's flag")
    ap.add_argument("--output-len-cap", type=int, default=256)
    ap.add_argument("--no-prefix-caching", action="store_true")
    a = ap.parse_args()

    from mixserve.bench.offline import run_offline
    from mixserve.data.datasets import load_dataset
    from mixserve.engine.args import EngineArgs
    from mixserve.engine.llm_engine import LLMEngine
    from mixserve.models.registry import resolve_model
    from mixserve.plan.cost_model import default_format
    from mixserve.plan.hardware import load_step_model
    from mixserve.plan.step_time import StepBatch

    eng = LLMEngine(EngineArgs(model=a.model, kv_cache_memory=a.kv_cache_memory, max_model_len=a.max_model_len,
                               progress=False, enable_prefix_caching=not a.no_prefix_caching))
    sm, _ = load_step_model(a.profile, eng.cfg, block_size=eng.args.block_size)
    fmt = default_format(resolve_model(a.model))
    from_file = a.dataset.endswith(".jsonl")  # a trace (mix sample): as it is, every request of it by default
    reqs = load_dataset(a.dataset, eng.tokenizer, a.num_prompts if not from_file else (a.num_prompts or None), seed=0,
                        output_len_cap=a.output_len_cap, **({} if from_file else {"max_prompt_len": 1024}))
    run_offline(eng, reqs[:2], progress=False)  # warm-up (the decode graph), not counted
    eng.reset_prefix_cache()
    last = {}
    schedule = eng.scheduler.schedule

    def keep(*args, **kw):  # the step's schedule, to read its shape after the step
        last["out"] = schedule(*args, **kw)
        return last["out"]

    eng.scheduler.schedule = keep
    rows = []
    step = eng.step

    def timed_step():
        t0 = time.perf_counter()
        out = step()
        dt = time.perf_counter() - t0
        if "out" not in last:
            return out
        b = StepBatch()
        cached = False
        for s in last.pop("out").scheduled:
            q = s.end - s.start
            (b.decode_contexts.append(s.end) if q == 1 else b.spans.append((q, s.end)))
            cached |= q > 1 and s.start > 0
            b.sampled_rows += int(s.samples)
        if b.num_tokens:
            rows.append((dt, sm.breakdown(b, fmt), len(b.decode_contexts), len(b.spans), b, cached))
        return out

    eng.step = timed_step
    run_offline(eng, reqs, progress=False, conversations_at_once=a.conversations_at_once)
    decode = [r for r in rows if r[3] == 0 and r[2] > 0]
    print(f"{len(rows)} steps, {len(decode)} pure decode")
    for lo, hi in ((1, 16), (16, 40), (40, 257)):
        sel = [r for r in decode if lo <= r[2] < hi]
        if sel:
            parts = {k: statistics.median(r[1][k] for r in sel) * 1e3 for k in sel[0][1]}
            print(f"decode steps of {lo}-{hi - 1} rows (n={len(sel)}): measured {statistics.median(r[0] for r in sel) * 1e3:.1f} ms, "
                  f"predicted {statistics.median(sum(r[1].values()) for r in sel) * 1e3:.1f} ms = "
                  + " + ".join(f"{k} {v:.1f}" for k, v in parts.items()))
    spans = [r for r in rows if r[3] > 0]
    for lo, hi in ((1, 32), (32, 128), (128, 512), (512, 1 << 30)):
        for cached in (False, True):
            sel = [r for r in spans if lo <= max(q for q, _ in r[4].spans) < hi and r[5] == cached]
            if sel:
                parts = {k: statistics.median(r[1][k] for r in sel) * 1e3 for k in sel[0][1]}
                ctx = statistics.median(max(c for _, c in r[4].spans) for r in sel)
                meas, pred = statistics.median(r[0] for r in sel), statistics.median(sum(r[1].values()) for r in sel)
                print(f"steps with a chunk of {lo}-{min(hi - 1, 99999)} tokens, {'after a cached prefix' if cached else 'from position 0'} "
                      f"(n={len(sel)}, median context {ctx:.0f}, decode rows {statistics.median(r[2] for r in sel):.0f}): "
                      f"measured {meas * 1e3:.1f} ms, predicted {pred * 1e3:.1f} ms ({pred / meas - 1:+.0%}) = "
                      + " + ".join(f"{k} {v:.1f}" for k, v in parts.items()))
    print(f"all steps: measured {sum(r[0] for r in rows):.2f} s, predicted {sum(sum(r[1].values()) for r in rows):.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
