"""Prometheus metrics of a serving engine (prometheus_client, text format at GET /metrics).

Engine state (requests running / waiting, KV blocks, preemptions, token counts) is read from the
engine when scraped; latency histograms are observed on the event loop when a request finishes.
The one per-step cost on the engine thread is the step timer (`observe_step`: one histogram
observation and one counter increment, microseconds next to a step of milliseconds), which is
what shows the HTTP side's cost to the engine (benchmarks/serve_load.py). Names follow vLLM's
where one exists.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from mixserve.engine.llm_engine import LLMEngine, RequestOutput

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0,
                 2.5, 5.0)
_TPOT_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)


def decode_graph_pending(engine: LLMEngine) -> bool:
    """Whether a decode graph of the engine (the target's, or a draft model's) is still compiling or
    loading in the background (ModelRunner.graph_pending; False for an engine without runners)."""
    runners = getattr(engine, "runners", None)
    return bool(runners) and any(r.graph_pending for r in runners())


class _EngineCollector:
    """Reads engine counters at scrape time. The reads race with the engine thread, but each is
    one atomic int / len read, so a scrape sees values at most one step apart."""

    def __init__(self, engine: LLMEngine, waiting_fn):
        self.engine = engine
        self.waiting_fn = waiting_fn

    def collect(self):
        eng = self.engine
        bm = eng.block_manager
        yield GaugeMetricFamily("mixserve_num_requests_running", "Requests running in the engine.",
                                value=len(eng.scheduler.running))
        yield GaugeMetricFamily("mixserve_num_requests_waiting",
                                "Requests waiting for admission (server queue + scheduler queue + n > 1 "
                                "samples parked behind their leader's prefill).", value=self.waiting_fn())
        yield GaugeMetricFamily("mixserve_kv_cache_blocks_used", "KV cache blocks in use.",
                                value=bm.num_used_blocks)
        yield GaugeMetricFamily("mixserve_kv_cache_blocks_total", "KV cache blocks in all.", value=bm.num_blocks)
        # the vendor-neutral KVCacheUtilization gauge external routers read (vLLM's kv_cache_usage_perc)
        yield GaugeMetricFamily("mixserve_kv_cache_usage_perc", "KV cache blocks in use / in all (0 to 1).",
                                value=bm.num_used_blocks / max(1, bm.num_blocks))
        # a benchmark started before the graph is in measures eager steps beside a compile
        yield GaugeMetricFamily("mixserve_decode_graph_pending",
                                "1 while the decode graph compiles or loads in the background (steps run "
                                "eager until it is installed), else 0.", value=int(decode_graph_pending(eng)))
        yield CounterMetricFamily("mixserve_num_preemptions", "Sequences preempted (recomputed later).",
                                  value=eng.scheduler.num_preemptions)
        yield CounterMetricFamily("mixserve_prompt_tokens", "Prompt tokens of accepted requests (a prompt of n > 1 samples once, "
                                  "as usage counts it).",
                                  value=eng.num_prompt_tokens)
        yield CounterMetricFamily("mixserve_generation_tokens", "Generated tokens (aborted requests' included).",
                                  value=eng.num_generated_tokens)
        yield CounterMetricFamily("mixserve_engine_steps", "Engine steps run.", value=eng.num_steps)
        yield CounterMetricFamily("mixserve_prefix_cache_queries",
                                  "Prompt tokens looked up in the prefix cache (tokens, first admissions).",
                                  value=bm.prefix_queries)
        yield CounterMetricFamily("mixserve_prefix_cache_hits",
                                  "Of the prefix-cache queries, tokens served from the cache (tokens).",
                                  value=bm.prefix_hits)
        idle = len(bm.evictable)
        g = GaugeMetricFamily("mixserve_prefix_cache_blocks",
                              "KV blocks registered in the prefix cache: in_use (held by a request) or evictable "
                              "(held by none, reused until their memory is needed).", labels=["state"])
        g.add_metric(["in_use"], bm.num_cached_blocks - idle)
        g.add_metric(["evictable"], idle)
        yield g


class ServerMetrics:
    """All metrics of one server, in their own registry (several servers can share a process).

    `observe(out)` takes a final RequestOutput: times in its `metrics` are seconds, TTFT and
    E2E count from the request's arrival at the server.
    """

    def __init__(self, engine: LLMEngine, waiting_fn=None):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine, waiting_fn or (lambda: engine.num_waiting)))
        r = self.registry
        self.finished = Counter("mixserve_request_success", "Finished requests by finish reason.",
                                ["finished_reason"], registry=r)
        self.ttft = Histogram("mixserve_time_to_first_token_seconds", "Time to first token, seconds.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("mixserve_time_per_output_token_seconds",
                              "Time per output token after the first, seconds.", buckets=_TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("mixserve_e2e_request_latency_seconds", "End-to-end request latency, seconds.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.speculative = engine.proposer is not None
        if self.speculative:
            self.spec_draft = Counter("mixserve_spec_decode_num_draft_tokens", "Draft tokens proposed.", registry=r)
            self.spec_accepted = Counter("mixserve_spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                                         registry=r)
            self.spec_evaluated = Counter("mixserve_spec_decode_num_evaluated_tokens",
                                          "Draft positions the target judged (acceptance = accepted / evaluated).",
                                          registry=r)
        self.errored = Counter("mixserve_request_errored",
                               "Requests ended by an error: non-finite logits in their row, or a failing engine step.",
                               ["reason"], registry=r)
        self.aborted = Counter("mixserve_request_aborted", "Requests aborted (client gone, timeout, shutdown).",
                               ["reason"], registry=r)
        self.rejected = Counter("mixserve_request_rejected", "Requests refused before running, by HTTP status.",
                                ["status"], registry=r)
        self.step_seconds = Histogram("mixserve_engine_step_seconds",
                                      "Wall time of one engine step (schedule, forward, sampling, outputs), seconds.",
                                      buckets=_STEP_BUCKETS, registry=r)
        self.step_tokens = Counter("mixserve_engine_step_tokens",
                                   "Tokens the model ran in engine steps (prefill + decode + verified drafts).",
                                   registry=r)

    def observe_step(self, seconds: float, tokens: int) -> None:
        """Record one engine step: its wall time (seconds) and tokens run. Thread-safe
        (prometheus_client locks), called on the engine thread."""
        self.step_seconds.observe(seconds)
        self.step_tokens.inc(tokens)

    def observe(self, out: RequestOutput) -> None:
        m = out.metrics
        if out.finish_reason == "error":
            self.errored.labels("non_finite_logits").inc()
            return
        self.finished.labels(out.finish_reason).inc()
        if m.get("ttft") is not None:
            self.ttft.observe(m["ttft"])
        if m.get("e2e") is not None:
            self.e2e.observe(m["e2e"])
            if m.get("ttft") is not None and len(out.token_ids) > 1:
                self.tpot.observe((m["e2e"] - m["ttft"]) / (len(out.token_ids) - 1))
        if self.speculative:
            self.spec_draft.inc(m.get("spec_proposed", 0))
            self.spec_accepted.inc(m.get("spec_accepted", 0))
            self.spec_evaluated.inc(m.get("spec_evaluated", 0))
