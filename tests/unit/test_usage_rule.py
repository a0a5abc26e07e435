"""Issue 45: where an output ends, and what is counted, by one rule on every path (README "Usage").

A property test on a tiny GGUF with a real byte-level tokenizer (tests/tiny_gguf.py: 256 byte tokens,
the two-character token "ab", an end token), whose logits are nudged towards "ab" so that stop
strings begin both where a token begins and inside one. Requests are drawn over: plain or
speculative decoding (n-gram, or the model as its own draft, whose runs are all accepted and so
cross stops and max_tokens), n of 1 or 2, stop strings at token starts and inside tokens,
max_tokens, logprobs or not, a prefix-cache hit or not, and a cache small enough to preempt. Every
output must satisfy: len(logprobs) == len(token_ids) (the counted tokens, the one that ended it
included), the streamed pieces and entries join to the final ones, the text is a prefix of the same
request's text without the stop, and the engine's prompt and generation counters add up to what
the outputs carry (a prompt of n samples once).
"""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mixserve import SamplingParams
from mixserve.engine.args import EngineArgs
from mixserve.engine.llm_engine import LLMEngine

AB = 256  # the "ab" token of tests/tiny_gguf.py's vocabulary
SPECS = ("off", "ngram", "self")
SEEN: set = set()  # (engine, how the drawn request ended, whether a draft run was accepted)


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    from tests.tiny_gguf import write_float_gguf

    path = str(write_float_gguf(tmp_path_factory.mktemp("usage") / "tiny.gguf", tokenizer=True))
    common = dict(model=path, dtype="float32", progress=False, kernels="eager", gguf_weights="dequantize",
                  max_model_len=128)
    out = {"off": LLMEngine(EngineArgs(kv_cache_memory="4MiB", **common)),
           "ngram": LLMEngine(EngineArgs(kv_cache_memory="4MiB", draft_model="ngram", speculation="fixed",
                                         num_speculative_tokens=3, **common)),
           "self": LLMEngine(EngineArgs(kv_cache_memory="4MiB", draft_model=path, speculation="fixed",
                                        num_speculative_tokens=4, **common)),
           # 8 blocks of 16 tokens: three requests of up to ~60 tokens preempt one another
           "small": LLMEngine(EngineArgs(kv_cache_memory=8 * 16 * 256, max_num_seqs=3, **common))}
    for eng in out.values():
        eng.logits_hook = _nudge
    return out


def _nudge(logits, rows):
    with torch.inference_mode():  # the engine's logits are inference tensors
        logits[:, AB] += 4.0  # "ab" often: stop strings then start inside a token too
        logits[:, 128:AB] = -1e4  # ASCII only (finite: a non-finite row is failed by the engine): every token whole characters, so decode() of
        # a prefix of the tokens is a prefix of the text


def _run(eng, reqs):
    """Add reqs [(prompt, params, share_with_index or None)], step to the end; returns per request
    (final output, joined streamed text, streamed logprob entries)."""
    ids = []
    for prompt, sp, share in reqs:
        ids.append(eng.add_request(prompt, sp, share_prompt_with=None if share is None else ids[share]))
    final, pieces, entries = {}, {i: [] for i in ids}, {i: [] for i in ids}
    while eng.has_unfinished():
        for o in eng.step():
            pieces[o.request_id].append(o.new_text)
            if o.logprobs is not None:  # a stream's entries only grow: each output extends the last
                seen = [(e.token_id, e.logprob) for e in entries[o.request_id]]
                assert [(e.token_id, e.logprob) for e in o.logprobs[:len(seen)]] == seen
                entries[o.request_id] = o.logprobs
            if o.finished:
                final[o.request_id] = o
    return [(final[i], "".join(pieces[i]), entries[i]) for i in ids]


@st.composite
def request_sets(draw):
    spec = draw(st.sampled_from(SPECS + ("small",)))
    n = draw(st.integers(1, 2))
    long_prompt = draw(st.booleans())
    prompt = ("ab" * 20 + "xyz") if long_prompt else draw(st.sampled_from(["abc", "hello ab", "zzab"]))
    max_tokens = draw(st.integers(1, 24))
    logprobs = draw(st.sampled_from([None, 1]))
    seed = draw(st.integers(0, 5))
    temperature = draw(st.sampled_from([0.0, 0.9]))
    stop_at = draw(st.sampled_from([None, "token_start", "inside_token"]))
    repeat = draw(st.booleans())  # the same request again: its prompt from the prefix cache
    others = 2 if spec == "small" else draw(st.integers(0, 1))  # neighbours (preemption in "small")
    return spec, n, prompt, max_tokens, logprobs, seed, temperature, stop_at, repeat, others


@settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=request_sets())
def test_outputs_count_what_they_carry(engines, case):
    spec, n, prompt, max_tokens, logprobs, seed, temperature, stop_at, repeat, others = case
    eng = engines[spec]
    tok = eng.tokenizer
    base = dict(max_tokens=max_tokens, logprobs=logprobs, seed=seed, temperature=temperature)
    # the reference: the same request without a stop string (seeded per position: the same tokens)
    ref = _run(eng, [(prompt, SamplingParams(**base), None)])[0][0]
    stop = None
    if stop_at is not None and ref.token_ids:
        starts = [len(tok.decode(ref.token_ids[:i])) for i in range(len(ref.token_ids))]
        if stop_at == "token_start":
            at = starts[len(starts) // 2]
        else:  # inside a two-character token ("ab"): the stop begins at its second character
            inside = [s + 1 for s, t in zip(starts, ref.token_ids) if len(tok.decode([t])) > 1]
            at = inside[len(inside) // 2] if inside else None
        if at is not None and at < len(ref.text):
            stop = ref.text[at:at + 2]
    sp = SamplingParams(**base, stop=[stop] if stop else None)
    reqs = [(prompt, sp, None)] + [(prompt, SamplingParams(**{**base, "seed": seed + i}), 0) for i in range(1, n)]
    reqs += [("neighbour number %d says" % i, SamplingParams(max_tokens=40, ignore_eos=True), None)
             for i in range(others)]
    p0, g0 = eng.num_prompt_tokens, eng.num_generated_tokens
    results = _run(eng, reqs)
    if repeat:
        results += _run(eng, [(prompt, sp, None)])
    prompt_ids = eng.encode(prompt)
    # each prompt once, however many samples: the drawn one (and its repeat) and the neighbours
    prompt_total = len(prompt_ids) * (1 + repeat) + sum(len(eng.encode(p)) for p, _, _ in reqs[n:])
    assert eng.num_prompt_tokens - p0 == prompt_total
    assert eng.num_generated_tokens - g0 == sum(len(o.token_ids) for o, _, _ in results)
    for out, streamed, entries in results:
        assert streamed == out.text  # the pieces join to the text
        if logprobs is not None and out.prompt_token_ids == prompt_ids:
            assert len(out.logprobs) == len(out.token_ids)  # one entry per counted token
            assert [lp.token_id for lp in out.logprobs] == out.token_ids
        if out.finish_reason == "length":
            assert len(out.token_ids) == (max_tokens if out.prompt_token_ids == prompt_ids else 40)
    # the drawn request (and its repeat): a prefix of its text without the stop, cut where it begins
    first = results[0][0]
    SEEN.add((spec, stop_at if first.finish_reason == "stop" and first.stop_reason == stop and stop else
              first.finish_reason, first.metrics["spec_accepted"] > 0))
    for out, _, _ in [results[0]] + ([results[-1]] if repeat else []):
        assert out.token_ids == ref.token_ids[:len(out.token_ids)]
        assert ref.text.startswith(out.text)
        if out.stop_reason == stop and stop is not None:
            assert out.finish_reason == "stop" and ref.text.find(stop) == len(out.text)
            # the last counted token completed the stop; nothing after it was counted
            assert stop in tok.decode(out.token_ids) and stop not in tok.decode(out.token_ids[:-1])
    if repeat and spec != "small":  # (the small cache may have evicted the first run's blocks)
        assert results[-1][0].metrics["cached_tokens"] == (len(prompt_ids) - 1) // 16 * 16


def test_the_cases_cover_the_paths():
    """What the property test's fixed draws reached (it runs first, in file order): stops at token
    starts and inside tokens, a speculative run accepted and cut by a stop or by max_tokens."""
    ended = {e[1] for e in SEEN}
    assert {"token_start", "inside_token", "length"} <= ended, sorted(SEEN)
    # a draft run accepted, then cut by a stop string, and one that ran into max_tokens
    assert any(e[2] and e[1] in ("token_start", "inside_token") for e in SEEN), sorted(SEEN)
    assert any(e[2] and e[1] == "length" for e in SEEN), sorted(SEEN)


def test_the_small_cache_preempts(engines):
    """The property test's "small" engine really preempts (its cases cover a recompute mid-run)."""
    eng = engines["small"]
    before = eng.scheduler.num_preemptions
    outs = _run(eng, [("neighbour number %d says" % i, SamplingParams(max_tokens=50, ignore_eos=True, logprobs=1),
                       None) for i in range(3)])
    assert eng.scheduler.num_preemptions > before
    for out, streamed, _ in outs:
        assert len(out.token_ids) == len(out.logprobs) == 50 and streamed == out.text


def test_a_stop_token_is_counted_but_not_in_the_text(engines):
    """A stop_token_ids token (an ordinary one, from the free output) ends the output: counted, with
    its logprob entry, and like an end token not part of the text (a break-it round found its text
    kept), with and without a draft."""
    for spec in ("off", "self"):
        eng = engines[spec]
        free = _run(eng, [("hello", SamplingParams(max_tokens=20, temperature=0, ignore_eos=True), None)])[0][0]
        t = free.token_ids[2]
        k = free.token_ids.index(t)
        sp = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop_token_ids=[t], logprobs=0)
        out, streamed, _ = _run(eng, [("hello", sp, None)])[0]
        assert out.finish_reason == "stop" and out.stop_reason == t
        assert out.token_ids == free.token_ids[:k + 1] and len(out.logprobs) == k + 1
        assert out.text == streamed == eng.tokenizer.decode(free.token_ids[:k])
        assert eng.tokenizer.decode([t])  # t has text of its own, which the output leaves out


def test_token_starts_after_an_invalid_byte(engines):
    """Where each token of a decoded group starts: a byte that is invalid UTF-8 for good (0xFF)
    stays U+FFFD and the next token starts after it, so a stream's logprob entries never run
    ahead of its text (the break-it round: entries decoded to '\\ufffd\\x0c' while '\\ufffd' was out)."""
    from mixserve.engine.detokenizer import detokenize_incrementally, tokens_in_text
    from mixserve.sequence import Sequence

    tok = engines["off"].tokenizer
    seq = Sequence("t", "x", [120], SamplingParams(logprobs=1))
    for t in (0xFF, 0x0C, ord("a")):
        seq.token_ids.append(t)
        detokenize_incrementally(tok, seq)
    assert seq.text == "\ufffd\x0ca" and seq.token_starts == [0, 1, 2]
    assert tokens_in_text(seq, 1) == 1  # only the invalid byte's token is in a text of one character
