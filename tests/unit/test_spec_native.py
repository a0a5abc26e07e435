"""Speculation over a native GGUF target (issue 34): greedy equal to plain native greedy, with prompt
lookup, with a draft model as stored and with the draft rounded to int4 at load (--draft-quantization
rtn), on a tiny GGUF made in the test. Batch invariance is on (the default), so the k + 1 rows of a
verification pass give the same logits as 1-row steps: equal outright, without the tie rule."""
import numpy as np
import pytest

from mixserve import SamplingParams
from mixserve.engine.args import EngineArgs
from mixserve.engine.llm_engine import LLMEngine
from tests.unit.test_gguf_native import VOCAB, write_tiny_gguf


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return str(write_tiny_gguf(tmp_path_factory.mktemp("spec-gguf") / "tiny-llama.gguf"))


def run(path, prompts, **kw):
    eng = LLMEngine(EngineArgs(model=path, dtype="float32", kv_cache_memory="4MiB", progress=False,
                               gguf_weights="native", graph_warmup="off", **kw))
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    ids = [eng.add_request(p, sp) for p in prompts]
    outs = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o.token_ids
    return [outs[i] for i in ids], eng


def prompts():
    rng = np.random.default_rng(3)
    # repeats inside each prompt give prompt lookup something to propose
    out = []
    for n in (12, 30, 45):
        base = rng.integers(2, VOCAB, n).tolist()
        out.append(base + base[: n // 2])
    return out


def test_speculative_greedy_over_a_native_target_equals_plain(tiny_gguf):
    ps = prompts()
    plain, _ = run(tiny_gguf, ps)
    ngram, eng = run(tiny_gguf, ps, draft_model="ngram", speculation="fixed", num_speculative_tokens=4)
    assert ngram == plain
    draft, eng = run(tiny_gguf, ps, draft_model=tiny_gguf, speculation="fixed", num_speculative_tokens=3)
    assert draft == plain
    # the draft, as stored, runs natively too; a copy of the target as draft accepts (nearly) every token
    assert "GGUF weights native" in eng.describe()
    assert eng.controller.alpha_global > 0.9


def test_an_int4_draft_keeps_the_targets_greedy_output(tiny_gguf):
    ps = prompts()
    plain, _ = run(tiny_gguf, ps)
    out, eng = run(tiny_gguf, ps, draft_model=tiny_gguf, draft_quantization="rtn", quant_group_size=32,
                   speculation="fixed", num_speculative_tokens=3)
    assert out == plain
    from mixserve.layers.linear import Int4Linear

    drafter = eng.proposer.runner.model
    assert any(isinstance(m, Int4Linear) for m in drafter.modules())
    with pytest.raises(ValueError, match="draft_quantization"):
        EngineArgs(model=tiny_gguf, draft_model="ngram", draft_quantization="rtn").validate()
