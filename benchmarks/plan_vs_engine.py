"""Does the planner predict the engine? Predictions first, written to a file, then the runs.

For each configuration (three mixes, and one held back while the cost model was built: a KV
budget small enough to force preemption) the planner simulates `mixserve bench` (every request
queued at t = 0, outputs generated to max_tokens) with step times taken only from a saved
`mixserve hw probe` profile. The predictions are written to `<out>.predictions.json` before any
engine runs; then each configuration runs through the real `mixserve bench` CLI in a subprocess,
and predicted output-token throughput and median TPOT are compared (target: within 15%).

    python benchmarks/plan_vs_engine.py --model qwen2.5-coder-0.5b-instruct \
        --profile results/hw-qwen05.json --out results/plan_vs_engine.json

Without an existing --profile, `mixserve hw probe` runs first and saves it there.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

# name, dataset, requests, KV budget; the last one was not used while building the model
CONFIGS = [
    ("sharegpt", "sharegpt", 64, "512MiB"),
    ("humaneval", "humaneval", 64, "512MiB"),
    ("synthetic long prompt / short output", "SYNTH", 16, "512MiB"),
    ("sharegpt, 24 MiB KV (preemption; unseen)", "sharegpt", 64, "24MiB"),
    # added after the first round, with the grouped decode attention in the step model
    ("humaneval, 24 MiB KV (preemption; unseen in round 2)", "humaneval", 64, "24MiB"),
    # added after round 5 (the decode attention grid), run with round 5's profile
    ("synthetic long prompt, 48 MiB KV (preemption; unseen until round 5)", "SYNTH", 16, "48MiB"),
    ("sharegpt, 128 requests, 64 MiB KV (preemption; unseen until round 5)", "sharegpt", 128, "64MiB"),
    # added with the decode graph (issue 14): code, chat and long documents in one trace
    ("mixed code + chat + long documents, 48 MiB KV (preemption; new in issue 14)", "MIXED", 48, "48MiB"),
]


def mixed_trace(parts: dict[str, Path], out: Path, seed: int = 0) -> None:
    """One JSONL trace from several (their records shuffled together, deterministically)."""
    import random

    lines = [ln for p in parts.values() for ln in p.read_text().splitlines() if ln.strip()]
    random.Random(seed).shuffle(lines)
    out.write_text("\n".join(lines) + "\n")


def run(cmd: list[str]) -> None:
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--profile", required=True, help="hw probe profile (made here when missing)")
    ap.add_argument("--out", default="results/plan_vs_engine.json")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--output-len-cap", type=int, default=256)
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every request count (smoke runs)")
    ap.add_argument("--configs", default=None, help="comma-separated indices into CONFIGS (default: all)")
    ap.add_argument("--repredict", default=None,
                    help="a *.predictions.json: predict its configurations again with this code and the same "
                         "profile, print old -> new, run nothing")
    a = ap.parse_args()

    from mixserve.env import machine_info
    from mixserve.engine.args import parse_bytes
    from mixserve.models.config import ModelConfig
    from mixserve.models.weights import convert_gguf
    from mixserve.models.registry import resolve_model
    from mixserve.plan.cost_model import default_format
    from mixserve.plan.hardware import load_step_model
    from mixserve.plan.planner import PlanSettings, Planner, Variant, trace_requests

    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    exe = [sys.executable, "-m", "mixserve.cli"]
    if not Path(a.profile).is_file():
        run(exe + ["hw", "probe", "--model", a.model, "--out", a.profile])
    synth = out.with_suffix(".synthetic.jsonl")
    if not synth.is_file():
        run(exe + ["mix", "sample", "--source", "synthetic-long-prompt", "--num", "64", "--seed", "0",
                   "--out", str(synth)])

    mixed = out.with_suffix(".mixed.jsonl")
    if not mixed.is_file():
        parts = {}
        for source, num in (("sharegpt", 20), ("humaneval", 20), ("synthetic-long-prompt", 8)):
            parts[source] = out.with_suffix(f".mixed-{source}.jsonl")
            run(exe + ["mix", "sample", "--source", source, "--num", str(num), "--seed", "1", "--model", a.model,
                       "--out", str(parts[source])])
        mixed_trace(parts, mixed)

    r = resolve_model(a.model)
    cfg = ModelConfig.from_folder(convert_gguf(r.path, progress=False) if r.kind == "gguf" else r.path)
    sm, hw = load_step_model(a.profile, cfg)
    traces = {"SYNTH": str(synth), "MIXED": str(mixed)}
    configs = [(n, traces.get(d, d), max(2, round(k * a.scale)), kv) for n, d, k, kv in CONFIGS]
    if a.configs:
        configs = [configs[int(i)] for i in a.configs.split(",")]

    old = None
    if a.repredict:
        old = json.loads(Path(a.repredict).read_text())
        configs = [(n, p["dataset"], p["num_prompts"], p["kv_cache_memory"]) for n, p in old["configs"].items()]
    preds = {"made_at": time.strftime("%Y-%m-%d %H:%M:%S"), "profile": a.profile, "machine": machine_info(),
             "configs": {}}
    for name, ds, num, kv in configs:
        reqs = trace_requests(ds, a.model, num, 0, a.output_len_cap, 1024)
        ps = PlanSettings(kv_bytes=parse_bytes(kv), max_model_len=a.max_model_len, slo={})
        res = Planner(cfg, sm, hw, reqs, ps).run(Variant("baseline", fmt=default_format(r)))  # the engine's default
        rep = res.report
        tpots = {}
        for q, m in zip(reqs, res.metrics):
            if m is not None and m.tpot is not None:
                tpots.setdefault(q.tag, []).append(m.tpot)
        preds["configs"][name] = {"dataset": ds, "num_prompts": num, "kv_cache_memory": kv,
                                  "output_tokens_per_s": rep["output_tokens_per_s"],
                                  "tpot_p50_s": rep["tpot_s"]["p50"], "ttft_p50_s": rep["ttft_s"]["p50"],
                                  "duration_s": rep["duration_s"], "preemptions": res.num_preemptions,
                                  "peak_kv_blocks": res.peak_kv_blocks,
                                  # the distribution behind the median, for the comparison below
                                  "tpot_sorted_s": sorted(t for v in tpots.values() for t in v),
                                  "per_tag_tpot_s": {t: {"p50": statistics.median(v), "mean": statistics.mean(v)}
                                                     for t, v in sorted(tpots.items())}}
        print(f"predicted {name}: {rep['output_tokens_per_s']:.1f} out tok/s, TPOT p50 "
              f"{rep['tpot_s']['p50'] * 1e3:.1f} ms, {res.num_preemptions} preemptions", flush=True)
    if old is not None:
        for name, p in preds["configs"].items():
            o = old["configs"][name]
            print(f"{name}: out tok/s {o['output_tokens_per_s']:.1f} -> {p['output_tokens_per_s']:.1f} "
                  f"({100 * (p['output_tokens_per_s'] / o['output_tokens_per_s'] - 1):+.1f}%), TPOT p50 "
                  f"{o['tpot_p50_s'] * 1e3:.1f} -> {p['tpot_p50_s'] * 1e3:.1f} ms "
                  f"({100 * (p['tpot_p50_s'] / o['tpot_p50_s'] - 1):+.1f}%)")
        return 0
    pred_path = out.with_suffix(".predictions.json")
    pred_path.write_text(json.dumps(preds, indent=1))
    print(f"wrote {pred_path} (before any measured run)", flush=True)

    rows = []
    for i, (name, ds, num, kv) in enumerate(configs):
        mpath = out.with_suffix(f".bench{i}.json")
        run(exe + ["bench", "--model", a.model, "--dataset", ds, "--num-prompts", str(num), "--kv-cache-memory", kv,
                   "--max-model-len", str(a.max_model_len), "--output-len-cap", str(a.output_len_cap),
                   "--output", str(mpath)])
        m = json.loads(mpath.read_text())
        p = preds["configs"][name]
        row = {"config": name, "pred_out_tok_s": p["output_tokens_per_s"], "meas_out_tok_s": m["output_tokens_per_s"],
               "pred_tpot_p50_ms": 1e3 * p["tpot_p50_s"], "meas_tpot_p50_ms": 1e3 * m["tpot_s"]["p50"],
               "pred_preemptions": p["preemptions"], "meas_preemptions": m["extra"]["preemptions"]}
        row["throughput_err_pct"] = 100 * (row["pred_out_tok_s"] / row["meas_out_tok_s"] - 1)
        row["tpot_err_pct"] = 100 * (row["pred_tpot_p50_ms"] / row["meas_tpot_p50_ms"] - 1)
        row["within_15pct"] = abs(row["throughput_err_pct"]) <= 15 and abs(row["tpot_err_pct"]) <= 15
        # the two middle ranks of TPOT (the median is their mean for an even count), and per tag
        meas = sorted(r["tpot_s"] for r in m.get("requests", []) if r["tpot_s"] is not None)
        pred = p.get("tpot_sorted_s", [])
        mid = lambda v: [round(1e3 * x, 1) for x in v[(len(v) - 1) // 2:len(v) // 2 + 1]]  # noqa: E731
        row["tpot_middle_ranks_ms"] = {"pred": mid(pred), "meas": mid(meas)}
        row["per_tag_tpot_ms"] = {
            t: {"pred_p50": 1e3 * v["p50"], "meas_p50": 1e3 * m["per_tag"][t]["tpot_s"]["p50"],
                "pred_mean": 1e3 * v["mean"], "meas_mean": 1e3 * m["per_tag"][t]["tpot_s"]["mean"]}
            for t, v in p.get("per_tag_tpot_s", {}).items() if t in m.get("per_tag", {})}
        rows.append(row)
        out.write_text(json.dumps({"predictions": preds, "rows": rows, "machine": machine_info()}, indent=1))

    print(f"\n{'config':44} {'out tok/s pred':>14} {'meas':>8} {'err':>7} {'TPOT p50 pred':>14} {'meas':>8} "
          f"{'err':>7} {'preempt p/m':>12}")
    for r in rows:
        print(f"{r['config']:44} {r['pred_out_tok_s']:14.1f} {r['meas_out_tok_s']:8.1f} {r['throughput_err_pct']:+6.1f}% "
              f"{r['pred_tpot_p50_ms']:12.1f}ms {r['meas_tpot_p50_ms']:6.1f}ms {r['tpot_err_pct']:+6.1f}% "
              f"{r['pred_preemptions']:>5}/{r['meas_preemptions']:<5}")
    for r in rows:
        if r["per_tag_tpot_ms"]:
            print(f"{r['config']}: TPOT middle ranks pred {r['tpot_middle_ranks_ms']['pred']} ms, meas "
                  f"{r['tpot_middle_ranks_ms']['meas']} ms; per tag p50 / mean pred -> meas: " + "; ".join(
                      f"{t} {v['pred_p50']:.0f} -> {v['meas_p50']:.0f} / {v['pred_mean']:.0f} -> {v['meas_mean']:.0f}"
                      for t, v in r["per_tag_tpot_ms"].items()))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
