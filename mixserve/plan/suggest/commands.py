"""What `plan --suggest` prints: ready `mixserve serve` / `bench` command lines for a configuration,
and the answer as text."""
from __future__ import annotations

import math
import re
import shlex
from dataclasses import dataclass, field

import numpy as np

from mixserve.plan.suggest.search import Suggestion
from mixserve.plan.suggest.space import Config, Drafter

@dataclass
class CommandContext:
    """What the command lines need besides the configuration: the model, trace and its reading
    (bench's --dataset, --num-prompts, --seed, --output-len-cap, --max-prompt-len,
    --conversations-at-once), the dtype, the KV budget, the quantization group size, an explicit
    --max-model-len, the SLO and the rate to bench at, and the server's address."""

    model: str
    trace: str
    num_prompts: int | None = None
    seed: int = 0
    output_len_cap: int = 256
    max_prompt_len: int = 1024
    conversations_at_once: int | None = None
    dtype: str | None = None
    kv_cache_memory: str | None = None
    group_size: int = 128
    max_model_len: int | None = None
    slo: dict = field(default_factory=dict)
    url: str = "http://127.0.0.1:8000"
    model_kind: str = "hf"


def _dur(seconds: float) -> str:
    """A duration as bench's --slo reads it: no exponent (it read 1e+06s as nothing), ms below 1 s."""
    v, unit = (seconds * 1e3, "ms") if seconds < 1 else (seconds, "s")
    return np.format_float_positional(v, trim="-") + unit


def commands(c: Config, ctx: CommandContext, drafter: Drafter | None, goodput_rate: float | None = None) -> dict:
    """Ready command lines for configuration `c`: {"prepare": [steps first], "serve": str,
    "bench": str} and, with an SLO, "bench_served": str. The weight format and dtype are pinned (a
    GGUF's --gguf-weights, int4's --quantization or the AWQ checkpoint `mixserve quantize` writes).
    `bench` runs the same engine flags in its own process: all requests at once without an SLO;
    with one, arriving at the predicted goodput rate, judged by bench's per-request SLO.
    "bench_served" replays the same against the `serve` line's endpoint. With replicas, `bench`
    is the endpoint's line (replicas are served)."""
    model = ctx.model
    prepare = []
    eng: list[str] = []
    if c.weights == "int4-awq" and ctx.model_kind != "awq":
        out = "awq-" + re.sub(r"[^A-Za-z0-9._-]+", "_", model).strip("_")
        prepare.append(shlex.join(["mixserve", "quantize", "--model", model, "--method", "awq", "--group-size",
                                   str(ctx.group_size), "--out", out]))
        model = out
    eng += ["--model", model]
    if ctx.dtype:
        eng += ["--dtype", ctx.dtype]
    if ctx.model_kind == "gguf":
        eng += ["--gguf-weights", "native" if c.weights == "gguf" else "dequantize"]
    if c.weights == "int4-rtn":
        eng += ["--quantization", "rtn", "--quant-group-size", str(ctx.group_size)]
    if c.weights.startswith("int4"):
        eng += ["--quant-lm-head"]  # as planned (the engine's default for int4, pinned)
    if ctx.kv_cache_memory:
        eng += ["--kv-cache-memory", ctx.kv_cache_memory]
    if ctx.max_model_len:
        eng += ["--max-model-len", str(ctx.max_model_len)]
    eng += ["--max-num-seqs", str(c.max_num_seqs), "--max-num-batched-tokens", str(c.max_num_batched_tokens)]
    if c.allocator == "contiguous":
        eng += ["--kv-allocator", "contiguous", "--reserve", "max-tokens"]
    eng += ["--enable-prefix-caching" if c.prefix_caching else "--no-enable-prefix-caching"]
    if c.speculation[0] != "off" and drafter is not None:
        eng += ["--draft-model", drafter.name, "--num-speculative-tokens", str(c.speculation[1]),
                "--speculation", c.speculation[0]]
    serve = ["mixserve", "serve"] + eng + (["--replicas", str(c.replicas)] if c.replicas > 1 else [])
    data = ["--dataset", ctx.trace, "--seed", str(ctx.seed), "--output-len-cap", str(ctx.output_len_cap),
            "--max-prompt-len", str(ctx.max_prompt_len)]
    if ctx.num_prompts is not None:
        data += ["--num-prompts", str(ctx.num_prompts)]
    if ctx.conversations_at_once:
        data += ["--conversations-at-once", str(ctx.conversations_at_once)]
    rate = []
    limits = []
    if ctx.slo:
        per = {}
        for key, v in ctx.slo.items():  # bench's SLO is per request: each measure's tightest limit
            m = key.split("_")[0]
            per[m] = min(v, per.get(m, math.inf))
        limits = ["--slo", ",".join(f"{m}={_dur(v)}" for m, v in sorted(per.items()))]
        if goodput_rate and goodput_rate > 0:
            rate = ["--request-rate", f"{goodput_rate:.4g}"]
    served = ["mixserve", "bench", "--url", ctx.url, "--model", model] + data + limits + rate
    if c.replicas > 1:
        bench = served  # replicas are a served thing: bench the endpoint
    else:
        # in this process, the engine as the planner simulates it: no HTTP client or server on the
        # same cores (on 2 cores those ran served steps 1.2-1.7x the in-process ones, BENCHMARKS
        # "Served against in-process steps")
        bench = ["mixserve", "bench"] + eng + data + limits + rate
    out = {"prepare": prepare, "serve": shlex.join(serve), "bench": shlex.join(bench)}
    if ctx.slo and c.replicas == 1 and not ctx.conversations_at_once:  # the online client replays no conversation
        out["bench_served"] = shlex.join(served)
    return out


def format_suggestion(s: Suggestion) -> str:
    """The human-readable answer: the verdict, the commands, the predictions, the runners-up."""
    def pred_line(p):
        t = (f"{p['throughput_output_tokens_per_s']:.1f} output tok/s offline, TTFT p50/p90 "
             f"{p['ttft_s']['p50'] * 1e3:.0f}/{p['ttft_s']['p90'] * 1e3:.0f} ms, TPOT p50/p90 "
             f"{p['tpot_s']['p50'] * 1e3:.1f}/{p['tpot_s']['p90'] * 1e3:.1f} ms, KV peak "
             f"{p['kv_peak_bytes'] / 2**20:.0f} of {p['kv_cache_bytes'] / 2**20:.0f} MiB")
        if "at_goodput_rate" in p:
            a = p["at_goodput_rate"]
            t += (f"; goodput {p['goodput_requests_per_s']:.3g} req/s ({p['goodput_output_tokens_per_s']:.1f} tok/s), "
                  f"there TTFT p90 {a['ttft_s']['p90'] * 1e3:.0f} ms, TPOT p90 {a['tpot_s']['p90'] * 1e3:.1f} ms")
        return t

    lines = [f"verdict: {s.verdict}", ""]
    b = s.best
    same = b["config"] == s.default["config"]
    lines.append(f"suggested: {'the default, ' if same else ''}{b['config']['summary']}")
    for step in b.get("commands", {}).get("prepare", []):
        lines.append(f"  first:  {step}")
    if b.get("commands"):
        lines.append(f"  serve:  {b['commands']['serve']}")
        lines.append(f"  bench:  {b['commands']['bench']}")
        if b["commands"].get("bench_served"):
            lines.append(f"  served: {b['commands']['bench_served']}  (against the serve line; on a machine that "
                         "also runs the client, served steps run slower than the prediction)")
    lines.append(f"  predicted: {pred_line(b['predicted'])}")
    if not same:
        lines.append(f"default: {s.default['config']['summary']}")
        lines.append(f"  predicted: {pred_line(s.default['predicted'])}")
    if s.runners_up:
        lines.append("runners-up (each with the reason it lost):")
        for r in s.runners_up:
            lines.append(f"  - {', '.join(r['differs_by'])}: {r['reason']}")
    for x in s.excluded:
        lines.append(f"not searched: {x['weights']}: {x['reason']}")
    for n in s.notes:
        lines.append(f"note: {n}")
    lines.append(f"searched {s.configurations_simulated} configurations ({s.settings.get('simulations')} simulations) "
                 f"in {s.search_seconds:.1f} s; objective: {s.settings.get('objective')}")
    return "\n".join(lines)
