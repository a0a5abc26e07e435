"""Replicas on one machine, on loopback: `mixserve serve` (one engine, every core) against
`mixserve serve --replicas 2` (Ray Serve, one core and one torch thread per replica), driven by
the online client (mixserve/bench/online.py) in this process.

1. Same trace, both servers: ShareGPT requests all sent at t = 0 (greedy, ignore_eos): output
   tokens/s and TTFT side by side. On a 2-core machine the replicas split the same cores and
   memory bandwidth, so no throughput gain is expected; the ratio says what the split costs.
2. Routing: a closed-loop multi-turn trace (`mix sample --source sharegpt-multiturn`: each
   conversation's next turn is sent, with the whole chat so far, when the previous answer has
   arrived) through 2 replicas with --routing prefix and with --routing round-robin. The
   prefix-cache hit rate is the replicas' own counters (/metrics, mixserve_prefix_cache_hits /
   _queries, summed over replicas) over the run; the client records which replica answered each
   turn (x-mixserve-replica).

    python benchmarks/replicas.py --model qwen2.5-coder-0.5b-instruct --out results/replicas.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

# `python benchmarks/replicas.py` puts this folder first on sys.path itself: serve_load is found
from serve_load import Server  # noqa: E402


async def conversation(client, url: str, model: str, turns: list[dict], max_tokens: int, log: list) -> None:
    """One conversation, closed loop: each turn carries the chat so far and waits for its answer."""
    messages = []
    for t in turns:
        messages.append({"role": "user", "content": t["prompt"]})
        body = {"model": model, "messages": messages, "max_tokens": min(max_tokens, t["max_tokens"]),
                "temperature": 0, "ignore_eos": True}
        t0 = time.perf_counter()
        r = await client.post(url + "/v1/chat/completions", json=body)
        r.raise_for_status()
        d = r.json()
        messages.append({"role": "assistant", "content": d["choices"][0]["message"]["content"]})
        log.append({"conversation": t["conversation"], "turn": t["turn"],
                    "replica": r.headers.get("x-mixserve-replica"), "route": r.headers.get("x-mixserve-route"),
                    "prompt_tokens": d["usage"]["prompt_tokens"],
                    "cached_tokens": (d["usage"].get("prompt_tokens_details") or {}).get("cached_tokens"),
                    "e2e_s": time.perf_counter() - t0})


async def multiturn(url: str, model: str, convs: list[list[dict]], max_tokens: int) -> tuple[list, float]:
    import httpx

    log: list = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0, connect=30.0)) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(conversation(client, url, model, c, max_tokens, log) for c in convs))
    return log, time.perf_counter() - t0


def load_conversations(path: str) -> list[list[dict]]:
    convs: dict = {}
    for line in open(path):
        d = json.loads(line)
        convs.setdefault(d["conversation"], []).append(d)
    return [sorted(c, key=lambda d: d["turn"]) for c in convs.values()]


def main():
    from mixserve.bench.online import online_report, run_online_async
    from mixserve.data.datasets import load_dataset
    from mixserve.env import machine_info
    from mixserve.models.weights import load_tokenizer

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--num-prompts", type=int, default=48, help="part 1: ShareGPT requests")
    p.add_argument("--output-len-cap", type=int, default=128)
    p.add_argument("--conversations", type=int, default=12, help="part 2: multi-turn conversations")
    p.add_argument("--turn-max-tokens", type=int, default=48, help="part 2: cap on each answer")
    p.add_argument("--kv-cache-memory", default="1GiB", help="per engine (each replica gets this much)")
    p.add_argument("--skip-throughput", action="store_true")
    p.add_argument("--out", default="results/replicas.json")
    a = p.parse_args()
    cores = os.cpu_count() or 2
    common = ["--kv-cache-memory", a.kv_cache_memory, "--served-model-name", "m"]
    replicas = ["--replicas", "2", "--replica-cpus", "1", "--replica-threads", "1"]
    out = {"machine": machine_info(), "date": time.strftime("%Y-%m-%d"), "args": vars(a), "cores": cores}
    print(json.dumps({k: out[k] for k in ("machine", "date", "cores")}), flush=True)

    def save() -> None:  # after each part: a run cut short keeps what it measured
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(out, indent=1))

    if not a.skip_throughput:
        tok = load_tokenizer(a.model)
        reqs = load_dataset("sharegpt", tok, a.num_prompts, seed=0, output_len_cap=a.output_len_cap,
                            max_prompt_len=1024)
        rows = {}
        for name, extra in (("1 engine, all cores", []), ("2 replicas x 1 core", replicas)):
            srv = Server(a.model, *common, *extra)
            try:
                asyncio.run(run_online_async(srv.url, "m", reqs[:4]))  # warm-up: compile, first shapes
                res, dur = asyncio.run(run_online_async(srv.url, "m", reqs))
                rep = online_report(res, dur)
            finally:
                srv.stop()
            rows[name] = {"output_tokens_per_s": rep["output_tokens_per_s"], "ttft_s": rep["ttft_s"],
                          "tpot_s": rep["tpot_s"], "failed": rep["failed"], "duration_s": dur}
            print(name, json.dumps(rows[name]), flush=True)
        one, two = rows["1 engine, all cores"], rows["2 replicas x 1 core"]
        out["throughput"] = {"rows": rows, "throughput_ratio_2rep_over_1": two["output_tokens_per_s"]
                             / one["output_tokens_per_s"],
                             "ttft_p50_ratio_2rep_over_1": two["ttft_s"]["p50"] / one["ttft_s"]["p50"]}
        save()

    trace = Path("/tmp/replicas_multiturn.jsonl")
    import subprocess

    subprocess.run([sys.executable, "-m", "mixserve.cli", "mix", "sample", "--source", "sharegpt-multiturn",
                    "--num", str(a.conversations), "--out", str(trace), "--seed", "0"], check=True)
    convs = load_conversations(str(trace))
    routing = {}
    for policy in ("prefix", "round-robin"):
        srv = Server(a.model, *common, *replicas, "--routing", policy)
        try:
            m0 = srv.metrics()
            log, dur = asyncio.run(multiturn(srv.url, "m", convs, a.turn_max_tokens))
            m1 = srv.metrics()
        finally:
            srv.stop()
        d = {k: m1.get(k, 0.0) - m0.get(k, 0.0) for k in ("mixserve_prefix_cache_hits_total",
                                                          "mixserve_prefix_cache_queries_total")}
        per_conv = {}
        for e in log:
            per_conv.setdefault(e["conversation"], set()).add(e["replica"])
        routing[policy] = {
            "hit_rate": d["mixserve_prefix_cache_hits_total"] / max(1.0, d["mixserve_prefix_cache_queries_total"]),
            "hits_tokens": d["mixserve_prefix_cache_hits_total"],
            "queries_tokens": d["mixserve_prefix_cache_queries_total"],
            "turns": len(log), "duration_s": dur,
            "conversations_on_one_replica": sum(len(v) == 1 for v in per_conv.values()),
            "conversations": len(per_conv),
            "turns_per_replica": {r: sum(e["replica"] == r for e in log) for r in sorted({e["replica"] for e in log})},
            "routes": {r: sum(e["route"] == r for e in log) for r in sorted({e["route"] for e in log})},
            "cached_tokens_reported": sum(e["cached_tokens"] or 0 for e in log)}
        print(policy, json.dumps(routing[policy]), flush=True)
        out["routing"] = routing
        save()
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
