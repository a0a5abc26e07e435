"""`mixserve plan`: capacity of one model on one machine for one traffic mix, and what each
optimization buys for that mix, from the simulator (simulator.py) and a step-time model
(a measured `hw probe` profile or a datasheet roofline, step_time.py).

Max sustainable rate: the highest Poisson arrival rate (requests/s) at which the trace's p99 TTFT
and p99 TPOT stay within the SLO, found by bisection (SLO met at the lower end, missed at the
upper). Throughput: output tokens/s with every request queued at t = 0 (as `mixserve bench`).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace

from mixserve.models.config import ModelConfig
from mixserve.bench.arrivals import arrival_offsets
from mixserve.plan.cost_model import BF16, WeightFormat, kv_bytes_per_token, weight_bytes
from mixserve.plan.simulator import SimConfig, SimRequest, SimResult, SpecSettings, simulate
from mixserve.plan.step_time import MeasuredModel, RooflineModel, StepBatch, StepModel

_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}


def parse_slo(text: str | None) -> dict:
    """'ttft_p99=2s,tpot_p99=200ms' -> {"ttft_p99": 2.0, "tpot_p99": 0.2} (seconds).
    Keys: ttft_p50|p90|p99, tpot_p50|p90|p99, each once, limits > 0. Raises ValueError naming the bad part."""
    out = {}
    for part in filter(None, (text or "").split(",")):
        m = re.fullmatch(r"\s*(ttft|tpot)_p(50|90|99)\s*=\s*([0-9]*\.?[0-9]+)\s*(s|ms|us)?\s*", part)
        if not m:
            raise ValueError(f"slo: cannot read {part!r}; use e.g. ttft_p99=2s,tpot_p99=200ms")
        key, value = f"{m.group(1)}_p{m.group(2)}", float(m.group(3)) * _TIME_UNITS[m.group(4) or "s"]
        # a 0 limit is never met (the plan would report rate 0 as if the hardware were too slow);
        # a key given twice is a typo for another percentile, not "the last one wins"
        if not value > 0:
            raise ValueError(f"slo: {part.strip()!r} must be a time > 0")
        if key in out:
            raise ValueError(f"slo: {key} given twice")
        out[key] = value
    return out


DEFAULT_SLO = "ttft_p99=2s,tpot_p99=200ms"


@dataclass
class Variant:
    """One engine configuration to plan: weights format, allocator, speculation."""

    name: str
    fmt: WeightFormat = BF16
    allocator: str = "paged"
    reserve: str = "max-model-len"
    spec: SpecSettings | None = None
    prefix_caching: bool = False  # the engine's automatic prefix caching (simulated, not assumed)
    replicas: int = 1  # engines behind serve --replicas' router (simulator.SimConfig.replicas)
    routing: str = "prefix"


@dataclass
class PlanSettings:
    """Engine settings (EngineArgs names) plus the planner's own: slo (seconds by key),
    kv_bytes (None: memory left after weights on a datasheet device, else the engine default
    1 GiB), device_memory_fraction (share of a datasheet device's memory the engine may use),
    seed (Poisson arrivals and acceptance draws), bisect_iters, route_margin and route_blocks
    (serve --replicas' router settings, for variants with replicas)."""

    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    kv_bytes: int | None = None
    slo: dict = field(default_factory=lambda: parse_slo(DEFAULT_SLO))
    device_memory_fraction: float = 0.9
    seed: int = 0
    bisect_iters: int = 10
    route_margin: int = 4
    route_blocks: int = 4

    def __post_init__(self):
        if not isinstance(self.route_margin, int) or self.route_margin < 0:
            raise ValueError(f"route_margin: must be an integer >= 0 (got {self.route_margin!r})")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "bisect_iters", "route_blocks"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}: must be an integer >= 1 (got {v!r})")
        if not isinstance(self.max_model_len, int) or self.max_model_len < 2:
            raise ValueError(f"max_model_len: must be an integer >= 2 (got {self.max_model_len!r})")


def kv_budget(cfg: ModelConfig, sm: StepModel, ps: PlanSettings, fmt: WeightFormat, hw: dict) -> int:
    """KV cache bytes: as given, else on a datasheet device memory * fraction - weights (as vLLM's
    gpu_memory_utilization), else the engine's default 1 GiB. Raises ValueError when the weights
    leave no memory."""
    if ps.kv_bytes is not None:
        return ps.kv_bytes
    if isinstance(sm, RooflineModel):
        left = hw["memory_bytes"] * ps.device_memory_fraction - weight_bytes(cfg, fmt)["total"]
        if left <= 0:
            raise ValueError(f"kv_cache_memory: the {fmt.name} weights do not fit in {hw['name']}")
        return int(left)
    return 1 << 30


def with_poisson_arrivals(reqs: list[SimRequest], rate: float, seed: int) -> list[SimRequest]:
    """The same requests, in trace order, arriving as a Poisson process of `rate` requests/s: the
    times `mixserve bench --request-rate rate --seed seed` replays (bench/arrivals.py), so a
    prediction and its measurement see the same arrivals."""
    return [replace(r, arrival_s=t) for r, t in zip(reqs, arrival_offsets(len(reqs), rate, 1.0, seed))]


def bisect_rate(probe, lo: float, lo_res, hi: float, iters: int):
    """Geometric bisection between a rate `lo` (requests/s) that meets the SLO (its result `lo_res`)
    and a rate `hi` that misses it, `iters` steps; probe(rate) -> (result, meets). Returns the
    highest rate found to meet it and its result."""
    for _ in range(iters):
        mid = math.sqrt(lo * hi)
        res, ok = probe(mid)
        if ok:
            lo, lo_res = mid, res
        else:
            hi = mid
    return lo, lo_res


class Planner:
    """Simulates `reqs` under variants of one engine configuration.

    Args: cfg (model), sm (step-time model), hw (hardware description from load_step_model),
    reqs (the trace in tokens), ps (settings).
    """

    def __init__(self, cfg: ModelConfig, sm: StepModel, hw: dict, reqs: list[SimRequest], ps: PlanSettings):
        if not reqs:
            raise ValueError("trace: no requests")
        self.cfg, self.sm, self.hw, self.reqs, self.ps = cfg, sm, hw, reqs, ps
        self.kv_token_bytes = kv_bytes_per_token(cfg)

    def sim_config(self, v: Variant) -> SimConfig:
        ps = self.ps
        blocks = kv_budget(self.cfg, self.sm, ps, v.fmt, self.hw) // (ps.block_size * self.kv_token_bytes)
        return SimConfig(num_blocks=max(1, blocks), block_size=ps.block_size, max_num_seqs=ps.max_num_seqs,
                         max_num_batched_tokens=ps.max_num_batched_tokens, max_model_len=ps.max_model_len,
                         allocator=v.allocator, reserve=v.reserve, spec=v.spec, seed=ps.seed,
                         prefix_caching=v.prefix_caching, replicas=v.replicas, routing=v.routing,
                         route_margin=ps.route_margin, route_blocks=ps.route_blocks)

    def run(self, v: Variant, rate: float | None = None, reqs: list[SimRequest] | None = None) -> SimResult:
        """One simulation: rate None = the trace's own arrival times (all at 0 when it has none)."""
        reqs = reqs or self.reqs
        if rate is not None:
            reqs = with_poisson_arrivals(reqs, rate, self.ps.seed)
        return simulate(reqs, self.sim_config(v), lambda b: self.sm.step_time(b, v.fmt))

    def meets_slo(self, res: SimResult) -> bool:
        for key, limit in self.ps.slo.items():
            metric, pct = key.split("_")
            v = res.report[f"{metric}_s"][pct]
            if not (v <= limit) and not math.isnan(v):
                return False
        return True

    def max_rate(self, v: Variant, offline: SimResult) -> dict:
        """Bisection over Poisson rates. A rate is sustainable when the SLO is met and the rate is
        at most the engine's capacity on this trace (the offline requests/s): above it a long
        stream queues without bound, which a finite trace may hide. Returns {"rate": req/s (0 when
        even a lone stream misses the SLO), "limit": "slo" | "capacity" | "unloaded", "result":
        SimResult at that rate, "curve": [(rate, ttft_p99, tpot_p99, ok)]}."""
        curve = []

        def probe(rate):
            res = self.run(v, rate)
            ok = self.meets_slo(res)
            curve.append((rate, res.report["ttft_s"]["p99"], res.report["tpot_s"]["p99"], ok))
            return res, ok

        cap = offline.report["requests_per_s"]
        # a request every 1000 mean service times never queues: the unloaded latency
        lo = cap * 1e-3
        lo_res, ok = probe(lo)
        if not ok:
            return {"rate": 0.0, "limit": "unloaded", "result": lo_res, "curve": curve}
        hi_res, ok = probe(cap)
        if ok:
            return {"rate": cap, "limit": "capacity", "result": hi_res, "curve": sorted(curve)}
        lo, lo_res = bisect_rate(probe, lo, lo_res, cap, self.ps.bisect_iters)
        return {"rate": lo, "limit": "slo", "result": lo_res, "curve": sorted(curve)}

    def single_stream_tpot(self, v: Variant) -> float:
        """TPOT (seconds) of the trace's median-length request running alone."""
        mid = sorted(self.reqs, key=lambda r: r.prompt_tokens + r.output_tokens)[len(self.reqs) // 2]
        one = SimRequest(mid.prompt_tokens, max(2, mid.output_tokens), 0.0, mid.tag)
        return self.run(v, None, [one]).report["tpot_s"]["p50"]

    def evaluate(self, v: Variant, find_rate: bool = True) -> dict:
        """Offline run, lone-stream TPOT and (with an SLO) the max rate of one variant. A variant
        under which no request fits (e.g. a contiguous max-model-len region larger than the KV
        cache) gets NaN figures and no rate search: there is nothing to run."""
        # capacity is measured as `mixserve bench` does, every request queued at t = 0, whatever
        # arrival times the trace carries (those are replayed separately, under "trace_arrivals")
        off = self.run(v, reqs=[replace(r, arrival_s=0.0) for r in self.reqs])
        fits = len(off.rejected) < len(self.reqs)
        out = {"variant": v.name, "format": v.fmt.name, "allocator": v.allocator,
               "reserve": v.reserve if v.allocator == "contiguous" else None,
               "spec": None if v.spec is None else vars(v.spec),
               "kv_blocks": self.sim_config(v).num_blocks, "offline": off.report,
               "prefix_caching": v.prefix_caching, "prefix_hit_rate": off.prefix_hit_rate,
               "single_stream_tpot_s": self.single_stream_tpot(v) if fits else float("nan")}
        if fits and any(r.arrival_s > 0 for r in self.reqs):
            out["trace_arrivals"] = self.run(v).report
        if find_rate and self.ps.slo and fits:
            mr = self.max_rate(v, off)
            out["max_rate"] = {"rate_per_s": mr["rate"], "limit": mr["limit"], "at_rate": mr["result"].report,
                               "curve": mr["curve"]}
            out["_at_rate"] = mr["result"]
        out["_offline"] = off
        return out


def parse_replicas(text: str) -> list[int]:
    """'1,2,4,8' -> [1, 2, 4, 8] (distinct, ascending). Raises ValueError naming the bad part."""
    out = set()
    for part in text.split(","):
        try:
            n = int(part)
        except ValueError:
            raise ValueError(f"replicas: cannot read {part.strip()!r}; use e.g. 1,2,4,8") from None
        if n < 1:
            raise ValueError(f"replicas: counts must be >= 1 (got {n})")
        out.add(n)
    return sorted(out)


def plan_replicas(planner: Planner, counts: list[int], routing: str = "prefix", target_rate: float | None = None,
                  fmt: WeightFormat = BF16, log=print) -> tuple[dict, dict]:
    """Scale-out: the engine as `serve` runs it by default (paged, prefix caching on, weights
    `fmt`) on each of N replicas behind serve --replicas' router, for each N in `counts`.

    Each N gets the planner's offline run, max rate under the SLO (bisection) and, with
    `target_rate` (requests/s), one run at that Poisson rate. `needed` is the fewest replicas
    whose run at the target rate meets the SLO without passing their capacity (None: none of the
    counts does, or no target). Returns (JSON-ready dict, {name: evaluation} for plots).
    Raises ValueError for a target rate that is not > 0.
    """
    if target_rate is not None and not 0 < target_rate < math.inf:
        raise ValueError(f"target_rate: must be a finite number > 0 requests/s (got {target_rate})")
    if counts and counts[-1] > len(planner.reqs):
        # a replica with no request measures nothing, and each one holds a whole simulated KV cache
        raise ValueError(f"replicas: {counts[-1]} replicas for a trace of {len(planner.reqs)} requests; "
                         "use a longer trace (--num-prompts) or fewer replicas")
    rows, evals = [], {}
    for n in counts:
        v = Variant(f"{n} replica{'s' if n > 1 else ''} ({routing})", fmt=fmt, prefix_caching=True,
                    replicas=n, routing=routing)
        log(f"simulating: {v.name}")
        e = planner.evaluate(v)
        evals[v.name] = e
        off = e["_offline"]
        row = {"replicas": n, "throughput_output_tokens_per_s": e["offline"]["output_tokens_per_s"],
               "capacity_requests_per_s": e["offline"]["requests_per_s"],
               "max_rate_per_s": e.get("max_rate", {}).get("rate_per_s", float("nan")),
               "max_rate_limit": e.get("max_rate", {}).get("limit"),
               "prefix_hit_rate": off.prefix_hit_rate, "route_reasons": off.route_reasons,
               "requests_per_replica": [r["requests"] for r in off.replicas]}
        if e.get("trace_arrivals"):
            row["prefix_hit_rate_trace_arrivals"] = e["trace_arrivals"]["extra"]["prefix_cache_hit_rate"]
        if len(planner.reqs) < n * planner.ps.max_num_seqs:
            # all queued at once, the trace ends before n engines fill their batches: the drain time
            # of a finite trace, not the replicas' steady-state capacity, bounds the figures
            row["warning"] = (f"{len(planner.reqs)} requests cannot fill {n} x max_num_seqs "
                              f"{planner.ps.max_num_seqs}: capacity and max rate are lower bounds")
        if target_rate is not None:
            at = planner.run(v, target_rate)
            row["at_target"] = {"meets_slo": planner.meets_slo(at) and target_rate <= row["capacity_requests_per_s"],
                                "ttft_p99_s": at.report["ttft_s"]["p99"], "tpot_p99_s": at.report["tpot_s"]["p99"],
                                "prefix_hit_rate": at.prefix_hit_rate}
        rows.append(row)
    needed = next((r["replicas"] for r in rows if r.get("at_target", {}).get("meets_slo")), None)
    return {"routing": routing, "route_margin": planner.ps.route_margin, "route_blocks": planner.ps.route_blocks,
            "format": fmt.name, "target_rate_per_s": target_rate, "needed": needed, "rows": rows}, evals


def binding(cfg: ModelConfig, sm: StepModel, hw: dict, batch: StepBatch, fmt: WeightFormat = BF16) -> dict:
    """Which resource binds a step of shape `batch`: the roofline terms (FLOPs / peak FLOP/s,
    bytes / bandwidth; measured profiles use the best FLOP/s their linear tables reached and the
    measured copy bandwidth) and the step-time breakdown. `bound` is "compute" or "bandwidth",
    or "overhead" when the non-matmul, non-attention time is over half the step."""
    from mixserve.plan.cost_model import attention_flops, linear_flops_per_token

    tokens = batch.num_tokens
    flops = (tokens * linear_flops_per_token(cfg, with_lm_head=False)
             + batch.sampled_rows * 2 * cfg.vocab_size * cfg.hidden_size
             + attention_flops(cfg, sum(batch.decode_contexts))
             + sum(attention_flops(cfg, q * c - q * (q - 1) // 2) for q, c in batch.spans))
    kv_read = kv_bytes_per_token(cfg) * (sum(batch.decode_contexts) + sum(c for _, c in batch.spans))
    byts = weight_bytes(cfg, fmt)["decode_read"] + kv_read
    if isinstance(sm, RooflineModel):
        peak, bw = sm.acc.bf16_flops, sm.acc.bandwidth
    else:
        peak = _measured_peak_flops(sm)
        bw = hw.get("bandwidth_bytes_per_s") or float("nan")
    bd = sm.breakdown(batch, fmt)
    total = sum(bd.values())
    t_c, t_m = flops / peak, byts / bw
    bound = "compute" if t_c >= t_m else "bandwidth"
    if total > 0 and bd["overhead"] / total > 0.5:
        bound = "overhead"
    return {"tokens": tokens, "seqs": batch.num_seqs, "flops": flops, "bytes": byts, "compute_s": t_c,
            "memory_s": t_m, "step_s": total, "breakdown_s": bd, "bound": bound, "peak_flops": peak,
            "bandwidth_bytes_per_s": bw}


def _measured_peak_flops(sm: MeasuredModel) -> float:
    best = 0.0
    for name, t in sm.profile["linear"].get("bf16", {}).items():
        for r, s in zip(t["rows"], t["seconds"]):
            best = max(best, 2 * r * t["out_features"] * t["in_features"] / s)
    return best


def _median(xs: list[int]) -> float:
    """Median of sorted xs, interpolated as `mix describe` does (numpy's linear method)."""
    n = len(xs)
    return float(xs[n // 2]) if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def typical_batches(res: SimResult, reqs: list[SimRequest], ps: PlanSettings) -> dict:
    """A typical prefill step (the trace's median prompt, chunked to the token budget) and a
    typical decode step (the mean number of sequences per step of the run, at the median
    context), for `binding`."""
    prompts = sorted(r.prompt_tokens for r in reqs)
    outs = sorted(r.output_tokens for r in reqs)
    p = min(prompts[len(prompts) // 2], ps.max_num_batched_tokens)
    seqs = [s[3] for s in res.steps] or [1]
    b = max(1, round(sum(seqs) / len(seqs)))
    ctx = prompts[len(prompts) // 2] + outs[len(outs) // 2] // 2
    return {"prefill": StepBatch([], [(p, p)], 1), "decode": StepBatch([ctx] * b, [], b)}


def trace_requests(trace: str, model: str, num_prompts: int | None, seed: int = 0, output_len_cap: int = 256,
                   max_prompt_len: int = 1024, conversations_at_once: int | None = None) -> list[SimRequest]:
    """A trace (sharegpt | humaneval | FILE.jsonl, as `mixserve bench --dataset`) in tokens of
    `model`'s tokenizer (no weights are loaded). Output length = the request's max_tokens, which
    bench generates in full (ignore_eos); arrival_s is kept when the trace has it."""
    from transformers import AutoTokenizer

    from mixserve.data.datasets import load_dataset
    from mixserve.models.weights import gguf_meta_dir
    from mixserve.models.registry import resolve_model

    r = resolve_model(model)
    folder = gguf_meta_dir(r.path) if r.kind == "gguf" else r.path
    tok = AutoTokenizer.from_pretrained(str(folder))
    reqs = load_dataset(trace, tok, num_prompts, seed=seed, output_len_cap=output_len_cap,
                        max_prompt_len=max_prompt_len)
    return sim_requests(reqs, tok, conversations_at_once)


def sim_requests(reqs, tokenizer, conversations_at_once: int | None = None) -> list[SimRequest]:
    """BenchRequests -> SimRequests with the trace's prefix structure as stand-in token ids
    (data/prefix.stand_ins): shared groups, recorded block hashes, repeated text and, for a
    multi-turn conversation, each turn's prompt as sent (the conversation so far) following the
    turn before it (closed loop)."""
    from mixserve.data.prefix import stand_ins

    out = []
    for br, it in zip(reqs, stand_ins(reqs, tokenizer, conversations_at_once)):
        arrival = getattr(br, "arrival_s", None)
        out.append(SimRequest(it.prompt_tokens, br.max_tokens, float(arrival or 0.0), br.tag,
                              token_ids=it.token_ids, after=it.after,
                              constrained=getattr(br, "response_format", None) is not None))
    return out


def default_variants(spec: SpecSettings, group_size: int = 128, gguf: WeightFormat | None = None) -> list[Variant]:
    """Baseline (paged, bf16, prefix caching off) and one variant per optimization (prefix
    caching among them: its hit rate comes out of the simulated cache); with `gguf` (a GGUF
    model's cost_model.gguf_format) also its quantized tensors as stored."""
    extra = [Variant(f"GGUF as stored ({gguf.label})", fmt=gguf)] if gguf is not None else []
    return [
        Variant("baseline (paged, bf16)"),
        Variant("contiguous, reserve max-model-len", allocator="contiguous", reserve="max-model-len"),
        Variant("contiguous, reserve max-tokens", allocator="contiguous", reserve="max-tokens"),
        Variant(f"speculative (alpha {spec.alpha:.3g}, k<={spec.k_max}, c {spec.draft_cost:.3g})", spec=spec),
        Variant(f"AWQ w4 (g{group_size})", fmt=WeightFormat("int4", group_size)),
        Variant("prefix caching", prefix_caching=True),
    ] + extra


def make_plan(cfg: ModelConfig, sm: StepModel, hw: dict, reqs: list[SimRequest], ps: PlanSettings,
              spec: SpecSettings, log=print, gguf: WeightFormat | None = None, replicas: list[int] | None = None,
              routing: str = "prefix", target_rate: float | None = None) -> tuple[dict, dict]:
    """Everything `mixserve plan` reports. Returns (JSON-ready dict, {variant name: evaluation
    with the SimResults under "_offline" / "_at_rate"} for plots). gguf: a GGUF model's format
    as stored (cost_model.gguf_format), planned as one more variant. replicas, routing,
    target_rate: the scale-out section (plan_replicas), under "replicas"; its evaluations are
    returned under "_replicas"."""
    from mixserve.plan.cost_model import summary

    planner = Planner(cfg, sm, hw, reqs, ps)
    evals = {}
    variants = default_variants(spec, gguf=gguf)
    if isinstance(sm, MeasuredModel) and "int4" not in sm.tables:
        log("note: the profile has no int4 timings (hw probe --formats bf16): AWQ is left out of the plan")
        variants = [v for v in variants if v.fmt.name != "int4"]
    if isinstance(sm, MeasuredModel) and gguf is not None and "gguf" not in sm.tables:
        log("note: the profile has no gguf timings (hw probe --formats bf16,int4,gguf): the GGUF-as-stored "
            "variant is left out of the plan")
        variants = [v for v in variants if v.fmt.name != "gguf"]
    for v in variants:
        log(f"simulating: {v.name}")
        evals[v.name] = planner.evaluate(v)
    names = list(evals)
    base = evals[names[0]]
    # requests the engine would refuse (check_request) are left out of every simulation: say so,
    # and refuse to plan on nothing rather than report NaN rates
    rejected = base["_offline"].rejected
    if len(rejected) == len(reqs):
        longest = min(r.prompt_tokens + r.output_tokens for r in reqs)
        raise ValueError(f"trace: none of the {len(reqs)} requests fits: the shortest needs {longest} tokens "
                         f"(prompt + max_tokens), over max_model_len {ps.max_model_len} or the KV cache of "
                         f"{base['kv_blocks'] * ps.block_size} tokens; raise --max-model-len or --kv-cache-memory")
    if rejected:
        log(f"warning: {len(rejected)} of {len(reqs)} requests never fit (prompt + max_tokens over max_model_len "
            f"{ps.max_model_len} or the KV cache) and are left out of the plan")

    def gain(e, key):
        b, x = key(base), key(e)
        return x / b if b and b == b and x == x else float("nan")

    thr = lambda e: e["offline"]["output_tokens_per_s"]  # noqa: E731
    rate = lambda e: e.get("max_rate", {}).get("rate_per_s", float("nan"))  # noqa: E731
    tpot1 = lambda e: 1.0 / e["single_stream_tpot_s"]  # noqa: E731
    rows = []
    for name, e in evals.items():
        if name == names[0]:
            continue
        if e["allocator"] == "contiguous":  # what paging buys over this allocator
            row = {"optimization": f"paging (vs {name})", "throughput_x": 1 / gain(e, thr),
                   "max_rate_x": 1 / gain(e, rate) if gain(e, rate) else float("inf"),
                   "single_stream_x": 1 / gain(e, tpot1)}
        else:
            row = {"optimization": name, "throughput_x": gain(e, thr), "max_rate_x": gain(e, rate),
                   "single_stream_x": gain(e, tpot1)}
        if e.get("prefix_caching"):
            ttft = lambda x: 1.0 / x["offline"]["ttft_s"]["p50"]  # noqa: E731
            row.update(ttft_p50_x=gain(e, ttft), prefix_hit_rate=e["prefix_hit_rate"])
            if e.get("trace_arrivals"):
                row["prefix_hit_rate_trace_arrivals"] = e["trace_arrivals"]["extra"]["prefix_cache_hit_rate"]
        rows.append(row)
    rows.sort(key=lambda r: (-(r["max_rate_x"] if r["max_rate_x"] == r["max_rate_x"] else 0), -r["throughput_x"]))
    typ = typical_batches(base["_offline"], reqs, ps)
    bind = {phase: binding(cfg, sm, hw, b) for phase, b in typ.items()}
    kv_tok = kv_bytes_per_token(cfg)
    at = base.get("_at_rate") or base["_offline"]
    prompts = sorted(r.prompt_tokens for r in reqs)
    outs = sorted(r.output_tokens for r in reqs)
    plan = {
        "model": {"config": cfg.as_dict(), "cost": summary(cfg)},
        "hardware": hw,
        "settings": {**{k: v for k, v in vars(ps).items()}, "spec": vars(spec)},
        "trace": {"num_requests": len(reqs), "prompt_tokens_p50": _median(prompts),
                  "output_tokens_p50": _median(outs), "prompt_tokens_max": prompts[-1],
                  "output_tokens_max": outs[-1], "rejected": len(rejected)},
        "kv": {"bytes_per_token": kv_tok, "budget_bytes": kv_budget(cfg, sm, ps, BF16, hw),
               "peak_blocks_offline": base["offline"]["extra"]["peak_kv_blocks"],
               "peak_bytes_offline": base["offline"]["extra"]["peak_kv_blocks"] * ps.block_size * kv_tok,
               "peak_bytes_at_max_rate": at.peak_kv_blocks * ps.block_size * kv_tok,
               "all_requests_at_once_bytes": sum(r.prompt_tokens + r.output_tokens for r in reqs) * kv_tok},
        "baseline": {"throughput_output_tokens_per_s": thr(base), "max_rate_per_s": rate(base),
                     "max_rate_limit": base.get("max_rate", {}).get("limit"),
                     "at_max_rate": {k: base.get("max_rate", {}).get("at_rate", {}).get(k)
                                     for k in ("ttft_s", "tpot_s", "e2e_s", "output_tokens_per_s")},
                     "offline": {k: base["offline"][k] for k in ("ttft_s", "tpot_s", "e2e_s", "duration_s")},
                     "trace_arrivals": base.get("trace_arrivals")},
        "binding": bind,
        "ranking": rows,
        "variants": {n: {k: v for k, v in e.items() if not k.startswith("_")} for n, e in evals.items()},
    }
    if replicas:
        plan["replicas"], evals["_replicas"] = plan_replicas(planner, replicas, routing, target_rate, log=log)
    return plan, evals
