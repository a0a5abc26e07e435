"""Serving under load, on loopback, with the real `mixserve serve` in a subprocess and the online
client (mixserve/bench/online.py) in this one:

1. Idle open streams: a server with --max-num-seqs 1 runs one streaming request (its inter-token
   latency is the engine's step time) alone, and again while 200 more streaming requests hold
   their connections open, waiting for admission. Rounds alternate; the ratio of medians is the
   HTTP side's cost to the engine (target: at most 1.10).
2. Load: 200 concurrent streaming ShareGPT requests at once; all must complete; /metrics must
   agree with what the client counted (requests, prompt and generated tokens) and show every KV
   block free afterwards.
3. Rate sweep: that run's request throughput is the capacity; then Poisson arrivals at 0.25x,
   0.5x, 1x and 2x of it, and all at once, with the latency table.

    python benchmarks/serve_load.py --model qwen2.5-coder-0.5b-instruct --out results/serve_load.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`mixserve serve` in a subprocess on a free port; waits for /health."""

    def __init__(self, model: str, *extra: str, timeout_s: float = 600.0):
        import httpx

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(f"/tmp/mixserve_serve_{self.port}.log", "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "mixserve.cli", "serve", "--model", model, "--port",
                                      str(self.port), *extra], stdout=self.log, stderr=subprocess.STDOUT)
        t0 = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: see {self.log.name}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() - t0 > timeout_s:
                raise RuntimeError("server did not start")
            time.sleep(0.5)

    def metrics(self) -> dict[str, float]:
        """Prometheus samples summed by name (labels dropped)."""
        import httpx
        from prometheus_client.parser import text_string_to_metric_families

        out: dict[str, float] = {}
        for fam in text_string_to_metric_families(httpx.get(self.url + "/metrics", timeout=30).text):
            for s in fam.samples:
                out[s.name] = out.get(s.name, 0.0) + s.value
        return out

    def stop(self) -> int:
        self.proc.terminate()
        rc = self.proc.wait(120)
        self.log.close()
        return rc


async def stream_one(client, url: str, body: dict, started: asyncio.Event | None = None) -> list[float]:
    """Chunk arrival times (perf_counter seconds) of one streaming completion."""
    times = []
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                ch = json.loads(line[6:])
                if ch.get("choices") and ch["choices"][0].get("text"):
                    times.append(time.perf_counter())
                    if started is not None:
                        started.set()
    return times


async def idle_streams(url: str, model: str, n_idle: int, rounds: int, tokens: int) -> dict:
    import httpx

    probe = {"model": model, "prompt": "def fibonacci(n):", "max_tokens": tokens, "temperature": 0,
             "ignore_eos": True, "stream": True}
    idle = {"model": model, "prompt": "Hello", "max_tokens": 1, "temperature": 0, "stream": True}
    # no keep-alive: uvicorn closes idle connections after 5 s, and reusing one then fails mid-round
    limits = httpx.Limits(max_connections=n_idle + 8, max_keepalive_connections=0)
    alone, loaded, waiting_seen = [], [], []
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await stream_one(client, url, {**probe, "max_tokens": 4})  # warm-up
        for _ in range(rounds):
            t = await stream_one(client, url, probe)
            alone.append(statistics.median(b - a for a, b in zip(t[1:], t[2:])))
            started = asyncio.Event()
            task = asyncio.create_task(stream_one(client, url, probe, started))
            await started.wait()
            others = [asyncio.create_task(stream_one(client, url, idle)) for _ in range(n_idle)]
            t_open = None
            for _ in range(600):  # until every idle stream is queued in the engine
                await asyncio.sleep(0.05)
                w = (await client.get(url + "/metrics")).text
                n_wait = [float(x.split()[-1]) for x in w.splitlines() if x.startswith("mixserve_num_requests_waiting")]
                if n_wait and n_wait[0] >= n_idle:
                    t_open = time.perf_counter()
                    waiting_seen.append(n_wait[0])
                    break
            t = await task
            gaps = [b - a for a, b in zip(t, t[1:]) if t_open is not None and a >= t_open]
            loaded.append(statistics.median(gaps) if gaps else float("nan"))
            await asyncio.gather(*others)
    a, lo = statistics.median(alone), statistics.median(loaded)
    return {"itl_alone_s": alone, "itl_with_idle_s": loaded, "waiting_seen": waiting_seen,
            "ratio": lo / a, "n_idle": n_idle}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--idle-streams", type=int, default=200)
    ap.add_argument("--idle-rounds", type=int, default=3)
    ap.add_argument("--load-requests", type=int, default=200)
    ap.add_argument("--sweep-requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64, help="cap on each request's output length")
    ap.add_argument("--out", default="results/serve_load.json")
    a = ap.parse_args()

    from transformers import AutoTokenizer

    from mixserve.bench.datasets import load_sharegpt
    from mixserve.bench.online import format_online, online_report, run_online_async
    from mixserve.cli import machine_info
    from mixserve.models.loader import convert_gguf
    from mixserve.models.registry import resolve_model

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    res = {"config": vars(a), "machine": machine_info()}
    r = resolve_model(a.model)
    folder = convert_gguf(r.path) if r.kind == "gguf" else Path(r.path)
    tok = AutoTokenizer.from_pretrained(str(folder))

    print("-- idle open streams", flush=True)
    srv = Server(a.model, "--max-num-seqs", "1")
    try:
        res["idle_streams"] = asyncio.run(idle_streams(srv.url, a.model, a.idle_streams, a.idle_rounds, 48))
    finally:
        rc = srv.stop()
    res["idle_streams"]["exit_code"] = rc
    print(res["idle_streams"], flush=True)

    reqs = load_sharegpt(tok, a.load_requests, seed=0, max_prompt_len=1024)
    for q in reqs:
        q.max_tokens = min(q.max_tokens, a.max_tokens)
    srv = Server(a.model, "--max-num-seqs", "256")
    try:
        print(f"-- load: {len(reqs)} concurrent streams", flush=True)
        m0 = srv.metrics()
        results, dur = asyncio.run(run_online_async(srv.url, a.model, reqs))
        m1 = srv.metrics()
        rep = online_report(results, dur)
        ok = [x for x in results if x.error is None]
        client = {"requests": len(ok), "prompt_tokens": sum(x.prompt_tokens for x in ok),
                  "generation_tokens": sum(x.output_tokens for x in ok)}
        server = {"requests": m1.get("mixserve_request_success_total", 0) - m0.get("mixserve_request_success_total", 0),
                  "prompt_tokens": m1["mixserve_prompt_tokens_total"] - m0["mixserve_prompt_tokens_total"],
                  "generation_tokens": m1["mixserve_generation_tokens_total"] - m0["mixserve_generation_tokens_total"],
                  "kv_blocks_used_after": m1["mixserve_kv_cache_blocks_used"],
                  "preemptions": m1["mixserve_num_preemptions_total"] - m0.get("mixserve_num_preemptions_total", 0)}
        res["load"] = {"report": rep, "client": client, "server_metrics": server,
                       "agree": all(client[k] == server[k] for k in client) and server["kv_blocks_used_after"] == 0}
        print(format_online(rep), "\nclient", client, "\nserver", server, flush=True)
        cap = rep["requests_per_s"]
        res["capacity_requests_per_s"] = cap
        sweep_reqs = reqs[: a.sweep_requests]
        res["sweep"] = {}
        for label, rate in (("0.25x", 0.25 * cap), ("0.5x", 0.5 * cap), ("1x", cap), ("2x", 2 * cap),
                            ("inf", float("inf"))):
            print(f"-- rate {label} = {rate:.3f} req/s, {len(sweep_reqs)} requests", flush=True)
            results, dur = asyncio.run(run_online_async(srv.url, a.model, sweep_reqs, request_rate=rate, seed=1))
            rep = online_report(results, dur)
            rep["request_rate"] = rate
            res["sweep"][label] = rep
            print(format_online(rep), flush=True)
        res["kv_blocks_used_at_end"] = srv.metrics()["mixserve_kv_cache_blocks_used"]
    finally:
        res["exit_code"] = srv.stop()
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    print("\n| rate | req/s | out tok/s | TTFT p50 / p99 (s) | TPOT p50 / p99 (ms) | ITL p50 (ms) | E2E p50 (s) |")
    print("|---|---|---|---|---|---|---|")
    for label, rep in res["sweep"].items():
        print(f"| {label} ({rep['request_rate']:.2f}) | {rep['requests_per_s']:.2f} | {rep['output_tokens_per_s']:.1f} | "
              f"{rep['ttft_s']['p50']:.2f} / {rep['ttft_s']['p99']:.2f} | {rep['tpot_s']['p50'] * 1e3:.0f} / "
              f"{rep['tpot_s']['p99'] * 1e3:.0f} | {rep['itl_s']['p50'] * 1e3:.0f} | {rep['e2e_s']['p50']:.2f} |")


if __name__ == "__main__":
    main()
