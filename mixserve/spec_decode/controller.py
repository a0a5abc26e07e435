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

    The host's speed drifts (a shared machine: 20-50% within minutes here), and a bucket that is
    seldom run keeps the speed of the minutes it was timed in: a 2-row verification timed early
    at 1.47x the 1-row step that later runs faster, where back-to-back timings give 1.30x, kept
    `auto` from speculating where k = 1 and 2 paid 1.07x and 1.10x (1.5B native target,
    HumanEval, 2026-12-06). So the table is a shape times a speed: every timing in a bucket with
    `min_samples` timings says how fast the host runs now (its seconds over the bucket's point),
    `speed` is the median of the last `speed_window` such ratios, and a bucket's points are kept
    in seconds at speed 1. Choices compare ratios of estimates, which the speed leaves alone.

    estimate(rows) interpolates linearly between the points (times `speed`), is flat below the
    smallest and proportional to rows above the largest; None when nothing is measured yet.
    has(rows) is true once a bucket holds `min_samples` timings.
    """

    def __init__(self, window: int = 15, keep: int = 256, min_samples: int = 3, speed_window: int = 9):
        self.window = window
        self.min_samples = min_samples
        self.keep = keep
        self.buckets: dict[int, tuple[float, float]] = {}  # bucket -> (rows, seconds at speed 1)
        # last `keep` (rows, seconds, seconds at speed 1) per bucket
        self.samples: dict[int, list[tuple[int, float, float]]] = {}
        self.speed = 1.0  # the host's speed now against the points (seconds / seconds at speed 1)
        self._speeds: collections.deque = collections.deque(maxlen=speed_window)

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
        if self.has(rows) and seconds > 0:
            at_one = self._shape(rows)
            if at_one:
                self._speeds.append(seconds / at_one)
                ss = sorted(self._speeds)
                self.speed = ss[len(ss) // 2]
        xs = self.samples.setdefault(b, [])
        xs.append((rows, seconds, seconds / self.speed))
        del xs[:-self.keep]
        recent = xs[-self.window:]
        r = sorted(x[0] for x in recent)
        t = sorted(x[2] for x in recent)
        self.buckets[b] = (float(r[len(r) // 2]), t[len(t) // 2])

    def median(self, rows: int) -> float | None:
        """Median of the raw timings in `rows`' bucket (robust to a noisy neighbour; for reports)."""
        xs = sorted(x[1] for x in self.samples.get(self.bucket(rows), []))
        return xs[len(xs) // 2] if xs else None

    def largest_rows(self) -> float:
        """Rows of the largest point timed (0 when nothing is)."""
        return max((r for r, _ in self.buckets.values()), default=0.0)

    def has(self, rows: int) -> bool:
        return len(self.samples.get(self.bucket(rows), ())) >= self.min_samples

    def estimate(self, rows: int) -> float | None:
        at_one = self._shape(rows)
        return None if at_one is None else at_one * self.speed

    def _shape(self, rows: int) -> float | None:
        """Seconds at speed 1 for `rows` rows (estimate's rule without the speed)."""
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
    max_rows: the most rows a step may run (--max-num-batched-tokens), or None: auto never picks a k
    whose verification rows exceed it (the scheduler would run fewer sequences, and a bucket it
    never fills would be explored forever).
    """

    def __init__(self, mode: str, k_max: int, max_rows: int | None = None):
        if mode not in ("auto", "fixed", "off"):
            raise ValueError(f"speculation: must be auto, fixed or off (got {mode!r})")
        if k_max < 0:
            raise ValueError(f"num_speculative_tokens: must be >= 0 (got {k_max})")
        self.mode = mode
        self.k_max = k_max
        self.max_rows = max_rows
        self.target = StepCostTable()
        self.draft = StepCostTable()
        self.history: collections.Counter = collections.Counter()  # k -> steps: bounded, unlike a list
        # engine-wide acceptance (decayed counts): the prior for requests with little history,
        # so that a new request is not stuck at k = 0 by a pessimistic fixed prior
        self._acc = 0.0
        self._ev = 0.0
        self._auto_steps = 0
        self._refresh_due = 0  # the auto step a refresh fell due at (0: none due)
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

    # draft positions (decayed counts) after which the engine-wide α is trusted as it is
    TRUST_POSITIONS = 8

    @property
    def alpha_prior(self) -> float:
        """The engine-wide α, until TRUST_POSITIONS positions are seen one standard deviation up
        (its Beta posterior's): optimism while little is known. Only speculation measures α, so a
        pessimistic early estimate would stop it for good: after 3 accepted proposals of 3 the mean is
        0.8, where k = 1 loses, though the draft's α on HumanEval is 0.93, where k = 1 and 2 pay 12%
        and 14% (1.5B native target, 2026-12-06). Kept for good, the optimism (~0.045 at the decay's
        ~100-position horizon) held k = 1 on at temperature 1 (α 0.76 against a break-even 0.78) for
        82 of 437 steps, 6% below plain; kept for 32 positions, ~45 steps of a ShareGPT run's first
        request; 8 is where benchmarks/spec_speed.py's auto came closest to the best fixed k on both
        (HumanEval 0.99x, ShareGPT at temperature 1 0.94x plain)."""
        a, n = self.alpha_global, self._ev + 2.0
        if self._ev >= self.TRUST_POSITIONS:
            return a
        return min(0.999, a + math.sqrt(a * (1.0 - a) / (n + 1.0)))

    def alpha_for(self, accepted: int, evaluated: int, weight: float = 16.0) -> float:
        """A request's smoothed α: its own counts plus `weight` pseudo-positions at `alpha_prior`
        (with 4, one rejected first proposal dropped a request to k = 0 for good: 147 of 330 steps
        plain on HumanEval, where k = 1 and 2 paid)."""
        return (accepted + weight * self.alpha_prior) / (evaluated + weight)

    def c(self, rows: int = 1) -> float | None:
        """Measured draft step time / target step time at `rows` rows."""
        d, t = self.draft.estimate(rows), self.target.estimate(rows)
        return d / t if d is not None and t else None

    def choose(self, alphas: list[float], prefill_tokens: int, lag: int = 0) -> int:
        """k for a step with one decode row per entry of `alphas` (each its smoothed α); `lag`: the
        tokens the draft has not seen yet over those rows (after plain steps), which a speculative
        step's first draft forward must run first."""
        if self.mode == "off" or not alphas or self.k_max == 0:
            k = 0
        elif self.mode == "fixed":
            k = self.k_max
        else:
            k = self._best(alphas, prefill_tokens, max(0, lag))
        self.history[k] += 1
        return k

    # every this many auto steps the best k's neighbour is tried once, so that costs measured
    # under other conditions (another batch size, a busy host) are refreshed
    REFRESH_EVERY = 50
    # speculation is chosen over plain decoding only where its predicted rate is this much higher:
    # the tables' medians move by a few percent between minutes (StepCostTable), and where a k sits
    # at break-even (k = 1 at temperature 1 over the native 1.5B: 0.97-1.02x plain measured) a choice
    # on the noise's side lost: `auto` 0.983x plain on ShareGPT at temperature 1 (BENCHMARKS.md,
    # issue 34's third round). A gain under 3% is not one the tables can tell from noise.
    MARGIN = 0.03
    # a refresh that falls due while the draft lags (the tokens of plain steps it has not seen) makes
    # its first forward catch up on them: past REFRESH_EVERY steps of waiting for a draft in step it
    # is taken anyway only where that catch-up costs at most this share of the plain steps waited.
    # After n plain steps of one stream the catch-up is ~n tokens of draft prefill, ~3-5% of those
    # steps' time whatever n is: forced every 100 steps, 7 catch-ups of 40-115 tokens (264-579 ms
    # each) cost 2.2% of a ShareGPT run at temperature 1, where `auto` came to 0.977x plain (1.5B
    # native target, 0.5B draft, the AMX Xeon, 2026-12-07). A single stream's refreshes thus wait
    # for its next request; a batch whose one row lags a few tokens still gets its refresh. The price:
    # a long request whose acceptance rises after a poor start (prose, then code) stays plain to its
    # end; on a simulated 60 tokens at α 0.2 then 2,000 at 0.95 the old rule ran 1.57x plain, this
    # one 1.0x. Plain is the floor `auto` promises; a catch-up over a window of the last tokens only,
    # its cost then bounded whatever the lag, would give that back.
    REFRESH_BUDGET = 0.01

    def _best(self, alphas: list[float], prefill_tokens: int, lag: int = 0) -> int:
        b = len(alphas)

        if self.max_rows is not None:  # the chunk that runs beside the decode rows, not all that waits
            prefill_tokens = min(prefill_tokens, max(0, self.max_rows - b))

        def measured(k: int) -> bool:
            return self.target.has(b * (k + 1) + prefill_tokens) and (k == 0 or self.draft.has(b))

        def fits(k: int) -> bool:
            return self.max_rows is None or k == 0 or b * (k + 1) + prefill_tokens <= self.max_rows

        # Explore upwards: plain first (it costs nothing to time), then k + 1 only while every k up
        # to the best so far was measured and k paid. A larger k pays only where k did, as long as
        # each verified row costs at least what the row before it did; so at temperature 1, where
        # speculation loses, only k = 1 is ever tried (largest-first exploration spent ~2% of a
        # 4 x 128-token ShareGPT run on k = 4 and 3 steps, and `auto` fell below plain).
        if not measured(0):
            return 0
        factors = self.position_factors()
        best_k, best_rate, plain_rate = 0, -1.0, 0.0
        for k in range(self.k_max + 1):
            if not fits(k):
                break
            if not measured(k):
                if k == best_k + 1:
                    return k
                continue
            cost = self.target.estimate(b * (k + 1) + prefill_tokens)
            if k:  # the first draft forward catches up on the lag
                cost += self._draft_cost(b + lag) + (k - 1) * self.draft.estimate(b)
            rate = sum(self.expected(a, k, factors) for a in alphas) / max(cost, 1e-9)
            if k == 0:
                plain_rate = rate
            if rate > best_rate and (k == 0 or best_k > 0 or rate > plain_rate * (1 + self.MARGIN)):
                best_k, best_rate = k, rate
        self._auto_steps += 1
        if self._auto_steps % self.REFRESH_EVERY == 0 and not self._refresh_due:
            self._refresh_due = self._auto_steps
        # the refresh waits for a step whose draft is in step (a new request's first decode): from
        # plain decoding its first forward would catch up on every token since, ~62 ms for 50 tokens
        # of the 0.5B draft, 2.3 target steps every 50 (auto 0.90x plain at temperature 1); but not
        # past another REFRESH_EVERY steps (overlapping requests are seldom all in step at once)
        waited = self._auto_steps - self._refresh_due if self._refresh_due else 0
        # the neighbour above, or below where the one above is past k_max or the token budget (a
        # refresh that could never run stayed due for ever, and no other fell due)
        nb = best_k + 1 if best_k < self.k_max and fits(best_k + 1) else best_k - 1  # below best_k: fits
        if self._refresh_due and nb >= 0 and (best_k > 0 or lag <= b or (
                waited >= self.REFRESH_EVERY and self._catch_up_fits(b, lag, waited))):
            self._refresh_due = 0
            return nb
        return best_k

    def _catch_up_fits(self, b: int, lag: int, waited: int) -> bool:
        """Whether a forced refresh's catch-up (the draft's first forward over b + lag rows instead of
        b) costs at most REFRESH_BUDGET of the `waited` plain decode steps' time since it fell due
        (steps of b rows: a prefill chunk in this step is no measure of the steps waited)."""
        plain = self.target.estimate(b)
        one = self.draft.estimate(b)
        if plain is None or one is None:
            return True  # nothing timed yet to weigh it by
        return self._draft_cost(b + lag) - one <= self.REFRESH_BUDGET * waited * plain

    def _draft_cost(self, rows: int) -> float:
        """Seconds of a draft forward over `rows` rows: measured where the draft has been timed at as
        many rows or more; past its largest timed point, that point's cost grown as the target's own row
        curve grows (a forward of many rows costs far less than as many one-row steps: the draft's table
        alone would extrapolate in proportion, 256 ms for a 401-row catch-up of a 3 ms draft step)."""
        top = self.draft.largest_rows()
        if rows <= top:
            return self.draft.estimate(rows)
        t_rows, t_top = self.target.estimate(rows), self.target.estimate(max(1, int(top)))
        if t_rows is None or not t_top:
            return self.draft.estimate(rows)
        return self.draft.estimate(int(top)) * t_rows / t_top
