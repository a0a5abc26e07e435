"""When benchmark requests arrive (bench/arrivals.py), and the planner replaying the same times."""
from __future__ import annotations

import math

import pytest

from mixserve.bench.arrivals import arrival_offsets, schedule
from mixserve.data.datasets import BenchRequest


def reqs(times):
    return [BenchRequest([1, 2], 3, 2, "t", arrival_s=t) for t in times]


def test_a_rate_sets_the_times_and_overrides_the_traces():
    at, how = schedule(reqs([None, 5.0, None]), 2.0, seed=3)
    assert how == "rate" and at == arrival_offsets(3, 2.0, 1.0, 3) and at[0] == 0.0
    assert at != [0.0, 5.0, 0.0]


def test_a_traces_own_times_are_replayed_without_a_rate():
    """bench (in process and online) ignored a trace's arrival_s; the planner replayed them."""
    assert schedule(reqs([0.5, None, 2.25])) == ([0.0, 0.0, 1.75], "trace")  # from its first arrival
    assert schedule(reqs([None, None])) == ([0.0, 0.0], "all at once")


def test_the_offsets_are_a_poisson_process_of_the_rate():
    at = arrival_offsets(4001, 4.0, 1.0, seed=1)
    gaps = [b - a for a, b in zip(at, at[1:])]
    assert abs(sum(gaps) / len(gaps) - 0.25) < 0.02  # mean gap 1 / rate
    assert all(b >= a for a, b in zip(at, at[1:]))
    for bad in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError, match="request_rate"):
            arrival_offsets(3, bad)


def test_the_planner_simulates_the_arrivals_bench_replays():
    """`plan`'s Poisson rate and `bench --request-rate` with the same seed give the same times, so a
    goodput prediction is checked on the arrivals it was made for (they were two different random
    streams: 48 requests differ enough to move a queue's percentiles)."""
    from mixserve.plan.planner import with_poisson_arrivals
    from mixserve.plan.simulator import SimRequest

    sim = with_poisson_arrivals([SimRequest(10, 5) for _ in range(20)], 1.5, seed=7)
    bench, _ = schedule(reqs([None] * 20), 1.5, seed=7)
    assert [r.arrival_s for r in sim] == bench


def test_rates_and_spans_that_cannot_be_replayed_are_refused():
    """A break-it round: --burstiness inf drew NaN gaps and the in-process bench spun for ever; a tiny
    rate (or a trace time of 1e300 s) overflowed time.sleep mid-run."""
    for burst in (math.inf, math.nan, 0.0):
        with pytest.raises(ValueError, match="burstiness"):
            arrival_offsets(3, 2.0, burst)
        with pytest.raises(ValueError, match="burstiness"):
            schedule(reqs([None]), math.inf, burst)
    with pytest.raises(ValueError, match="request_rate"):
        arrival_offsets(3, 1e-300)
    with pytest.raises(ValueError, match="span"):
        schedule(reqs([0.0, 1e300]))


def test_a_traces_times_count_from_its_first_arrival():
    """A trace cut from a longer recording (first arrival_s 2.0 s) slept through the lead time and
    reported a lower throughput than the planner, which counts from the first arrival."""
    assert schedule(reqs([2.0, 2.5, None, 3.0])) == ([0.0, 0.5, 0.0, 1.0], "trace")
