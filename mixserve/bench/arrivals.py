"""When each benchmark request arrives: a seeded gamma process at a request rate, or the trace's own
`arrival_s` times, or all at once. One rule for the in-process bench, the online bench and the
planner's simulation, so that a prediction and its measurement replay the same arrival times."""
from __future__ import annotations

import math

import numpy as np

from mixserve.data.datasets import BenchRequest

MAX_SPAN_S = 1e7  # ~116 days of arrivals: a replay past it would never end


def check_rate(request_rate: float, burstiness: float = 1.0) -> None:
    """Raise ValueError (naming the flag) unless `request_rate` is > 0 requests/s (inf: all at once)
    and `burstiness` a finite number > 0: an infinite shape draws NaN gaps."""
    if not burstiness > 0 or not math.isfinite(burstiness):
        raise ValueError(f"burstiness: must be a finite number > 0 (got {burstiness})")
    if not request_rate > 0:
        raise ValueError(f"request_rate: must be > 0 requests/s, or inf (got {request_rate})")


def arrival_offsets(n: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times in seconds from the start for n requests: cumulative gamma(shape=burstiness,
    scale=1/(rate*burstiness)) gaps, whose mean is 1/rate (shape 1 is a Poisson process); the first
    request at 0; all 0 for an infinite rate. Raises ValueError as check_rate does, or where the
    arrivals would span more than MAX_SPAN_S."""
    check_rate(request_rate, burstiness)
    if request_rate == float("inf"):
        return [0.0] * n
    gaps = np.random.default_rng(seed).gamma(burstiness, 1.0 / (request_rate * burstiness), size=n)
    if n:
        gaps[0] = 0.0  # the first request opens the run
    out = np.cumsum(gaps).tolist()
    if out and not out[-1] <= MAX_SPAN_S:
        raise ValueError(f"request_rate: {request_rate:g} requests/s spreads {n} requests over {out[-1]:.3g} s "
                         f"(at most {MAX_SPAN_S:g})")
    return out


def schedule(requests: list[BenchRequest], request_rate: float = math.inf, burstiness: float = 1.0,
             seed: int = 0) -> tuple[list[float], str]:
    """Each request's arrival, seconds from the run's start, and where the times came from.

    A finite `request_rate` (requests/s) sets them (arrival_offsets; a trace's own times are then
    overridden); else a trace whose lines carry `arrival_s` replays those, counted from the first of
    them (lines without one arrive with it); else everything arrives at 0 ("all at once"). Returns
    (offsets in request order, "rate" | "trace" | "all at once"). Raises ValueError for a rate or
    burstiness that is not a finite number > 0 (an infinite rate is all at once) and for arrivals
    spread over more than MAX_SPAN_S."""
    if request_rate != math.inf:
        return arrival_offsets(len(requests), request_rate, burstiness, seed), "rate"
    check_rate(request_rate, burstiness)
    if any(r.arrival_s is not None for r in requests):
        # the run starts at the first arrival (as the planner's simulation does), not at the trace's 0
        first = min(r.arrival_s for r in requests if r.arrival_s is not None)
        out = [(r.arrival_s if r.arrival_s is not None else first) - first for r in requests]
        if not max(out) <= MAX_SPAN_S:
            raise ValueError(f"trace: its arrival_s times span {max(out):.3g} s (at most {MAX_SPAN_S:g})")
        return out, "trace"
    return [0.0] * len(requests), "all at once"
