"""Prompt scoring (issue 15, item 3): SamplingParams.prompt_logprobs computed in the prefill that
runs anyway, equal to a float32 reference forward's log-softmax, through chunked prefill and
preemption; max_tokens 0 runs the prefill only."""
import pytest
import torch

from mixserve import SamplingParams
from mixserve.llm import LLM
from tests.unit.test_engine_tiny import VOCAB, make_tiny, prompts


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("pl"), "qwen2", tie=False)


def reference_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """log p(ids[i] | ids[:i]) for i >= 1 and the full log-softmax rows, float32, from HF."""
    with torch.inference_mode():
        logits = hf(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, -1)


def check(out, hf, ids, k):
    ref = reference_logprobs(hf, ids)
    pl = out.prompt_logprobs
    assert pl is not None and len(pl) == len(ids) - 1
    for i, lp in enumerate(pl):
        row = ref[i]
        assert lp.token_id == ids[i + 1]
        assert abs(lp.logprob - row[ids[i + 1]].item()) < 1e-4, (i, lp.logprob, row[ids[i + 1]].item())
        assert lp.rank == int((row > row[ids[i + 1]]).sum()) + 1
        assert len(lp.top) == k
        if not k:
            continue
        top_v, top_i = row.topk(k)
        assert [t for t, _ in lp.top][:1] == top_i.tolist()[:1]
        assert max(abs(v - rv) for (_, v), rv in zip(lp.top, top_v.tolist())) < 1e-4


def test_prompt_logprobs_equal_float32_reference_with_chunked_prefill(tiny):
    folder, hf = tiny
    ps = prompts(5, seed=3, lo=20, hi=60)
    for budget in (2048, 7):  # one prefill per prompt; chunks of 7 tokens
        llm = LLM(folder, dtype="float32", kv_cache_memory="4MiB", max_num_batched_tokens=budget, progress=False)
        f0 = llm.engine.runner.num_forwards
        outs = llm.generate(ps, SamplingParams(max_tokens=0, prompt_logprobs=3))
        forwards = llm.engine.runner.num_forwards - f0
        for o, ids in zip(outs, ps):
            check(o, hf, ids, 3)
            assert o.token_ids == [] and o.finish_reason == "length" and o.text == ""
        # only the prefill ran: the same forwards as the same prompts without scoring, one
        # token each (max_tokens 1), and no forward beyond the prefill chunks (with the prompts'
        # cached blocks forgotten: scoring filled the prefix cache)
        assert llm.engine.reset_prefix_cache()
        f0 = llm.engine.runner.num_forwards
        llm.generate(ps, SamplingParams(max_tokens=1, temperature=0))
        assert forwards == llm.engine.runner.num_forwards - f0
        if budget == 7:
            assert forwards >= sum(len(p) for p in ps) // 7


def test_prompt_logprobs_kept_through_preemption(tiny):
    folder, hf = tiny
    ps = prompts(6, seed=5, lo=30, hi=40)
    # a cache too small for six 40 + 60 token sequences: decode preempts and recomputes
    llm = LLM(folder, dtype="float32", kv_cache_memory=f"{160 * 1024}", block_size=4, progress=False)
    outs = llm.generate(ps, SamplingParams(max_tokens=60, temperature=0, ignore_eos=True, prompt_logprobs=2))
    assert sum(o.metrics["num_preemptions"] for o in outs) > 0
    for o, ids in zip(outs, ps):
        check(o, hf, ids, 2)
        assert len(o.token_ids) == 60
    assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks


def test_prompt_logprobs_with_a_draft_model_and_sampling(tiny):
    folder, hf = tiny
    ps = prompts(3, seed=9, lo=10, hi=30)
    llm = LLM(folder, dtype="float32", kv_cache_memory="4MiB", draft_model="ngram", speculation="fixed",
              progress=False)
    outs = llm.generate(ps, SamplingParams(max_tokens=8, temperature=0.8, seed=1, prompt_logprobs=0))
    for o, ids in zip(outs, ps):
        check(o, hf, ids, 0)
        assert len(o.token_ids) >= 1


def test_prompt_logprobs_limits(tiny):
    folder, _ = tiny
    llm = LLM(folder, dtype="float32", kv_cache_memory="4MiB", max_scored_prompt_tokens=16, progress=False)
    with pytest.raises(ValueError, match="prompt scoring"):
        llm.generate([[1] * 17], SamplingParams(max_tokens=0, prompt_logprobs=1))
    out = llm.generate([[1] * 16], SamplingParams(max_tokens=0, prompt_logprobs=1))[0]
    assert len(out.prompt_logprobs) == 15
    # a one-token prompt has nothing to score: an empty list, not None
    assert llm.generate([[5]], SamplingParams(max_tokens=0, prompt_logprobs=1))[0].prompt_logprobs == []
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    # a prompt that fills the context is scored (max_tokens 0) but not continued
    full = LLM(folder, dtype="float32", kv_cache_memory="4MiB", max_model_len=24, progress=False)
    ids = prompts(1, seed=2, lo=24, hi=24)[0]
    assert len(full.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=0))[0].prompt_logprobs) == 23
    with pytest.raises(ValueError, match="context"):
        full.generate([ids], SamplingParams(max_tokens=1))
    assert full.engine.block_manager.num_free_blocks == full.engine.num_blocks
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=-1)
    assert VOCAB > 0
