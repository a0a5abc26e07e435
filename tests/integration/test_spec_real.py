"""Speculative decoding on real models: greedy output equals plain greedy (float32)."""
import pytest

from mixserve import SamplingParams
from mixserve.llm import LLM

pytestmark = pytest.mark.integration


def test_smollm2_self_draft_accepts_everything(smollm2_path):
    llm = LLM(smollm2_path, dtype="float32", kv_cache_memory="256MiB", draft_model=smollm2_path,
              num_speculative_tokens=4, speculation="fixed", progress=False)
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    spec = llm.generate(["def fib(n):", "The capital of France is"], sp)
    llm.engine.controller.mode = "off"
    plain = llm.generate(["def fib(n):", "The capital of France is"], sp)
    for s, p in zip(spec, plain):
        assert s.token_ids == p.token_ids
        m = s.metrics
        assert m["spec_proposed"] > 0 and m["spec_accepted"] == m["spec_evaluated"]


def test_qwen_pair_humaneval_greedy_equals_plain():
    from mixserve.data.datasets import load_humaneval

    llm = LLM("qwen2.5-coder-1.5b-instruct", dtype="float32", kv_cache_memory="512MiB",
              draft_model="qwen2.5-coder-0.5b-instruct", num_speculative_tokens=4, speculation="fixed",
              progress=False)
    prompts = [r.prompt for r in load_humaneval(2)]
    sp = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    spec = llm.generate(prompts, sp)
    llm.engine.controller.mode = "off"
    plain = llm.generate(prompts, sp)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert sum(o.metrics["spec_accepted"] for o in spec) > 0
    assert llm.engine.runner.num_forwards == llm.engine.num_steps

