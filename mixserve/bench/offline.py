"""In-process benchmark run: requests go into the engine as they arrive (all at t=0 for a throughput
run, or on a rate's or a trace's arrival times), the engine steps until all finish."""
from __future__ import annotations

import time

from tqdm import tqdm

from mixserve.data.datasets import BenchRequest
from mixserve.data.prefix import chat_ids, conversation_links, conversation_messages
from mixserve.bench.arrivals import MAX_SPAN_S
from mixserve.bench.metrics import RequestMetrics, build_report, goodput
from mixserve.engine.llm_engine import LLMEngine
from mixserve.kv.usage import kv_usage
from mixserve.sampling_params import SamplingParams
from mixserve.structured_output.spec import from_response_format


def tool_constraint(engine: LLMEngine, r: BenchRequest):
    """The constraint a trace line's tools and tool_choice put on its reply (the server's, as
    server/tool_calls.py builds it)."""
    from mixserve.structured_output.tools import call_constraint

    if engine.grammars is None:
        raise ValueError("trace: tools need the model's tokenizer and chat template")
    fns = {t["function"]["name"]: t["function"].get("parameters", {"type": "object", "properties": {}})
           for t in r.tools}
    choice, name = r.tool_choice or "auto", None
    if isinstance(choice, dict):
        choice, name = "named", choice["function"]["name"]
    return call_constraint(fns, choice, name, True, engine.grammars.lark_literal, engine.grammars.is_one_token)


def run_offline(engine: LLMEngine, requests: list[BenchRequest], temperature: float = 0.0,
                ignore_eos: bool = True, seed: int | None = None, progress: bool = True,
                conversations_at_once: int | None = None, arrivals: list[float] | None = None,
                slo: dict[str, float] | None = None) -> tuple[dict, list]:
    """Replay `requests` through the engine and measure.

    `arrivals`: each request's arrival in seconds from the run's start (request order; see
    bench/arrivals.schedule), or None for all at once (a throughput run). A request joins the
    engine between steps, once its time has come, with its arrival time set to that time, so its
    TTFT counts the wait for the step in flight, as a served request's does; an idle engine sleeps
    until the next arrival. This measures the engine as the planner simulates it, with no HTTP
    client or server on the same cores. A conversation's first turn arrives on its time; later
    turns follow their answers. `slo` ({"ttft" | "tpot" | "e2e": seconds}): the report adds
    goodput (bench/metrics.goodput).

    Output lengths follow each request's max_tokens (ignore_eos=True, as vLLM's throughput
    benchmark does), so runs compare the same work. Returns (report dict, RequestOutputs in
    request order). Report times are seconds; throughputs tokens/s.

    KV waste (see kv/usage.py) is sampled after every step: `kv_waste_pct_time_avg` is the share
    of reserved slot-seconds that held no K/V, sum(step s * (reserved - written)) /
    sum(step s * reserved) with each sample weighted by the wall time of the step before it;
    `kv_waste_pct_at_peak` is the waste after the first step that reached `peak_running_seqs`.
    Engine counters (preemptions, steps, peak blocks, prefix-cache queries and hits) count this run
    only. `requests`: per request (request order) its tag, token counts (cached_tokens: prompt
    tokens the prefix cache served), turn, TTFT, TPOT and end-to-end seconds.

    A multi-turn conversation (BenchRequest.conversation) runs closed-loop: its first turn at
    the start, each later turn when the one before has finished, its prompt the chat template
    over the conversation with the model's own replies (data/prefix.py); TTFT counts from then.
    `conversations_at_once` C: conversation k (in trace order) starts when conversation k - C has
    finished (data/prefix.conversation_links, the rule the planner simulates); None: all at once.
    """
    def params(i: int, r: BenchRequest) -> SamplingParams:
        # a trace line's response_format or tools: constrained (it ends where its grammar does,
        # ignore_eos or not)
        structured = from_response_format(r.response_format) if r.response_format is not None else None
        if r.tools is not None:
            structured = tool_constraint(engine, r)
        return SamplingParams(temperature=temperature, max_tokens=r.max_tokens, ignore_eos=ignore_eos,
                              seed=None if seed is None else seed + i, structured=structured)

    # a conversation's turns go in one at a time (closed loop): the next when the last has finished
    turns: dict[str, list[int]] = {}
    for i, r in enumerate(requests):
        if r.conversation is not None:
            turns.setdefault(r.conversation, []).append(i)
    if turns and engine.tokenizer is None:
        raise ValueError("trace: a multi-turn conversation needs the model's tokenizer and chat template")
    history: dict[str, list[tuple[str, str]]] = {c: [] for c in turns}
    starts_after = conversation_links(requests, conversations_at_once)  # first turn -> a last turn
    opens = {j: i for i, j in starts_after.items()}
    ids: list[str | None] = [None] * len(requests)
    index: dict[str, int] = {}

    def prompt_of(i: int):
        r = requests[i]
        return r.prompt if r.conversation is None and r.tools is None else chat_ids(
            engine.tokenizer, conversation_messages(r, history.get(r.conversation, [])), r.tools)

    def send(i: int) -> None:
        ids[i] = engine.add_request(prompt_of(i), params(i, requests[i]))
        index[ids[i]] = i

    if arrivals is not None:
        if len(arrivals) != len(requests):
            raise ValueError(f"arrivals: {len(arrivals)} times for {len(requests)} requests")
        if not all(0.0 <= a <= MAX_SPAN_S for a in arrivals):  # NaN fails too
            raise ValueError(f"arrivals: every time must be a number of seconds in [0, {MAX_SPAN_S:g}]")
    opening = [i for i, r in enumerate(requests)
               if r.conversation is None or (turns[r.conversation][0] == i and i not in starts_after)]
    if arrivals is not None:  # a request the engine refuses is refused now, before the clock, not at its time
        for i in opening:
            p = prompt_of(i)
            engine.check_request(engine.encode(p) if isinstance(p, str) else list(p), params(i, requests[i]))
    # (time, index), latest first: pop() takes the next arrival
    due = sorted(((arrivals[i] if arrivals is not None else 0.0, i) for i in opening), reverse=True)
    at_start = []
    while due and due[-1][0] <= 0.0:  # those at 0 go in before the clock starts, as in a throughput run
        at_start.append(due.pop()[1])
        send(at_start[-1])
    t0 = time.perf_counter()
    for i in at_start:
        engine.requests[ids[i]].arrival_time = t0

    def release(now: float) -> None:
        while due and t0 + due[-1][0] <= now:
            at, i = due.pop()
            send(i)
            engine.requests[ids[i]].arrival_time = t0 + at  # its time, not the step boundary's
    q0, h0 = engine.block_manager.prefix_queries, engine.block_manager.prefix_hits
    finals = {}
    bar = tqdm(total=len(ids), desc="bench", unit="req", disable=not progress)
    bm, sched = engine.block_manager, engine.scheduler
    bm.peak_used = bm.num_used_blocks
    preemptions0, steps0 = sched.num_preemptions, engine.num_steps
    peak_running, waste_at_peak = 0, 0.0
    wasted_s = reserved_s = 0.0  # slot-seconds
    t_prev = t0
    while engine.has_unfinished() or due:
        if not engine.has_unfinished():  # idle until the next arrival
            time.sleep(max(0.0, t0 + due[-1][0] - time.perf_counter()))
            release(time.perf_counter())
            t_prev = time.perf_counter()
            continue
        outs = engine.step()
        now = time.perf_counter()
        use = kv_usage(bm, sched.running)
        wasted_s += (now - t_prev) * (use.reserved_slots - use.written_slots)
        reserved_s += (now - t_prev) * use.reserved_slots
        t_prev = now
        if len(sched.running) > peak_running:
            peak_running, waste_at_peak = len(sched.running), use.waste
        for o in outs:
            if o.finished:
                finals[o.request_id] = o
                bar.update(1)
                r = requests[index[o.request_id]]
                if r.conversation is not None:
                    history[r.conversation].append((r.prompt, o.text))
                    left = turns[r.conversation]
                    left.pop(0)
                    if left:
                        send(left[0])
                    elif index[o.request_id] in opens:
                        send(opens[index[o.request_id]])
        release(now)
    duration = time.perf_counter() - t0
    bar.close()
    outs = [finals[r] for r in ids]
    metrics = [RequestMetrics(o.metrics["arrival"], o.metrics["first_token"], o.metrics["finish"],
                              len(o.prompt_token_ids), len(o.token_ids)) for o in outs]
    extra = {
        "peak_kv_blocks": engine.block_manager.peak_used,
        "kv_blocks_total": engine.num_blocks,
        "block_size": engine.args.block_size,
        "peak_running_seqs": peak_running,
        "kv_waste_pct_time_avg": 100 * wasted_s / reserved_s if reserved_s else 0.0,
        "kv_waste_pct_at_peak": 100 * waste_at_peak,
        "preemptions": sched.num_preemptions - preemptions0,
        "engine_steps": engine.num_steps - steps0,
        "prefix_caching": engine.args.prefix_caching,
        "prefix_cache_queries": bm.prefix_queries - q0,
        "prefix_cache_hits": bm.prefix_hits - h0,
        # hits / prompt tokens looked up, from the engine's counters
        "prefix_cache_hit_rate": (bm.prefix_hits - h0) / max(1, bm.prefix_queries - q0),
    }
    if engine.proposer is not None:
        m = [o.metrics for o in outs]
        acc, ev = sum(x["spec_accepted"] for x in m), sum(x["spec_evaluated"] for x in m)
        steps = sum(x["spec_steps"] for x in m)
        c = engine.controller.c(1)
        extra.update(spec_proposed=sum(x["spec_proposed"] for x in m), spec_accepted=acc,
                     spec_alpha=acc / ev if ev else float("nan"),
                     spec_mean_accepted_per_step=acc / steps if steps else float("nan"),
                     spec_c=None if c is None else round(c, 3),
                     spec_k_histogram={str(k): engine.controller.history[k]
                                       for k in sorted(engine.controller.history)})
    report = build_report(metrics, duration, extra)
    if slo:
        report.update(goodput(metrics, slo, duration))
    # per request, in request order: what the percentiles summarize (a planner's per-request
    # prediction is compared against these, and a median that falls between clusters shows here)
    report["requests"] = [{"tag": r.tag, "prompt_tokens": m.prompt_tokens, "output_tokens": m.output_tokens,
                           "cached_tokens": o.metrics.get("cached_tokens", 0), "turn": r.turn,
                           "ttft_s": m.ttft, "tpot_s": m.tpot, "e2e_s": m.e2e}
                          for m, r, o in zip(metrics, requests, outs)]
    tags = sorted({r.tag for r in requests})
    if len(tags) > 1:  # a user's own mix: the same measures per slice, over the same wall time
        report["per_tag"] = {t: build_report([m for m, r in zip(metrics, requests) if r.tag == t], duration)
                             for t in tags}
    return report, outs
