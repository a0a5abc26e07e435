"""Greedy speculative output equals plain greedy output, float32, real target/draft pair.

Both runs batch all prompts through the same engine. The plain run asks for top-2 logprobs, so at the
first divergence the near-tie rule can be applied: it counts only where the reference's two largest
logits differ by >= 0.01 (a log-softmax gap equals the logit gap).

    python benchmarks/spec_equality.py --prompts 20 --max-tokens 128
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--out", default="results/spec_equality.json")
    a = ap.parse_args()

    from mixserve import SamplingParams
    from mixserve.data.datasets import load_humaneval
    from mixserve.llm import LLM

    llm = LLM(a.target, dtype="float32", kv_cache_memory="2GiB", draft_model=a.draft,
              num_speculative_tokens=a.k, speculation="fixed", progress=False)
    prompts = [r.prompt for r in load_humaneval(a.prompts)]
    eng = llm.engine
    eng.controller.mode = "off"
    plain = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True, logprobs=2))
    eng.controller.mode = "fixed"
    spec = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True))
    rows = []
    for i, (p, s) in enumerate(zip(plain, spec)):
        diff = next((t for t, (x, y) in enumerate(zip(p.token_ids, s.token_ids)) if x != y), None)
        gap = None
        if diff is not None:
            top = p.logprobs[diff].top
            gap = top[0][1] - top[1][1]
        ok = diff is None or gap < 0.01
        m = s.metrics
        rows.append({"prompt": i, "identical": diff is None, "ok": ok, "first_diff": diff, "gap": gap,
                     "alpha": m["spec_accepted"] / max(1, m["spec_evaluated"])})
        print(rows[-1], flush=True)
    res = {"config": vars(a), "checked": len(rows), "ok": sum(r["ok"] for r in rows),
           "identical": sum(r["identical"] for r in rows), "tie_rule_used": sum(r["ok"] and not r["identical"] for r in rows),
           "rows": rows}
    print(f"{res['ok']}/{res['checked']} equal (identical {res['identical']}, tie rule used {res['tie_rule_used']})")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
