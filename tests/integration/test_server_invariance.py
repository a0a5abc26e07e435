"""One request, one answer through the server (shared/cases/seeded-output-depends-on-batch.md), on
SmolLM2 with the default engine (native GGUF where the CPU has the kernel): a seeded request gives
the same tokens and logprobs (bitwise) alone, beside another request, streamed, and with or without
logprobs; a repeated n = 3 request gives the same choices, each equal to its seed's n = 1 request
(its samples read the prompt from the prefix cache); a greedy chat answer does not change between
the first, uncached request and later ones."""
import concurrent.futures as cf

import openai
import pytest

from mixserve.engine.args import EngineArgs
from mixserve.engine.llm_engine import LLMEngine
from mixserve.server.api import ServerConfig
from tests.live_server import LiveServer

pytestmark = pytest.mark.integration

NAME = "smol"
P = "The capital of France is"
SEEDED = dict(model=NAME, prompt=P, temperature=0.8, seed=42, max_tokens=16, extra_body={"ignore_eos": True,
                                                                                        "return_token_ids": True})


@pytest.fixture(scope="module")
def server(smollm2_path):
    srv = LiveServer(LLMEngine(EngineArgs(model=smollm2_path, kv_cache_memory="160MiB", max_model_len=512,
                                          progress=False)), ServerConfig(NAME))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def _key(choice):
    lp = choice.logprobs
    return choice.token_ids, lp.token_logprobs, lp.top_logprobs


def _streamed(client, **kw):
    ids, lps, tops = [], [], []
    for c in client.completions.create(stream=True, **kw):
        if c.choices:
            ids += c.choices[0].token_ids or []
            if c.choices[0].logprobs is not None:
                lps += c.choices[0].logprobs.token_logprobs
                tops += c.choices[0].logprobs.top_logprobs
    return ids, lps, tops


def test_seeded_request_alone_beside_another_streamed_and_without_logprobs(server, client):
    alone = _key(client.completions.create(logprobs=2, **SEEDED).choices[0])
    assert len(alone[0]) == 16
    with cf.ThreadPoolExecutor(2) as pool:
        other = pool.submit(client.completions.create, model=NAME, prompt="Write a short poem about the sea:",
                            temperature=0.8, max_tokens=48, extra_body={"ignore_eos": True})
        beside = pool.submit(client.completions.create, logprobs=2, **SEEDED)
        assert _key(beside.result(timeout=600).choices[0]) == alone
        other.result(timeout=600)
    assert _streamed(client, logprobs=2, **SEEDED) == alone
    assert client.completions.create(**SEEDED).choices[0].token_ids == alone[0]
    assert _streamed(client, **SEEDED)[0] == alone[0]


def test_repeated_n3_seeded_request_gives_the_same_choices(client):
    kw = dict(SEEDED, seed=123, n=3, logprobs=1)
    first = sorted(client.completions.create(**kw).choices, key=lambda c: c.index)
    second = sorted(client.completions.create(**kw).choices, key=lambda c: c.index)
    assert [_key(c) for c in first] == [_key(c) for c in second]
    for c in first:  # sample k is the n = 1 request with seed 123 + k
        single = client.completions.create(**dict(kw, n=1, seed=123 + c.index)).choices[0]
        assert _key(single) == _key(c)


def test_greedy_chat_same_first_and_later_and_streamed(client):
    msgs = [{"role": "user", "content": "Repeat exactly: 霓虹灯 🎉👩‍💻 naïve café 𠜎𠜱𠝹"}]
    kw = dict(model=NAME, messages=msgs, temperature=0, max_tokens=12, extra_body={"return_token_ids": True})
    answers = [client.chat.completions.create(**kw).choices[0].token_ids for _ in range(3)]
    answers.append(client.chat.completions.create(logprobs=True, top_logprobs=1, **kw).choices[0].token_ids)
    streamed = [t for c in client.chat.completions.create(stream=True, **kw) if c.choices
                for t in (getattr(c.choices[0], "token_ids", None) or [])]
    assert all(a == answers[0] for a in answers) and len(answers[0]) == 12
    if streamed:  # the stream carries token ids where the server sends them
        assert streamed == answers[0]
