"""`serve --replicas 2` on Ray Serve (local cluster, loopback), SmolLM2-135M in float32, driven by
the official `openai` client: the same API as the single-engine server, routing that can be
seen (x-mixserve-replica header, replica pid), and a replica killed under load.

One Ray cluster for the module; the round-robin case redeploys the application on it, and the
kill test runs last. Greedy outputs are compared with the single engine's offline generation
under the near-tie rule (tests/reference.py).
"""
import json
import os
import signal
import socket
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytest.importorskip("ray.serve")

from mixserve import SamplingParams  # noqa: E402
from mixserve.engine.args import EngineArgs  # noqa: E402
from mixserve.llm import LLM  # noqa: E402
from mixserve.server.api import ServerConfig  # noqa: E402
from tests.live_server import gap_logits  # noqa: E402
from tests.reference import compare_greedy  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.ray]

NAME = "smol"
ENGINE = dict(dtype="float32", kv_cache_memory="96MiB", max_model_len=512, progress=False, gguf_weights="dequantize")
# longer than the 4 blocks x 16 tokens of a route key, so every variant below shares its key
SYSTEM = ("You are a careful assistant for a team of Python developers. You answer with short, correct code and "
          "explain the standard library function you used, its arguments and what it returns, in two sentences. "
          "Prefer the clearest built-in over a clever one-liner, name every edge case the code handles, and say "
          "which Python version the answer needs when it is newer than 3.8. ")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(smollm2_path):
    from mixserve.replicas.app import ReplicaOptions, start, stop

    port = _free_port()
    args = EngineArgs(model=smollm2_path, **ENGINE)
    opts = ReplicaOptions(num_replicas=2, cpus=1, threads=1, routing="prefix", grace_s=5, stats_period_s=0.5)
    local = start(args, ServerConfig(NAME), opts, port=port)
    state = {"url": f"http://127.0.0.1:{port}", "args": args, "opts": opts}
    yield state
    stop(local)


@pytest.fixture(scope="module")
def offline(smollm2_path):
    return LLM(smollm2_path, **ENGINE)


def client(cluster):
    return openai.OpenAI(base_url=cluster["url"] + "/v1", api_key="none", max_retries=0, timeout=120)


def replica_metrics(cluster, with_aborted: bool = False):
    """{replica name: {sample name: value}} of the replica-labelled samples of /metrics; with
    with_aborted, also {replica name: requests it aborted, all reasons} from the same scrape."""
    text = httpx.get(cluster["url"] + "/metrics", timeout=30).text
    out: dict = {}
    aborts: dict = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if "replica" in s.labels and set(s.labels) == {"replica"}:
                out.setdefault(s.labels["replica"], {})[s.name] = s.value
            if s.name == "mixserve_request_aborted_total" and "replica" in s.labels:
                aborts[s.labels["replica"]] = aborts.get(s.labels["replica"], 0) + s.value
    return (out, aborts) if with_aborted else out


def completion(cluster, prompt, **kw):
    r = client(cluster).completions.with_raw_response.create(
        model=NAME, prompt=prompt, max_tokens=kw.pop("max_tokens", 12), temperature=0,
        extra_body={"return_token_ids": True}, **kw)
    return r.headers["x-mixserve-replica"], int(r.headers["x-mixserve-replica-pid"]), r.parse()


def test_completions_chat_and_streaming_equal_the_single_engine(cluster, offline):
    prompts = ["def fibonacci(n):", "The capital of France is", SYSTEM + "How do I sort a list?"]
    refs = offline.generate(prompts, SamplingParams(temperature=0, max_tokens=24, logprobs=2))
    for p, ref in zip(prompts, refs):
        _, _, body = completion(cluster, p, max_tokens=24)
        ch = body.choices[0]
        c = compare_greedy(ch.token_ids, ref.token_ids, gap_logits(ref.logprobs))
        assert c.ok, f"{p!r}: diverged at token {c.position}, top-2 gap {c.gap}"
        if c.position is None:
            assert ch.text == ref.text
    # streaming: the pieces join to the non-streamed text
    oc = client(cluster)
    whole = oc.completions.create(model=NAME, prompt=prompts[0], max_tokens=24, temperature=0).choices[0].text
    pieces = [e.choices[0].text for e in oc.completions.create(model=NAME, prompt=prompts[0], max_tokens=24,
                                                               temperature=0, stream=True) if e.choices]
    assert "".join(pieces) == whole
    msgs = [{"role": "user", "content": "Say hi in one word."}]
    chat = oc.chat.completions.create(model=NAME, messages=msgs, max_tokens=16, temperature=0)
    deltas = [e.choices[0].delta.content or "" for e in oc.chat.completions.create(
        model=NAME, messages=msgs, max_tokens=16, temperature=0, stream=True) if e.choices]
    assert chat.choices[0].message.content and "".join(deltas) == chat.choices[0].message.content
    # errors are the single server's: a 400 naming the field, an unknown model
    with pytest.raises(openai.BadRequestError) as e:
        oc.completions.create(model=NAME, prompt="x", max_tokens=-1)
    assert "max_tokens" in str(e.value)
    with pytest.raises(openai.BadRequestError):
        oc.completions.create(model="other", prompt="x", max_tokens=2)
    assert [m.id for m in oc.models.list().data] == [NAME]


def test_prefix_routing_keeps_a_shared_prefix_on_one_replica(cluster):
    # a prefix no earlier test sent: the first request finds nothing cached
    seen = [completion(cluster, "Team B. " + SYSTEM + f"Question {i}: how do I reverse a string?") for i in range(5)]
    names = {n for n, _, _ in seen}
    pids = {p for _, p, _ in seen}
    assert len(names) == 1 and len(pids) == 1, seen
    # after the first, each one finds the shared blocks cached on that replica
    cached = [b.usage.prompt_tokens_details.cached_tokens for _, _, b in seen]
    assert cached[0] == 0 and all(c >= 64 for c in cached[1:]), cached
    # the replica's own counters say the same, in the ingress's /metrics (stats lag by a period)
    deadline = time.time() + 30
    while time.time() < deadline:
        m = replica_metrics(cluster)
        if len(m) == 2 and m.get(seen[0][0], {}).get("mixserve_prefix_cache_hits_total", 0) >= 4 * 64:
            break
        time.sleep(0.5)
    m = replica_metrics(cluster)
    assert len(m) == 2 and m[seen[0][0]]["mixserve_prefix_cache_hits_total"] >= 4 * 64
    for name in m:  # the vendor-neutral gauges are there per replica
        for g in ("mixserve_num_requests_waiting", "mixserve_num_requests_running", "mixserve_kv_cache_usage_perc"):
            assert g in m[name]
    text = httpx.get(cluster["url"] + "/metrics").text
    assert f'mixserve_router_requests_total{{reason="affinity",replica="{seen[0][0]}"}}' in text


def aborted(cluster) -> dict:
    """{replica name: requests it aborted, all reasons} from the ingress's /metrics, as reported
    after this call began (each replica's figures reach the ingress every stats_period_s)."""
    since, deadline = time.time(), time.time() + 30
    while True:
        now = time.time()
        m, out = replica_metrics(cluster, with_aborted=True)
        ages = [v.get("mixserve_replica_stats_age_seconds") for v in m.values()]
        if (m and all(a is not None and now - a > since for a in ages)) or now > deadline:
            return out
        time.sleep(0.25)


def test_client_disconnect_frees_the_blocks_on_the_replica(cluster):
    body = {"model": NAME, "prompt": SYSTEM + "Write a long story.", "max_tokens": 400, "stream": True,
            "ignore_eos": True}
    before = aborted(cluster)
    with httpx.stream("POST", cluster["url"] + "/v1/completions", json=body, timeout=60) as r:
        name = r.headers["x-mixserve-replica"]
        for _ in zip(range(5), r.iter_lines()):
            pass
    # the client is gone after 5 lines: the replica aborts the request (not one that ran to its
    # end: the abort counter moves) and frees every block
    closed = time.time()
    # Only figures the replica reported after the client left count (they reach the ingress
    # through Ray Serve's controller, so a reading can predate the request or its abort). The
    # timeline goes into the failure message: a stale relay (age grows) and a replica that holds
    # blocks while it steps on are different faults.
    # The abort is counted when the request is cancelled, its blocks are freed by the engine
    # thread before its next step: a report may fall in between, so wait for one that shows both.
    deadline, timeline, fresh = time.time() + 60, [], None
    while time.time() < deadline:
        now = time.time()
        m, n_aborted = replica_metrics(cluster, with_aborted=True)
        m, n_aborted = m.get(name, {}), n_aborted.get(name, 0)
        age = m.get("mixserve_replica_stats_age_seconds")
        timeline.append((round(now - closed, 1), m.get("mixserve_kv_cache_blocks_used"),
                         m.get("mixserve_num_requests_running"), m.get("mixserve_engine_steps_total"),
                         None if age is None else round(age, 2), n_aborted))
        if age is not None and now - age > closed + 0.2 and n_aborted > before.get(name, 0):
            fresh = (m, n_aborted)
            if m.get("mixserve_kv_cache_blocks_used") == 0 and m.get("mixserve_num_requests_running") == 0:
                break
        time.sleep(0.5)
    why = f"(t, blocks, running, steps, stats age, aborted) {timeline[::max(1, len(timeline) // 12)] + timeline[-1:]}"
    assert fresh is not None, "no report after the client left shows the abort: " + why
    m, n_aborted = fresh
    assert m["mixserve_kv_cache_blocks_used"] == 0 and m["mixserve_num_requests_running"] == 0, why
    assert n_aborted == before.get(name, 0) + 1, why


def test_round_robin_alternates(cluster):
    from ray import serve

    from mixserve.replicas.app import APP_NAME, ReplicaOptions, build_app

    opts = ReplicaOptions(**{**cluster["opts"].__dict__, "routing": "round-robin"})
    serve.run(build_app(cluster["args"], ServerConfig(NAME), opts), name=APP_NAME, route_prefix="/")
    cluster["opts"] = opts
    seen = [completion(cluster, SYSTEM + "Question: how do I reverse a string?", max_tokens=2) for _ in range(6)]
    names = [n for n, _, _ in seen]
    assert len(set(names)) == 2 and all(a != b for a, b in zip(names, names[1:])), names


def _load_request(url: str, i: int, out: dict) -> None:
    """One request of the kill test: streamed (even i) or not; records how it ended."""
    body = {"model": NAME, "prompt": f"Story number {i}: once upon a time", "max_tokens": 48, "ignore_eos": True,
            "temperature": 0}
    try:
        if i % 2 == 0:
            body["stream"] = True
            events, finish = [], None
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=90) as r:
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        ev = json.loads(line[6:])
                        events.append(ev)
                        if "error" in ev:
                            finish = "error"
                        elif ev["choices"] and ev["choices"][0]["finish_reason"]:
                            finish = ev["choices"][0]["finish_reason"]
                out[i] = ("stream", r.status_code, finish, events[-1] if events else None)
        else:
            r = httpx.post(url + "/v1/completions", json=body, timeout=90)
            j = r.json()
            out[i] = ("json", r.status_code, j["choices"][0]["finish_reason"] if r.status_code == 200 else
                      j["error"]["message"], None)
    except Exception as e:  # noqa: BLE001 -- recorded and asserted on below
        out[i] = ("raised", None, repr(e), None)


def test_a_killed_replica_loses_no_request_and_comes_back(cluster):
    url = cluster["url"]
    # which processes serve now
    pids = {}
    for i in range(8):
        name, pid, _ = completion(cluster, f"Hello {i}", max_tokens=1)
        pids[name] = pid
    assert len(pids) == 2
    victim, survivor = sorted(pids)
    out: dict = {}
    threads = [threading.Thread(target=_load_request, args=(url, i, out)) for i in range(12)]
    for t in threads:
        t.start()
    time.sleep(2.0)  # streams are under way on both replicas
    os.kill(pids[victim], signal.SIGKILL)
    t0 = time.time()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a request hung past 120 s"
    assert time.time() - t0 < 120 and len(out) == 12
    for i, (kind, status, finish, last) in sorted(out.items()):
        assert kind != "raised", (i, finish)
        if kind == "json":  # never sent a byte before the kill: retried, so it completes
            assert status == 200 and finish == "length", (i, status, finish)
        else:  # completes, or ends with an error event naming the failed replica, then [DONE]
            assert status == 200 and finish in ("length", "error"), (i, finish)
            if finish == "error":
                assert last["error"]["code"] == "replica_failed"
    # Ray Serve starts a new replica; it serves again (a new process)
    deadline = time.time() + 180
    new_pid = None
    while time.time() < deadline and new_pid is None:
        try:
            for i in range(6):
                _, pid, _ = completion(cluster, f"Again {i}", max_tokens=1)
                if pid not in pids.values():
                    new_pid = pid
        except openai.APIError:
            pass
        time.sleep(1)
    assert new_pid is not None, "the killed replica did not come back"
    # the survivor's KV blocks are all free once its requests ended
    deadline = time.time() + 30
    while time.time() < deadline:
        m = replica_metrics(cluster).get(survivor, {})
        if m.get("mixserve_kv_cache_blocks_used") == 0:
            break
        time.sleep(0.5)
    assert replica_metrics(cluster)[survivor]["mixserve_kv_cache_blocks_used"] == 0
