"""Server pieces on a tiny random model (no tokenizer: token-id prompts), and request parsing."""
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mixserve import SamplingParams
from mixserve.engine.llm_engine import EngineArgs, LLMEngine
from mixserve.server.api import ServerConfig
from mixserve.server.protocol import APIError, parse_request
from tests.live_server import LiveServer
from tests.unit.test_engine_tiny import make_tiny


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    folder, _ = make_tiny(tmp_path_factory.mktemp("srv"), "llama", tie=True)
    eng = LLMEngine(EngineArgs(model=folder, dtype="float32", kv_cache_memory="8MiB", draft_model="ngram",
                               speculation="fixed", num_speculative_tokens=3, progress=False))
    srv = LiveServer(eng, ServerConfig("tiny"))
    yield srv
    srv.stop()


def test_token_prompts_spec_metrics_and_no_tokenizer(tiny_server):
    url = tiny_server.url
    prompts = [[5, 6, 7, 8] * 6, [9, 10, 11] * 5]
    r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": prompts, "max_tokens": 20,
                                                 "temperature": 0, "n": 2, "ignore_eos": True,
                                                 "return_token_ids": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [c["prompt_token_ids"] for c in body["choices"]] == [prompts[0]] * 2 + [prompts[1]] * 2
    assert all(len(c["token_ids"]) == 20 for c in body["choices"])
    assert body["usage"] == {"prompt_tokens": 24 + 15, "completion_tokens": 80, "total_tokens": 24 + 15 + 80}
    # greedy: both samples of a prompt agree
    assert body["choices"][0]["token_ids"] == body["choices"][1]["token_ids"]
    text = httpx.get(url + "/metrics").text
    m = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}
    assert m["mixserve_spec_decode_num_draft_tokens_total"] > 0
    assert m["mixserve_spec_decode_num_accepted_tokens_total"] <= m["mixserve_spec_decode_num_evaluated_tokens_total"]
    assert m["mixserve_spec_decode_num_evaluated_tokens_total"] > 0
    assert m["mixserve_generation_tokens_total"] == 80
    r = httpx.post(url + "/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "text"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert tiny_server.wait_idle(5)


def test_engine_check_request_and_counters(tiny_server):
    eng = tiny_server.engine
    with pytest.raises(ValueError, match="^prompt:"):
        eng.check_request([], SamplingParams())
    with pytest.raises(ValueError, match="^max_tokens:"):
        eng.check_request([1, 2], SamplingParams(max_tokens=eng.max_model_len))
    eng.check_request([1, 2], SamplingParams(max_tokens=4))  # fine: no exception


@pytest.mark.parametrize("kind,body,param", [
    ("completions", {"model": "m", "prompt": "x", "temperature": "1"}, "temperature"),
    ("completions", {"model": "m", "prompt": "x", "n": True}, "n"),
    ("completions", {"model": "m", "prompt": "x", "logit_bias": {"1": 1}}, "logit_bias"),
    ("completions", {"model": "m", "prompt": "x", "bogus": 1}, "bogus"),
    ("completions", {"model": "m"}, "prompt"),
    ("chat", {"model": "m", "messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages"),
    ("chat", {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [{}]}, "tools"),
    ("chat", [1, 2], None),
])
def test_parse_request_names_the_field(kind, body, param):
    with pytest.raises(APIError) as e:
        parse_request(kind, body)
    assert e.value.status == 400 and e.value.param == param


def test_parse_request_null_means_default():
    r = parse_request("chat", {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                                       {"type": "text", "text": "b"}]}],
                               "tools": None, "temperature": None, "seed": None})
    assert r.temperature == 1.0 and r.messages[0].text() == "ab"
