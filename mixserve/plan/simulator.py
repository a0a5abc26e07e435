"""Discrete-event simulation of the engine over a trace, with step times from a StepModel.

The policy is not re-implemented: the simulator drives the engine's own `Scheduler` and
`BlockManager` (engine/scheduler.py, kv/block_manager.py), so continuous batching, the token
budget, chunked prefill, FCFS admission, paged blocks, preemption by recompute and automatic
prefix caching (hits, LRU eviction) are exactly the engine's. Sequences carry stand-in token ids
that only say which tokens are equal: a request's own `token_ids` when the trace gives its
prefix structure (equal ids where its prompt, or its output, repeats another request's), else
ids unique to the request, so the cache hits exactly what the trace says repeats. What the
simulator replaces is the model: a step takes `step_time(StepBatch)` seconds of simulated time, and every sequence that reaches its
last token gets one output token (greedy with ignore_eos, as `mixserve bench` runs), or, with
speculative decoding, 1 + the accepted draft tokens drawn with per-position acceptance α.

Events: requests arrive at `arrival_s` and join the waiting queue before the next step starts;
a step's tokens exist at its end (engine/llm_engine.py stamps first_token / finish after the
forward). When nothing is runnable the clock jumps to the next arrival.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable

from mixserve.bench.metrics import RequestMetrics, build_report
from mixserve.data.prefix import unique_ids
from mixserve.engine.scheduler import Scheduler
from mixserve.kv.block_manager import BlockManager
from mixserve.plan.step_time import StepBatch
from mixserve.sampling_params import SamplingParams
from mixserve.sequence import Sequence
from mixserve.spec_decode.controller import expected_tokens


@dataclass
class SimRequest:
    """One trace request in tokens: prompt length, output length (generated in full), arrival
    time in seconds from the start of the run, and its slice tag."""

    prompt_tokens: int
    output_tokens: int
    arrival_s: float = 0.0
    tag: str = ""
    # stand-in ids of prompt + output (at least prompt_tokens of them; missing output ids are
    # made unique): equal ids mark repeated content for the prefix cache. None: all unique.
    token_ids: list[int] | None = None
    # closed loop (a conversation's next turn): the index of the request this one follows; it
    # arrives when that one finishes (arrival_s is then ignored)
    after: int | None = None
    # structured output: its rows are masked by a grammar each step (StepBatch.masked_rows)
    constrained: bool = False


@dataclass
class SpecSettings:
    """Speculative decoding in the simulation (Leviathan et al. 2023).

    alpha: per-token acceptance probability; k_max: most tokens proposed per row;
    draft_cost: a draft step's time as a fraction of the target step over the same rows (c in the
        paper's §3.4); mode: "fixed" (always k_max) or "auto" (the k with the most expected tokens
        per second for this step, as spec_decode/controller.py chooses).
    """

    alpha: float
    k_max: int = 4
    draft_cost: float = 0.0
    mode: str = "auto"

    def __post_init__(self):
        if not 0.0 <= self.alpha < 1.0:
            raise ValueError(f"spec_alpha: must be in [0, 1) (got {self.alpha})")
        if self.k_max < 0 or not (0 <= self.draft_cost < float("inf")):
            raise ValueError(f"spec k and draft cost must be finite and >= 0 (got k {self.k_max}, "
                             f"draft cost {self.draft_cost})")
        if self.mode not in ("fixed", "auto"):
            raise ValueError(f"spec mode: fixed or auto (got {self.mode!r})")


@dataclass
class SimConfig:
    """Engine settings being simulated (the EngineArgs of the same names).

    num_blocks: KV blocks of `block_size` tokens. allocator: "paged" (the engine's) or
    "contiguous" (a region of `reserve` tokens taken at admission: "max-model-len" or
    "max-tokens" = prompt + max_tokens; no external fragmentation, a best case for it).
    prefix_caching: the engine's automatic prefix caching (paged only). replicas: that many
    engines, each with these settings (its own num_blocks), behind serve --replicas' router with
    `routing`, `route_margin` and `route_blocks` (replicas/routing.py).
    """

    num_blocks: int
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    allocator: str = "paged"
    prefix_caching: bool = False  # the paged allocator's automatic prefix caching
    reserve: str = "max-model-len"
    spec: SpecSettings | None = None
    seed: int = 0
    replicas: int = 1  # engines behind the router, each with all of the settings above
    routing: str = "prefix"  # replicas/routing.POLICIES
    route_margin: int = 4  # serve's --route-margin
    route_blocks: int = 4  # serve's --route-blocks

    def __post_init__(self):
        from mixserve.replicas.routing import POLICIES

        if self.routing not in POLICIES:
            raise ValueError(f"routing: one of {', '.join(POLICIES)} (got {self.routing!r})")
        for name in ("replicas", "route_blocks", "route_margin"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise ValueError(f"{name}: must be an integer (got {v!r})")
        if self.route_margin < 0:
            raise ValueError(f"route_margin: must be >= 0 (got {self.route_margin})")
        for name in ("replicas", "route_blocks", "num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1 (got {getattr(self, name)})")
        if self.allocator not in ("paged", "contiguous"):
            raise ValueError(f"allocator: paged or contiguous (got {self.allocator!r})")
        if self.reserve not in ("max-model-len", "max-tokens"):
            raise ValueError(f"reserve: max-model-len or max-tokens (got {self.reserve!r})")


class ReservingAllocator(BlockManager):
    """Contiguous allocation as older engines do it: at admission a sequence takes a region of
    its whole reservation; it never grows, and is returned when the sequence finishes or is
    preempted. Counted in blocks of `block_size` like the paged cache; blocks are plain counters
    here (the simulation never reads K/V)."""

    def __init__(self, num_blocks: int, block_size: int, reserve_tokens: dict[int, int]):
        super().__init__(num_blocks, block_size)
        self.reserve_tokens = reserve_tokens

    def num_blocks_needed(self, seq_id: int, start: int, end: int) -> int:
        have = len(self.tables.get(seq_id, []))
        want = max(self.blocks_for(end), self.blocks_for(self.reserve_tokens[seq_id]))
        return max(0, want - have)

    def append_slots(self, seq_id: int, start: int, end: int) -> list:
        need = self.num_blocks_needed(seq_id, start, end)
        super().append_slots(seq_id, 0, 0)  # creates the table; checks nothing is shared
        table = self.tables[seq_id]
        if need > len(self.free_blocks):
            from mixserve.kv.block_manager import NoFreeBlocksError

            raise NoFreeBlocksError(f"need {need} blocks, {len(self.free_blocks)} free")
        for _ in range(need):
            table.append(self._take())
        self.peak_used = max(self.peak_used, self.num_used_blocks)
        return []

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """A reservation is kept whole until the sequence leaves (speculative rollback frees nothing)."""


@dataclass
class SimResult:
    """Per request: `token_steps[i]` lists the step index (0-based) in which each output token
    was produced; `metrics` the RequestMetrics (seconds of simulated time). `steps`:
    (start_s, end_s, tokens, seqs) per step. `report`: bench/metrics.build_report of the run,
    the same measures `mixserve bench` prints. rejected: indices of requests the engine's
    check_request would refuse (never fit). With replicas, peak_kv_blocks and peak_running_seqs
    are the largest of one replica (memory is per engine), preemptions and prefix counters sums."""

    metrics: list[RequestMetrics | None]
    token_steps: list[list[int]]
    preemptions: list[int]
    steps: list[tuple[float, float, int, int]]
    peak_kv_blocks: int
    peak_running_seqs: int
    num_preemptions: int
    duration_s: float
    rejected: list[int] = field(default_factory=list)
    report: dict = field(default_factory=dict)
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache (first admissions)
    prefix_hits: int = 0  # of them, tokens served from it
    recompute_hits: int = 0  # tokens preempted requests found again in the cache
    replica_of: list[int] = field(default_factory=list)  # the replica that served each request (-1: refused)
    step_replica: list[int] = field(default_factory=list)  # the replica of each step
    route_reasons: dict = field(default_factory=dict)  # routing.Choice reasons, counted (replicas > 1)
    replicas: list[dict] = field(default_factory=list)  # per replica: requests, peak_kv_blocks, hit rate, busy_s

    @property
    def prefix_hit_rate(self) -> float:
        """Prefix-cache hits / prompt tokens (0 with caching off)."""
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0


def stand_in_ids(index: int, r: SimRequest) -> list[int]:
    """Prompt + output stand-in ids of request `index`: its `token_ids`, completed with ids no
    other request has (request index + position, kept above every real vocabulary)."""
    total = r.prompt_tokens + r.output_tokens
    given = list(r.token_ids or [])[:total]
    if r.token_ids is not None and len(given) < r.prompt_tokens:
        raise ValueError(f"request {index}: token_ids has {len(given)} ids, the prompt {r.prompt_tokens} tokens")
    return given + unique_ids(index, len(given), total)


def _draw_accepted(rng: random.Random, alpha: float, k: int) -> int:
    j = 0
    while j < k and rng.random() < alpha:
        j += 1
    return j


class _Replica:
    """One simulated engine: its own Scheduler, BlockManager and clock (`now`, the end of its
    last step, or the time it was woken from idle)."""

    def __init__(self, index: int, cfg: SimConfig):
        self.index, self.cfg = index, cfg
        self.reserve: dict[int, int] = {}
        if cfg.allocator == "paged":
            self.bm = BlockManager(cfg.num_blocks, cfg.block_size, enable_caching=cfg.prefix_caching)
        else:
            self.bm = ReservingAllocator(cfg.num_blocks, cfg.block_size, self.reserve)
        self.sched = Scheduler(self.bm, cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.max_model_len)
        self.now = 0.0
        self.peak_running = 0
        self.requests = 0
        self.live = 0  # requests admitted here and not finished
        self.finishes: list[float] = []  # finish times not yet passed by the router's clock

    def queue_len(self, t: float) -> int:
        """Requests this replica holds at time t (running + waiting), as the router sees them:
        finishes already simulated but later than t still count."""
        self.finishes = [f for f in self.finishes if f > t]
        return self.live + len(self.finishes)


def simulate(requests: list[SimRequest], cfg: SimConfig, step_time: Callable[[StepBatch], float],
             max_steps: int = 10**7) -> SimResult:
    """Run `requests` through the engine's scheduler with simulated step times.

    step_time: seconds for a step of the given shape (e.g. StepModel.step_time with a format
    bound). Requests are admitted in arrival order (ties: trace order). With cfg.replicas > 1,
    each request is routed at its arrival to one of that many engines by replicas/routing.choose
    (the policy `serve --replicas` uses) from the replicas' queue lengths at that instant and the
    route key of its stand-in prompt ids; each engine steps on its own clock. Step indices in
    `token_steps` then index the one `steps` list, in order of step start.
    Raises RuntimeError when the waiting head can never be scheduled (cannot happen for requests
    that pass the engine's check_request, which the simulator applies first).
    """
    from mixserve.replicas.routing import PrefixTable, choose, route_keys

    reps = [_Replica(j, cfg) for j in range(cfg.replicas)]
    names = [f"r{j}" for j in range(cfg.replicas)]
    rng = random.Random(cfg.seed)
    table = PrefixTable()  # the router's memory of where each prefix went
    route_rng = random.Random(f"route-{cfg.seed}")  # apart from the acceptance draws: N = 1 stays as it was
    n = len(requests)
    metrics: list[RequestMetrics | None] = [None] * n
    token_steps: list[list[int]] = [[] for _ in range(n)]
    first: list[float | None] = [None] * n
    replica_of = [-1] * n
    reasons: dict[str, int] = {}
    rejected = []
    order = sorted(range(n), key=lambda i: requests[i].arrival_s)
    seqs: dict[int, tuple[int, Sequence, _Replica]] = {}
    outputs: dict[int, list[int]] = {}  # seq_id -> the stand-in ids of its output tokens
    pending = []
    followers: dict[int, list[int]] = {}
    for i in order:
        if requests[i].after is not None:
            if not 0 <= requests[i].after < n or requests[i].after == i:
                raise ValueError(f"request {i}: after must name another request (got {requests[i].after})")
            followers.setdefault(requests[i].after, []).append(i)
    arrive = [requests[i].arrival_s for i in range(n)]

    def release(i: int, t: float) -> None:
        """Request i is done (or refused) at t: the turns that follow it arrive now."""
        for j in followers.pop(i, ()):
            arrive[j] = t
            if j in refused:
                release(j, t)
            else:
                pending.append(j)
                pending.sort(key=lambda k: (-arrive[k], -k))

    refused = set()
    blocks_for = reps[0].bm.blocks_for
    for i in order:
        r = requests[i]
        total = r.prompt_tokens + r.output_tokens
        # a contiguous max-model-len region is taken whole: one larger than the cache never fits
        # (the engine refuses to start then; here every request is refused instead of a deadlock)
        region = cfg.max_model_len if cfg.allocator == "contiguous" and cfg.reserve == "max-model-len" else total
        if (r.prompt_tokens < 1 or r.output_tokens < 1 or total > cfg.max_model_len
                or blocks_for(max(total, region)) > cfg.num_blocks):
            rejected.append(i)
            refused.add(i)
            continue
        if r.after is None:
            pending.append(i)
    pending.reverse()  # pop() from the end = earliest arrival
    for i in sorted(refused):
        if requests[i].after is None:
            release(i, requests[i].arrival_s)

    def admit(i: int) -> None:
        r = requests[i]
        ids = stand_in_ids(i, r)
        t = arrive[i]
        rep = reps[0]
        if len(reps) > 1:
            keys = route_keys(ids[:r.prompt_tokens], cfg.block_size, cfg.route_blocks)
            q = {names[j]: reps[j].queue_len(t) for j in range(len(reps))}
            c = choose(cfg.routing, names, q, keys, cfg.route_margin, turn=sum(reasons.values()), rng=route_rng,
                       table=table)
            reasons[c.reason] = reasons.get(c.reason, 0) + 1
            rep = reps[names.index(c.ranked[0])]
        seq = Sequence(str(i), None, ids[:r.prompt_tokens], SamplingParams(max_tokens=r.output_tokens,
                                                                           ignore_eos=True))
        outputs[seq.seq_id] = ids[r.prompt_tokens:]
        seq.constrained = r.constrained  # read by _step_batch: its rows pay the grammar masks
        seq.arrival_time = t
        seqs[seq.seq_id] = (i, seq, rep)
        rep.reserve[seq.seq_id] = (cfg.max_model_len if cfg.reserve == "max-model-len"
                                   else r.prompt_tokens + r.output_tokens)
        if not rep.sched.has_unfinished:
            rep.now = max(rep.now, t)  # an idle engine wakes at the arrival
        rep.sched.add(seq)
        rep.requests += 1
        rep.live += 1
        replica_of[i] = rep.index

    steps = []
    step_replica = []
    inf = float("inf")
    for _ in range(max_steps):
        busy = [rep for rep in reps if rep.sched.has_unfinished]
        rep = min(busy, key=lambda x: (x.now, x.index)) if busy else None
        t_arrive = arrive[pending[-1]] if pending else inf
        if rep is None and t_arrive == inf:
            break
        if t_arrive <= (rep.now if rep else inf):
            # an arrival joins the waiting queue before a step that starts at or after it
            admit(pending.pop())
            continue
        sched, bm = rep.sched, rep.bm
        k = 0
        if cfg.spec is not None:
            k = _choose_k(cfg, sched, step_time)
        out = sched.schedule(lookahead=k)
        if not out.scheduled:
            if not sched.running and pending:
                rep.now = max(rep.now, t_arrive)
                continue
            raise RuntimeError("simulator: nothing can be scheduled (a request larger than the KV cache?)")
        batch = _step_batch(out.scheduled, with_lookahead=True)
        dt = step_time(batch)
        if k:
            # a verification step does all a plain step would and more: never cheaper than it, even
            # where a profile's span attention (prefill timings) undercuts its decode attention
            dt = max(dt, step_time(_step_batch(out.scheduled, with_lookahead=False)))
        if k and cfg.spec.draft_cost:
            dt += _draft_time(cfg.spec, out, step_time)
        t0 = rep.now
        rep.now = now = t0 + dt
        step = len(steps)
        steps.append((t0, now, batch.num_tokens, batch.num_seqs))
        step_replica.append(rep.index)
        # end and samples are read from num_computed_tokens: take them all before it moves
        done_now = [(s, s.end, s.samples) for s in out.scheduled]
        for s, end, _ in done_now:
            s.seq.num_computed_tokens = end
        sched.commit(s.seq for s in out.scheduled)  # before anyone finishes, as the engine does
        for s, end, samples in done_now:
            seq = s.seq
            i = seqs[seq.seq_id][0]
            if not samples:
                continue
            emit = 1 + (_draw_accepted(rng, cfg.spec.alpha, s.lookahead) if s.lookahead else 0)
            emit = min(emit, seq.params.max_tokens - seq.num_output_tokens)
            for _ in range(emit):
                seq.token_ids.append(outputs[seq.seq_id][seq.num_output_tokens])
                token_steps[i].append(step)
            if first[i] is None:
                first[i] = now
            if seq.num_output_tokens >= seq.params.max_tokens or seq.num_tokens >= cfg.max_model_len:
                sched.finish(seq)
                metrics[i] = RequestMetrics(seq.arrival_time, first[i], now, seq.num_prompt_tokens,
                                            seq.num_output_tokens)
                rep.live -= 1
                rep.finishes.append(now)
                release(i, now)
            elif s.lookahead:
                # as the engine's _spec_step: the last kept token is recomputed next step, and the
                # blocks past the kept tokens go back
                seq.num_computed_tokens = seq.num_tokens - 1
                bm.truncate(seq.seq_id, seq.num_tokens)
        if cfg.spec is not None:
            sched.commit(s.seq for s in out.scheduled)
        # after the step's finishes, as `mixserve bench` counts it
        rep.peak_running = max(rep.peak_running, len(sched.running))
    else:
        raise RuntimeError(f"simulator: still running after {max_steps} steps")
    done = [m for m in metrics if m is not None]
    start = min((m.arrival_s for m in done), default=0.0)
    duration = max((m.finish_s for m in done), default=0.0) - start
    preempted = [0] * n
    for i, seq, _ in seqs.values():
        preempted[i] = seq.num_preemptions
    peak_used = max(rep.bm.peak_used for rep in reps)
    peak_running = max(rep.peak_running for rep in reps)
    num_preemptions = sum(rep.sched.num_preemptions for rep in reps)
    res = SimResult(metrics, token_steps, preempted, steps, peak_used, peak_running, num_preemptions, duration,
                    sorted(rejected))
    res.prefix_queries = sum(rep.bm.prefix_queries for rep in reps)
    res.prefix_hits = sum(rep.bm.prefix_hits for rep in reps)
    res.recompute_hits = sum(rep.bm.recompute_hits for rep in reps)
    res.replica_of, res.step_replica, res.route_reasons = replica_of, step_replica, reasons
    res.replicas = [{"replica": names[rep.index], "requests": rep.requests, "peak_kv_blocks": rep.bm.peak_used,
                     "prefix_cache_hit_rate": rep.bm.prefix_hits / max(1, rep.bm.prefix_queries),
                     "busy_s": sum(b - a for (a, b, _, _), j in zip(steps, step_replica) if j == rep.index)}
                    for rep in reps]
    extra = {"peak_kv_blocks": peak_used, "kv_blocks_total": cfg.num_blocks,
             "prefix_cache_hit_rate": res.prefix_hit_rate, "peak_running_seqs": peak_running,
             "preemptions": num_preemptions, "engine_steps": len(steps), "rejected": len(rejected)}
    if cfg.replicas > 1:
        extra.update(replicas=cfg.replicas, routing=cfg.routing, route_reasons=dict(reasons))
    res.report = build_report(done, duration, extra)
    return res


def _step_batch(scheduled, with_lookahead: bool) -> StepBatch:
    """The StepBatch of a step's scheduled sequences, with their speculative rows or (False) as the
    plain step that would run without them. A constrained request's sequence is marked by its
    `constrained` attribute (simulate sets it)."""
    b = StepBatch()
    for s in scheduled:
        extra = s.lookahead if with_lookahead else 0
        q = s.num_new_tokens + extra
        if q == 1:
            b.decode_contexts.append(s.end)
        else:
            b.spans.append((q, s.end + extra))
        if s.samples:
            b.sampled_rows += 1 + extra
            if getattr(s.seq, "constrained", False):
                b.masked_rows += 1 + extra
    return b


def _choose_k(cfg: SimConfig, sched: Scheduler, step_time) -> int:
    """k for the coming step: k_max when fixed; when auto, the k maximizing expected emitted
    tokens per second over the running decode rows (spec_decode/controller.py's rule, with known costs)."""
    sp = cfg.spec
    decoding = [s for s in sched.running if s.num_uncomputed_tokens == 1]
    if not decoding or sp.k_max == 0:
        return 0
    if sp.mode == "fixed":
        return sp.k_max
    prefill = sum(s.num_uncomputed_tokens for s in sched.running) - len(decoding)
    spans = [(min(prefill, cfg.max_num_batched_tokens), min(prefill, cfg.max_num_batched_tokens))] if prefill else []
    best_k, best_rate = 0, -1.0
    for k in range(sp.k_max + 1):
        if k == 0:
            b = StepBatch([s.num_tokens for s in decoding], list(spans), len(decoding))
        else:
            b = StepBatch([], [(k + 1, s.num_tokens + k) for s in decoding] + spans, len(decoding) * (k + 1))
        plain = StepBatch([s.num_tokens for s in decoding], list(spans), len(decoding))
        cost = (max(step_time(b), step_time(plain))
                + k * sp.draft_cost * step_time(StepBatch([s.num_tokens for s in decoding], [], len(decoding))))
        rate = len(decoding) * expected_tokens(sp.alpha, k) / cost
        if rate > best_rate:
            best_k, best_rate = k, rate
    return best_k


def _draft_time(sp: SpecSettings, out, step_time) -> float:
    """k draft steps over the decode rows plus the draft's pass over this step's prefill chunks
    (the engine runs prefill through the draft in the same step), at draft_cost times the
    target's time for the same shapes."""
    decode = [s for s in out.scheduled if s.lookahead]
    prefill = [s for s in out.scheduled if not s.lookahead]
    k = max((s.lookahead for s in decode), default=0)
    t = k * step_time(StepBatch([s.end for s in decode], [], len(decode))) if decode else 0.0
    spans = [(s.num_new_tokens, s.end) for s in prefill if s.num_new_tokens > 1]
    if spans:
        t += step_time(StepBatch([], spans, 0))
    return sp.draft_cost * t
