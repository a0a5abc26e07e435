"""The search of `plan --suggest`: coordinate descent over the engine's configurations with the
planner's simulator, pruned against the best goodput found so far, and the answer it gives."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from mixserve.bench.metrics import json_safe
from mixserve.models.config import ModelConfig
from mixserve.plan.cost_model import BF16, WeightFormat, kv_bytes_per_token
from mixserve.plan.planner import PlanSettings, Planner, Variant, bisect_rate, kv_budget
from mixserve.plan.simulator import SimRequest, SpecSettings
from mixserve.plan.step_time import MeasuredModel, StepModel
from mixserve.plan.suggest.space import (BATCHED_TOKENS, DIMENSIONS, PLANNER_ERROR, SEQS, SPEC_KS, Config,
                                         Drafter, _ms)

@dataclass
class Suggestion:
    """What `plan --suggest` answers (as_json gives the --json document)."""

    best: dict
    default: dict
    runners_up: list
    excluded: list
    verdict: str
    slo_met: bool
    configurations_simulated: int
    search_seconds: float
    notes: list = field(default_factory=list)
    settings: dict = field(default_factory=dict)

    def as_json(self) -> dict:
        """The --json document: plain JSON (a non-finite number, e.g. an infinite gain, is null)."""
        return json_safe({"best": self.best, "default": self.default, "runners_up": self.runners_up,
                "excluded": self.excluded, "verdict": self.verdict, "slo_met": self.slo_met,
                "configurations_simulated": self.configurations_simulated,
                "search_seconds": self.search_seconds, "notes": self.notes, "settings": self.settings})


class Suggester:
    """Searches the engine's configurations for one trace (`reqs`, SimRequests) on one step model.

    Args: cfg, sm (a MeasuredModel or RooflineModel), hw (load_step_model's description), reqs,
    ps (PlanSettings: block size, KV budget, SLO, seed, bisection steps; its batch limits are the
    default configuration's), formats ({format name: WeightFormat} the profile can time), drafter
    (Drafter or None), replicas (counts to try, [1] by default), exclusions ({format: reason} for
    formats left out, e.g. by the quality floor), model_kind ("gguf", "hf" or "awq": what the
    default loads), min_gain (fraction), search_bisect_iters and search_requests (the search's
    bisection steps and trace prefix; None: the whole trace). Raises ValueError for an empty trace
    or no format.
    """

    def __init__(self, cfg: ModelConfig, sm: StepModel, hw: dict, reqs: list[SimRequest], ps: PlanSettings,
                 formats: dict[str, WeightFormat], drafter: Drafter | None = None, replicas: list[int] | None = None,
                 exclusions: dict[str, str] | None = None, model_kind: str = "hf", min_gain: float = PLANNER_ERROR,
                 search_bisect_iters: int = 4, search_requests: int | None = 64,
                 default_formats: dict[str, WeightFormat] | None = None, spec_k: int = 8, log=print):
        if not reqs:
            raise ValueError("trace: no requests")
        if not formats:
            raise ValueError("weights: no format left to plan (see the exclusions)")
        if not (0 <= min_gain < math.inf):
            raise ValueError(f"min_gain: must be a finite fraction >= 0 (got {min_gain})")
        self.cfg, self.sm, self.hw, self.reqs, self.ps = cfg, sm, hw, reqs, ps
        self.formats, self.drafter = formats, drafter
        # what the engine runs by default stays the baseline even where the quality floor leaves it out
        # of the search (default_formats: {name: WeightFormat} of formats not searched but evaluable)
        self.eval_formats = {**(default_formats or {}), **formats}
        if not isinstance(spec_k, int) or spec_k < 1:
            raise ValueError(f"spec_k: must be an integer >= 1 (got {spec_k!r})")
        self.spec_k = spec_k  # the largest k tried (fixed 1, 2, 4, 8 up to it, and auto up to it)
        self.replicas = sorted(set(replicas or [1]))
        self.exclusions = dict(exclusions or {})
        self.min_gain, self.log = min_gain, log
        self.search_iters = max(1, min(search_bisect_iters, ps.bisect_iters))
        self.final_iters = ps.bisect_iters
        # the search simulates a prefix of the trace (a closed-loop turn only follows an earlier
        # request, so a prefix keeps every link); the default and the best are then run whole
        self.search_reqs = reqs[:search_requests] if search_requests else reqs
        self.step = 0.03  # a candidate must meet the SLO 3% above the incumbent's goodput to replace it
        self.cache: dict[tuple[Config, bool], dict] = {}  # (config, on the whole trace) -> evaluate()
        self.simulations = 0
        # the most rows the profile timed a linear at (None: a datasheet roofline, which has no table)
        self.max_rows = (min(max(t["rows"]) for f in sm.profile["linear"].values() for t in f.values())
                         if isinstance(sm, MeasuredModel) else None)
        # the KV cache every configuration gets (bytes): the format-independent budget of the settings
        self.kv_bytes = kv_budget(cfg, sm, ps, BF16, hw)
        kv_block = ps.block_size * kv_bytes_per_token(cfg)
        if self.kv_bytes < kv_block:
            raise ValueError(f"kv_cache_memory: {self.kv_bytes} bytes hold no KV block ({kv_block} bytes of "
                             f"{ps.block_size} tokens): the engine would not start")
        self.default = self.default_config(model_kind)
        self.mean_output = sum(r.output_tokens for r in reqs) / len(reqs)

    # the space ------------------------------------------------------------------------------
    def default_config(self, model_kind: str) -> Config:
        """What `mixserve serve --model M` runs with no other flag: a GGUF natively where the
        profile times it (the engine's default where the kernel exists), an AWQ checkpoint as
        int4, else bf16; paged, prefix caching on, the settings' batch limits, no speculation."""
        if model_kind == "gguf" and "gguf" in self.eval_formats:
            w = "gguf"
        elif model_kind == "awq" and "int4-awq" in self.eval_formats:
            w = "int4-awq"
        else:
            w = "bf16" if "bf16" in self.eval_formats else next(iter(self.formats))
        return Config(weights=w, max_num_seqs=self.ps.max_num_seqs,
                      max_num_batched_tokens=self.ps.max_num_batched_tokens)

    def values(self, dim: str, at: Config) -> list:
        """The values dimension `dim` may take with the rest of `at` held (combinations the
        engine refuses are not offered: a draft model with the contiguous allocator, prefix
        caching with it)."""
        if dim == "weights":
            return list(self.formats)
        if dim == "prefix_caching":
            return [True, False] if at.allocator == "paged" else [False]
        if dim == "allocator":
            draft_model = self.drafter is not None and self.drafter.name != "ngram" and at.speculation[0] != "off"
            return ["paged"] if draft_model else ["paged", "contiguous"]
        if dim == "max_num_seqs":
            return sorted({v for v in SEQS if v <= max(4, len(self.reqs))} | {self.default.max_num_seqs})
        if dim == "max_num_batched_tokens":
            vals = set(BATCHED_TOKENS)
            if self.max_rows:  # a table extrapolates past its last point: no chunk budget past what was timed
                vals = {v for v in vals if v <= self.max_rows}
            return sorted(vals | {self.default.max_num_batched_tokens})
        if dim == "speculation":
            if self.drafter is None:
                return [("off", 0)]
            if at.allocator == "contiguous" and self.drafter.name != "ngram":
                return [("off", 0)]
            ks = sorted({k for k in SPEC_KS if k <= self.spec_k} | {self.spec_k})
            return [("off", 0)] + [("fixed", k) for k in ks] + [("auto", self.spec_k)]
        if dim == "replicas":
            return [n for n in self.replicas if n <= len(self.reqs)] or [1]
        raise ValueError(f"unknown dimension {dim!r}")

    def normalized(self, c: Config) -> Config:
        """A configuration the engine would run as given: prefix caching off with the contiguous
        allocator (it cannot share blocks), no draft model beside it."""
        if c.allocator == "contiguous":
            c = replace(c, prefix_caching=False)
            if self.drafter is not None and self.drafter.name != "ngram":
                c = replace(c, speculation=("off", 0))
        return c

    # one configuration ----------------------------------------------------------------------
    def variant(self, c: Config) -> Variant:
        spec = None
        if c.speculation[0] != "off" and self.drafter is not None:
            spec = SpecSettings(self.drafter.alpha, c.speculation[1], self.drafter.cost, c.speculation[0])
        return Variant(c.describe(), fmt=self.eval_formats[c.weights], allocator=c.allocator, reserve="max-tokens",
                       spec=spec, prefix_caching=c.prefix_caching, replicas=c.replicas)

    def evaluate(self, c: Config, final: bool = False, floor_rate: float | None = None) -> dict:
        """Predicted figures of `c` (memoized): offline throughput, TTFT / TPOT percentiles and KV
        use; with an SLO the goodput (the highest Poisson rate whose percentiles meet it) and the
        figures at that rate. The search runs on the trace's first `search_requests` requests and
        a short bisection; `final` on the whole trace. floor_rate: the rate `c` must meet the SLO at
        to matter (the incumbent's goodput, a little over): below its capacity, or missing the SLO
        there, it is `pruned` with that reason after one or two simulations instead of a whole
        bisection. When even the lowest rate tried (capacity / 64, nearly unloaded) misses the SLO,
        `slo_miss` says by how much."""
        key = (c, final)
        old = self.cache.get(key)
        # a pruned figure answers only a caller whose floor would prune it again: one with a lower
        # floor, or none (simplify, the final answer), gets the configuration simulated
        if old is not None and (not old.get("pruned") or (floor_rate is not None and floor_rate >= old["floor_rate"])):
            return old
        reqs = self.reqs if final else self.search_reqs
        ps = replace(self.ps, max_num_seqs=c.max_num_seqs, max_num_batched_tokens=c.max_num_batched_tokens)
        pl = Planner(self.cfg, self.sm, self.hw, reqs, ps)
        v = self.variant(c)
        off = pl.run(v, reqs=[replace(r, arrival_s=0.0) for r in reqs])
        self.simulations += 1
        kv_tok = kv_bytes_per_token(self.cfg)
        rep = off.report
        out = {"config": c, "final": final, "requests": len(reqs), "fits": len(off.rejected) < len(reqs),
               "rejected": len(off.rejected), "throughput_output_tokens_per_s": rep["output_tokens_per_s"],
               "requests_per_s": rep["requests_per_s"],
               "offline": {k: {p: rep[k][p] for p in ("p50", "p90", "p99")} for k in ("ttft_s", "tpot_s")},
               "kv_blocks": pl.sim_config(v).num_blocks,
               "kv_peak_bytes": off.peak_kv_blocks * ps.block_size * kv_tok,
               "preemptions": off.num_preemptions, "prefix_hit_rate": off.prefix_hit_rate}
        if self.ps.slo and out["fits"]:
            out.update(self._goodput(pl, v, off, reqs, floor_rate, iters=self.final_iters if final else self.search_iters))
        self.cache[key] = out
        return out

    def _goodput(self, pl: Planner, v: Variant, off, reqs, floor_rate: float | None, iters: int) -> dict:
        """Bisection for the highest rate meeting the SLO, in [floor_rate or capacity / 64, capacity]
        (above capacity a long stream queues without bound: Planner.max_rate's rule)."""
        cap = off.report["requests_per_s"]
        kv_tok = kv_bytes_per_token(self.cfg)
        mean_out = sum(r.output_tokens for r in reqs) / len(reqs)

        def run(rate):
            self.simulations += 1
            res = pl.run(v, rate)
            return res, pl.meets_slo(res)

        def found(rate, res, limit):
            return {"goodput_requests_per_s": rate, "goodput_output_tokens_per_s": rate * mean_out,
                    "rate_limit": limit,
                    # throughput at the rate: what bench measures there (the arrivals' span and the drain after)
                    "at_rate": {"output_tokens_per_s": res.report["output_tokens_per_s"],
                                **{k: {p: res.report[k][p] for p in ("p50", "p90", "p99")} for k in ("ttft_s", "tpot_s")}},
                    "kv_peak_bytes_at_rate": res.peak_kv_blocks * pl.ps.block_size * kv_tok}

        if floor_rate is not None:
            if cap < floor_rate:
                return {"pruned": f"its capacity ({cap:.3g} req/s) is under the rate it had to meet the SLO at "
                                  f"({floor_rate:.3g}: 3% over the best goodput found before it)",
                        "floor_rate": floor_rate, "goodput_requests_per_s": 0.0}
            lo = floor_rate
            lo_res, ok = run(lo)
            if not ok:
                return {"pruned": f"misses the SLO at {floor_rate:.3g} req/s (3% over the best goodput found "
                                  "before it)",
                        "floor_rate": floor_rate, "goodput_requests_per_s": 0.0}
        else:
            lo = cap / 64
            lo_res, ok = run(lo)
            if not ok:
                return {"goodput_requests_per_s": 0.0, "rate_limit": "unloaded",
                        "slo_miss": self.slo_miss(lo_res.report)}
        hi_res, ok = run(cap)
        if ok:
            return found(cap, hi_res, "capacity")
        lo, lo_res = bisect_rate(run, lo, lo_res, cap, iters)
        return found(lo, lo_res, "slo")

    def slo_miss(self, report: dict) -> dict:
        """The SLO measure furthest over its limit in `report`: {"measure", "predicted_s",
        "limit_s", "over_x"} (over_x: predicted / limit)."""
        worst = None
        for key, limit in self.ps.slo.items():
            metric, pct = key.split("_")
            v = report[f"{metric}_s"][pct]
            x = v / limit if v == v else math.inf
            if worst is None or x > worst["over_x"]:
                worst = {"measure": key, "predicted_s": v, "limit_s": limit, "over_x": x}
        return worst

    def score(self, e: dict) -> tuple:
        """Larger is better: with an SLO (goodput, output tokens/s), or, for configurations that
        meet it at no rate, (0, -how far over the SLO they are); without one (output tokens/s,).
        A pruned configuration or one under which no request fits scores below every other."""
        if not e["fits"]:
            return (-math.inf, -math.inf)
        if e.get("pruned"):  # below every unpruned one, ranked among themselves by capacity
            return (-1.0, e["requests_per_s"])
        thr = e["throughput_output_tokens_per_s"]
        if self.ps.slo:
            g = e.get("goodput_requests_per_s", 0.0)
            return (g, thr) if g > 0 else (0.0, -e.get("slo_miss", {}).get("over_x", math.inf))
        return (thr,)

    def objective(self, e: dict) -> float:
        """The figure the search maximizes: goodput (requests/s) with an SLO, else output tokens/s."""
        return self.score(e)[0]

    # the search -----------------------------------------------------------------------------
    def _floor(self, best_e: dict) -> float | None:
        g = best_e.get("goodput_requests_per_s", 0.0) if self.ps.slo else 0.0
        return g * (1 + self.step) if g > 0 else None

    def search(self, max_passes: int = 3) -> Config:
        """Coordinate descent from the default; returns the best configuration found."""
        best = self.default
        best_e = self.evaluate(best)
        for _ in range(max_passes):
            moved = False
            for dim in DIMENSIONS:
                for val in self.values(dim, best):
                    c = self.normalized(replace(best, **{dim: val}))
                    if c == best:
                        continue
                    e = self.evaluate(c, floor_rate=self._floor(best_e))
                    allowed_now = best.weights in self.formats
                    # from an excluded default, the first allowed configuration is taken whatever its score
                    if (c.weights in self.formats and not allowed_now) or self.score(e) > self.score(best_e):
                        best, best_e, moved = c, e, True
            if not moved:
                break
        return best

    def simplify(self, found: Config) -> Config:
        """Undo the settings of `found` that do not pay: each one it changed from the default is set
        back where that scores at least 99% as well on the search's sample (coordinate descent keeps
        a move that later moves made unimportant), so the answer asks for no flag that does not matter."""
        if found == self.default:
            return found
        # each step is held to 99% of what the search found, not of the step before (losses compound)
        target = self.score(self.evaluate(found))
        changed = True
        while changed:  # again after a change: one setting can hold another (contiguous: no prefix caching)
            changed = False
            for d in DIMENSIONS:
                if getattr(found, d) == getattr(self.default, d):
                    continue
                c = self.normalized(replace(found, **{d: getattr(self.default, d)}))
                if c == found or (c.weights not in self.formats and c.weights != found.weights):
                    continue
                e = self.evaluate(c)
                a = self.score(e)
                if target[0] > 0:
                    ok = a[0] >= 0.99 * target[0]
                else:  # nothing met the SLO: its miss (score[1] = -over_x) no more than 1% further over
                    ok = a[0] > 0 or (len(a) > 1 and a[1] >= target[1] * 1.01)
                if e["fits"] and not e.get("pruned") and ok:
                    found, changed = c, True
        return found

    def run(self) -> Suggestion:
        """Search, then evaluate the default and the best on the whole trace; the verdict applies
        the min_gain rule. Runners-up are the searched configurations one setting away from the
        best (their figures from the search's sample)."""
        import time

        t0 = time.perf_counter()
        found = self.simplify(self.search())
        d_e = self.evaluate(self.default, final=True)
        if not d_e["fits"]:
            raise ValueError(f"trace: none of the {len(self.reqs)} requests fits the default configuration (prompt + "
                             f"max_tokens over max_model_len {self.ps.max_model_len}, or over the KV cache of "
                             f"{d_e['kv_blocks'] * self.ps.block_size} tokens); raise --max-model-len or "
                             "--kv-cache-memory")
        b_e = d_e if found == self.default else self.evaluate(found, final=True)
        # whether the SLO is met is the whole trace's answer (the search's sample may be easier)
        slo_met = not self.ps.slo or self.objective(b_e) > 0 or self.objective(d_e) > 0
        if self.ps.slo and not slo_met:  # nothing meets it: the closest is the one that misses it least
            pool = [e for e in (b_e, d_e) if e.get("slo_miss")]
            pool += [e for e in self.cache.values() if e.get("slo_miss") and not e["final"]]
            closest = min(pool, key=lambda e: e["slo_miss"]["over_x"])["config"] if pool else found
            found = closest
            b_e = self.evaluate(found, final=True)
        gain = self._gain(b_e, d_e)
        default_ok = self.default.weights in self.formats
        if not default_ok and found == self.default:  # the search started there: move to the best allowed
            allowed = [e for (c, f), e in self.cache.items() if not f and c.weights in self.formats]
            found = max(allowed, key=self.score)["config"] if allowed else found
            b_e = self.evaluate(found, final=True)
            gain = self._gain(b_e, d_e)
        use_default = default_ok and (found == self.default or not (gain > 1 + self.min_gain))
        chosen, chosen_e = (self.default, d_e) if use_default and slo_met else (found, b_e)
        verdict = self._verdict(chosen, chosen_e, found, b_e, d_e, gain, slo_met, use_default)
        # runners-up: the default and the found configuration where not chosen (whole trace, against
        # the chosen one's whole-trace figures), then, per setting, the best searched configuration that
        # differs from the chosen one in that setting alone (the contiguous allocator with the prefix
        # caching and speculation it forces), against the chosen one's figures on the same search sample
        others = [(e, chosen_e) for e in ([b_e] if chosen != found else []) + ([d_e] if chosen != self.default else [])]
        chosen_s = self.evaluate(chosen)
        per_dim = {}
        for (c, f), e in self.cache.items():
            diff = [d for d in DIMENSIONS if getattr(c, d) != getattr(chosen, d)]
            if f or c in (found, self.default) or not diff:
                continue
            if "allocator" in diff:
                if not set(diff) <= {"allocator", "prefix_caching", "speculation"}:
                    continue
                d = "allocator"
            elif len(diff) == 1:
                d = diff[0]
            else:
                continue
            if d not in per_dim or self.score(e) > self.score(per_dim[d]):
                per_dim[d] = e
        others += [(e, chosen_s) for e in sorted(per_dim.values(), key=self.score, reverse=True)]
        runners = [self._runner_up(e, base, chosen == self.default) for e, base in others]
        tried = {c.speculation[0] for c, _ in self.cache}
        spec_note = None
        if self.drafter is not None and chosen.speculation[0] == "off" and "speculation" not in per_dim:
            spec_note = (f"speculation ({self.drafter.name}, alpha {self.drafter.alpha:.2f}) was searched "
                         f"({', '.join(sorted(tried - {'off'})) or 'no'} modes) and did not pay for this mix")
        notes = [spec_note] if spec_note else []
        for name, e in (("suggestion", chosen_e), ("default", d_e)):
            if e["rejected"]:
                notes.append(f"{e['rejected']} of {len(self.reqs)} requests never fit the {name} (prompt + max_tokens "
                             f"over max_model_len {self.ps.max_model_len} or over the KV cache): the engine would "
                             "refuse them, and its figures leave them out")
        if chosen.replicas > 1:
            notes.append(f"{chosen.replicas} replicas are predicted as {chosen.replicas} engines, each with the whole "
                         "of the --hardware machine: serve them on that many machines (serve --replicas with "
                         "--ray-address of a cluster); on this one host they would share its cores")
        if self.ps.slo:
            notes.append("goodput here is the highest Poisson rate whose run meets the SLO's percentiles; bench --slo "
                         "counts the requests that meet it one by one, so the two figures differ")
        return Suggestion(
            notes=notes,
            best=self.describe(chosen, chosen_e), default=self.describe(self.default, d_e), runners_up=runners,
            excluded=[{"weights": f, "reason": r} for f, r in sorted(self.exclusions.items())], verdict=verdict,
            slo_met=slo_met, configurations_simulated=len({c for c, _ in self.cache}),
            search_seconds=time.perf_counter() - t0,
            settings={"slo": self.ps.slo, "min_gain": self.min_gain, "kv_cache_bytes": self.kv_bytes,
                      "simulations": self.simulations, "search_requests": len(self.search_reqs),
                      "drafter": None if self.drafter is None else vars(self.drafter),
                      "objective": "goodput (the highest request rate whose percentiles meet the SLO)" if self.ps.slo
                      else "output tokens/s (every request at t = 0, as bench)"})

    def _gain(self, e: dict, base: dict) -> float:
        a, b = self.objective(e), self.objective(base)
        if b > 0 and math.isfinite(a):
            return a / b
        return math.inf if a > 0 else 1.0

    def _verdict(self, chosen, chosen_e, found, b_e, d_e, gain, slo_met, use_default) -> str:
        what = "goodput" if self.ps.slo else "output throughput"
        if not slo_met:
            m = chosen_e.get("slo_miss") or {}
            return (f"no configuration meets the SLO: the closest ({chosen.describe()}) predicts "
                    f"{m.get('measure', '?')} {_ms(m.get('predicted_s', math.nan))} against "
                    f"{_ms(m.get('limit_s', math.nan))} ({m.get('over_x', math.nan):.3g}x the limit) "
                    "when nearly unloaded; relax the SLO, or plan a faster machine")
        if self.default.weights not in self.formats:
            return (f"change {', '.join(chosen.differences(self.default))}: the default's weights "
                    f"({self.default.weights}) are left out: {self.exclusions.get(self.default.weights, '?')}; "
                    f"predicted {gain:.2f}x the default's {what}")
        if found == self.default:
            return f"the default is best: no configuration the search tried predicts a higher {what}"
        if use_default:
            return (f"the default is best: the best other configuration ({', '.join(found.differences(self.default))}) "
                    f"predicts {gain:.2f}x the default's {what}, within the planner's own error "
                    f"({self.min_gain:.0%}), so the gain is not one it can claim")
        return (f"change {', '.join(chosen.differences(self.default))}: predicted {gain:.2f}x the default's {what} "
                f"(over the planner's error of {self.min_gain:.0%})")

    def _runner_up(self, e: dict, best: dict, kept_default: bool) -> dict:
        c = e["config"]
        diff = c.differences(best["config"]) or ["the same settings"]
        what = "goodput" if self.ps.slo else "output throughput"
        if not e["fits"]:
            reason = (f"no request fits ({e['rejected']} refused): prompt + max_tokens over max_model_len or its KV "
                      "reservation over the cache")
        elif e.get("pruned"):
            reason = e["pruned"]
        elif self.ps.slo and self.objective(e) <= 0:
            m = e.get("slo_miss") or {}
            reason = (f"misses the SLO even nearly unloaded: {m.get('measure')} "
                      f"{_ms(m.get('predicted_s', math.nan))} > {_ms(m.get('limit_s', math.nan))}")
        else:
            g = self._gain(e, best)
            if abs(g - 1) < 0.01:
                reason = f"ties with the chosen value ({what} {g:.2f}x)"
            elif g > 1 and kept_default:
                reason = (f"{what} {g:.2f}x the default's, within the planner's error of {self.min_gain:.0%}: "
                          "not a gain it can claim")
            else:
                reason = f"{what} {g:.2f}x the suggestion's"
        if not e["final"] and e["requests"] < len(self.reqs):
            reason += f" (both on the trace's first {e['requests']} requests, as searched)"
        return {"config": self._config_json(c), "differs_by": diff, "reason": reason,
                "predicted": self._predicted(e)}

    # output ---------------------------------------------------------------------------------
    def _config_json(self, c: Config) -> dict:
        return {"weights": c.weights, "allocator": c.allocator, "prefix_caching": c.prefix_caching,
                "max_num_seqs": c.max_num_seqs, "max_num_batched_tokens": c.max_num_batched_tokens,
                "speculation": c.speculation[0], "num_speculative_tokens": c.speculation[1],
                "draft_model": self.drafter.name if self.drafter and c.speculation[0] != "off" else None,
                "replicas": c.replicas, "summary": c.describe()}

    def _predicted(self, e: dict) -> dict:
        p = {"throughput_output_tokens_per_s": e["throughput_output_tokens_per_s"],
             "ttft_s": e["offline"]["ttft_s"], "tpot_s": e["offline"]["tpot_s"],
             "kv_peak_bytes": e["kv_peak_bytes"], "kv_cache_bytes": self.kv_bytes,
             "preemptions": e["preemptions"], "prefix_hit_rate": e["prefix_hit_rate"]}
        for k, name in (("goodput_requests_per_s", None), ("goodput_output_tokens_per_s", None),
                        ("rate_limit", None), ("at_rate", "at_goodput_rate"), ("kv_peak_bytes_at_rate", None),
                        ("slo_miss", None), ("pruned", None)):
            if k in e:
                p[name or k] = e[k]
        p["requests_simulated"] = e["requests"]
        p["requests_refused"] = e["rejected"]
        return p

    def describe(self, c: Config, e: dict) -> dict:
        """{"config": the flags' values and a summary, "predicted": evaluate()'s figures} of `c`."""
        return {"config": self._config_json(c), "predicted": self._predicted(e)}
