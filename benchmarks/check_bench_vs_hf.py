"""Rerun k requests of a `mixserve bench` ShareGPT run greedily in float32, in mixserve and in HF
transformers, and check the outputs match under the near-tie rule (a divergence counts only where
HF's two largest logits differ by >= 0.01).

    python benchmarks/check_bench_vs_hf.py --num-prompts 200 --check 8
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def _reference():
    """tests/reference.py loaded by its path: this script changes no sys.path, so no module of the
    checkout can shadow an installed package for the rest of the process (issue 46)."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "tests" / "reference.py"
    spec = importlib.util.spec_from_file_location("mixserve_tests_reference", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up by name
    spec.loader.exec_module(mod)
    return mod


_ref = _reference()
compare_greedy, hf_greedy = _ref.compare_greedy, _ref.hf_greedy


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--num-prompts", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check", type=int, default=8)
    ap.add_argument("--out", default="results/check_bench_vs_hf.json")
    a = ap.parse_args()

    from transformers import AutoModelForCausalLM

    from mixserve import SamplingParams
    from mixserve.data.datasets import load_sharegpt
    from mixserve.llm import LLM

    llm = LLM(a.model, dtype="float32", progress=False)
    reqs = load_sharegpt(llm.tokenizer, a.num_prompts, seed=a.seed, max_prompt_len=1024, max_output_len=256)
    step = max(1, len(reqs) // a.check)
    picked = list(range(0, len(reqs), step))[:a.check]
    prompts = [llm.tokenizer.encode(reqs[i].prompt) for i in picked]
    outs = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=reqs[i].max_tokens, ignore_eos=True)
                                  for i in picked])
    hf = AutoModelForCausalLM.from_pretrained(str(llm.engine.model_dir), dtype=torch.float32).eval()
    rows = []
    for i, p, o in zip(picked, prompts, outs):
        ref, logits = hf_greedy(hf, p, reqs[i].max_tokens)
        c = compare_greedy(o.token_ids, ref, logits)
        rows.append({"request": i, "prompt_tokens": len(p), "new_tokens": len(o.token_ids), "ok": c.ok,
                     "identical": c.equal, "tie_rule_used": c.tie_used, "first_diff": c.position, "gap": c.gap})
        print(rows[-1], flush=True)
    summary = {"checked": len(rows), "ok": sum(r["ok"] for r in rows), "identical": sum(r["identical"] for r in rows),
               "tie_rule_used": sum(r["tie_rule_used"] for r in rows), "rows": rows}
    print(f"{summary['ok']}/{summary['checked']} match (identical {summary['identical']}, "
          f"tie rule used {summary['tie_rule_used']})")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(summary, indent=1))
    sys.exit(0 if summary["ok"] == summary["checked"] else 1)


if __name__ == "__main__":
    main()
