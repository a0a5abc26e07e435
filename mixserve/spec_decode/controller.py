"""Choosing how many tokens to speculate each step (Leviathan et al., ICML 2023, §3.4).

With per-token acceptance probability α and k proposed tokens, a verification step emits on
average E(k) = (1 - α^(k+1)) / (1 - α) tokens (Leviathan et al., eq. 1). It costs k draft steps
plus one target step over (k+1) rows per sequence. On CPUs the target's cost is nearly flat in
rows for a few rows (decode is bandwidth-bound) and grows in large batches, so the step costs
are measured online, per row count, rather than assumed. k = 0 is plain decoding.
"""
from __future__ import annotations

import collections

import math


class StepCostTable:
    """Measured seconds per forward by row count (exact up to 16 rows, then powers of 2): each
    bucket is a point (median rows, median seconds) of its last `window` timings, so a one-off
    outlier (oneDNN building a primitive for a new shape on first use, a noisy neighbour) drops
    out. The point sits at the rows actually measured, not at the bucket's upper edge: a 160-row
    verification timed into the 256 bucket placed at 256 would make every count between the
    buckets look cheaper than it is, and large k at batch look like it pays when it does not.

    estimate(rows) interpolates linearly between the points, is flat below the smallest and
    proportional to rows above the largest; None when nothing is measured yet. has(rows) is true
    once a bucket holds `min_samples` timings.
    """

    def __init__(self, window: int = 15, keep: int = 256, min_samples: int = 3):
        self.window = window
        self.min_samples = min_samples
        self.keep = keep
        self.buckets: dict[int, tuple[float, float]] = {}  # bucket -> (rows, seconds)
        self.samples: dict[int, list[tuple[int, float]]] = {}  # last `keep` raw (rows, seconds) per bucket

    @staticmethod
    def bucket(rows: int) -> int:
        # exact for the few rows of single-stream verification, where k choices differ by a row
        if rows <= 16:
            return max(1, rows)
        return 1 << math.ceil(math.log2(rows))

    def record(self, rows: int, seconds: float) -> None:
        if rows < 1 or not (0 <= seconds < math.inf):
            return  # no forward, or a clock glitch: nothing to learn a cost from (0 is real: prompt lookup)
        b = self.bucket(rows)
        xs = self.samples.setdefault(b, [])
        xs.append((rows, seconds))
        del xs[:-self.keep]
        recent = xs[-self.window:]
        r = sorted(x for x, _ in recent)
        t = sorted(y for _, y in recent)
        self.buckets[b] = (float(r[len(r) // 2]), t[len(t) // 2])

    def median(self, rows: int) -> float | None:
        """Median of the raw timings in `rows`' bucket (robust to a noisy neighbour; for reports)."""
        xs = sorted(y for _, y in self.samples.get(self.bucket(rows), []))
        return xs[len(xs) // 2] if xs else None

    def has(self, rows: int) -> bool:
        return len(self.samples.get(self.bucket(rows), ())) >= self.min_samples

    def estimate(self, rows: int) -> float | None:
        if not self.buckets:
            return None
        pts = sorted(self.buckets.values())
        if rows <= pts[0][0]:
            return pts[0][1]
        if rows >= pts[-1][0]:
            return pts[-1][1] * rows / pts[-1][0]
        for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
            if x0 <= rows <= x1:
                return y0 if x1 == x0 else y0 + (rows - x0) / (x1 - x0) * (y1 - y0)
        return None


def expected_tokens(alpha: float, k: int) -> float:
    """E(k) = (1 - α^(k+1)) / (1 - α): expected tokens emitted per verification of k proposals."""
    if alpha >= 1.0:
        return k + 1.0
    return (1 - alpha ** (k + 1)) / (1 - alpha)


class SpecController:
    """Picks k per engine step.

    mode: "off" (always 0), "fixed" (always k_max), "auto" (maximize expected tokens per second).
    k_max: the largest k considered (--num-speculative-tokens).
    """

    def __init__(self, mode: str, k_max: int):
        if mode not in ("auto", "fixed", "off"):
            raise ValueError(f"speculation: must be auto, fixed or off (got {mode!r})")
        if k_max < 0:
            raise ValueError(f"num_speculative_tokens: must be >= 0 (got {k_max})")
        self.mode = mode
        self.k_max = k_max
        self.target = StepCostTable()
        self.draft = StepCostTable()
        self.history: collections.Counter = collections.Counter()  # k -> steps: bounded, unlike a list
        # engine-wide acceptance (decayed counts): the prior for requests with little history,
        # so that a new request is not stuck at k = 0 by a pessimistic fixed prior
        self._acc = 0.0
        self._ev = 0.0
        self._auto_steps = 0
        # acceptance by draft position (decayed counts): later positions are accepted less often
        # than the first (measured on ShareGPT at T=1: α 0.77 with k=1, 0.70 with k=4), so a
        # single α overrates large k
        self._pos_acc = [0.0] * max(1, k_max)
        self._pos_ev = [0.0] * max(1, k_max)

    def observe(self, accepted: int, evaluated: int, decay: float = 0.99) -> None:
        """Record one verification's accepted / evaluated draft positions (a run stops at its first
        rejection, so positions < evaluated were evaluated and positions < accepted accepted)."""
        self._acc = decay * self._acc + accepted
        self._ev = decay * self._ev + evaluated
        for i in range(len(self._pos_ev)):
            self._pos_ev[i] = decay * self._pos_ev[i] + (i < evaluated)
            self._pos_acc[i] = decay * self._pos_acc[i] + (i < accepted)

    def position_factors(self, weight: float = 8.0) -> list[float]:
        """α at draft position i relative to the engine-wide α (1.0 until measured)."""
        g = self.alpha_global
        return [((a + weight * g) / (e + weight)) / g for a, e in zip(self._pos_acc, self._pos_ev)]

    def expected(self, alpha: float, k: int, factors: list[float] | None = None) -> float:
        """Expected tokens per verification of k proposals for a request with smoothed α, with the
        acceptance at position i scaled by the measured positional factor: 1 + sum_j prod_{i<j} α_i."""
        factors = self.position_factors() if factors is None else factors
        e, p = 1.0, 1.0
        for i in range(k):
            p *= min(0.999, alpha * factors[min(i, len(factors) - 1)])
            e += p
        return e

    @property
    def alpha_global(self) -> float:
        return (self._acc + 1.0) / (self._ev + 2.0)

    def alpha_for(self, accepted: int, evaluated: int, weight: float = 4.0) -> float:
        """A request's smoothed α: its own counts plus `weight` pseudo-positions at the engine-wide α."""
        return (accepted + weight * self.alpha_global) / (evaluated + weight)

    def c(self, rows: int = 1) -> float | None:
        """Measured draft step time / target step time at `rows` rows."""
        d, t = self.draft.estimate(rows), self.target.estimate(rows)
        return d / t if d is not None and t else None

    def choose(self, alphas: list[float], prefill_tokens: int) -> int:
        """k for a step with one decode row per entry of `alphas` (each its smoothed α)."""
        if self.mode == "off" or not alphas or self.k_max == 0:
            k = 0
        elif self.mode == "fixed":
            k = self.k_max
        else:
            k = self._best(alphas, prefill_tokens)
        self.history[k] += 1
        return k

    # every this many auto steps the best k's neighbour is tried once, so that costs measured
    # under other conditions (another batch size, a busy host) are refreshed
    REFRESH_EVERY = 50

    def _best(self, alphas: list[float], prefill_tokens: int) -> int:
        b = len(alphas)
        # Explore: a candidate with too few timings is tried (min_samples times in all).
        for k in range(self.k_max, -1, -1):
            if not self.target.has(b * (k + 1) + prefill_tokens) or (k and not self.draft.has(b)):
                return k
        best_k, best_rate = 0, -1.0
        factors = self.position_factors()
        for k in range(self.k_max + 1):
            cost = self.target.estimate(b * (k + 1) + prefill_tokens) + k * self.draft.estimate(b)
            rate = sum(self.expected(a, k, factors) for a in alphas) / max(cost, 1e-9)
            if rate > best_rate:
                best_k, best_rate = k, rate
        self._auto_steps += 1
        if self._auto_steps % self.REFRESH_EVERY == 0:
            return best_k + 1 if best_k < self.k_max else best_k - 1
        return best_k
