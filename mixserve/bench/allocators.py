"""`bench --compare-allocators`: the PagedAttention comparison (Kwon et al., SOSP 2023, §6.1) on
this engine: the same requests under the same KV byte budget, with paged allocation and with
contiguous reservation of max-model-len and of prompt + max_tokens, one run after another in one
process (the model is loaded once)."""
from __future__ import annotations

import gc
from dataclasses import replace

from mixserve.data.datasets import BenchRequest
from mixserve.bench.offline import run_offline
from mixserve.engine.args import EngineArgs, parse_dtype
from mixserve.engine.llm_engine import LLMEngine
from mixserve.models.loader import load_model
from mixserve.kv.contiguous import ContiguousBlockManager

# (kv_allocator, reserve) in run order
VARIANTS = (("paged", None), ("contiguous", "max-model-len"), ("contiguous", "max-tokens"))


def compare_allocators(args: EngineArgs, requests: list[BenchRequest], temperature: float = 0.0,
                       ignore_eos: bool = True, loaded=None, progress: bool = True) -> dict:
    """Run `requests` offline (all at t=0) under each of VARIANTS with `args`' KV budget.

    Each engine first runs one 2-token request (not measured) so no variant pays for first-call
    set-up. Returns {"runs": [one dict per variant: kv_allocator, reserve, peak_running_seqs,
    requests_per_s, output_tokens_per_s, kv_waste_pct_time_avg, kv_waste_pct_at_peak,
    preemptions, duration_s, same_outputs_as_paged (requests whose token ids equal the paged
    run's), report (the full run_offline report)]}. Throughputs per wall second.

    Raises ValueError (before any run) when a variant cannot run: a max-model-len region larger
    than the KV budget, or a request that can never be served (prompt + max_tokens over
    max_model_len or the whole cache; the same check for every variant).
    """
    if not requests:
        raise ValueError("requests: nothing to run")
    loaded = loaded or load_model(args.model, parse_dtype(args.dtype), args.max_model_len, args.progress,
                                  args.quantization, args.quant_group_size, args.int4_lm_head, args.gguf_weights)
    # prefix caching off in every run: the comparison measures paging alone
    variants = [replace(args, kv_allocator=a, reserve=r or args.reserve, enable_prefix_caching=False)
                for a, r in VARIANTS]
    runs, paged_ids = [], None
    for i, va in enumerate(variants):
        eng = LLMEngine(va, loaded)
        eng.wait_for_graph()  # each variant timed as it serves, not while its graph compiles
        if i == 0:  # fail before the first run, not after it: same geometry for every variant
            for other in variants:
                if other.kv_allocator == "contiguous":
                    ContiguousBlockManager(eng.num_blocks, other.block_size, other.reserve, eng.max_model_len)
        warm = replace(requests[0], max_tokens=2)
        run_offline(eng, [warm], temperature=temperature, ignore_eos=True, progress=False)
        report, outs = run_offline(eng, requests, temperature=temperature, ignore_eos=ignore_eos,
                                   progress=progress)
        ids = [o.token_ids for o in outs]
        paged_ids = paged_ids or ids
        ex = report["extra"]
        runs.append({
            "kv_allocator": va.kv_allocator,
            "reserve": va.reserve if va.kv_allocator == "contiguous" else None,
            "peak_running_seqs": ex["peak_running_seqs"],
            "requests_per_s": report["requests_per_s"],
            "output_tokens_per_s": report["output_tokens_per_s"],
            "kv_waste_pct_time_avg": ex["kv_waste_pct_time_avg"],
            "kv_waste_pct_at_peak": ex["kv_waste_pct_at_peak"],
            "preemptions": ex["preemptions"],
            "duration_s": report["duration_s"],
            "same_outputs_as_paged": sum(a == b for a, b in zip(ids, paged_ids)),
            "report": report,
        })
        del eng  # its KV cache goes before the next one is allocated
        gc.collect()
    return {"runs": runs, "num_blocks": runs[0]["report"]["extra"]["kv_blocks_total"]}


def format_comparison(result: dict) -> str:
    """The comparison as an aligned text table (throughputs per second, waste in percent)."""
    head = ["allocator", "reserve", "peak seqs", "req/s", "out tok/s", "waste avg %", "waste @peak %",
            "preempt", "same out", "time s"]
    rows = [head]
    for r in result["runs"]:
        rows.append([r["kv_allocator"], r["reserve"] or "-", str(r["peak_running_seqs"]),
                     f"{r['requests_per_s']:.3f}", f"{r['output_tokens_per_s']:.1f}",
                     f"{r['kv_waste_pct_time_avg']:.1f}", f"{r['kv_waste_pct_at_peak']:.1f}", str(r["preemptions"]),
                     f"{r['same_outputs_as_paged']}/{r['report']['num_requests']}", f"{r['duration_s']:.1f}"])
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
                     for row in rows)
