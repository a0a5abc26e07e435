"""The server's prefix-cache surface on a tiny model: cached_tokens in usage, per-key salting
(tenant isolation), cache_salt, the Prometheus counters, and the recorded mix."""
import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mixserve.engine.args import EngineArgs
from mixserve.engine.llm_engine import LLMEngine
from mixserve.server.api import ServerConfig, read_api_keys
from tests.live_server import LiveServer
from tests.unit.test_engine_tiny import make_tiny

PROMPT = list(range(3, 43))  # 40 tokens: two full 16-token blocks are cacheable


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pcs")
    folder, _ = make_tiny(tmp, "llama", tie=True)
    (tmp / "keys").write_text("# tenants\nalice key-a\n\nbob   key-b\n")
    eng = LLMEngine(EngineArgs(model=folder, dtype="float32", kv_cache_memory="8MiB", progress=False))
    cfg = ServerConfig("tiny", api_keys=read_api_keys(str(tmp / "keys")), prefix_cache_salt="per-key",
                       record_mix=str(tmp / "mix.jsonl"))
    srv = LiveServer(eng, cfg)
    yield srv, tmp / "mix.jsonl"
    srv.stop()


def _complete(url, key, prompt=PROMPT, **extra):
    r = httpx.post(url + "/v1/completions", headers={"Authorization": f"Bearer {key}"},
                   json={"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                         **extra}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_per_key_salting_isolates_tenants_and_the_mix_is_recorded(server):
    srv, mix = server
    url = srv.url
    cached = lambda body: body["usage"]["prompt_tokens_details"]["cached_tokens"]  # noqa: E731
    b1 = _complete(url, "key-b")
    assert cached(b1) == 0
    a1 = _complete(url, "key-a")
    assert cached(a1) == 0  # bob's identical prompt is not visible to alice
    a2 = _complete(url, "key-a")
    assert cached(a2) == 32  # her own is
    assert cached(_complete(url, "key-b")) == 32
    assert cached(_complete(url, "key-a", cache_salt="other")) == 0  # a salt of her own separates again
    assert a1["choices"][0]["text"] == a2["choices"][0]["text"] == b1["choices"][0]["text"]
    r = httpx.post(url + "/v1/completions", headers={"Authorization": "Bearer key-a"},
                   json={"model": "tiny", "prompt": PROMPT, "cache_salt": ""}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"
    # the longest salt a request may give still fits behind its key's name
    assert cached(_complete(url, "key-a", cache_salt="s" * 1024)) == 0
    text = httpx.get(url + "/metrics", timeout=60).text
    fams = {s.name: s for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}
    assert fams["mixserve_prefix_cache_queries_total"].value == 6 * 40
    assert fams["mixserve_prefix_cache_hits_total"].value == 64
    states = {s.labels["state"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
              if s.name == "mixserve_prefix_cache_blocks"}
    assert states["in_use"] == 0 and states["evictable"] > 0
    assert srv.wait_idle(30)
    lines = [json.loads(x) for x in mix.read_text().splitlines()]
    assert [x["tag"] for x in lines] == ["bob", "alice", "alice", "bob", "alice", "alice"]
    assert [x["cached_tokens"] for x in lines] == [0, 0, 32, 32, 0, 0]
    assert all(x["prompt_tokens"] == 40 and x["output_tokens"] == 4 and "prompt" not in x for x in lines)
    assert all(x["finish_reason"] == "length" and x["ttft_s"] > 0 and x["block_size"] == 16 for x in lines)
    h = [x["block_hashes"] for x in lines]
    assert len(h[0]) == 2 and h[1] == h[2] and h[0] == h[3] and h[0] != h[1] and h[4] != h[1]
    r = httpx.post(url + "/v1/completions", headers={"Authorization": "Bearer nope"},
                   json={"model": "tiny", "prompt": PROMPT}, timeout=60)
    assert r.status_code == 401


def test_api_keys_file_errors(tmp_path):
    bad = tmp_path / "k"
    bad.write_text("alice key-a extra\n")
    with pytest.raises(ValueError, match=":1: expected `NAME KEY`"):
        read_api_keys(str(bad))
    bad.write_text("alice k1\nbob k1\n")
    with pytest.raises(ValueError, match=":2: key given twice"):
        read_api_keys(str(bad))
    bad.write_text("\ufeffalice k1\n", encoding="utf-8")  # a BOM is not part of the name
    assert read_api_keys(str(bad)) == {"k1": "alice"}
    bad.write_text("alice k\x001\n")
    with pytest.raises(ValueError, match="printable"):
        read_api_keys(str(bad))
    bad.write_text("# nothing\n")
    with pytest.raises(ValueError, match="no keys"):
        read_api_keys(str(bad))
    with pytest.raises(ValueError, match="per-key needs API keys"):
        ServerConfig("m", prefix_cache_salt="per-key")
