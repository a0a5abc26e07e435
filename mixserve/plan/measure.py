"""`mixserve plan --measure`: what the planner cannot know from a hardware profile, measured on
the real engine with a sample of the user's own trace.

- Speculative decoding's acceptance rate α (accepted / evaluated draft positions, Leviathan et
  al. 2023 §3.1) and the draft cost c (draft step time / target step time at one row, §3.4) depend
  on the traffic: code and summaries accept far more than open chat at temperature 1. A few of the
  trace's requests run through the engine with the draft (k fixed, so every decode step is
  measured) and the engine's own counters give α and c.
- AWQ's quality change per slice comes from a `mixserve eval-ppl --baseline ...` report: quality
  is not simulated, only carried into the plan beside the speed.
"""
from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path


def sample_trace(requests: list, n: int, seed: int = 0) -> list:
    """n requests of the trace (all when it has fewer), drawn without replacement with `seed`,
    in trace order. Raises ValueError for n < 1."""
    if n < 1:
        raise ValueError(f"measure_requests: must be >= 1 (got {n})")
    if n >= len(requests):
        return list(requests)
    idx = sorted(random.Random(seed).sample(range(len(requests)), n))
    return [requests[i] for i in idx]


def measure_speculation(model: str, requests: list, draft_model: str = "ngram", k: int = 4,
                        max_tokens: int = 128, temperature: float = 0.0, dtype: str | None = None,
                        max_model_len: int | None = None, kv_cache_memory: str | int | None = None,
                        seed: int = 0, progress: bool = False) -> dict:
    """α and c of `draft_model` proposing for `model`, measured by running `requests`
    (data.datasets.BenchRequest, each cut to `max_tokens` output tokens) through the engine with
    k fixed at `k`, every request queued at once.

    Returns {"alpha", "draft_cost", "requests", "output_tokens", "proposed", "accepted",
    "evaluated", "seconds", "draft_model", "k", "temperature"}. alpha: accepted / evaluated draft
    positions (a verification stops at its first rejection). draft_cost: the engine's measured draft
    step time over its target step time at one row (0 for prompt lookup, whose proposals cost no
    forward pass). Raises ValueError when nothing was proposed (prompts too short, or k = 0).
    """
    from mixserve.data.datasets import BenchRequest
    from mixserve.bench.offline import run_offline
    from mixserve.engine.args import EngineArgs
    from mixserve.engine.llm_engine import LLMEngine

    if k < 1:
        raise ValueError(f"spec_k: measuring acceptance needs k >= 1 (got {k})")
    if max_tokens < 2:
        raise ValueError(f"measure_max_tokens: must be >= 2 (got {max_tokens})")
    kw = {"model": model, "dtype": dtype, "draft_model": draft_model, "num_speculative_tokens": k,
          "speculation": "fixed", "max_model_len": max_model_len, "progress": progress}
    if kv_cache_memory is not None:
        kw["kv_cache_memory"] = kv_cache_memory
    eng = LLMEngine(EngineArgs(**kw))
    reqs = [BenchRequest(r.prompt, min(r.max_tokens, max_tokens), r.prompt_len, r.tag) for r in requests]
    t0 = time.perf_counter()
    report, outs = run_offline(eng, reqs, temperature=temperature, seed=seed if temperature > 0 else None,
                               progress=progress)
    seconds = time.perf_counter() - t0
    m = [o.metrics for o in outs]
    acc, ev = sum(x["spec_accepted"] for x in m), sum(x["spec_evaluated"] for x in m)
    if ev == 0:
        raise ValueError(f"measure: the draft ({draft_model}) proposed nothing on {len(reqs)} sampled requests; "
                         "give --spec-alpha instead")
    c = 0.0 if draft_model == "ngram" else eng.controller.c(1)
    return {"alpha": acc / ev, "draft_cost": float("nan") if c is None else c, "requests": len(reqs),
            "output_tokens": sum(len(o.token_ids) for o in outs), "proposed": sum(x["spec_proposed"] for x in m),
            "accepted": acc, "evaluated": ev, "seconds": seconds, "draft_model": draft_model, "k": k,
            "temperature": temperature, "tags": sorted({r.tag for r in reqs}),
            "engine_tokens_per_s": report["output_tokens_per_s"]}


def load_quality(path: str | Path, flag: str = "awq_quality") -> dict:
    """Per-slice quality change from a `mixserve eval-ppl --baseline B` report:
    {slice: {"ppl", "delta", "ci95", "significant"}} (perplexity, increase over the baseline with
    its paired-bootstrap 95% interval). Raises ValueError when the file is missing, not JSON, or
    has no comparison with a baseline; its message names `flag` (the option that gave the path)."""
    p = Path(path)
    try:
        rep = json.loads(p.read_text())
    except OSError as e:
        raise ValueError(f"{flag}: cannot read {p} ({e.strerror or e})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag}: {p} is not JSON ({e.msg})") from None
    cmp = rep.get("vs_baseline") if isinstance(rep, dict) else None
    if not isinstance(cmp, dict) or not cmp or not isinstance(rep.get("slices"), dict):
        raise ValueError(f"{flag}: {p} has no comparison with a baseline; make it with "
                         "`mixserve eval-ppl --quantization awq --baseline BASELINE.json --output FILE`")
    num = lambda x: isinstance(x, (int, float)) and not isinstance(x, bool)  # noqa: E731
    out = {}
    for name, c in cmp.items():
        sl = rep["slices"].get(name)
        ok = (isinstance(c, dict) and num(c.get("delta")) and isinstance(c.get("ci95"), list)
              and len(c["ci95"]) == 2 and all(num(x) for x in c["ci95"]) and isinstance(c.get("significant"), bool)
              and (sl is None or isinstance(sl, dict)))
        if not ok:
            raise ValueError(f"{flag}: {p}: slice {name!r} is not an eval-ppl comparison (needs delta, ci95 "
                             "[lo, hi] and significant under vs_baseline, and a dict under slices)")
        ppl = sl.get("ppl", math.nan) if sl else math.nan
        out[name] = {"ppl": ppl if num(ppl) else math.nan, "delta": c["delta"], "ci95": c["ci95"],
                     "significant": c["significant"]}
    return out
