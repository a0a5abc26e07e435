"""Bad input is refused with a clear error naming the field, and loses nothing else
(regressions from trying to break the engine)."""
import pytest
import torch

from mixserve import SamplingParams
from mixserve.llm import LLM
from tests.unit.test_engine_tiny import make_tiny


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder, _ = make_tiny(tmp_path_factory.mktemp("rb"), "qwen2", tie=False)
    return folder


def G(n):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


@pytest.mark.parametrize("kw,field", [
    (dict(stop=[1]), "stop"), (dict(stop_token_ids=5), "stop_token_ids"), (dict(stop_token_ids="abc"), "stop_token_ids"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature="hot"), "temperature"), (dict(repetition_penalty=float("nan")), "repetition_penalty"),
    (dict(top_p=float("inf")), "top_p"), (dict(max_tokens=True), "max_tokens"), (dict(seed=2**70), "seed"),
    (dict(logprobs=True), "logprobs"), (dict(top_k=2.5), "top_k"), (dict(min_tokens=5, max_tokens=2), "min_tokens"),
    (dict(top_k=10**400), "top_k"),
])
def test_sampling_params_refused(kw, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        SamplingParams(**kw)


def test_tiny_temperature_is_greedy():
    # 1/T would overflow float32: served as greedy, not refused (OpenAI accepts any T in [0, 2])
    assert SamplingParams(temperature=1e-38).greedy and SamplingParams(temperature=1e-300).greedy
    assert not SamplingParams(temperature=1e-4).greedy


@pytest.mark.parametrize("kw,field", [
    (dict(block_size=0), "block_size"), (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens"), (dict(speculation="bogus"), "speculation"),
    (dict(max_model_len=100000), "max_model_len"), (dict(kv_cache_memory="lots"), "lots"),
])
def test_engine_args_refused(tiny, kw, field):
    with pytest.raises(ValueError, match=field):
        LLM(tiny, dtype="float32", progress=False, **{"kv_cache_memory": "8MiB", **kw})


def test_bad_prompt_in_batch_leaves_nothing_queued(tiny):
    llm = LLM(tiny, dtype="float32", kv_cache_memory="8MiB", progress=False)
    for bad in ([[1, 2, 3], [None]], [[1, 2, 3], [1.5, 2.0]], [[1, 2, 3], [True, 2]]):
        with pytest.raises(ValueError, match="prompt"):
            llm.generate(bad, G(4))
        assert not llm.engine.requests and not llm.engine.has_unfinished()
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate([[1, 2, 3]], ["not params"])
    assert llm.generate([[1, 2, 3]], G(4))[0].finish_reason == "length"


def test_explicit_request_id_does_not_block_auto_ids(tiny):
    llm = LLM(tiny, dtype="float32", kv_cache_memory="8MiB", progress=False)
    eng = llm.engine
    eng.add_request([1, 2, 3], G(4), request_id="0")
    eng.add_request([1, 2, 3], G(4), request_id="1")
    assert eng.add_request([1, 2, 3], G(4)) not in ("0", "1")


def test_speculation_stops_at_context_limit(tiny):
    plain = LLM(tiny, dtype="float32", kv_cache_memory="8MiB", max_model_len=64, progress=False)
    ref = plain.generate([[5, 6, 7, 8] * 15], G(4))[0].token_ids
    for draft in (tiny, "ngram"):
        llm = LLM(tiny, dtype="float32", kv_cache_memory="8MiB", max_model_len=64, draft_model=draft,
                  num_speculative_tokens=8, speculation="fixed", progress=False)
        out = llm.generate([[5, 6, 7, 8] * 15], G(4))[0]
        assert out.token_ids == ref
        assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks


def test_lookahead_larger_than_cache_does_not_preempt(tiny):
    from mixserve.models.config import ModelConfig

    cfg = ModelConfig.from_folder(tiny)
    llm = LLM(tiny, dtype="float32", kv_cache_memory=4 * 16 * cfg.kv_bytes_per_token(4), draft_model="ngram",
              num_speculative_tokens=100, speculation="fixed", progress=False)
    out = llm.generate([[1, 2, 3, 4, 1, 2, 3, 4, 1, 2]], G(40))[0]
    assert len(out.token_ids) == 40
    assert llm.engine.scheduler.num_preemptions == 0


def test_failed_sampling_leaves_no_zombie(tiny, monkeypatch):
    llm = LLM(tiny, dtype="float32", kv_cache_memory="8MiB", progress=False)
    eng = llm.engine
    eng.add_request([1, 2, 3, 4], G(5))
    calls = {"n": 0}
    real = eng.sampler.__class__.__call__

    def flaky(self, logits, meta):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("transient")
        return real(self, logits, meta)

    monkeypatch.setattr(eng.sampler.__class__, "__call__", flaky)
    with pytest.raises(RuntimeError):
        eng.step()
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert outs[-1].finished and len(outs[-1].token_ids) == 5
    assert eng.block_manager.num_free_blocks == eng.num_blocks


@pytest.mark.parametrize("spec", [False, True])
def test_a_poisoned_row_fails_alone(tmp_path, spec):
    """NaN written into one request's actual logits (the engine's test hook) ends exactly that
    request with finish_reason "error", frees its blocks and counts it; the others in the batch
    produce what they produce without the poison (greedy)."""
    from mixserve.engine.args import EngineArgs
    from mixserve.engine.llm_engine import LLMEngine
    from tests.unit.test_engine_tiny import make_tiny

    folder, _ = make_tiny(tmp_path, "llama", tie=True)
    kw = dict(draft_model="ngram", speculation="fixed", num_speculative_tokens=2) if spec else {}
    prompts = [[5, 6, 7, 8] * 3, [9, 10, 11] * 4, [12, 13] * 5]

    def run(poison):
        eng = LLMEngine(EngineArgs(model=folder, dtype="float32", kv_cache_memory="8MiB", progress=False, **kw))
        ids = [eng.add_request(p, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)) for p in prompts]
        victim = eng.requests[ids[1]].seq_id
        calls = {"n": 0}

        def hook(logits, rows):
            calls["n"] += 1
            r = 0
            for it in rows:
                if it.seq_id == victim and calls["n"] == 4:
                    with torch.inference_mode():  # the engine's logits are inference tensors
                        logits[r + it.num_logits - 1, 3] = float("nan")
                r += it.num_logits
        if poison:
            eng.logits_hook = hook
        done = {}
        while eng.has_unfinished():
            for o in eng.step():
                if o.finished:
                    done[o.request_id] = o
        return eng, [done[i] for i in ids]

    clean_eng, clean = run(False)
    eng, outs = run(True)
    assert outs[1].finish_reason == "error" and "non-finite" in outs[1].stop_reason
    assert len(outs[1].token_ids) < 12
    assert [o.token_ids for o in (outs[0], outs[2])] == [clean[0].token_ids, clean[2].token_ids]
    assert all(o.finish_reason == "length" for o in (outs[0], outs[2]))
    assert eng.num_errored == 1 and clean_eng.num_errored == 0
    assert eng.block_manager.num_used_blocks == 0 and not eng.has_unfinished()
