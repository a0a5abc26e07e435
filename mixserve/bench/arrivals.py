"""When each benchmark request arrives: a seeded gamma process at a request rate, or the trace's own
`arrival_s` times, or all at once. One rule for the in-process bench, the online bench and the
planner's simulation, so that a prediction and its measurement replay the same arrival times."""
from __future__ import annotations

import math

import numpy as np

from mixserve.data.datasets import BenchRequest


def arrival_offsets(n: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times in seconds from the start for n requests: cumulative gamma(shape=burstiness,
    scale=1/(rate*burstiness)) gaps, whose mean is 1/rate (shape 1 is a Poisson process); the first
    request at 0; all 0 for an infinite rate. Raises ValueError unless rate and burstiness > 0."""
    if request_rate == float("inf"):
        return [0.0] * n
    if not request_rate > 0 or not burstiness > 0:
        raise ValueError("request_rate and burstiness must be > 0")
    gaps = np.random.default_rng(seed).gamma(burstiness, 1.0 / (request_rate * burstiness), size=n)
    if n:
        gaps[0] = 0.0  # the first request opens the run
    return np.cumsum(gaps).tolist()


def schedule(requests: list[BenchRequest], request_rate: float = math.inf, burstiness: float = 1.0,
             seed: int = 0) -> tuple[list[float], str]:
    """Each request's arrival, seconds from the run's start, and where the times came from.

    A finite `request_rate` (requests/s) sets them (arrival_offsets; a trace's own times are then
    overridden); else a trace whose lines carry `arrival_s` replays those (lines without one arrive
    at 0); else everything arrives at 0 ("all at once"). Returns (offsets in request order,
    "rate" | "trace" | "all at once")."""
    if request_rate != math.inf:
        return arrival_offsets(len(requests), request_rate, burstiness, seed), "rate"
    if any(r.arrival_s is not None for r in requests):
        return [r.arrival_s or 0.0 for r in requests], "trace"
    return [0.0] * len(requests), "all at once"
