"""Serving under load, on loopback, with the real `mixserve serve` in a subprocess and the online
client (mixserve/bench/online.py) in this one:

1. Idle open streams: a server with --max-num-seqs 1 runs one greedy streaming request alone (A),
   and again while 200 more streaming requests hold their connections open, waiting for
   admission (B). The engine's own step timer (/metrics, mixserve_engine_step_seconds) gives the
   mean step time over the same window of the probe's decode in both; rounds interleave A B / B A,
   and the median of the per-round ratios B / A is the HTTP side's cost to the engine (target:
   at most 1.10).
2. Load: 200 concurrent streaming ShareGPT requests at once; all must complete; /metrics must
   agree with what the client counted (requests, prompt and generated tokens) and show every KV
   block free afterwards.
3. Rate sweep: that run's request throughput is the capacity; then Poisson arrivals at 0.25x,
   0.5x, 1x and 2x of it, and all at once, with the latency table.

    python benchmarks/serve_load.py --model qwen2.5-coder-0.5b-instruct --out results/serve_load.json
    python benchmarks/serve_load.py --only-idle --out results/serve_idle.json   # phase 1 alone
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from live import free_port


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


async def engine_steps(client, url: str) -> dict[str, float]:
    """The engine step timer from /metrics: steps, their total seconds, and tokens run."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families((await client.get(url + "/metrics")).text):
        for s in fam.samples:
            if s.name in ("mixserve_engine_step_seconds_count", "mixserve_engine_step_seconds_sum",
                          "mixserve_engine_step_tokens_total", "mixserve_num_requests_waiting"):
                out[s.name] = s.value
    return out


async def stream_one(client, url: str, body: dict, chunks: asyncio.Queue | None = None) -> int:
    """Stream one completion; puts each text chunk's arrival (perf_counter seconds) in `chunks`.
    Returns the number of text chunks."""
    n = 0
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                ch = json.loads(line[6:])
                if ch.get("choices") and ch["choices"][0].get("text"):
                    n += 1
                    if chunks is not None:
                        chunks.put_nowait(time.perf_counter())
    return n


async def idle_round(client, url: str, model: str, n_idle: int, skip: int, window: int) -> dict:
    """One measurement of the engine's mean step time over a single-stream greedy decode
    (server at --max-num-seqs 1), with `n_idle` open streams waiting for admission when n_idle > 0.

    The window is the probe's chunks [skip, skip + window) (later if opening the idle streams
    took longer: `window_start_chunk` says; raise --idle-skip until both arms start alike, since
    steps get slower as the context grows), read from the server's own step timer (mixserve_engine_step_seconds) at its two
    ends; the probe is then closed (aborted)."""
    # room to spare: the probe is closed after the window, so its length costs nothing
    probe = {"model": model, "prompt": "def fibonacci(n):", "max_tokens": skip + window + 512, "temperature": 0,
             "ignore_eos": True, "stream": True}
    idle = {"model": model, "prompt": "Hello", "max_tokens": 1, "temperature": 0, "stream": True}
    chunks: asyncio.Queue = asyncio.Queue()
    task = asyncio.create_task(stream_one(client, url, probe, chunks))
    seen = 0
    await chunks.get()  # the probe holds the only sequence slot: the idle streams must wait
    seen += 1
    others, waiting = [], 0.0
    if n_idle:
        others = [asyncio.create_task(stream_one(client, url, idle)) for _ in range(n_idle)]
        for _ in range(1200):  # until every idle stream is queued in the engine
            await asyncio.sleep(0.05)
            waiting = (await engine_steps(client, url)).get("mixserve_num_requests_waiting", 0.0)
            if waiting >= n_idle:
                break
        else:
            raise RuntimeError(f"only {waiting} of {n_idle} idle streams ever waited")
    while seen < skip:
        await chunks.get()
        seen += 1
    while not chunks.empty():  # chunks that arrived while opening the idle streams
        chunks.get_nowait()
        seen += 1
    start = seen
    m0 = await engine_steps(client, url)
    for _ in range(window):
        await asyncio.wait_for(chunks.get(), 300)
    m1 = await engine_steps(client, url)
    if n_idle:  # all still waiting: the window saw only the probe's decode steps
        waiting = min(waiting, m1.get("mixserve_num_requests_waiting", 0.0))
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    if others:
        await asyncio.gather(*others)
    steps = m1["mixserve_engine_step_seconds_count"] - m0["mixserve_engine_step_seconds_count"]
    seconds = m1["mixserve_engine_step_seconds_sum"] - m0["mixserve_engine_step_seconds_sum"]
    tokens = m1["mixserve_engine_step_tokens_total"] - m0["mixserve_engine_step_tokens_total"]
    return {"mean_step_s": seconds / steps, "steps": steps, "tokens_per_step": tokens / steps,
            "window_start_chunk": start, "idle_waiting": waiting}


async def idle_streams(url: str, model: str, n_idle: int, rounds: int, skip: int, window: int) -> dict:
    """The HTTP side's cost to the engine: the engine's own mean step time for the same single-stream
    decode alone (A) and with `n_idle` idle open streams (B), `rounds` rounds, interleaved A B / B A
    so that a drifting host load weighs on both arms alike. Ratio per round B / A, and the median."""
    import httpx

    # no keep-alive: uvicorn closes idle connections after 5 s, and reusing one then fails mid-round
    limits = httpx.Limits(max_connections=n_idle + 8, max_keepalive_connections=0)
    alone, loaded = [], []
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await idle_round(client, url, model, 0, 2, 4)  # warm-up
        for i in range(rounds):
            for arm in ((0, n_idle) if i % 2 == 0 else (n_idle, 0)):
                r = await idle_round(client, url, model, arm, skip, window)
                (loaded if arm else alone).append(r)
                print(f"round {i} {'B (idle streams)' if arm else 'A (alone)'}: mean step "
                      f"{r['mean_step_s'] * 1e3:.2f} ms over {r['steps']:.0f} steps", flush=True)
    ratios = [b["mean_step_s"] / a["mean_step_s"] for a, b in zip(alone, loaded)]
    return {"n_idle": n_idle, "alone": alone, "with_idle": loaded, "ratios": ratios,
            "median_ratio": statistics.median(ratios), "target_ratio": 1.10}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--idle-streams", type=int, default=200)
    ap.add_argument("--idle-rounds", type=int, default=6, help="rounds of A (alone) and B (with idle streams)")
    ap.add_argument("--idle-skip", type=int, default=128,
                    help="probe chunks before the measured window (time to open the idle streams)")
    ap.add_argument("--idle-window", type=int, default=192, help="probe decode steps measured per arm")
    ap.add_argument("--only-idle", action="store_true", help="run the idle-stream phase only")
    ap.add_argument("--load-requests", type=int, default=200)
    ap.add_argument("--sweep-requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64, help="cap on each request's output length")
    ap.add_argument("--out", default="results/serve_load.json")
    a = ap.parse_args()

    from transformers import AutoTokenizer

    from mixserve.data.datasets import load_sharegpt
    from mixserve.bench.online import format_online, online_report, run_online_async
    from mixserve.env import machine_info
    from mixserve.models.weights import convert_gguf
    from mixserve.models.registry import resolve_model

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    res = {"config": vars(a), "machine": machine_info()}
    r = resolve_model(a.model)
    folder = convert_gguf(r.path) if r.kind == "gguf" else Path(r.path)
    tok = AutoTokenizer.from_pretrained(str(folder))

    print("-- idle open streams", flush=True)
    srv = Server(a.model, "--max-num-seqs", "1")
    try:
        res["idle_streams"] = asyncio.run(idle_streams(srv.url, a.model, a.idle_streams, a.idle_rounds,
                                                       a.idle_skip, a.idle_window))
    finally:
        rc = srv.stop()
    idle = res["idle_streams"]
    idle["exit_code"] = rc
    print("per-round ratios (B / A):", " ".join(f"{r:.3f}" for r in idle["ratios"]),
          f"| median {idle['median_ratio']:.3f} (target <= {idle['target_ratio']})", flush=True)
    if a.only_idle:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=1))
        return

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
