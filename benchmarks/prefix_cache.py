"""Prefix caching on the 0.5B: caching on and off alternated in one process, and the planner's
prediction of what it buys, written before any run.

Three traces, made with `mixserve mix sample` (seeded):
- multi-turn: ShareGPT conversations of >= 4 user turns, replayed closed-loop (each turn sent when
  the previous answer is done, with the model's own replies in the prompt); turns >= 2 counted;
- shared system prompt: 4 system prompts of 512 tokens behind every request;
- single-turn ShareGPT: little reuse, for the cost of caching where it finds nothing.

The planner (profile from `mixserve hw probe`, step times only from it) simulates each trace with
prefix caching off and on through the engine's own block manager; its predictions (throughput
and TTFT p50 ratios, hit rate) go to `<out>.predictions.json` first. Then one engine runs each
trace off, on, off, on, off, on (caches emptied before every run, every request queued at t = 0,
outputs to max_tokens), and the medians are compared.

    python benchmarks/prefix_cache.py --out results/prefix_cache.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path


def run(cmd):
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def ttft_p50(requests: list[dict], later_turns: bool) -> float:
    v = [r["ttft_s"] for r in requests if r["ttft_s"] is not None and (not later_turns or (r.get("turn") or 1) >= 2)]
    return statistics.median(v)


def hit_rate(requests: list[dict], later_turns: bool) -> float:
    rs = [r for r in requests if not later_turns or (r.get("turn") or 1) >= 2]
    return sum(r["cached_tokens"] for r in rs) / sum(r["prompt_tokens"] for r in rs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--profile", default="results/hw-prefix-cache.json")
    ap.add_argument("--out", default="results/prefix_cache.json")
    ap.add_argument("--conversations", type=int, default=30)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-requests", type=int, default=48)
    ap.add_argument("--single-requests", type=int, default=48)
    ap.add_argument("--output-len-cap", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3, help="on/off pairs per trace")
    ap.add_argument("--kv-cache-memory", default="1GiB")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--conversations-at-once", type=int, default=None,
                    help="multi-turn: at most this many conversations in flight (default: all at once)")
    ap.add_argument("--traces", default="multi-turn,shared system prompt,single-turn sharegpt",
                    help="comma-separated subset of the three traces")
    ap.add_argument("--predict-only", action="store_true", help="write the predictions and stop")
    a = ap.parse_args()

    from mixserve.bench.offline import run_offline
    from mixserve.data.datasets import load_dataset
    from mixserve.engine.args import EngineArgs, parse_bytes
    from mixserve.engine.llm_engine import LLMEngine
    from mixserve.env import machine_info
    from mixserve.models.config import ModelConfig
    from mixserve.models.registry import resolve_model
    from mixserve.models.weights import convert_gguf, load_tokenizer
    from mixserve.plan.cost_model import default_format
    from mixserve.plan.hardware import load_step_model
    from mixserve.plan.planner import PlanSettings, Planner, Variant, sim_requests

    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    exe = [sys.executable, "-m", "mixserve.cli"]
    if not Path(a.profile).is_file():
        run(exe + ["hw", "probe", "--model", a.model, "--out", a.profile])
    traces = {"multi-turn": out.with_suffix(".multiturn.jsonl"), "shared system prompt": out.with_suffix(".system.jsonl"),
              "single-turn sharegpt": out.with_suffix(".sharegpt.jsonl")}
    if not traces["multi-turn"].is_file():
        run(exe + ["mix", "sample", "--source", "sharegpt-multiturn", "--num", str(a.conversations), "--min-turns",
                   str(a.turns), "--max-turns", str(a.turns), "--output-len-cap", str(a.output_len_cap),
                   "--model", a.model, "--seed", "0", "--out", str(traces["multi-turn"])])
    if not traces["shared system prompt"].is_file():
        run(exe + ["mix", "sample", "--source", "shared-system-prompt", "--num", str(a.system_requests),
                   "--system-prompts", "4", "--system-prompt-len", "512", "--seed", "0",
                   "--out", str(traces["shared system prompt"])])
    if not traces["single-turn sharegpt"].is_file():
        run(exe + ["mix", "sample", "--source", "sharegpt", "--num", str(a.single_requests), "--output-len-cap",
                   str(a.output_len_cap), "--model", a.model, "--seed", "0", "--out", str(traces["single-turn sharegpt"])])

    tok = load_tokenizer(a.model)
    keep = a.traces.split(",")
    reqs = {name: load_dataset(str(p), tok, None, output_len_cap=a.output_len_cap) for name, p in traces.items()
            if name in keep}
    at_once = lambda name: a.conversations_at_once if name == "multi-turn" else None  # noqa: E731
    for name, rs in reqs.items():  # a shared system prompt's requests have 32-64 output tokens; keep them
        for r in rs:
            r.max_tokens = min(r.max_tokens, 64)

    # -- predictions, before any run -------------------------------------------------------------
    r = resolve_model(a.model)
    cfg = ModelConfig.from_folder(convert_gguf(r.path, progress=False) if r.kind == "gguf" else r.path)
    sm, hw = load_step_model(a.profile, cfg)
    fmt = default_format(r)  # the engine below runs its default (a GGUF natively)
    ps = PlanSettings(kv_bytes=parse_bytes(a.kv_cache_memory), max_model_len=a.max_model_len, slo={})
    preds = {"made_at": time.strftime("%Y-%m-%d %H:%M:%S"), "profile": a.profile, "machine": machine_info(),
             "conversations_at_once": a.conversations_at_once, "traces": {}}
    for name, rs in reqs.items():
        sims = sim_requests(rs, tok, at_once(name))
        planner = Planner(cfg, sm, hw, sims, ps)
        later = name == "multi-turn"
        p = {}
        for on in (False, True):
            res = planner.run(Variant("prefix caching" if on else "baseline", fmt=fmt, prefix_caching=on))
            rows = [{"ttft_s": m.ttft, "turn": q.turn, "prompt_tokens": s.prompt_tokens}
                    for m, q, s in zip(res.metrics, rs, sims) if m is not None]
            p["on" if on else "off"] = {"output_tokens_per_s": res.report["output_tokens_per_s"],
                                        "ttft_p50_s": ttft_p50(rows, later), "hit_rate": res.prefix_hit_rate}
        p["throughput_x"] = p["on"]["output_tokens_per_s"] / p["off"]["output_tokens_per_s"]
        p["ttft_p50_x"] = p["off"]["ttft_p50_s"] / p["on"]["ttft_p50_s"]
        preds["traces"][name] = p
        print(f"predicted {name}: throughput x{p['throughput_x']:.2f}, TTFT p50 {'(turns >= 2) ' if later else ''}"
              f"x{p['ttft_p50_x']:.2f} lower, hit rate {p['on']['hit_rate']:.1%}", flush=True)
    pred_path = out.with_suffix(".predictions.json")
    pred_path.write_text(json.dumps(preds, indent=1))
    print(f"wrote {pred_path} (before any measured run)", flush=True)
    if a.predict_only:
        return 0

    # -- runs: one engine, caching toggled -------------------------------------------------------
    eng = LLMEngine(EngineArgs(model=a.model, kv_cache_memory=a.kv_cache_memory, max_model_len=a.max_model_len,
                               progress=False))
    print(eng.describe(), flush=True)
    run_offline(eng, next(iter(reqs.values()))[:4], progress=False)  # warm-up, not counted
    meas = {name: {"off": [], "on": []} for name in reqs}
    for k in range(a.repeats):
        for name, rs in reqs.items():
            for on in (False, True):
                eng.set_prefix_caching(on)
                rep, _ = run_offline(eng, rs, progress=False, conversations_at_once=at_once(name))
                later = name == "multi-turn"
                m = {"output_tokens_per_s": rep["output_tokens_per_s"], "ttft_p50_s": ttft_p50(rep["requests"], later),
                     "hit_rate": hit_rate(rep["requests"], later),
                     "engine_hit_rate": rep["extra"]["prefix_cache_hit_rate"], "duration_s": rep["duration_s"],
                     "prompt_tokens": sum(x["prompt_tokens"] for x in rep["requests"])}
                meas[name]["on" if on else "off"].append(m)
                print(f"run {k + 1} {name} caching {'on ' if on else 'off'}: {m['output_tokens_per_s']:.1f} out tok/s, "
                      f"TTFT p50 {m['ttft_p50_s'] * 1e3:.0f} ms, hit rate {m['hit_rate']:.1%} "
                      f"({m['duration_s']:.1f} s)", flush=True)
                out.write_text(json.dumps({"predictions": preds, "runs": meas, "machine": machine_info(),
                                           "engine": eng.describe()}, indent=1))
    eng.set_prefix_caching(True)

    summary = {}
    for name in reqs:
        med = {side: {key: statistics.median(x[key] for x in meas[name][side])
                      for key in ("output_tokens_per_s", "ttft_p50_s", "hit_rate", "engine_hit_rate")}
               for side in ("off", "on")}
        p = preds["traces"][name]
        s = {"median": med, "throughput_x": med["on"]["output_tokens_per_s"] / med["off"]["output_tokens_per_s"],
             "ttft_p50_x": med["off"]["ttft_p50_s"] / med["on"]["ttft_p50_s"],
             "pred_throughput_x": p["throughput_x"], "pred_ttft_p50_x": p["ttft_p50_x"],
             "pred_hit_rate": p["on"]["hit_rate"]}
        s["throughput_x_err_pct"] = 100 * (s["pred_throughput_x"] / s["throughput_x"] - 1)
        s["ttft_p50_x_err_pct"] = 100 * (s["pred_ttft_p50_x"] / s["ttft_p50_x"] - 1)
        summary[name] = s
    out.write_text(json.dumps({"predictions": preds, "runs": meas, "summary": summary, "machine": machine_info(),
                               "engine": eng.describe()}, indent=1))
    print(f"\n{'trace':22} {'hit rate':>9} {'pred':>6} {'out tok/s off':>13} {'on':>7} {'x':>6} {'pred x':>7} "
          f"{'TTFT p50 off':>12} {'on':>7} {'x lower':>8} {'pred x':>7}")
    for name, s in summary.items():
        m = s["median"]
        print(f"{name:22} {m['on']['hit_rate']:9.1%} {s['pred_hit_rate']:6.1%} {m['off']['output_tokens_per_s']:13.1f} "
              f"{m['on']['output_tokens_per_s']:7.1f} {s['throughput_x']:6.3f} {s['pred_throughput_x']:7.3f} "
              f"{m['off']['ttft_p50_s'] * 1e3:10.0f}ms {m['on']['ttft_p50_s'] * 1e3:5.0f}ms {s['ttft_p50_x']:8.2f} "
              f"{s['pred_ttft_p50_x']:7.2f}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
