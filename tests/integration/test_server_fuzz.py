"""Schema fuzzing of /v1/completions and /v1/chat/completions on SmolLM2 (float32, loopback).

Hypothesis draws request bodies: valid ones from the documented parameters (small max_tokens),
and hostile ones made from a valid body by breaking one field (wrong type, NaN / Infinity,
huge integers, lone surrogates, enormous strings, negative and zero limits, deep nesting) or
adding an unknown or conflicting one, plus raw bodies that are not JSON objects at all. Every
valid body must get a 200 with a well-formed response; every hostile one a 4xx in OpenAI's error
shape, naming the broken field where there is one; never a 500, a reset or a hang; and a normal
request must still succeed afterwards.
"""
import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mixserve.engine.args import EngineArgs
from mixserve.engine.llm_engine import LLMEngine
from mixserve.server.api import ServerConfig
from tests.live_server import LiveServer

pytestmark = pytest.mark.integration

NAME = "smol"
EXAMPLES = 80  # per test; two tests: 160 bodies in all, the same ones each run (derandomized); 130 before issue 32 cut the suite


@pytest.fixture(scope="module")
def fuzz_server(smollm2_path):
    eng = LLMEngine(EngineArgs(model=smollm2_path, dtype="float32", kv_cache_memory="64MiB", max_model_len=256,
                               progress=False))
    srv = LiveServer(eng, ServerConfig(NAME, max_n=4, max_body_bytes=1 << 20))
    client = httpx.Client(base_url=srv.url, timeout=60)
    yield srv, client
    client.close()
    srv.stop()


text = st.text(st.characters(codec="utf-8"), max_size=40)
common = {
    "temperature": st.floats(0, 2), "top_p": st.floats(0.05, 1), "top_k": st.sampled_from([-1, 1, 5, 50]),
    "min_p": st.floats(0, 0.5), "n": st.integers(1, 2), "seed": st.integers(0, 2**31 - 1),
    "stop": st.one_of(st.none(), text.filter(bool), st.lists(text.filter(bool), max_size=3)),
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2), "stream": st.booleans(), "min_tokens": st.integers(0, 2),
    "ignore_eos": st.booleans(), "return_token_ids": st.booleans(), "user": text,
}


def valid_completion():
    prompt = st.one_of(text.filter(str.strip), st.lists(text.filter(str.strip), min_size=1, max_size=2),
                       st.lists(st.integers(0, 49151), min_size=1, max_size=20))
    # max_tokens 0 with echo + logprobs scores the prompt (evaluation harnesses)
    fields = {**common, "logprobs": st.integers(0, 5), "echo": st.booleans(), "max_tokens": st.integers(0, 4)}
    return st.fixed_dictionaries({"model": st.just(NAME), "prompt": prompt}, optional=fields).map(
        lambda b: _min_fix(b, 16))


def valid_chat():
    msg = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]), "content": text})
    messages = st.lists(msg, min_size=1, max_size=3).map(lambda m: m + [{"role": "user", "content": "hi"}])
    fields = {**common, "logprobs": st.booleans(), "max_tokens": st.integers(1, 4),
              "max_completion_tokens": st.integers(1, 4)}
    return st.fixed_dictionaries({"model": st.just(NAME), "messages": messages}, optional=fields).map(_chat_fix)


def _min_fix(body, default_max):
    """min_tokens above the output limit is a documented 400: keep valid bodies valid."""
    limit = min(body.get("max_completion_tokens", default_max), body.get("max_tokens", default_max))
    if body.get("min_tokens", 0) > limit:
        body["min_tokens"] = limit
    return body


def _chat_fix(body):
    if "max_tokens" in body and "max_completion_tokens" in body:
        del body["max_tokens"]  # both at once is a documented 400 (a conflict: hostile bodies try it)
    if "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = 3  # a reply may otherwise run to the end of the context
    if body.get("logprobs"):
        body["top_logprobs"] = 2
    return _min_fix(body, 3)


HOSTILE_VALUES = [None, "x", "", 1.5, -1, 0, 10**400, float("nan"), float("inf"), -float("inf"), True, [], {},
                  [[[]]], {"a": 1}, "\ud800", "a" * 200_000, -(10**30), 2**63]


def hostile(valid):
    """A valid body with one field broken or one unknown/conflicting field added: (body, field)."""
    def mutate(draw):
        body = draw(valid)
        choice = draw(st.integers(0, 3))
        if choice == 0:  # a field set to a hostile value
            field = draw(st.sampled_from(sorted(body) + ["max_tokens", "n", "temperature", "top_p", "logprobs",
                                                         "stop", "seed", "top_k", "min_tokens"]))
            body[field] = draw(st.sampled_from(HOSTILE_VALUES))
        elif choice == 1:  # an unknown field
            field = draw(st.text(st.characters(codec="utf-8", categories=["L"]), min_size=3, max_size=12)
                         .filter(lambda k: k not in body and k not in common))
            body[field] = draw(st.sampled_from(HOSTILE_VALUES[1:]))
        elif choice == 2:  # limits out of range
            field = draw(st.sampled_from(["max_tokens", "n", "top_k", "min_tokens", "top_p", "temperature"]))
            body[field] = draw(st.sampled_from([-5, -1, 0, 10**9, 10**18]))
        else:  # deep nesting inside a field, written as JSON text (json.dumps itself would recurse)
            field = draw(st.sampled_from(sorted(body)))
            depth = draw(st.integers(50, 3000))
            rest = json.dumps({k: v for k, v in body.items() if k != field})
            body = (rest[:-1] + (", " if len(rest) > 2 else "") + json.dumps(field) + ": " + "[" * depth + "1"
                    + "]" * depth + "}").encode()
        return body, field
    return st.composite(lambda draw: mutate(draw))()


RAW = [b"", b"null", b"[]", b"[1, 2]", b'"text"', b"{", b'{"model": NaN}', b"\xff\xfe", b"{" * 5000 + b"}" * 5000,
       b'{"model": "smol", "prompt": "\\ud800"}', b'{"model": "smol", "prompt": "hi", "max_tokens": 1e400}']


def post(client, path, body) -> httpx.Response:
    data = body if isinstance(body, bytes) else json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")
    return client.post(path, content=data, headers={"content-type": "application/json"})


def check_ok(r: httpx.Response, body: dict, chat: bool) -> None:
    assert r.status_code == 200, (body, r.status_code, r.text[:500])
    if body.get("stream"):
        lines = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
        assert lines and lines[-1] == "[DONE]", r.text[-300:]
        for ln in lines[:-1]:
            d = json.loads(ln)
            assert "error" not in d, d
        return
    d = r.json()
    n = body.get("n") or 1  # null means the default
    prompts = body["prompt"] if not chat and isinstance(body["prompt"], list) and body["prompt"] and \
        not isinstance(body["prompt"][0], int) else [0]
    assert len(d["choices"]) == n * len(prompts)
    for c in d["choices"]:
        assert c["finish_reason"] in ("stop", "length")
        assert isinstance(c["message"]["content"] if chat else c["text"], str)
        if not chat and body.get("echo") and body.get("logprobs") is not None:  # prompt scoring
            assert c["logprobs"]["token_logprobs"][0] is None and c["logprobs"]["text_offset"][0] == 0
    u = d["usage"]
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]


def check_refused(r: httpx.Response, field) -> None:
    assert 400 <= r.status_code < 500, (field, r.status_code, r.text[:500])
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"] and "type" in err
    if field is not None and r.status_code == 400 and err["param"] is not None:
        # the field named is the one broken (or, for a conflict, the field it conflicts with)
        assert err["param"] == field or field in err["message"] or err["param"] in json.dumps(field), err


@pytest.mark.parametrize("path,chat", [("/v1/completions", False), ("/v1/chat/completions", True)])
def test_fuzzed_bodies_never_break_the_server(fuzz_server, path, chat):
    srv, client = fuzz_server
    valid = valid_chat() if chat else valid_completion()
    seen = {"valid": 0, "hostile": 0}

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,  # the same bodies each run
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(case=st.one_of(valid.map(lambda b: ("valid", b, None)),
                          hostile(valid).map(lambda bf: ("hostile", bf[0], bf[1])),
                          st.sampled_from(RAW).map(lambda b: ("raw", b, None))))
    def run(case):
        kind, body, field = case
        r = post(client, path, body)
        assert r.status_code != 500 and r.status_code < 500, (kind, field, r.status_code, r.text[:500])
        if kind == "valid":
            seen["valid"] += 1
            if r.status_code == 400 and "encodes to no tokens" in r.text:
                # a text of characters the vocabulary drops (SmolLM2: control characters, e.g. "\x16")
                texts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
                assert any(isinstance(t, str) and not srv.engine.encode(t) for t in texts), (body, r.text)
                check_refused(r, "prompt")
                return
            check_ok(r, body, chat)
        elif r.status_code != 200:  # a "hostile" value may be a legal one (0 for temperature)
            seen["hostile"] += 1
            check_refused(r, field)
        else:
            assert kind == "hostile"
            if isinstance(body, bytes):
                r.json()
            else:
                check_ok(r, body, chat)
    run()
    assert seen["valid"] > 20 and seen["hostile"] > 20, seen
    ok = post(client, path, {"model": NAME, "max_tokens": 3, **({"messages": [{"role": "user", "content": "hi"}]}
                                                                 if chat else {"prompt": "hello"})})
    assert ok.status_code == 200
    assert srv.wait_idle(30) and srv.engine.block_manager.num_used_blocks == 0
