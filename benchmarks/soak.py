"""Soak test of the real server (issue 15, item 7): a bounded run of mixed, partly hostile client
behaviour against `mixserve serve`, then an account of every request.

The server runs as its own process (`mixserve serve`, the n-gram drafter on, a KV cache small
enough to preempt, a bounded waiting queue). Requests arrive as a Poisson process for --duration
seconds, drawn with a fixed seed from HumanEval and ShareGPT prompts: completions and chat,
streamed and not, n in {1, 2, 3}, greedy and sampled, stop strings, logprobs, prompt scoring
(echo + logprobs + max_tokens 0), outputs of 1-64 tokens. Some clients misbehave on purpose:
a share disconnect early (a stream closed after a few chunks, a plain request cancelled after a
random wait) and a share use a short client timeout.

Every HTTP request ends in exactly one client-side class:
  completed  a 200 whose body (or stream, to its [DONE]) is whole and well-formed;
  cancelled  the client disconnected or timed out on purpose;
  refused    a 503 at admission (the waiting queue full);
  errored    anything else (a 5xx, a broken stream, a malformed body, an unexpected 4xx);
  lost       no answer at all within the run's end + --drain seconds (should never happen).
Afterwards, with the load gone: KV blocks in use (must be 0), requests running/waiting (0), and
`/metrics` against the client's counts: engine requests admitted (sum of n over requests not
refused) = finished + aborted + errored in the server's counters; the server's 503 rejections =
the client's refused; the server's errored = 0. Resident memory (VmRSS of the server process) is
sampled every --rss-every seconds; the figure of merit is the last sample against the first one
after --warmup seconds.

    python benchmarks/soak.py --model qwen2.5-coder-0.5b-instruct --duration 660 --rate 2.0

Writes --out (results/soak.json: counts, metrics, RSS series, per-class latencies) and the server's
log beside it (results/soak.server.log).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
from live import free_port, wait_healthy

NAME = "soak"


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def metric_values(text: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = s.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}" if s.labels else "")
            out[key] = s.value
    return out


def prompts_pool(seed: int) -> list[str]:
    from mixserve.data.datasets import load_humaneval, load_sharegpt_pairs

    pool = [r.prompt for r in load_humaneval()]
    try:
        pairs = [p for p, _ in load_sharegpt_pairs().pairs if 8 <= len(p) <= 1200]
        pool += random.Random(seed).sample(pairs, min(400, len(pairs)))
    except Exception as e:  # ShareGPT missing: HumanEval alone still exercises everything
        print(f"ShareGPT unavailable ({e}); HumanEval prompts only")
    return pool


def draw_request(rng: random.Random, pool: list[str]) -> dict:
    """One request's body, path and client behaviour."""
    prompt = rng.choice(pool)
    chat = rng.random() < 0.4
    stream = rng.random() < 0.5
    n = rng.choices([1, 2, 3], [80, 15, 5])[0]
    body = {"model": NAME, "max_tokens": rng.randint(1, 64), "stream": stream, "n": n,
            "temperature": rng.choice([0, 0, 0.7, 1.0])}
    if body["temperature"]:
        body["seed"] = rng.randrange(2**31)
    if rng.random() < 0.2:
        body["stop"] = rng.choice([["\n\n"], ["def ", "return"], ["."]])
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
        if rng.random() < 0.25:
            body["logprobs"], body["top_logprobs"] = True, rng.randint(0, 3)
        path = "/v1/chat/completions"
    else:
        body["prompt"] = prompt
        if rng.random() < 0.25:
            body["logprobs"] = rng.randint(0, 3)
        if rng.random() < 0.05:  # prompt scoring, as evaluation harnesses do it
            body.update(echo=True, logprobs=1, max_tokens=0, n=1)
        path = "/v1/completions"
    if stream:
        body["stream_options"] = {"include_usage": True}
    r = rng.random()
    behaviour = ("disconnect", rng.uniform(0.05, 1.5)) if r < 0.10 else \
        ("timeout", rng.uniform(0.3, 2.0)) if r < 0.15 else ("normal", None)
    return {"path": path, "body": body, "behaviour": behaviour}


def well_formed(path: str, body: dict, data: dict) -> bool:
    chat = path.endswith("chat/completions")
    choices = data.get("choices")
    if not isinstance(choices, list) or len(choices) != body["n"]:
        return False
    for c in choices:
        if c.get("finish_reason") not in ("stop", "length"):
            return False
        text = c["message"]["content"] if chat else c["text"]
        if not isinstance(text, str):
            return False
        # item 1's rule: the entries join to the text (a stop string may cut inside the last one)
        lp = c.get("logprobs")
        if lp is not None and chat:
            joined = b"".join(bytes(t["bytes"]) for t in lp["content"]).decode("utf-8", "replace")
            if not joined.startswith(text) or (not body.get("stop") and joined != text):
                return False
        if lp is not None and not chat and not body.get("echo") and \
                not any(t.startswith("bytes:") for t in lp["tokens"]):
            joined = "".join(lp["tokens"])
            if not joined.startswith(text) or (not body.get("stop") and joined != text):
                return False
    u = data.get("usage", {})
    return u.get("total_tokens") == u.get("prompt_tokens", 0) + u.get("completion_tokens", -1)


async def one(client: httpx.AsyncClient, req: dict, stats: dict) -> None:
    path, body, (how, arg) = req["path"], req["body"], req["behaviour"]
    t0 = time.perf_counter()
    timeout = httpx.Timeout(arg) if how == "timeout" else httpx.Timeout(600.0)

    async def run():
        if body["stream"]:
            async with client.stream("POST", path, json=body, timeout=timeout) as r:
                if r.status_code != 200:
                    await r.aread()
                    return r.status_code, None
                events, chunks = [], 0
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    events.append(line[6:])
                    chunks += 1
                    if how == "disconnect" and chunks >= 2:
                        return "cancelled", None
                return 200, events
        r = await client.post(path, json=body, timeout=timeout)
        return r.status_code, r.text

    try:
        if how == "disconnect" and not body["stream"]:
            task = asyncio.ensure_future(run())
            done, _ = await asyncio.wait({task}, timeout=arg)
            if not done:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
                status, payload = "cancelled", None
            else:
                status, payload = task.result()
        else:
            status, payload = await run()
    except (httpx.TimeoutException, asyncio.TimeoutError):
        status, payload = ("cancelled", None) if how == "timeout" else ("errored", None)
    except (httpx.TransportError, httpx.StreamError) as e:
        status, payload = "errored", repr(e)
    dt = time.perf_counter() - t0
    if status == "cancelled":
        cls = "cancelled"
    elif status == 503:
        cls = "refused"
    elif status == 200 and payload is not None:
        if body["stream"]:
            events = [json.loads(e) for e in payload[:-1]] if payload and payload[-1] == "[DONE]" else None
            ends = [c.get("finish_reason") for e in events or [] for c in e.get("choices", [])
                    if c.get("finish_reason")]
            # whole: [DONE] last, no error event, every choice ended by stop or length
            ok = events is not None and all("error" not in e for e in events) and len(ends) == body["n"] \
                and all(r in ("stop", "length") for r in ends)
        else:
            try:
                ok = well_formed(path, body, json.loads(payload))
            except (ValueError, KeyError, TypeError):
                ok = False
        cls = "completed" if ok else "errored"
        if not ok:
            stats["errors"].append({"body": body, "why": "malformed", "payload": str(payload)[:400]})
    elif status == 200:  # a stream that ended early on purpose
        cls = "cancelled"
    else:
        cls = "errored"
        stats["errors"].append({"body": body, "status": status, "payload": str(payload)[:400]})
    stats[cls] += 1
    stats["choices_admitted"] += 0 if cls == "refused" else body["n"]
    stats["latency"].setdefault(cls, []).append(dt)
    if how != "normal" and cls in ("completed", "cancelled"):
        stats["misbehaved_" + cls] += 1


async def drive(url: str, pool: list[str], duration: float, rate: float, seed: int, pid: int, rss_every: float,
                drain: float) -> dict:
    rng = random.Random(seed)
    stats = {k: 0 for k in ("sent", "completed", "cancelled", "refused", "errored", "lost", "choices_admitted",
                            "misbehaved_completed", "misbehaved_cancelled")}
    stats["errors"], stats["latency"], rss = [], {}, []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=32)
    async with httpx.AsyncClient(base_url=url, limits=limits) as client:
        tasks = []
        start = time.perf_counter()
        next_rss = 0.0
        t = 0.0
        while True:
            t += rng.expovariate(rate)
            if t >= duration:
                break
            while True:
                now = time.perf_counter() - start
                if now >= next_rss:
                    rss.append((round(now, 1), rss_bytes(pid)))
                    next_rss += rss_every
                if now >= t:
                    break
                await asyncio.sleep(min(t - now, max(0.0, next_rss - now), 0.5))
            tasks.append(asyncio.ensure_future(one(client, draw_request(rng, pool), stats)))
            stats["sent"] += 1
        end = time.perf_counter()
        pending = [x for x in tasks if not x.done()]
        if pending:
            done, still = await asyncio.wait(pending, timeout=drain)
            stats["lost"] = len(still)
            for x in still:
                x.cancel()
        stats["drain_s"] = time.perf_counter() - end
        stats["run_s"] = end - start
        rss.append((round(time.perf_counter() - start, 1), rss_bytes(pid)))
    stats["rss"] = rss
    return stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct", help="model (default %(default)s)")
    ap.add_argument("--duration", type=float, default=660.0, help="seconds of arrivals (default %(default)s)")
    ap.add_argument("--rate", type=float, default=1.7, help="requests per second, Poisson (default %(default)s)")
    ap.add_argument("--kv-cache-memory", default="12MiB",
                    help="server KV cache, small enough to preempt under this load (default %(default)s)")
    ap.add_argument("--max-num-seqs", type=int, default=48, help="server --max-num-seqs (default %(default)s)")
    ap.add_argument("--max-waiting", type=int, default=48, help="server --max-waiting (default %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="seed of arrivals, prompts and behaviours")
    ap.add_argument("--warmup", type=float, default=120.0,
                    help="seconds before the RSS baseline; under --duration (default %(default)s)")
    ap.add_argument("--rss-every", type=float, default=10.0, help="RSS sampling period, s (default %(default)s)")
    ap.add_argument("--drain", type=float, default=300.0,
                    help="seconds to wait for answers after arrivals stop (default %(default)s)")
    ap.add_argument("--out", default="results/soak.json", help="JSON results (default %(default)s)")
    a = ap.parse_args()
    if a.warmup >= a.duration:
        a.warmup = a.duration / 2
        print(f"--warmup is not under --duration: the RSS baseline is taken at {a.warmup:.0f} s instead")
    port = free_port()
    cmd = [sys.executable, "-m", "mixserve.cli", "serve", "--model", a.model, "--port", str(port),
           "--served-model-name", NAME, "--draft-model", "ngram", "--kv-cache-memory", a.kv_cache_memory,
           "--max-num-seqs", str(a.max_num_seqs), "--max-waiting", str(a.max_waiting), "--max-model-len", "2048"]
    print(" ".join(cmd))
    log = open(Path(a.out).with_suffix(".server.log"), "w") if Path(a.out).parent.exists() else subprocess.DEVNULL
    srv = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, srv, interval_s=1.0)
        # one request first: the decode graph and kernels are ready before the clock starts
        httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": "hello", "max_tokens": 4}, timeout=600)
        m0 = metric_values(httpx.get(url + "/metrics", timeout=10).text)  # the warm-up's counts, subtracted
        pool = prompts_pool(a.seed)
        info = {"cpu": cpu_name(), "cores": os.cpu_count(), "date": time.strftime("%Y-%m-%d %H:%M"),
                "model": a.model, "command": " ".join(sys.argv), "server": " ".join(cmd)}
        print(f"{info['cpu']}, {info['cores']} cores, {info['date']}; {len(pool)} prompts; "
              f"{a.duration:.0f} s at {a.rate}/s")
        stats = asyncio.run(drive(url, pool, a.duration, a.rate, a.seed, srv.pid, a.rss_every, a.drain))
        # the load is gone: the server must come back to idle, every block free
        for _ in range(120):
            m = metric_values(httpx.get(url + "/metrics", timeout=10).text)
            if m.get("mixserve_num_requests_running", 1) == 0 and m.get("mixserve_num_requests_waiting", 1) == 0:
                break
            time.sleep(1)
        m = metric_values(httpx.get(url + "/metrics", timeout=10).text)
        after = httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": "def f(x):", "max_tokens": 8,
                                                         "temperature": 0}, timeout=120)
    finally:
        srv.send_signal(signal.SIGINT)
        try:
            srv.wait(60)
        except subprocess.TimeoutExpired:
            srv.kill()
    def total(prefix):
        return sum(v - m0.get(k, 0.0) for k, v in m.items() if k.startswith(prefix))
    fin, abo = total("mixserve_request_success_total"), total("mixserve_request_aborted_total")
    err, rej503 = total("mixserve_request_errored_total"), total("mixserve_request_rejected_total{status=503}")
    base = [r for t, r in stats["rss"] if t >= a.warmup]
    rss0, rss1 = (base[0], stats["rss"][-1][1]) if base else (stats["rss"][0][1], stats["rss"][-1][1])
    checks = {
        "lost == 0": stats["lost"] == 0,
        "errored == 0": stats["errored"] == 0,
        "blocks in use at the end == 0": m.get("mixserve_kv_cache_blocks_used") == 0,
        "server finished + aborted + errored == choices admitted": fin + abo + err == stats["choices_admitted"],
        "server 503 rejections == client refused": rej503 == stats["refused"],
        "server errored == 0": err == 0,
        "preemptions > 0": total("mixserve_num_preemptions_total") > 0,
        "RSS end within 5% of post-warm-up start": abs(rss1 - rss0) <= 0.05 * rss0,
        "a request after the soak succeeds": after.status_code == 200,
    }
    lat = {k: {"n": len(v), "median_s": statistics.median(v), "max_s": max(v)} for k, v in stats["latency"].items()}
    res = {**info, "args": vars(a), "counts": {k: stats[k] for k in ("sent", "completed", "cancelled", "refused",
                                                                    "errored", "lost", "choices_admitted",
                                                                    "misbehaved_completed",
                                                                    "misbehaved_cancelled")},
           "run_s": stats["run_s"], "drain_s": stats["drain_s"],
           "server": {"finished": fin, "aborted": abo, "errored": err, "rejected_503": rej503,
                      "preemptions": m.get("mixserve_num_preemptions_total"),
                      "blocks_used": m.get("mixserve_kv_cache_blocks_used"),
                      "blocks_total": m.get("mixserve_kv_cache_blocks_total"),
                      "by_reason": {k: v - m0.get(k, 0.0) for k, v in m.items()
                                    if k.startswith(("mixserve_request_success_total",
                                                     "mixserve_request_aborted_total"))}},
           "rss_mib": {"post_warmup_start": rss0 / 2**20, "end": rss1 / 2**20,
                       "max": max(r for _, r in stats["rss"]) / 2**20, "series": stats["rss"]},
           "latency": lat, "checks": checks, "errors": stats["errors"][:20]}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    c = res["counts"]
    print(f"sent {c['sent']}: completed {c['completed']}, cancelled by the client {c['cancelled']}, "
          f"refused (503) {c['refused']}, errored {c['errored']}, lost {c['lost']} "
          f"(arrivals {stats['run_s']:.0f} s, drain {stats['drain_s']:.0f} s)")
    print(f"server: finished {fin:.0f} + aborted {abo:.0f} + errored {err:.0f} = {fin + abo + err:.0f} engine requests; "
          f"client admitted {c['choices_admitted']}; 503s {rej503:.0f}; preemptions "
          f"{res['server']['preemptions']:.0f}; blocks in use {res['server']['blocks_used']:.0f}"
          f"/{res['server']['blocks_total']:.0f}")
    print(f"RSS: {rss0 / 2**20:.0f} MiB after warm-up -> {rss1 / 2**20:.0f} MiB at the end "
          f"({(rss1 - rss0) / rss0 * 100:+.1f}%), max {res['rss_mib']['max']:.0f} MiB")
    for k, ok in checks.items():
        print(f"  {'PASS' if ok else 'FAIL'}  {k}")
    print(f"wrote {a.out}")
    sys.exit(0 if all(checks.values()) else 1)


if __name__ == "__main__":
    main()
