"""Rendering a plan (planner.make_plan): a text table, a Markdown report and PNG plots."""
from __future__ import annotations

import json
import math
from pathlib import Path


def _ms(x) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x * 1e3:.1f}"


def _x(x) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return "inf" if math.isinf(x) else f"{x:.2f}x"


def _hits(row: dict) -> str:
    """The prefix-caching row's simulated hit rates: all queued at t = 0, and at the trace's own
    arrival times when it has them (requests that start together cannot reuse each other)."""
    if "prefix_hit_rate" not in row:
        return ""
    own = row.get("prefix_hit_rate_trace_arrivals")
    return (f" (hit rate {row['prefix_hit_rate']:.0%} all queued"
            + (f", {own:.0%} at the trace's arrivals" if own is not None else "") + ")")


def _replica_lines(plan: dict) -> list[str]:
    """The scale-out section (planner.plan_replicas), when planned."""
    rp = plan.get("replicas")
    if not rp:
        return []
    target = rp["target_rate_per_s"]
    lines = ["", f"scale-out: N replicas behind serve --replicas' router (routing {rp['routing']}, margin "
                 f"{rp['route_margin']}, {rp['route_blocks']} route blocks; each replica paged, prefix caching on, "
                 f"{rp['format']})"]
    head = ("replicas", "throughput tok/s", "capacity req/s", "max rate req/s", "hit rate")
    if target is not None:
        head += (f"at {target:g} req/s: TTFT p99 ms", "TPOT p99 ms", "SLO")
    rows = [head]
    for r in rp["rows"]:
        row = (str(r["replicas"]), f"{r['throughput_output_tokens_per_s']:.1f}", f"{r['capacity_requests_per_s']:.3f}",
               f"{r['max_rate_per_s']:.3f}" + (" (cap)" if r["max_rate_limit"] == "capacity" else ""),
               f"{r['prefix_hit_rate']:.0%}" + (f" ({r['prefix_hit_rate_trace_arrivals']:.0%} at trace arrivals)"
                                                 if r.get("prefix_hit_rate_trace_arrivals") is not None else ""))
        if target is not None:
            at = r["at_target"]
            row += (_ms(at["ttft_p99_s"]), _ms(at["tpot_p99_s"]), "met" if at["meets_slo"] else "missed")
        rows.append(row)
    w = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines += ["  " + "  ".join(c.rjust(wi) for c, wi in zip(r, w)) for r in rows]
    lines += [f"  warning ({r['replicas']} replica{'s' if r['replicas'] != 1 else ''}): {r['warning']}"
              for r in rp["rows"] if r.get("warning")]
    lines.append("  hit rate: all requests queued at t = 0 (they cannot reuse each other's new blocks); at the "
                 "trace's own arrival times where it has them")
    if target is None:
        lines.append("  replicas needed: give --target-rate REQ_PER_S to have the plan pick the count")
    elif rp["needed"] is None:
        lines.append(f"  replicas needed for {target:g} requests/s under the SLO: more than {rp['rows'][-1]['replicas']}")
    else:
        lines.append(f"  replicas needed for {target:g} requests/s under the SLO: {rp['needed']}")
    return lines


def format_table(plan: dict) -> str:
    """The plan's headline numbers and the ranking, as plain text (latencies in ms)."""
    hw, b, kv = plan["hardware"], plan["baseline"], plan["kv"]
    slo = ", ".join(f"{k}={v * 1e3:g}ms" for k, v in plan["settings"]["slo"].items())
    where = hw.get("name") or (f"{hw['machine'].get('cpu')}, {hw['machine'].get('torch_threads')} threads, "
                               f"probed {hw['machine'].get('date')} for {hw.get('model')}"
                               if isinstance(hw.get("machine"), dict) else hw.get("model"))
    lines = [f"hardware: {where} ({hw['label']})",
             *[f"warning (hw probe): {w}" for w in hw.get("warnings") or []],
             f"trace: {plan['trace']['num_requests']} requests, prompt p50 {plan['trace']['prompt_tokens_p50']:g} "
             f"tokens, output p50 {plan['trace']['output_tokens_p50']:g} tokens",
             f"KV cache: {kv['budget_bytes'] / 2**20:.0f} MiB budget, {kv['bytes_per_token']} bytes/token; peak "
             f"{kv['peak_bytes_offline'] / 2**20:.0f} MiB offline, {kv['peak_bytes_at_max_rate'] / 2**20:.0f} MiB "
             f"at the max rate; all requests at once would need {kv['all_requests_at_once_bytes'] / 2**20:.0f} MiB",
             f"throughput (all queued at t=0): {b['throughput_output_tokens_per_s']:.1f} output tokens/s",
             *([f"the trace's own arrival times replayed: {b['trace_arrivals']['output_tokens_per_s']:.1f} output "
                f"tokens/s, TTFT p50 {_ms(b['trace_arrivals']['ttft_s']['p50'])} ms, TPOT p50 "
                f"{_ms(b['trace_arrivals']['tpot_s']['p50'])} ms"] if b.get("trace_arrivals") else []),
             (f"max sustainable rate under {slo} (Poisson arrivals): {b['max_rate_per_s']:.3f} requests/s"
              + (" (the engine's capacity on this trace: the SLO holds up to it)"
                 if b.get("max_rate_limit") == "capacity" else "")) if slo
             else "max sustainable rate: not searched (no SLO given: --slo is empty)"]
    at = b["at_max_rate"]
    if not b["max_rate_per_s"]:
        lines.append("  the SLO is missed even by requests arriving one at a time (unloaded latency)")
    elif at.get("ttft_s"):
        lines.append("  at that rate: TTFT p50/p90/p99 " + "/".join(_ms(at["ttft_s"][p]) for p in ("p50", "p90", "p99"))
                     + " ms, TPOT p50/p90/p99 " + "/".join(_ms(at["tpot_s"][p]) for p in ("p50", "p90", "p99"))
                     + " ms")
    for phase, d in plan["binding"].items():
        bd = d["breakdown_s"]
        lines.append(f"{phase} ({d['tokens']} tokens, {d['seqs']} seqs): bound by {d['bound']}; compute "
                     f"{_ms(d['compute_s'])} ms vs memory {_ms(d['memory_s'])} ms at roofline; step "
                     f"{_ms(d['step_s'])} ms = linear {_ms(bd['linear'])} + lm_head {_ms(bd['lm_head'])} + attention "
                     f"{_ms(bd['attention'])} + overhead {_ms(bd['overhead'])}")
    lines.append("")
    head = ("optimization", "throughput", "max rate", "single-stream", "TTFT p50")
    rows = [head] + [(r["optimization"] + _hits(r),
                      _x(r["throughput_x"]), _x(r["max_rate_x"]), _x(r["single_stream_x"]),
                      _x(r["ttft_p50_x"]) if "ttft_p50_x" in r else "")
                     for r in plan["ranking"]]
    w = [max(len(r[i]) for r in rows) for i in range(5)]
    for r in rows:
        lines.append("  ".join([r[0].ljust(w[0])] + [c.rjust(wi) for c, wi in zip(r[1:], w[1:])]))
    lines += _replica_lines(plan)
    m = plan.get("spec_measured")
    lines.append("")
    if m:
        lines.append(f"speculation measured on {m['requests']} requests of this trace ({m['draft_model']}, k={m['k']}, "
                     f"temperature {m['temperature']:g}): alpha {m['alpha']:.3f} ({m['accepted']}/{m['evaluated']} "
                     f"draft positions), draft cost c {m['draft_cost']:.3f}")
        lines += [f"  warning: {w}" for w in m.get("warnings") or []]
    else:
        sp = plan["settings"]["spec"]
        how = "as given" if plan.get("spec_given", True) else "assumed (the defaults)"
        lines.append(f"speculation: alpha {sp['alpha']:g} and draft cost c {sp['draft_cost']:g} (0: prompt lookup, "
                     f"no draft model) {how}, not measured (--measure measures them on a sample of the trace)")
    q = plan.get("awq_quality")
    if q:
        lines.append(f"AWQ quality from {plan.get('awq_quality_file') or 'an eval-ppl report'} (perplexity increase "
                     "over its baseline, 95% CI; * significant):")
        w = max(len(n) for n in q)
        for name, d in q.items():
            lines.append(f"  {name:<{w}}  ppl {d['ppl']:8.3f}  {d['delta']:+8.3f} [{d['ci95'][0]:+.3f}, "
                         f"{d['ci95'][1]:+.3f}]{' *' if d['significant'] else ''}")
    else:
        lines.append("AWQ quality: not given (--awq-quality REPORT from `mixserve eval-ppl --baseline ...`)")
    return "\n".join(lines)


def write_report(plan: dict, evals: dict, out_dir: str | Path) -> list[Path]:
    """Write plan.json, report.md and PNG plots into out_dir. Returns the written paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "plan.json"]
    paths[0].write_text(json.dumps(plan, indent=1, default=str))
    reps = evals.get("_replicas")
    evals = {k: v for k, v in evals.items() if not k.startswith("_")}
    base_name = next(iter(evals))
    base = evals[base_name]

    # latency distributions at the baseline's max sustainable rate
    res = base.get("_at_rate") or base["_offline"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    for ax, label, vals in ((axes[0], "TTFT (s)", [m.ttft for m in res.metrics if m and m.ttft is not None]),
                            (axes[1], "TPOT (s)", [m.tpot for m in res.metrics if m and m.tpot is not None])):
        if vals:
            v = np.sort(vals)
            ax.plot(v, np.arange(1, len(v) + 1) / len(v))
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
    fig.suptitle(f"{base_name}: latency at {plan['baseline']['max_rate_per_s']:.3g} req/s (simulated)")
    fig.tight_layout()
    paths.append(out / "latency_cdf.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    # p99 latencies against the offered rate, per variant
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    for name, e in evals.items():
        curve = e.get("max_rate", {}).get("curve") or []
        if curve:
            r = [c[0] for c in curve]
            axes[0].plot(r, [c[1] for c in curve], marker=".", label=name)
            axes[1].plot(r, [c[2] for c in curve], marker=".", label=name)
    for ax, label, key in ((axes[0], "TTFT p99 (s)", "ttft_p99"), (axes[1], "TPOT p99 (s)", "tpot_p99")):
        if key in plan["settings"]["slo"]:
            ax.axhline(plan["settings"]["slo"][key], color="k", ls="--", lw=1)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("Poisson arrival rate (requests/s)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    if any(ax.get_legend_handles_labels()[0] for ax in axes):
        axes[1].legend(fontsize=7)
    fig.tight_layout()
    paths.append(out / "rate_sweep.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    # what each optimization buys
    rows = plan["ranking"]
    fig, ax = plt.subplots(figsize=(8, 0.6 * len(rows) + 1.5))
    y = np.arange(len(rows))
    fin = lambda x: x if x == x and not math.isinf(x) else 0.0  # noqa: E731
    ax.barh(y - 0.2, [fin(r["max_rate_x"]) for r in rows], 0.4, label="max rate under SLO")
    ax.barh(y + 0.2, [fin(r["throughput_x"]) for r in rows], 0.4, label="throughput")
    ax.axvline(1.0, color="k", lw=1)
    ax.set_yticks(y, [r["optimization"] for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("speed-up (x)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out / "optimizations.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    if reps:
        rows = plan["replicas"]["rows"]
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ns = [r["replicas"] for r in rows]
        ax.plot(ns, [r["max_rate_per_s"] for r in rows], marker="o", label="max rate under SLO")
        ax.plot(ns, [r["capacity_requests_per_s"] for r in rows], marker=".", ls=":", label="capacity (all queued)")
        if plan["replicas"]["target_rate_per_s"]:
            ax.axhline(plan["replicas"]["target_rate_per_s"], color="k", ls="--", lw=1, label="target rate")
        ax.set_xscale("log", base=2)
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.set_xlabel("replicas")
        ax.set_ylabel("requests/s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        paths.append(out / "replicas.png")
        fig.savefig(paths[-1], dpi=100)
        plt.close(fig)

    hw = plan["hardware"]
    md = [f"# Capacity plan: {plan['settings'].get('model', '')}", "",
          f"Hardware: **{hw.get('name') or hw.get('model')}** ({hw['label']}). Simulated with the engine's own "
          "scheduler (mixserve/plan/simulator.py); step times from "
          + ("a datasheet roofline, not measured here." if hw["kind"] == "datasheet" else "a `hw probe` profile."),
          "", "```", format_table(plan), "```", "",
          "![latency](latency_cdf.png)", "", "![rate sweep](rate_sweep.png)", "",
          "![optimizations](optimizations.png)", "",
          *(["![replicas](replicas.png)", ""] if reps else []),
          "Speed-ups are over the baseline (paged KV, bf16, no speculation); for paging, the baseline over the "
          "contiguous allocator. Speculative decoding uses the acceptance α and draft cost c shown under the table "
          "(measured on a sample of this trace with --measure, else as given); AWQ w4 uses the profile's int4 "
          "matmul times, and its quality change is the eval-ppl report given with --awq-quality, not simulated.",
          ""]
    paths.append(out / "report.md")
    paths[-1].write_text("\n".join(md))
    return paths
