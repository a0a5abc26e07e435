"""Traffic mixes: describe a trace (length percentiles, length bands, histograms) and sample new
traces from ShareGPT, HumanEval or a synthetic long-prompt / short-output mix.

A trace is the JSONL file :func:`mixserve.data.datasets.load_jsonl` reads: one request a line,
``prompt`` (text) or ``prompt_tokens`` (a length), ``max_tokens`` and/or ``output_tokens``,
optional ``arrival_s`` (seconds from the trace start) and ``tag``. All lengths here are tokens,
counted without special tokens.
"""
from __future__ import annotations

import json
import os
import random
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from mixserve.data.datasets import BenchRequest, load_humaneval, load_sharegpt

__all__ = ["PERCENTILES", "PROMPT_BANDS", "OUTPUT_BANDS", "SOURCES", "describe_requests", "format_description",
           "plot_histograms", "sample_requests", "add_arrivals", "write_trace"]

PERCENTILES = (10, 50, 90, 99)
# upper edges (tokens) of the "share below" bands: the sizes that decide KV and prefill cost
PROMPT_BANDS = (128, 256, 512, 1024, 2048, 4096, 8192, 32768)
OUTPUT_BANDS = (32, 64, 128, 256, 512, 1024, 4096)
SOURCES = ("sharegpt", "humaneval", "synthetic-long-prompt")


def _lengths_summary(values: list[int], bands: tuple[int, ...]) -> dict:
    arr = np.asarray(values, dtype=np.float64)
    pct = np.percentile(arr, PERCENTILES, method="linear")
    out = {f"p{p}": float(v) for p, v in zip(PERCENTILES, pct)}
    out["max"] = int(arr.max())
    out["mean"] = float(arr.mean())
    out["below"] = {str(b): float((arr < b).mean()) for b in bands}
    return out


def describe_requests(reqs: list[BenchRequest], prompt_bands: tuple[int, ...] = PROMPT_BANDS,
                      output_bands: tuple[int, ...] = OUTPUT_BANDS) -> dict:
    """Summary of a request mix.

    Returns a JSON-able dict: ``count``; ``prompt_tokens`` and ``output_tokens``, each with
    p10/p50/p90/p99 (numpy linear interpolation), max, mean and ``below`` = {band edge (str):
    share of requests with fewer tokens than the edge}; ``tags`` = {tag: count}; and, when every
    request has ``arrival_s``, ``arrival`` = {span_s: last - first arrival in seconds,
    rate_per_s: (count - 1) / span_s, the mean arrival rate, None when span_s is 0}.
    The output length is ``max_tokens``: what a bench run generates with ignore_eos.

    Raises:
        ValueError: no requests, or a request whose prompt was not counted (prompt_len -1).
    """
    if not reqs:
        raise ValueError("trace: no requests to describe")
    if any(r.prompt_len < 0 for r in reqs):
        raise ValueError("trace: prompt lengths were not counted (load it with a tokenizer)")
    out = {
        "count": len(reqs),
        "prompt_tokens": _lengths_summary([r.prompt_len for r in reqs], prompt_bands),
        "output_tokens": _lengths_summary([r.max_tokens for r in reqs], output_bands),
        "tags": dict(sorted(Counter(r.tag for r in reqs).items())),
    }
    arrivals = [r.arrival_s for r in reqs]
    if all(a is not None for a in arrivals):
        span = max(arrivals) - min(arrivals)
        out["arrival"] = {"span_s": span, "rate_per_s": (len(reqs) - 1) / span if span > 0 else None}
    return out


def format_description(d: dict, name: str = "") -> str:
    """Plain-text rendering of :func:`describe_requests`'s dict."""
    lines = [f"{name + ': ' if name else ''}{d['count']} requests"
             + (" (" + ", ".join(f"{t} {n}" for t, n in d["tags"].items()) + ")" if len(d["tags"]) > 1 else "")]
    head = "".join(f"{'p' + str(p):>8}" for p in PERCENTILES) + f"{'max':>8}{'mean':>8}"
    lines.append(f"{'tokens':<8}{head}")
    for label, key in (("prompt", "prompt_tokens"), ("output", "output_tokens")):
        s = d[key]
        lines.append(f"{label:<8}" + "".join(f"{s['p' + str(p)]:>8.0f}" for p in PERCENTILES)
                     + f"{s['max']:>8}{s['mean']:>8.1f}")
    for label, key in (("prompts", "prompt_tokens"), ("outputs", "output_tokens")):
        lines.append(", ".join(f"{share:.0%} {label} < {edge} tokens" for edge, share in d[key]["below"].items()))
    if "arrival" in d:
        a = d["arrival"]
        rate = "" if a["rate_per_s"] is None else f", {a['rate_per_s']:.2f} requests/s"
        lines.append(f"arrivals over {a['span_s']:.1f} s{rate}")
    return "\n".join(lines)


def plot_histograms(reqs: list[BenchRequest], path: str | os.PathLike, title: str = "") -> Path:
    """Write prompt and output length histograms (tokens, side by side) to a PNG. Returns the path."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, vals, label in ((axes[0], [r.prompt_len for r in reqs], "prompt tokens"),
                            (axes[1], [r.max_tokens for r in reqs], "output tokens (max_tokens)")):
        ax.hist(vals, bins=min(50, max(5, len(set(vals)))), color="#4472c4")
        ax.axvline(float(np.median(vals)), color="k", ls="--", lw=1, label=f"median {np.median(vals):.0f}")
        ax.set_xlabel(label)
        ax.set_ylabel("requests")
        ax.legend()
    fig.suptitle(f"{title} ({len(reqs)} requests)" if title else f"{len(reqs)} requests")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def sample_requests(source: str, num: int, seed: int = 0, tokenizer: Any = None, output_len_cap: int = 256,
                    max_prompt_len: int = 1024, long_prompt_range: tuple[int, int] = (1500, 3000),
                    short_output_range: tuple[int, int] = (16, 64)) -> list[dict]:
    """``num`` trace lines (dicts, without arrival times) from a source, seeded.

    - sharegpt: :func:`load_sharegpt` (needs ``tokenizer``): ``prompt`` text, ``max_tokens`` =
      reply length capped at ``output_len_cap``, ``output_tokens`` = uncapped reply length.
    - humaneval: the first ``num`` problems: ``prompt`` text, ``max_tokens`` = ``output_len_cap``.
      Not shuffled (HumanEval's order is its own); at most 164.
    - synthetic-long-prompt: long documents with short answers, as ``prompt_tokens`` uniform in
      ``long_prompt_range`` and ``output_tokens`` uniform in ``short_output_range`` (inclusive),
      so the trace is the same for every tokenizer.

    Raises ValueError for an unknown source, num < 1, or sharegpt without a tokenizer.
    """
    if num < 1:
        raise ValueError(f"num: must be >= 1 (got {num})")
    if source == "sharegpt":
        if tokenizer is None:
            raise ValueError("source sharegpt: needs a tokenizer to count tokens")
        reqs = load_sharegpt(tokenizer, num, seed=seed, max_prompt_len=max_prompt_len, max_output_len=output_len_cap)
        return [{"prompt": r.prompt, "max_tokens": r.max_tokens, "output_tokens": r.ref_output_len, "tag": r.tag}
                for r in reqs]
    if source == "humaneval":
        return [{"prompt": r.prompt, "max_tokens": r.max_tokens, "tag": r.tag}
                for r in load_humaneval(num, max_tokens=output_len_cap)]
    if source == "synthetic-long-prompt":
        rng = random.Random(seed)
        return [{"prompt_tokens": rng.randint(*long_prompt_range), "output_tokens": rng.randint(*short_output_range),
                 "tag": "long-prompt"} for _ in range(num)]
    raise ValueError(f"source: unknown {source!r}; use one of {', '.join(SOURCES)}")


def add_arrivals(lines: list[dict], request_rate: float, seed: int = 0) -> list[dict]:
    """Set ``arrival_s`` on every line: a Poisson process of ``request_rate`` requests per second
    (exponential gaps, seeded), the first request at 0. Raises ValueError unless rate > 0."""
    if not request_rate > 0:
        raise ValueError(f"request_rate: must be > 0 requests/s (got {request_rate})")
    rng = random.Random(seed)
    t = 0.0
    for i, line in enumerate(lines):
        if i:
            t += rng.expovariate(request_rate)
        line["arrival_s"] = round(t, 6)
    return lines


def write_trace(lines: list[dict], path: str | os.PathLike) -> Path:
    """Write trace lines as JSONL (UTF-8, one object a line). Returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for line in lines:
            f.write(json.dumps(line, ensure_ascii=False) + "\n")
    return path
