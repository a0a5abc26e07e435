"""Server pieces on a tiny random model (no tokenizer: token-id prompts), and request parsing."""
import json
import time
import types

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from mixserve import SamplingParams
from mixserve.engine.args import EngineArgs
from mixserve.engine.llm_engine import LLMEngine
from mixserve.server.api import ServerConfig
from mixserve.server.protocol import APIError, parse_request
from tests.live_server import LiveServer
from tests.waits import wait_until
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
                                                 "return_token_ids": True}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [c["prompt_token_ids"] for c in body["choices"]] == [prompts[0]] * 2 + [prompts[1]] * 2
    assert all(len(c["token_ids"]) == 20 for c in body["choices"])
    assert body["usage"] == {"prompt_tokens": 24 + 15, "completion_tokens": 80, "total_tokens": 24 + 15 + 80,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    # greedy: both samples of a prompt agree
    assert body["choices"][0]["token_ids"] == body["choices"][1]["token_ids"]
    text = httpx.get(url + "/metrics", timeout=60).text
    m = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}
    assert m["mixserve_spec_decode_num_draft_tokens_total"] > 0
    assert m["mixserve_spec_decode_num_accepted_tokens_total"] <= m["mixserve_spec_decode_num_evaluated_tokens_total"]
    assert m["mixserve_spec_decode_num_evaluated_tokens_total"] > 0
    assert m["mixserve_generation_tokens_total"] == 80
    r = httpx.post(url + "/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "x"}]},
                   timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "text"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert tiny_server.wait_idle(30)


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
    ("chat", {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": "all"}, "tools"),
    ("chat", {"model": "m", "messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]}, "messages"),
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


# -- shutdown, tokenization off the loop, waiting count, docs behind the key, step timer ----------
import json  # noqa: E402
import threading  # noqa: E402

from mixserve.server.engine_loop import EngineLoop, ServerOverloaded, _Stream  # noqa: E402
from mixserve.server.metrics import ServerMetrics  # noqa: E402


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("srv2"), "llama", tie=True)[0]


def plain_engine(folder):
    return LLMEngine(EngineArgs(model=folder, dtype="float32", kv_cache_memory="8MiB", progress=False))


class StepPermits:
    """Replaces engine.step: each step waits for a permit, so the test decides how far requests get."""

    def __init__(self, engine):
        self.sem = threading.Semaphore(0)
        self.orig = engine.step
        engine.step = self.step

    def step(self):
        assert self.sem.acquire(timeout=60), "test never released the engine"
        return self.orig()

    def allow(self, n: int):
        for _ in range(n):
            self.sem.release()


class StreamReader(threading.Thread):
    """Reads one streaming request's SSE data lines in the background."""

    def __init__(self, url, body, headers=None):
        super().__init__(daemon=True)
        self.url, self.body, self.headers = url, body, headers or {}
        self.lines: list[str] = []
        self.status = None
        self.start()

    def run(self):
        with httpx.stream("POST", self.url + "/v1/completions", json=self.body, headers=self.headers,
                          timeout=60) as r:
            self.status = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: "):
                    self.lines.append(line[6:])

    def wait_for(self, n: int, timeout_s: float = 30.0) -> bool:
        import time

        t0 = time.monotonic()
        while len(self.lines) < n and time.monotonic() - t0 < timeout_s:
            time.sleep(0.01)
        return len(self.lines) >= n


def test_shutdown_past_grace_ends_streams_and_answers_json_503(tiny_folder):
    eng = plain_engine(tiny_folder)
    permits = StepPermits(eng)
    srv = LiveServer(eng, ServerConfig("tiny"), grace_s=0)
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 200, "ignore_eos": True, "return_token_ids": True}
    stream = StreamReader(srv.url, {**body, "stream": True, "stream_options": {"include_usage": True}})
    permits.allow(3)
    assert stream.wait_for(3)
    plain: dict = {}
    t = threading.Thread(target=lambda: plain.update(r=httpx.post(srv.url + "/v1/completions", json=body, timeout=60)))
    t.start()
    while srv.loop._adds_sent < 2:  # both submitted; the engine is held, so neither can finish
        t.join(0.01)
    stopper = threading.Thread(target=srv.stop)
    stopper.start()  # grace 0: the app ends both requests at once
    stream.join(30)
    t.join(30)
    permits.allow(10_000)  # now let the engine thread run to its own stop
    stopper.join(30)
    assert stream.status == 200 and stream.lines[-1] == "[DONE]"
    last, usage = json.loads(stream.lines[-3]), json.loads(stream.lines[-2])
    assert last["choices"][0]["finish_reason"] == "abort"
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] >= 3
    r = plain["r"]
    assert r.status_code == 503 and r.headers["content-type"] == "application/json"
    assert r.json()["error"]["type"] == "server_error" and r.json()["error"]["code"] == "server_shutting_down"
    assert eng.block_manager.num_free_blocks == eng.num_blocks and not eng.requests


class SlowTokenizer:
    """Encodes only when the test says so, and says when it has started."""

    chat_template = None
    all_special_ids: list = []

    def __init__(self):
        self.entered, self.release = threading.Event(), threading.Event()

    def encode(self, text):
        self.entered.set()
        assert self.release.wait(60)
        return [3, 4, 5]

    def convert_ids_to_tokens(self, i):
        return f"t{i}"


def test_tokenizing_a_prompt_does_not_block_other_streams(tiny_folder):
    eng = plain_engine(tiny_folder)
    permits = StepPermits(eng)
    tok = SlowTokenizer()
    srv = LiveServer(eng, ServerConfig("tiny"), tokenizer=tok)
    try:
        stream = StreamReader(srv.url, {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 100, "stream": True,
                                        "ignore_eos": True, "return_token_ids": True})
        permits.allow(2)
        assert stream.wait_for(2)
        out: dict = {}
        t = threading.Thread(target=lambda: out.update(r=httpx.post(
            srv.url + "/v1/completions", json={"model": "tiny", "prompt": "long text", "max_tokens": 2}, timeout=60)))
        t.start()
        assert tok.entered.wait(30)
        n = len(stream.lines)
        permits.allow(5)
        # the other stream's chunks go out while the prompt is still being tokenized
        assert stream.wait_for(n + 5) and not tok.release.is_set()
        tok.release.set()
        permits.allow(10_000)
        t.join(30)
        stream.join(30)
        assert out["r"].status_code == 200 and out["r"].json()["usage"]["prompt_tokens"] == 3
        assert stream.lines[-1] == "[DONE]"
    finally:
        tok.release.set()
        permits.allow(10_000)
        srv.stop()


def test_parked_parallel_samples_count_as_waiting(tiny_folder):
    eng = plain_engine(tiny_folder)
    p = list(range(3, 40))
    sp = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True)
    eng.add_request(p, sp, request_id="a")
    for r in "bcd":
        eng.add_request(p, sp, request_id=r, share_prompt_with="a")
    assert len(eng.scheduler.waiting) == 1 and eng.num_waiting == 4
    loop = EngineLoop(eng, max_waiting=4)
    assert loop.num_waiting == 4
    with pytest.raises(ServerOverloaded):
        loop.check_admission()
    metrics = ServerMetrics(eng, lambda: loop.num_waiting)
    waiting = [s.value for f in text_string_to_metric_families(
        __import__("prometheus_client").generate_latest(metrics.registry).decode())
        for s in f.samples if s.name == "mixserve_num_requests_waiting"]
    assert waiting == [4]
    assert eng.abort("d") and eng.num_waiting == 3  # a parked sample aborted
    eng.step()  # the leader's prefill releases its samples into the waiting queue
    assert eng.num_waiting == 2 and len(eng.scheduler.waiting) == 2
    loop.check_admission()  # room again
    eng.add_request(p, sp, request_id="e")
    eng.add_request(p, sp, request_id="f", share_prompt_with="e")
    assert eng.num_waiting == 4
    assert eng.abort("e") and eng.num_waiting == 3  # its sample prefills by itself now: still waiting
    while eng.has_unfinished():
        eng.step()
    assert eng.num_waiting == 0


def test_docs_need_the_key_health_and_metrics_do_not_and_step_timer(tiny_folder):
    eng = plain_engine(tiny_folder)
    srv = LiveServer(eng, ServerConfig("tiny", api_key="sekret"))
    try:
        key = {"Authorization": "Bearer sekret"}
        for path in ("/docs", "/redoc", "/openapi.json"):
            r = httpx.get(srv.url + path, timeout=60)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
            assert httpx.get(srv.url + path, headers=key, timeout=60).status_code == 200, path
        assert "/v1/completions" in httpx.get(srv.url + "/openapi.json", headers=key, timeout=60).json()["paths"]
        health = httpx.get(srv.url + "/health", timeout=60)
        assert health.status_code == 200 and health.json() == {"status": "ok", "decode_graph_pending": False}
        # as while a graph compiles (no request is in flight: no step reads it meanwhile)
        compiling = types.SimpleNamespace(ready=threading.Event())
        eng.runner.pending_graph, pending = compiling, eng.runner.pending_graph
        try:
            assert httpx.get(srv.url + "/health", timeout=60).json()["decode_graph_pending"] is True
            text = httpx.get(srv.url + "/metrics", timeout=60).text
            assert {s.name: s.value for f in text_string_to_metric_families(text)
                    for s in f.samples}["mixserve_decode_graph_pending"] == 1
            compiling.ready.set()  # compiled: installed at the next step, no longer pending
            assert httpx.get(srv.url + "/health", timeout=60).json()["decode_graph_pending"] is False
        finally:
            eng.runner.pending_graph = pending
        r = httpx.post(srv.url + "/v1/completions", headers=key,
                       json={"model": "tiny", "prompt": [5, 6, 7, 8, 9], "max_tokens": 4, "ignore_eos": True},
                       timeout=60)
        assert r.status_code == 200
        assert srv.wait_idle(10)
        text = httpx.get(srv.url + "/metrics", timeout=60).text
        m = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
        # one prefill step (5 tokens) and 3 decode steps (1 token each; the last token is never fed back)
        assert m["mixserve_engine_step_seconds_count"] == eng.num_steps == 4
        assert m["mixserve_engine_step_tokens_total"] == 5 + 3
        assert 0 < m["mixserve_engine_step_seconds_sum"]
        assert m["mixserve_decode_graph_pending"] == 0
    finally:
        srv.stop()
    open_srv = LiveServer(plain_engine(tiny_folder), ServerConfig("tiny"))
    try:
        assert httpx.get(open_srv.url + "/docs", timeout=60).status_code == 200
    finally:
        open_srv.stop()


def test_oversized_body_is_413_and_others_run_on(tiny_folder):
    """A body over max_body_bytes is refused with 413 and OpenAI's error shape, whether its size
    is declared (Content-Length) or only found while reading (chunked); the next request runs."""
    srv = LiveServer(plain_engine(tiny_folder), ServerConfig("tiny", max_body_bytes=4096))
    try:
        url = srv.url + "/v1/completions"
        big = {"model": "tiny", "prompt": [5] * 3000, "max_tokens": 2}
        r = httpx.post(url, json=big, timeout=60)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        assert "4096" in r.json()["error"]["message"]

        def chunks():  # no Content-Length: the limit is found while reading
            for _ in range(10):
                yield b" " * 1000
            yield b'{"model": "tiny", "prompt": [5, 6], "max_tokens": 2}'
        r = httpx.post(url, content=chunks(), headers={"content-type": "application/json"}, timeout=60)
        assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"
        r = httpx.post(url, json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 3, "ignore_eos": True},
                       timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    finally:
        srv.stop()


def test_poisoned_row_is_500_or_error_chunk_and_others_run_on(tiny_folder):
    """A request whose logits turn non-finite (the engine's test hook writes NaN into its rows) is a
    500 with OpenAI's error shape, or a stream whose last chunk has finish_reason "error"; a
    request beside it completes; the errors are counted; no block stays in use."""
    import threading

    eng = plain_engine(tiny_folder)
    marker = [77, 77, 77]

    def hook(logits, rows):
        r = 0
        with torch.inference_mode():
            for it in rows:
                if it.token_ids[:3] == marker and len(it.token_ids) > 6:  # after a few tokens
                    logits[r:r + it.num_logits] = float("nan")
                r += it.num_logits
    eng.logits_hook = hook
    srv = LiveServer(eng, ServerConfig("tiny"))
    try:
        url = srv.url + "/v1/completions"
        good = {}

        def other():
            good["r"] = httpx.post(url, json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 30,
                                              "ignore_eos": True}, timeout=60)
        t = threading.Thread(target=other)
        t.start()
        bad = httpx.post(url, json={"model": "tiny", "prompt": marker, "max_tokens": 30, "ignore_eos": True},
                         timeout=60)
        assert bad.status_code == 500 and "non-finite" in bad.json()["error"]["message"]
        lines = []
        with httpx.stream("POST", url, json={"model": "tiny", "prompt": marker, "max_tokens": 30,
                                             "ignore_eos": True, "stream": True}, timeout=60) as r:
            assert r.status_code == 200
            lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
        assert lines[-1] == "[DONE]" and json.loads(lines[-2])["choices"][0]["finish_reason"] == "error"
        t.join(60)
        assert good["r"].status_code == 200 and good["r"].json()["usage"]["completion_tokens"] == 30
        text = httpx.get(srv.url + "/metrics", timeout=60).text
        errs = [s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == "mixserve_request_errored_total" and s.labels.get("reason") == "non_finite_logits"]
        assert errs == [2.0]
        assert srv.wait_idle(30) and eng.block_manager.num_used_blocks == 0 and eng.num_errored == 2
    finally:
        srv.stop()


def test_an_exception_in_a_forward_fails_only_that_steps_requests(tiny_folder):
    """A forward that raises fails the requests its step scheduled (500), not one that was waiting
    (max_num_seqs 1 keeps the second out of the step), which then completes; the server stays up."""
    import threading

    eng = LLMEngine(EngineArgs(model=tiny_folder, dtype="float32", kv_cache_memory="8MiB", progress=False,
                               max_num_seqs=1))
    real = eng.runner.run

    def run(items, copies=()):
        # fails the marked request's step once the other request waits behind it
        if eng.num_waiting and any(it.token_ids[:3] == [77, 77, 77] for it in items):
            raise RuntimeError("injected forward failure")
        return real(items, copies)
    eng.runner.run = run
    srv = LiveServer(eng, ServerConfig("tiny"))
    try:
        url = srv.url + "/v1/completions"
        res = {}

        def post(name, prompt, n):
            res[name] = httpx.post(url, json={"model": "tiny", "prompt": prompt, "max_tokens": n,
                                              "ignore_eos": True}, timeout=60)
        a = threading.Thread(target=post, args=("bad", [77, 77, 77], 400))
        a.start()
        wait_until(eng.has_unfinished, 60, "the marked request to run first", poll_s=0.005)
        b = threading.Thread(target=post, args=("good", [5, 6, 7], 20))
        b.start()
        a.join(60)
        b.join(60)
        assert res["bad"].status_code == 500 and "injected forward failure" in res["bad"].json()["error"]["message"]
        assert res["good"].status_code == 200 and res["good"].json()["usage"]["completion_tokens"] == 20
        assert srv.wait_idle(30) and eng.block_manager.num_used_blocks == 0
    finally:
        srv.stop()


def test_prompt_scoring_over_http_limit_stream_and_max_tokens_zero(tiny_folder):
    """echo + logprobs + max_tokens 0 returns the prompt's token logprobs (first null), equal to
    the engine's own prompt scoring; a prompt over --max-scored-prompt-tokens is a 400 that says
    so; streamed, the echo chunk carries them; the server goes on afterwards."""
    from mixserve.llm import LLM

    eng = LLMEngine(EngineArgs(model=tiny_folder, dtype="float32", kv_cache_memory="8MiB", progress=False,
                               max_scored_prompt_tokens=12))
    srv = LiveServer(eng, ServerConfig("tiny"))
    try:
        url = srv.url + "/v1/completions"
        ids = [5, 9, 17, 33, 2, 8, 41, 7, 3, 99, 12, 60]
        body = {"model": "tiny", "prompt": ids, "echo": True, "logprobs": 2, "max_tokens": 0}
        r = httpx.post(url, json=body, timeout=60)
        assert r.status_code == 200, r.text
        ch = r.json()["choices"][0]
        assert ch["finish_reason"] == "length" and r.json()["usage"]["completion_tokens"] == 0
        lp = ch["logprobs"]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None and len(lp["token_logprobs"]) == 12
        ref = LLM(tiny_folder, dtype="float32", kv_cache_memory="8MiB", progress=False).generate(
            [ids], SamplingParams(max_tokens=0, prompt_logprobs=2))[0].prompt_logprobs
        assert lp["token_logprobs"][1:] == pytest.approx([x.logprob for x in ref], abs=1e-5)
        r = httpx.post(url, json={**body, "prompt": ids + [1]}, timeout=60)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "prompt" and "12" in err["message"] \
            and "scoring" in err["message"]
        with httpx.stream("POST", url, json={**body, "stream": True, "max_tokens": 2, "ignore_eos": True},
                          timeout=60) as s:
            events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
        first = events[0]["choices"][0]
        assert first["logprobs"]["token_logprobs"][1:] == pytest.approx(lp["token_logprobs"][1:], abs=1e-5)
        gen = [e["choices"][0] for e in events[1:] if e["choices"]]
        assert sum(len(c["logprobs"]["tokens"]) for c in gen if c["logprobs"]) == 2
        assert gen[-1]["finish_reason"] == "length"
        r = httpx.post(url, json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2}, timeout=60)
        assert r.status_code == 200
        assert srv.wait_idle(30) and eng.block_manager.num_free_blocks == eng.num_blocks
    finally:
        srv.stop()


def test_a_request_counts_once_finished_or_aborted():
    """The race of a client abort with the engine finishing the same request: whichever reaches
    the event loop first counts it (on_finish, or abort() returning True), never both."""
    import asyncio

    from mixserve.engine.llm_engine import RequestOutput

    def out(rid):
        return RequestOutput(rid, None, [1], "", "", [2], True, "length")

    async def run():
        finished = []
        loop = EngineLoop(engine=None, on_finish=finished.append)
        q = asyncio.Queue()
        # finished first: the output is counted, the late abort is not
        loop._streams["a"] = _Stream(q)
        loop._dispatch([out("a")], [])
        assert [o.request_id for o in finished] == ["a"] and loop.abort("a") is False
        # aborted first: the abort counts, the finished output arriving after it does not
        loop._streams["b"] = _Stream(q)
        assert loop.abort("b") is True
        loop._dispatch([out("b")], [])
        assert [o.request_id for o in finished] == ["a"]
        assert loop._commands.get_nowait() == ("abort", "b")
    asyncio.run(run())


def test_failed_requests_count_once_each_and_admission_is_all_or_nothing():
    """Each request an engine step fails is counted once as errored (n > 1: every sample); a job
    whose samples would pass max_waiting is refused before any is added."""
    import asyncio

    from mixserve.server.engine_loop import EngineFailure

    async def run():
        failed = []
        loop = EngineLoop(engine=None, on_fail=failed.append)
        q = asyncio.Queue()
        for rid in ("a", "b", "c"):
            loop._streams[rid] = _Stream(q)
        assert loop.abort("c") is True  # aborted before the failure: counted as aborted only
        loop._dispatch([], [("a", "boom"), ("b", "boom"), ("c", "boom")])
        assert failed == ["a", "b"] and isinstance(q.get_nowait(), EngineFailure)
        loop._dispatch([], [("d", "bye")], shutdown=True)
        assert failed == ["a", "b"]

        class Eng:
            num_waiting = 1
        full = EngineLoop(engine=Eng(), max_waiting=2)
        full.check_admission(1)
        with pytest.raises(ServerOverloaded):
            full.check_admission(2)
    asyncio.run(run())
