"""Online benchmark: replay requests against a running server's streaming completions API.

Arrivals follow a gamma process (shape = burstiness; 1 is Poisson) at `request_rate` requests/s,
or all at t=0 for an infinite rate, optionally capped at `max_concurrency` in flight (as vLLM's
benchmark_serving does). Per request: TTFT (send -> first chunk with text), ITL (gaps between later
chunks), TPOT = (E2E - TTFT) / (output tokens - 1), E2E. Output token counts are the server's
`usage`. Goodput counts requests per second that met every SLO given. All times are seconds.
"""
from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import dataclass, field

from mixserve.data.datasets import BenchRequest
from mixserve.bench.arrivals import schedule
from mixserve.bench.metrics import RequestMetrics, build_report, goodput, summarize


@dataclass
class OnlineResult:
    """One request's outcome. Times are time.perf_counter() seconds; error is None on success."""

    sent: float
    first_token: float | None = None
    finish: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str | None = None


def parse_slo(text: str | None) -> dict[str, float]:
    """'ttft=500ms,tpot=50ms,e2e=10' -> {"ttft": 0.5, "tpot": 0.05, "e2e": 10.0} (seconds; a bare
    number is seconds). Raises ValueError naming a bad entry."""
    slo = {}
    for part in filter(None, (text or "").split(",")):
        m = re.fullmatch(r"\s*(ttft|tpot|e2e)\s*[=:]\s*([0-9]*\.?[0-9]+)\s*(ms|s)?\s*", part)
        if not m:
            raise ValueError(f"slo: cannot read {part!r}; use e.g. ttft=500ms,tpot=50ms,e2e=10s")
        slo[m.group(1)] = float(m.group(2)) / (1000.0 if m.group(3) == "ms" else 1.0)
    return slo


async def _send(client, url: str, body: dict, headers: dict) -> OnlineResult:
    res = OnlineResult(sent=time.perf_counter())
    try:
        async with client.stream("POST", url, json=body, headers=headers) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = chunk["error"].get("message", "error")
                    return res
                ch = chunk["choices"][0] if chunk.get("choices") else {}
                delta = ch.get("delta") or {}  # a chat chunk (a trace line with tools)
                if ch.get("text") or delta.get("content") or delta.get("tool_calls"):
                    if res.first_token is None:
                        res.first_token = now
                    res.chunk_times.append(now)
                if chunk.get("usage"):
                    res.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    res.output_tokens = chunk["usage"]["completion_tokens"]
        res.finish = time.perf_counter()
        if res.output_tokens == 0:
            res.error = "no usage reported"
    except Exception as e:  # one failed request must not end the run
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run_online_async(url: str, model: str, requests: list[BenchRequest], request_rate: float = float("inf"),
                           burstiness: float = 1.0, max_concurrency: int | None = None, temperature: float = 0.0,
                           ignore_eos: bool = True, api_key: str | None = None, seed: int = 0,
                           timeout_s: float = 3600.0) -> tuple[list[OnlineResult], float]:
    """Send `requests` on schedule; returns (results in request order, wall seconds from the
    first send to the last finish)."""
    import httpx

    offsets, _ = schedule(requests, request_rate, burstiness, seed)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=max_concurrency or len(requests) or 1, max_keepalive_connections=64)
    endpoint = url.rstrip("/") + "/v1/completions"
    chat_endpoint = url.rstrip("/") + "/v1/chat/completions"
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=30.0), limits=limits) as client:
        t0 = time.perf_counter()

        async def one(i: int, r: BenchRequest) -> OnlineResult:
            await asyncio.sleep(max(0.0, t0 + offsets[i] - time.perf_counter()))
            body = {"model": model, "prompt": r.prompt, "max_tokens": r.max_tokens, "temperature": temperature,
                    "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": ignore_eos}
            if r.response_format is not None:  # a trace line's constraint, as the server reads it
                body["response_format"] = r.response_format
            target = endpoint
            if r.tools is not None:  # ... or its tools: a chat request
                target = chat_endpoint
                body.pop("prompt")
                body.update(messages=[{"role": "user", "content": r.prompt}], tools=r.tools,
                            tool_choice=r.tool_choice or "auto")
            if sem is None:
                return await _send(client, target, body, headers)
            async with sem:
                return await _send(client, target, body, headers)

        results = await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
    ends = [r.finish for r in results if r.finish is not None]
    return list(results), (max(ends) - t0) if ends else 0.0


def online_report(results: list[OnlineResult], duration_s: float, slo: dict[str, float] | None = None) -> dict:
    """The offline report's fields (bench/metrics.py) over the successful requests, plus ITL
    (seconds, first token excluded), failures, and goodput (requests/s meeting every SLO)."""
    ok = [r for r in results if r.error is None and r.first_token is not None]
    metrics = [RequestMetrics(r.sent, r.first_token, r.finish, r.prompt_tokens, r.output_tokens) for r in ok]
    report = build_report(metrics, duration_s)
    report["itl_s"] = summarize(b - a for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:]))
    report["failed"] = len(results) - len(ok)
    report["errors"] = sorted({r.error for r in results if r.error})[:5]
    if slo:
        report.update(goodput(metrics, slo, duration_s))
    return report


def format_online(report: dict) -> str:
    """Latency table in ms (mean, median, p90, p99) and throughput lines."""
    lines = [f"requests {report['num_requests']} ok, {report['failed']} failed in {report['duration_s']:.2f} s",
             f"throughput {report['requests_per_s']:.3f} req/s, {report['output_tokens_per_s']:.1f} output tok/s, "
             f"{report['total_tokens_per_s']:.1f} total tok/s"]
    if "goodput_requests_per_s" in report:
        lines.append(f"goodput {report['goodput_requests_per_s']:.3f} req/s ({report['good_requests']} requests "
                     f"met {report['slo']})")
    lines.append(f"{'latency (ms)':<14}{'mean':>10}{'median':>10}{'p90':>10}{'p99':>10}{'n':>7}")
    for label, key in (("TTFT", "ttft_s"), ("TPOT", "tpot_s"), ("ITL", "itl_s"), ("E2E", "e2e_s")):
        s = report[key]
        lines.append(f"{label:<14}" + "".join(f"{s[k] * 1e3:>10.1f}" for k in ("mean", "p50", "p90", "p99"))
                     + f"{s['count']:>7}")
    for e in report["errors"]:
        lines.append(f"error: {e}")
    return "\n".join(lines)
