"""Benchmark metrics: per-request latencies and a run report.

Units: all times are seconds (``time.perf_counter()`` values for absolute
timestamps, differences for durations) in the data structures and in the
report dict; only :func:`format_table` converts latencies to milliseconds for
reading on screen. Throughputs are per second of wall time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np

__all__ = ["summarize", "RequestMetrics", "BenchReport", "build_report", "goodput", "format_table"]

_PERCENTILES = (50, 90, 99)


def summarize(values: Iterable[float]) -> dict:
    """Summary of ``values`` (any unit; the result is in the same unit).

    Returns ``{"mean", "p50", "p90", "p99", "count"}``. Percentiles use numpy's
    linear interpolation between closest ranks. An empty input gives NaN for
    every statistic and count 0, so a run without e.g. any multi-token request
    still produces a report.
    """
    arr = np.asarray(list(values), dtype=np.float64)
    if arr.size == 0:
        nan = float("nan")
        return {"mean": nan, "p50": nan, "p90": nan, "p99": nan, "count": 0}
    pct = np.percentile(arr, _PERCENTILES, method="linear")
    return {
        "mean": float(arr.mean()),
        "p50": float(pct[0]),
        "p90": float(pct[1]),
        "p99": float(pct[2]),
        "count": int(arr.size),
    }


@dataclass
class RequestMetrics:
    """Timestamps (seconds, ``time.perf_counter()``) and token counts of one request.

    arrival_s: when the request was submitted to the engine.
    first_token_s: when its first output token was available (None if it
        produced none, e.g. aborted).
    finish_s: when its last output token was available.
    prompt_tokens / output_tokens: counts in tokens.
    """

    arrival_s: float
    first_token_s: float | None
    finish_s: float
    prompt_tokens: int
    output_tokens: int

    @property
    def ttft(self) -> float | None:
        """Time to first token, seconds (queueing + prefill)."""
        if self.first_token_s is None:
            return None
        return self.first_token_s - self.arrival_s

    @property
    def e2e(self) -> float:
        """End-to-end latency, seconds."""
        return self.finish_s - self.arrival_s

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first, seconds/token.

        ``(e2e - ttft) / (output_tokens - 1)``: the first token is excluded
        because its latency is TTFT; None below 2 tokens (no decode interval).
        """
        ttft = self.ttft
        if ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - ttft) / (self.output_tokens - 1)


@dataclass
class BenchReport:
    """Builds the report of one benchmark run.

    requests: per-request metrics of the completed requests.
    duration_s: wall time of the run, seconds (first arrival to last finish,
        as measured by the caller).
    extra: engine counters to carry along (peak_kv_blocks, preemptions, ...);
        kept under ``report["extra"]`` so they cannot clobber computed keys.
    """

    requests: list[RequestMetrics]
    duration_s: float
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict:
        """The report as a JSON-serializable dict.

        Keys: num_requests, duration_s, input_tokens, output_tokens,
        requests_per_s, input_tokens_per_s, output_tokens_per_s,
        total_tokens_per_s (per wall second; NaN if duration_s <= 0),
        ttft_s / tpot_s / e2e_s (summaries in seconds, see :func:`summarize`;
        requests where the metric is undefined are left out), extra.
        """
        reqs = self.requests
        n_in = sum(r.prompt_tokens for r in reqs)
        n_out = sum(r.output_tokens for r in reqs)
        dur = float(self.duration_s)

        def rate(x: float) -> float:
            return x / dur if dur > 0 else float("nan")

        return {
            "num_requests": len(reqs),
            "duration_s": dur,
            "input_tokens": n_in,
            "output_tokens": n_out,
            "requests_per_s": rate(len(reqs)),
            "input_tokens_per_s": rate(n_in),
            "output_tokens_per_s": rate(n_out),
            "total_tokens_per_s": rate(n_in + n_out),
            "ttft_s": summarize(v for r in reqs if (v := r.ttft) is not None),
            "tpot_s": summarize(v for r in reqs if (v := r.tpot) is not None),
            "e2e_s": summarize(r.e2e for r in reqs),
            "extra": dict(self.extra),
        }


def build_report(
    requests: list[RequestMetrics], duration_s: float, extra: dict[str, Any] | None = None
) -> dict:
    """Shorthand for ``BenchReport(requests, duration_s, extra or {}).to_dict()``."""
    return BenchReport(list(requests), duration_s, dict(extra or {})).to_dict()


def goodput(metrics: list[RequestMetrics], slo: dict[str, float], duration_s: float) -> dict:
    """Goodput under a per-request SLO (DistServe's measure): requests meeting every limit in `slo`
    ({"ttft" | "tpot" | "e2e": seconds}; a one-token request's TPOT counts as 0), per second of
    `duration_s`. Returns {"slo", "good_requests", "goodput_requests_per_s"} (NaN for a zero duration)."""
    def meets(m: RequestMetrics) -> bool:
        vals = {"ttft": m.ttft, "tpot": m.tpot if m.tpot is not None else 0.0, "e2e": m.e2e}
        return all(vals[k] <= v for k, v in slo.items())

    good = sum(meets(m) for m in metrics)
    return {"slo": dict(slo), "good_requests": good,
            "goodput_requests_per_s": good / duration_s if duration_s > 0 else float("nan")}


def json_safe(obj: Any) -> Any:
    """`obj` (dicts, lists, tuples, numbers) with every NaN or infinite float as None, so that a
    report is JSON that any reader parses (RFC 8259 has no NaN; Python wrote a bare `NaN`, which
    jq and JavaScript reject): a run with one-token outputs has no TPOT, an empty one no rate."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def _fmt(x: Any, digits: int = 2) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return str(x)
    if isinstance(x, float) and math.isnan(x):
        return "-"
    if isinstance(x, int):
        return str(x)
    return f"{x:.{digits}f}"


def format_table(report: dict) -> str:
    """Plain aligned text rendering of a report dict, latencies in ms."""
    lines: list[str] = []

    def kv_block(rows: list[tuple[str, str]]) -> None:
        w = max(len(k) for k, _ in rows)
        for k, v in rows:
            lines.append(f"{k:<{w}}  {v}")

    kv_block([
        ("requests", _fmt(report["num_requests"])),
        ("duration (s)", _fmt(report["duration_s"])),
        ("input tokens", _fmt(report["input_tokens"])),
        ("output tokens", _fmt(report["output_tokens"])),
        ("requests/s", _fmt(report["requests_per_s"], 3)),
        ("input tok/s", _fmt(report["input_tokens_per_s"], 1)),
        ("output tok/s", _fmt(report["output_tokens_per_s"], 1)),
        ("total tok/s", _fmt(report["total_tokens_per_s"], 1)),
    ])
    lines.append("")

    header = ["latency (ms)", "mean", "p50", "p90", "p99", "n"]
    table = [header]
    for label, key in (("TTFT", "ttft_s"), ("TPOT", "tpot_s"), ("E2E", "e2e_s")):
        s = report[key]
        table.append([label] + [_fmt(None if s[k] is None else s[k] * 1e3) for k in ("mean", "p50", "p90", "p99")] + [str(s["count"])])
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        # Label left-aligned, numbers right-aligned so decimals line up.
        cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]
        lines.append("  ".join(cells))

    extra = report.get("extra") or {}
    if extra:
        lines.append("")
        kv_block([(str(k), _fmt(v)) for k, v in extra.items()])
    return "\n".join(lines)
