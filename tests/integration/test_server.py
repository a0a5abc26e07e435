"""The OpenAI-compatible server on SmolLM2-135M (float32, loopback), driven by the official client.

Greedy outputs are compared with the offline `LLM.generate` of a second engine under the near-tie
rule (tests/reference.py): the server batches differently, so float rounding may flip an argmax
where the reference's top-two logits are within 0.01.
"""
import asyncio
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from mixserve import SamplingParams
from mixserve.engine.args import EngineArgs
from mixserve.engine.llm_engine import LLMEngine
from mixserve.llm import LLM
from mixserve.server.api import ServerConfig
from tests.live_server import LiveServer, gap_logits, start_drain_streams, wait_healthy
from tests.reference import compare_greedy
from tests.waits import await_until

pytestmark = pytest.mark.integration

KEY = "test-key"
NAME = "smol"
# dequantized weights: these tests pin outputs (stops, greedy equal offline) made with them; the
# native kernel is tried on the server in test_server_fuzz.py
ENGINE = dict(dtype="float32", kv_cache_memory="160MiB", max_model_len=512, progress=False, gguf_weights="dequantize")
CHAT = [{"role": "user", "content": "Say hi in Chinese and add an emoji."}]


@pytest.fixture(scope="module")
def server(smollm2_path):
    srv = LiveServer(LLMEngine(EngineArgs(model=smollm2_path, **ENGINE)), ServerConfig(NAME, api_key=KEY))
    yield srv
    srv.stop()
    assert not srv.thread.is_alive() and not srv.loop.alive


@pytest.fixture(scope="module")
def offline(smollm2_path):
    return LLM(smollm2_path, **ENGINE)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def greedy(max_tokens, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=2, **kw)


def assert_same_greedy(server_ids, ref):
    c = compare_greedy(server_ids, ref.token_ids, gap_logits(ref.logprobs))
    assert c.ok, f"diverged at token {c.position}, top-2 gap {c.gap}"
    return c


def metrics(server) -> dict:
    text = httpx.get(server.url + "/metrics").text
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples if not s.labels}


# -- shapes, equality with offline generation ------------------------------------------------------
def test_models_health_and_auth(server, client):
    assert [m.id for m in client.models.list().data] == [NAME]
    # the suite's engines time no kernels, so no graph compiles in the background (decode_graph_pending)
    assert httpx.get(server.url + "/health").json() == {"status": "ok", "decode_graph_pending": False}
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(server.url + "/v1/completions", json={"model": NAME, "prompt": "x"}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_completions_greedy_equal_offline(server, client, offline):
    prompts = ["def quicksort(arr):", "The three primary colors are"]
    refs = offline.generate(prompts, greedy(32))
    for prompt, ref in zip(prompts, refs):
        r = client.completions.create(model=NAME, prompt=prompt, max_tokens=32, temperature=0,
                                      extra_body={"return_token_ids": True})
        ch = r.choices[0]
        assert_same_greedy(ch.token_ids, ref)
        if ch.token_ids == ref.token_ids:
            assert ch.text == ref.text and ch.finish_reason == ref.finish_reason
        assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert r.usage.completion_tokens == len(ch.token_ids)
        assert r.object == "text_completion" and r.model == NAME
        # the same request streamed joins to the same text and tokens
        chunks = list(client.completions.create(model=NAME, prompt=prompt, max_tokens=32, temperature=0, stream=True,
                                                stream_options={"include_usage": True},
                                                extra_body={"return_token_ids": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == ch.text
        assert [t for c in chunks if c.choices for t in c.choices[0].token_ids] == ch.token_ids
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == ch.finish_reason
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ch.token_ids)
    # echo puts the prompt in front
    r = client.completions.create(model=NAME, prompt=prompts[0], max_tokens=4, temperature=0, echo=True)
    assert r.choices[0].text.startswith(prompts[0]) and len(r.choices[0].text) > len(prompts[0])


def test_chat_greedy_equal_offline_one_bos(server, client, offline):
    tok = offline.tokenizer
    ref = offline.chat(CHAT, greedy(30))[0]
    template_ids = tok.apply_chat_template(CHAT, tokenize=True, add_generation_prompt=True)["input_ids"]
    r = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=30, temperature=0,
                                       extra_body={"return_token_ids": True})
    ch = r.choices[0]
    # the template's own tokens, no second BOS in front
    assert ch.prompt_token_ids == template_ids == ref.prompt_token_ids
    assert ch.prompt_token_ids[:2] != [tok.bos_token_id] * 2
    assert_same_greedy(ch.token_ids, ref)
    if ch.token_ids == ref.token_ids:
        assert ch.message.content == ref.text
    assert ch.message.role == "assistant" and r.object == "chat.completion"
    assert r.usage.prompt_tokens == len(template_ids) and r.usage.completion_tokens == len(ch.token_ids)
    chunks = list(client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=30, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ch.message.content
    assert chunks[-1].choices[0].finish_reason == ch.finish_reason


# -- streaming: UTF-8, stop strings, chunks while generating ---------------------------------------
def test_stream_multibyte_joins_exactly(server, client, offline):
    tok = offline.tokenizer
    r = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=30, temperature=0,
                                       extra_body={"return_token_ids": True})
    text, ids = r.choices[0].message.content, r.choices[0].token_ids
    # the case worth testing: a character whose UTF-8 bytes are spread over several tokens
    assert any(ord(ch) > 0x2E80 for ch in text), text
    assert any("\ufffd" in tok.decode([t]) for t in ids), "no token splits a character: pick another prompt"
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=NAME, messages=CHAT, max_tokens=30, temperature=0, stream=True)]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


def test_stop_string_across_tokens(server, client, offline):
    tok = offline.tokenizer
    prompt = "def quicksort(arr):"
    full = client.completions.create(model=NAME, prompt=prompt, max_tokens=40, temperature=0,
                                     extra_body={"return_token_ids": True, "ignore_eos": True}).choices[0]
    toks = full.token_ids
    k = next(i for i in range(3, len(toks) - 1)
             if len(tok.decode([toks[i]])) >= 2 and len(tok.decode([toks[i + 1]])) >= 2)
    stop = tok.decode([toks[k]])[-1] + tok.decode([toks[k + 1]])[0]
    cut = full.text.find(stop)
    assert cut >= 0
    plain = client.completions.create(model=NAME, prompt=prompt, max_tokens=40, temperature=0, stop=[stop])
    assert plain.choices[0].text == full.text[:cut] and plain.choices[0].finish_reason == "stop"
    pieces = [c.choices[0].text for c in client.completions.create(
        model=NAME, prompt=prompt, max_tokens=40, temperature=0, stop=stop, stream=True)]
    assert "".join(pieces) == full.text[:cut]
    assert not any(stop in p for p in pieces)


def _chat_joined(entries) -> str:
    return b"".join(bytes(e.bytes) for e in entries).decode()


@pytest.mark.parametrize("draft", [False, True])
def test_logprob_entries_are_the_counted_tokens(server, smollm2_path, draft):
    """Issue 45's rule (it replaces ../shared/cases/logprobs-end-token.md's): one logprob entry per
    counted token, so len(entries) == len(token_ids) and usage.completion_tokens is their sum over
    choices. The in-text entries join to the returned text; a choice ended by the end token has it
    as its last entry (`<|im_end|>`, not in the text); where a stop string cuts, the last entry is
    the token that completed it. Chat and completions, streamed and not, n = 2, with and without a
    draft (n-gram) model."""
    srv = None
    if draft:
        srv = LiveServer(LLMEngine(EngineArgs(model=smollm2_path, draft_model="ngram", speculation="fixed",
                                              num_speculative_tokens=3, **ENGINE)), ServerConfig(NAME, api_key=KEY))
    url = (srv or server).url
    cl = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    ids = {"return_token_ids": True}
    try:
        msgs = [{"role": "user", "content": "Say hi."}]
        r = cl.chat.completions.create(model=NAME, messages=msgs, max_tokens=40, temperature=0.7, seed=3, n=2,
                                       logprobs=True, top_logprobs=1, extra_body=ids)
        assert any(c.finish_reason == "stop" for c in r.choices)  # ended by the end token
        assert r.usage.completion_tokens == sum(len(c.token_ids) for c in r.choices)
        for c in r.choices:
            assert len(c.logprobs.content) == len(c.token_ids)
            if c.finish_reason == "stop":
                assert c.logprobs.content[-1].token == "<|im_end|>"
                assert _chat_joined(c.logprobs.content[:-1]) == c.message.content
            else:
                assert _chat_joined(c.logprobs.content) == c.message.content
        entries, text, usage = {}, {}, None
        for ch in cl.chat.completions.create(model=NAME, messages=msgs, max_tokens=40, temperature=0.7, seed=3,
                                              n=2, logprobs=True, stream=True, stream_options={"include_usage": True}):
            usage = ch.usage or usage
            for c in ch.choices:
                text[c.index] = text.get(c.index, "") + (c.delta.content or "")
                entries.setdefault(c.index, []).extend(c.logprobs.content if c.logprobs else [])
        assert text == {c.index: c.message.content for c in r.choices}
        assert {i: [e.token for e in v] for i, v in entries.items()} == \
            {c.index: [e.token for e in c.logprobs.content] for c in r.choices}
        assert usage.completion_tokens == r.usage.completion_tokens and usage.prompt_tokens == r.usage.prompt_tokens
        # completions: ended by the end token, and cut by a stop string
        prompt = "<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n"
        full = cl.completions.create(model=NAME, prompt=prompt, max_tokens=48, temperature=0, logprobs=1,
                                     extra_body=ids)
        c = full.choices[0]
        assert c.finish_reason == "stop" and "".join(c.logprobs.tokens) == c.text + "<|im_end|>"
        assert len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) == len(c.logprobs.top_logprobs) \
            == len(c.logprobs.text_offset) == len(c.token_ids) == full.usage.completion_tokens
        stop = c.text[len(c.text) // 2:len(c.text) // 2 + 2]
        for stream in (False, True):
            got = cl.completions.create(model=NAME, prompt=prompt, max_tokens=48, temperature=0, logprobs=1,
                                        stop=[stop], stream=stream, stream_options={"include_usage": True}
                                        if stream else None, extra_body=ids)
            chunks = list(got) if stream else [got]
            t = "".join(ch.choices[0].text for ch in chunks if ch.choices)
            toks = [x for ch in chunks if ch.choices and ch.choices[0].logprobs for x in ch.choices[0].logprobs.tokens]
            n_ids = sum(len(ch.choices[0].token_ids or []) for ch in chunks if ch.choices)
            joined = "".join(toks)
            assert t == c.text[:c.text.find(stop)] and joined.startswith(t)
            # the last entry is the token that completed the stop string, and nothing came after it
            assert joined.find(stop) == len(t) and stop not in "".join(toks[:-1])
            assert len(toks) == n_ids == [ch for ch in chunks if ch.usage][-1].usage.completion_tokens
    finally:
        if srv is not None:
            srv.stop()


def test_metrics_totals_are_the_summed_usage(smollm2_path):
    """Issue 45: after a mixed run on an n-gram-speculative server whose cache is small enough to
    preempt (n = 2, stop strings, chat streams with include_usage, and a stream its client leaves
    after a few chunks), /metrics' prompt total is the summed usage.prompt_tokens plus the aborted
    request's prompt, and its generation total the summed usage.completion_tokens plus what the
    aborted one generated: at least what its client saw, at most its max_tokens."""
    import concurrent.futures

    eng = LLMEngine(EngineArgs(model=smollm2_path, draft_model="ngram", speculation="fixed", num_speculative_tokens=3,
                               **{**ENGINE, "kv_cache_memory": "12MiB"}))
    srv = LiveServer(eng, ServerConfig(NAME, api_key=KEY))
    cl = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=300)
    try:
        m0 = metrics(srv)

        def completion(i):
            r = cl.completions.create(model=NAME, prompt=f"List {i + 3} fruits, one per line:\n", n=2, max_tokens=60,
                                      temperature=0.8, seed=i, stop=["\n\n", "7."], extra_body={"return_token_ids": True})
            assert r.usage.completion_tokens == sum(len(c.token_ids) for c in r.choices)
            return r.usage.prompt_tokens, r.usage.completion_tokens

        def chat(i):
            usage = None
            for ch in cl.chat.completions.create(model=NAME, messages=[{"role": "user", "content": f"Story {i}:"}],
                                                  max_tokens=60, temperature=0.8, seed=i, stream=True,
                                                  stream_options={"include_usage": True}):
                usage = ch.usage or usage
            return usage.prompt_tokens, usage.completion_tokens

        left = {"seen": 0}
        aborted_prompt = "Once upon a time there was a very long story that"

        def leave_early():
            body = {"model": NAME, "prompt": aborted_prompt, "max_tokens": 200, "ignore_eos": True, "stream": True,
                    "return_token_ids": True}
            with httpx.stream("POST", srv.url + "/v1/completions", json=body,
                              headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        left["seen"] += len(json.loads(line[6:])["choices"][0].get("token_ids") or [])
                        if left["seen"] >= 3:
                            break
            return 0, 0

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            jobs = [pool.submit(completion, i) for i in range(3)] + [pool.submit(chat, i) for i in range(3)]
            jobs.append(pool.submit(leave_early))
            usage = [j.result() for j in jobs]
        await_aborted = time.time() + 30
        while time.time() < await_aborted and (eng.has_unfinished() or srv.loop._streams):
            time.sleep(0.2)
        m1 = metrics(srv)
        prompt = sum(p for p, _ in usage) + len(eng.encode(aborted_prompt))
        generated = sum(c for _, c in usage)
        assert m1["mixserve_prompt_tokens_total"] - m0["mixserve_prompt_tokens_total"] == prompt
        extra = m1["mixserve_generation_tokens_total"] - m0["mixserve_generation_tokens_total"] - generated
        assert left["seen"] <= extra <= 200, (extra, left)
        assert m1["mixserve_num_preemptions_total"] > m0.get("mixserve_num_preemptions_total", 0)
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def spec_server(smollm2_path):
    srv = LiveServer(LLMEngine(EngineArgs(model=smollm2_path, draft_model="ngram", speculation="fixed",
                                          num_speculative_tokens=4, **ENGINE)), ServerConfig(NAME, api_key=KEY))
    yield srv
    srv.stop()


def _completion(cl, stream: bool, **kw) -> dict:
    """One completions request through the client: choices' text, token ids and logprob tokens
    by index, and usage (streamed: joined from the chunks, usage from the include_usage chunk)."""
    kw = {**kw, "extra_body": {"return_token_ids": True}}
    if not stream:
        r = cl.completions.create(model=NAME, **kw)
        return {"choices": {c.index: (c.text, c.token_ids, c.logprobs.tokens if c.logprobs else None,
                                      c.finish_reason) for c in r.choices}, "usage": r.usage}
    out, usage = {}, None
    for ch in cl.completions.create(model=NAME, stream=True, stream_options={"include_usage": True}, **kw):
        usage = ch.usage or usage
        for c in ch.choices:
            t, ids, toks, fin = out.get(c.index, ("", [], [] if kw.get("logprobs") else None, None))
            out[c.index] = (t + c.text, ids + (c.token_ids or []),
                            toks + c.logprobs.tokens if toks is not None and c.logprobs else toks,
                            c.finish_reason or fin)
    return {"choices": out, "usage": usage}


@settings(max_examples=10, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(1, 2), max_tokens=st.integers(1, 40), logprobs=st.sampled_from([None, 1]),
       stop_at=st.sampled_from([None, 0.3, 0.6]), seed=st.integers(0, 3), repeat=st.booleans())
def test_usage_rule_through_the_server_with_speculation(spec_server, n, max_tokens, logprobs, stop_at, seed, repeat):
    """Issue 45's property test on SmolLM2 through the server, n-gram speculation on (runs of up to
    5 tokens accepted at once cross stops and max_tokens): for each drawn request, streamed and
    not, usage.completion_tokens is the sum of len(token_ids), each choice has one logprob entry
    per token, the streamed text equals the non-streamed, the text is a prefix of the same
    request's text without the stop, prompt_tokens is the prompt's length, and a repeated prompt's
    cached_tokens are its full blocks."""
    cl = openai.OpenAI(base_url=spec_server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    prompt = "def fibonacci(n):\n    # the classic recursive definition, then an iterative one\n" * 2
    base = dict(prompt=prompt, n=n, max_tokens=max_tokens, logprobs=logprobs, temperature=0.8, seed=seed)
    ref = _completion(cl, False, **base)["choices"]
    stop = None
    if stop_at is not None and len(ref[0][0]) >= 4:
        at = int(len(ref[0][0]) * stop_at)
        stop = ref[0][0][at:at + 2]
    with ThreadPoolExecutor(2) as pool:  # streamed and not at once (batch invariance: the same tokens)
        jobs = {s: pool.submit(_completion, cl, s, **base, stop=[stop] if stop else None) for s in (False, True)}
        got = {s: j.result() for s, j in jobs.items()}
    n_prompt = len(spec_server.engine.encode(prompt))
    for stream, r in got.items():
        assert r["usage"].completion_tokens == sum(len(c[1]) for c in r["choices"].values())
        assert r["usage"].prompt_tokens == n_prompt
        for i, (text, ids, toks, fin) in r["choices"].items():
            assert ref[i][0].startswith(text) and ref[i][1][:len(ids)] == ids
            if toks is not None:
                assert len(toks) == len(ids)
            if fin == "length":
                assert len(ids) == max_tokens
            if stop and fin == "stop" and toks is not None:  # the last entry completed the stop
                joined = "".join(toks)
                assert ref[i][0].find(stop) == len(text) == joined.find(stop) and stop not in "".join(toks[:-1])
    assert got[False]["choices"] == got[True]["choices"]
    if repeat:
        again = cl.completions.create(model=NAME, prompt=prompt, max_tokens=1, temperature=0)
        assert again.usage.prompt_tokens_details.cached_tokens == (n_prompt - 1) // 16 * 16


def test_chunks_arrive_while_generating(server, client):
    t0 = time.perf_counter()
    first_still_running, times = None, []
    for c in client.completions.create(model=NAME, prompt="Once upon a time", max_tokens=48, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True}):
        if c.choices and c.choices[0].text:
            times.append(time.perf_counter() - t0)
            if first_still_running is None:
                first_still_running = f"{c.id}-0" in server.engine.requests
    assert first_still_running, "the first chunk came after the request had finished"
    assert len(times) >= 20 and times[0] < 0.5 * times[-1]


# -- cancellation ----------------------------------------------------------------------------------
N_CANCEL = 50


def test_cancel_half_of_streams(server, offline):
    prompts = [f"Fact {i}: the number {i * 7} is" for i in range(N_CANCEL)]
    max_tokens = 24
    before = metrics(server)

    async def one(client, i):
        stream = await client.completions.create(model=NAME, prompt=prompts[i], max_tokens=max_tokens,
                                                 temperature=0, stream=True,
                                                 extra_body={"return_token_ids": True, "ignore_eos": True})
        ids = []
        async for c in stream:
            ids += c.choices[0].token_ids
            if i % 2 and len(ids) >= 2:
                await stream.close()  # the client goes away mid-stream
                return None
        return ids

    async def run():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120) as c:
            return await asyncio.gather(*(one(c, i) for i in range(N_CANCEL)))

    got = asyncio.run(run())
    assert server.wait_idle(10), "requests still running or KV blocks not freed after the clients left"
    after = metrics(server)
    assert after["mixserve_kv_cache_blocks_used"] == 0
    survivors = [i for i in range(N_CANCEL) if i % 2 == 0]
    assert all(got[i] is not None and len(got[i]) == max_tokens for i in survivors)
    # the cancelled half stopped early: far fewer tokens than if they had run to the end
    generated = after["mixserve_generation_tokens_total"] - before["mixserve_generation_tokens_total"]
    assert generated < len(survivors) * max_tokens + (N_CANCEL - len(survivors)) * max_tokens / 2
    refs = offline.generate([prompts[i] for i in survivors], greedy(max_tokens, ignore_eos=True))
    ties = sum(assert_same_greedy(got[i], ref).tie_used for i, ref in zip(survivors, refs))
    print(f"tie rule used for {ties}/{len(survivors)} survivors")


def test_abort_lands_within_one_step(server, client):
    stream = client.completions.create(model=NAME, prompt="Once upon a time", max_tokens=200, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True, "return_token_ids": True})
    chunks = iter(stream)
    first = next(c for c in chunks if c.choices and c.choices[0].token_ids)
    rid = f"{first.id}-0"
    entered, release = _blocked_engine(server)
    try:
        assert entered.wait(10)  # the engine thread is now inside a step
        generated = server.engine.num_generated_tokens
        stream.close()
        t0 = time.monotonic()
        while rid in server.loop._streams:  # until the server has seen the disconnect and sent the abort
            assert time.monotonic() - t0 < 10
            time.sleep(0.01)
    finally:
        release.set()
    assert server.wait_idle(5)
    # only the step already running when the client left produced a token for it
    assert server.engine.num_generated_tokens - generated <= 1


def test_disconnect_and_timeout_abort_non_streaming(server):
    h = {"Authorization": f"Bearer {KEY}"}
    body = {"model": NAME, "prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "ignore_eos": True}
    before = metrics(server)
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(server.url + "/v1/completions", json=body, headers=h, timeout=0.7)
    assert server.wait_idle(5)
    assert metrics(server)["mixserve_generation_tokens_total"] - before["mixserve_generation_tokens_total"] < 300
    server.config.request_timeout = 0.5
    try:
        r = httpx.post(server.url + "/v1/completions", json=body, headers=h, timeout=30)
        assert r.status_code == 504 and r.json()["error"]["code"] == "request_timeout"
        assert server.wait_idle(5)
        with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, headers=h,
                          timeout=30) as r:
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert json.loads(events[-2])["error"]["code"] == "request_timeout" and events[-1] == "[DONE]"
        assert server.wait_idle(5)
    finally:
        server.config.request_timeout = None


# -- bad input, overload, engine failure -----------------------------------------------------------
LONG = "hello " * 600
C, CH = "completions", "chat/completions"
BAD = [
    (C, {"prompt": ""}, "prompt"), (C, {"prompt": []}, "prompt"), (C, {"prompt": 123}, "prompt"),
    (C, {"prompt": [1, True]}, "prompt"), (C, {"prompt": [10**7]}, "prompt"), (C, {"prompt": LONG}, "prompt"),
    (C, {"prompt": "hi", "max_tokens": 600}, "max_tokens"), (C, {"prompt": "hi", "max_tokens": -1}, "max_tokens"),
    (C, {"prompt": "hi", "max_tokens": "10"}, "max_tokens"), (C, {"prompt": "hi", "temperature": "hot"}, "temperature"),
    (C, {"prompt": "hi", "temperature": -1}, "temperature"), (C, {"prompt": "hi", "top_p": 1.5}, "top_p"),
    (C, {"prompt": "hi", "top_k": 1.5}, "top_k"), (C, {"prompt": "hi", "min_p": 2}, "min_p"),
    (C, {"prompt": "hi", "n": 0}, "n"), (C, {"prompt": "hi", "n": 1000}, "n"),
    (C, {"prompt": "hi", "logprobs": 50}, "logprobs"), (C, {"prompt": "hi", "seed": -1}, "seed"),
    (C, {"prompt": "hi", "stop": 5}, "stop"), (C, {"prompt": "hi", "presence_penalty": 3}, "presence_penalty"),
    (C, {"prompt": "hi", "frequency_penalty": -3}, "frequency_penalty"),
    (C, {"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty"),
    (C, {"prompt": "hi", "model": "gpt-4"}, "model"), (C, {"prompt": "hi", "model": None}, "model"),
    (C, {}, "prompt"), (C, {"prompt": "hi", "echo": True, "logprobs": 21}, "logprobs"),
    (C, {"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    (C, {"prompt": "hi", "logit_bias": {"1": 5}}, "logit_bias"), (C, {"prompt": "hi", "suffix": "x"}, "suffix"),
    (C, {"prompt": "hi", "best_of": 2}, "best_of"), (C, {"prompt": "hi", "foo": 1}, "foo"),
    (CH, {"messages": []}, "messages"), (CH, {}, "messages"),
    (CH, {"messages": [{"role": "robot", "content": "hi"}]}, "messages"),
    (CH, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
    (CH, {"messages": [{"role": "user", "content": LONG}]}, "messages"),
    (CH, {"messages": CHAT, "tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools"),
    (CH, {"messages": CHAT, "parallel_tool_calls": False}, "parallel_tool_calls"),
    (CH, {"messages": CHAT, "tool_choice": "auto"}, "tool_choice"),
    (CH, {"messages": CHAT, "functions": [{"name": "f"}]}, "functions"),
    # structured output (issue 33): every bad constraint a 400 naming its field
    (CH, {"messages": CHAT, "response_format": {"type": "xml"}}, "response_format"),
    (CH, {"messages": CHAT, "response_format": {"type": "json_schema"}}, "response_format"),
    (CH, {"messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
     "response_format"),
    (CH, {"messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "wat"}}}}, "response_format"),
    (CH, {"messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "array", "uniqueItems": True}}}}, "response_format"),
    (C, {"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": []}}},
     "response_format"),
    (C, {"prompt": "hi", "structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    (C, {"prompt": "hi", "structured_outputs": {"grammar": "start: nothing_defined"}}, "structured_outputs"),
    (C, {"prompt": "hi", "structured_outputs": {"choice": []}}, "structured_outputs"),
    (C, {"prompt": "hi", "structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    (C, {"prompt": "hi", "structured_outputs": {"structural_tag": "x"}}, "structured_outputs"),
    (C, {"prompt": "hi", "structured_outputs": "json"}, "structured_outputs"),
    (C, {"prompt": "hi", "guided_json": "{not json"}, "guided_json"),
    (C, {"prompt": "hi", "guided_choice": ["a"], "guided_regex": "b"}, "guided_choice"),
    (CH, {"messages": CHAT, "logit_bias": {"1": 5}}, "logit_bias"),
    (CH, {"messages": CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
    (CH, {"messages": CHAT, "max_completion_tokens": 600}, "max_completion_tokens"),
    (CH, {"messages": CHAT, "top_logprobs": 3}, "top_logprobs"),
    (CH, {"messages": CHAT, "max_tokens": 0}, "max_tokens"),  # 0 is a value, not "no limit"
    (CH, {"messages": CHAT, "logprobs": True, "top_logprobs": 30}, "top_logprobs"),
    # lone UTF-16 surrogates are valid JSON but not text: json.dumps sends them
    (C, {"prompt": "\ud800"}, "prompt"), (C, {"prompt": ["ok", "\ud83d"]}, "prompt"),
    (CH, {"messages": [{"role": "user", "content": "hi \udc00"}]}, "messages"),
]


def test_bad_inputs_named_then_good_request(server, client):
    h = {"Authorization": f"Bearer {KEY}"}
    for path, body, field in BAD:
        # json.dumps escapes lone surrogates as Python clients send them (httpx's json= cannot)
        r = httpx.post(f"{server.url}/v1/{path}", content=json.dumps({"model": NAME, **body}).encode(),
                       headers={**h, "content-type": "application/json"})
        assert r.status_code == 400, (path, body, r.status_code, r.text)
        err = r.json()["error"]
        assert err["param"] == field and field in err["message"], (body, err)
        assert err["type"] == "invalid_request_error"
    r = httpx.post(server.url + "/v1/completions", content=b"{not json", headers=h)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    deep = b'{"model": "%s", "prompt": ' % NAME.encode() + b"[" * 100000 + b"]" * 100000 + b"}"
    r = httpx.post(server.url + "/v1/completions", content=deep, headers=h)
    assert r.status_code == 400 and "nested" in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError) as e:  # the official client sees it as such
        client.chat.completions.create(model=NAME, messages=CHAT, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}})
    assert e.value.body["param"] == "response_format"
    assert server.engine.block_manager.num_used_blocks == 0
    assert not server.engine.has_unfinished()
    r = client.completions.create(model=NAME, prompt="hi", max_tokens=3, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3


def test_response_format_with_the_openai_client(server, client):
    """json_schema through the official client: n = 3 sampled answers and a streamed one, each
    parsing and validating; json_object on completions too; the same stream joined equals the
    non-streamed answer (seeded)."""
    import jsonschema

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                               "population": {"type": "integer", "minimum": 0}},
              "required": ["city", "population"], "additionalProperties": False}
    rf = {"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}}
    msgs = [{"role": "user", "content": "Name a large city and its population, as JSON."}]
    r = client.chat.completions.create(model=NAME, messages=msgs, response_format=rf, n=3, temperature=1, seed=5,
                                       max_tokens=200)
    assert len(r.choices) == 3
    for c in r.choices:
        assert c.finish_reason == "stop", c
        jsonschema.validate(json.loads(c.message.content), schema)
    stream = client.chat.completions.create(model=NAME, messages=msgs, response_format=rf, temperature=1, seed=5,
                                            max_tokens=200, stream=True)
    joined = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert joined == r.choices[0].message.content
    r = client.completions.create(model=NAME, prompt="A JSON object:", max_tokens=100, temperature=0,
                                  extra_body={"response_format": {"type": "json_object"}})
    assert isinstance(json.loads(r.choices[0].text), dict) or r.choices[0].finish_reason == "length"
    assert server.wait_idle(30) and server.engine.block_manager.num_used_blocks == 0


def _blocked_engine(server):
    """Make the engine thread stall inside its next step until the returned event is set."""
    eng, entered, release = server.engine, threading.Event(), threading.Event()
    real = eng.step

    def step():
        entered.set()
        release.wait(30)
        eng.step = real
        return real()

    eng.step = step
    return entered, release


def test_full_waiting_queue_is_503_with_retry_after(server):
    h = {"Authorization": f"Bearer {KEY}"}
    body = {"model": NAME, "prompt": "hi", "max_tokens": 2, "temperature": 0}
    server.loop.max_waiting = 2
    entered, release = _blocked_engine(server)

    async def run():
        async with httpx.AsyncClient(base_url=server.url, headers=h, timeout=60) as c:
            first = asyncio.ensure_future(c.post("/v1/completions", json=body))
            # the engine holds request 1 in its waiting queue (a first request that fails never
            # gets there: the deadline ends the test instead of hanging the run)
            await await_until(entered.is_set, 60, "the engine to take request 1")
            second = asyncio.ensure_future(c.post("/v1/completions", json=body))
            await await_until(lambda: server.loop.num_waiting >= 2, 60, "two requests in the waiting queue")
            third = await c.post("/v1/completions", json=body)
            release.set()
            return await first, await second, third

    try:
        first, second, third = asyncio.run(run())
    finally:
        release.set()
        server.loop.max_waiting = None
    assert third.status_code == 503 and int(third.headers["Retry-After"]) >= 1
    assert third.json()["error"]["code"] == "server_busy"
    # a request that alone needs more queue places than exist can never succeed: 400, not 503
    server.loop.max_waiting = 2
    try:
        r = httpx.post(server.url + "/v1/completions", json={**body, "n": 3}, headers=h)
    finally:
        server.loop.max_waiting = None
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    assert first.status_code == 200 and second.status_code == 200
    assert server.wait_idle(5)


def test_failing_step_fails_its_requests_not_the_server(server, client):
    eng = server.engine
    real = eng.step

    def broken():
        eng.step = real
        raise RuntimeError("injected failure")

    eng.step = broken
    with pytest.raises(openai.InternalServerError, match="injected failure"):
        client.completions.create(model=NAME, prompt="hi", max_tokens=3, temperature=0)
    assert server.wait_idle(5)
    assert httpx.get(server.url + "/health").status_code == 200
    r = client.completions.create(model=NAME, prompt="hi", max_tokens=3, temperature=0)
    assert r.usage.completion_tokens == 3


# -- n > 1, metrics --------------------------------------------------------------------------------
def test_n_samples_distinct_and_reproducible(server, client):
    kw = dict(model=NAME, prompt="My favourite animal is", max_tokens=12, temperature=1.0, n=3, seed=7)
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert len({c.text for c in a.choices}) == 3
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.usage.prompt_tokens == b.usage.prompt_tokens < a.usage.completion_tokens


def test_metrics_agree_with_clients(server, client):
    m0 = metrics(server)
    rs = [client.completions.create(model=NAME, prompt=f"Count to {i}:", max_tokens=5 + i, temperature=0,
                                    extra_body={"ignore_eos": True}) for i in range(3)]
    m1 = metrics(server)
    assert m1["mixserve_generation_tokens_total"] - m0["mixserve_generation_tokens_total"] == \
        sum(r.usage.completion_tokens for r in rs) == 5 + 6 + 7
    assert m1["mixserve_prompt_tokens_total"] - m0["mixserve_prompt_tokens_total"] == \
        sum(r.usage.prompt_tokens for r in rs)
    assert m1["mixserve_time_to_first_token_seconds_count"] - m0["mixserve_time_to_first_token_seconds_count"] == 3
    assert m1["mixserve_e2e_request_latency_seconds_count"] - m0["mixserve_e2e_request_latency_seconds_count"] == 3
    assert m1["mixserve_kv_cache_blocks_total"] == server.engine.num_blocks
    assert m1["mixserve_kv_cache_blocks_used"] == 0 and m1["mixserve_num_requests_running"] == 0


# -- SIGTERM ---------------------------------------------------------------------------------------
def test_sigterm_finishes_short_stream_aborts_long_one_and_exits(smollm2_path, tmp_path):
    log_file = tmp_path / "serve.log"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "mixserve.cli", "serve", "--model", smollm2_path,
                             "--dtype", "float32", "--kv-cache-memory", "256MiB", "--max-model-len", "2048",
                             "--port", str(port), "--served-model-name", NAME, "--shutdown-grace", "3"],
                            stdout=log_file.open("wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    log = lambda: log_file.read_text(errors="replace")[-2000:]  # noqa: E731  (a file: a pipe could fill and block the server)
    try:
        wait_healthy(url, proc, log)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)

        short, long, threads = start_drain_streams(client, NAME)
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(60)
        assert short["finish"] == "length" and len(short["ids"]) == 12  # finished within the grace period
        # aborted when the grace period ran out, and ended properly: a last chunk, then [DONE]
        assert "error" not in long and long["finish"] == "abort" and len(long["ids"]) < 2000
        assert proc.wait(30) == 0, log()
        assert "timeout graceful shutdown exceeded" not in log(), log()  # nothing left for uvicorn to cut
        with pytest.raises(httpx.TransportError):  # no longer accepting
            httpx.get(url + "/health")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


# -- online benchmark client -----------------------------------------------------------------------
def test_online_bench_against_server(server, smollm2_path, tmp_path):
    from mixserve.bench.arrivals import arrival_offsets
    from mixserve.bench.online import parse_slo
    from mixserve.cli import main

    assert parse_slo("ttft=500ms,tpot=0.05") == {"ttft": 0.5, "tpot": 0.05}
    gaps = [b - a for a, b in zip(*[arrival_offsets(2001, 4.0, 0.5, seed=1)[i:] for i in (0, 1)])]
    assert abs(sum(gaps) / len(gaps) - 0.25) < 0.03  # mean gap 1/rate, whatever the burstiness
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"prompt": f"Item {i}: a short note about", "max_tokens": 6 + i}) + "\n"
                             for i in range(4)))
    m0 = metrics(server)
    out = tmp_path / "online.json"
    assert main(["bench", "--url", server.url, "--api-key", KEY, "--model", smollm2_path, "--dataset", str(trace),
                 "--num-prompts", "4", "--request-rate", "20", "--max-concurrency", "2",
                 "--slo", "ttft=60s,tpot=10s", "--output", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert rep["num_requests"] == 4 and rep["failed"] == 0
    assert rep["output_tokens"] == 6 + 7 + 8 + 9  # ignore_eos: exactly max_tokens each
    assert rep["output_tokens"] == metrics(server)["mixserve_generation_tokens_total"] - \
        m0["mixserve_generation_tokens_total"]
    assert rep["good_requests"] == 4 and rep["ttft_s"]["count"] == 4 and rep["itl_s"]["count"] > 0
    assert rep["ttft_s"]["p50"] <= rep["e2e_s"]["p50"]
    strict = tmp_path / "strict.json"
    main(["bench", "--url", server.url, "--api-key", KEY, "--model", smollm2_path, "--dataset", str(trace),
          "--num-prompts", "2", "--request-rate", "inf", "--slo", "ttft=0.1ms", "--output", str(strict)])
    assert json.loads(strict.read_text())["good_requests"] == 0


# -- prompt scoring: echo + logprobs + max_tokens 0 -------------------------------------------------
def test_prompt_scoring_echo_logprobs_equal_float32_reference(server, client, smollm2_path):
    """How evaluation harnesses score a text: the prompt's token logprobs (first null) equal a
    float32 HF forward's log-softmax; no token is generated; streamed, the echo chunk carries them."""
    from tests.integration.test_real_models import hf_model

    prompt = "def add(a, b):\n    return a + b\n"
    r = client.completions.create(model=NAME, prompt=prompt, echo=True, logprobs=2, max_tokens=0, temperature=0)
    ch = r.choices[0]
    assert ch.text == prompt and ch.finish_reason == "length"
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ch.logprobs.tokens)
    lp = ch.logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert "".join(lp.tokens) == prompt and lp.text_offset[0] == 0
    ids = server.engine.tokenizer.encode(prompt)
    import torch

    with torch.inference_mode():
        logits = hf_model(smollm2_path)(torch.tensor([ids])).logits[0].float()
    ref = logits.log_softmax(-1)
    for i in range(1, len(ids)):
        assert abs(lp.token_logprobs[i] - ref[i - 1, ids[i]].item()) < 1e-4, i
        assert len(lp.top_logprobs[i]) == 2
        best = max(lp.top_logprobs[i].values())
        assert abs(best - ref[i - 1].max().item()) < 1e-4
    # with generated tokens after the echo: the prompt's entries, then the generation's, offsets running on
    r2 = client.completions.create(model=NAME, prompt=prompt, echo=True, logprobs=1, max_tokens=5, temperature=0)
    lp2 = r2.choices[0].logprobs
    n = len(ids)
    assert lp2.token_logprobs[0] is None and len(lp2.tokens) > n
    assert all(abs(a - b) < 1e-4 for a, b in zip(lp2.token_logprobs[1:n], lp.token_logprobs[1:]))
    assert "".join(lp2.tokens) == r2.choices[0].text and lp2.text_offset[n] == len(prompt)
    # streamed: the echo chunk (prompt + its logprobs) first, then the generated text
    chunks = list(client.completions.create(model=NAME, prompt=prompt, echo=True, logprobs=1, max_tokens=3,
                                            temperature=0, stream=True))
    first = chunks[0].choices[0]
    assert first.text == prompt and first.logprobs.token_logprobs[0] is None
    assert len(first.logprobs.tokens) == n
    plain3 = client.completions.create(model=NAME, prompt=prompt, max_tokens=3, temperature=0).choices[0].text
    assert "".join(c.choices[0].text for c in chunks if c.choices) == prompt + plain3


def test_prompt_scoring_limits_and_max_tokens_zero(server):
    url, h = server.url, {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(url + "/v1/completions", headers=h, timeout=60,
                   json={"model": NAME, "prompt": "hello", "max_tokens": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "" \
        and r.json()["choices"][0]["finish_reason"] == "length"
    r = httpx.post(url + "/v1/chat/completions", headers=h, timeout=60,
                   json={"model": NAME, "messages": CHAT, "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    # n > 1 with echo + logprobs: every choice carries the same prompt logprobs
    r = httpx.post(url + "/v1/completions", headers=h, timeout=60,
                   json={"model": NAME, "prompt": "one two three", "max_tokens": 2, "n": 2, "echo": True,
                         "logprobs": 0, "temperature": 0})
    a, b = (c["logprobs"] for c in r.json()["choices"])
    # the samples score the prompt in batches of other shapes: float32 sums in another order (an
    # AVX2-only machine differed by 1.8e-5 at a logprob of -13)
    assert a["tokens"][:3] == b["tokens"][:3] and \
        a["token_logprobs"][1:3] == pytest.approx(b["token_logprobs"][1:3], rel=1e-5, abs=1e-4)
