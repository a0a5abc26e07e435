"""What each optimization buys for each mix: the planner's predicted throughput gains against the
engine's measured ones, side by side (issue 6).

For each mix (ShareGPT, HumanEval, synthetic long prompt / short output) and each optimization
(paging, vs a contiguous max-model-len reservation; speculative decoding with prompt lookup;
AWQ w4 weights) the planner predicts the offline output-token throughput relative to the
baseline (paged, bf16), from the saved `hw probe` profile only. Speculation's acceptance rate α
is measured first on a sample of each mix (4 requests through `mixserve bench --draft-model
ngram`), as `plan --measure` would. All predictions are written to `<out>.predictions.json`
before the measured runs; then every (mix, variant) runs through the real `mixserve bench`.

    python benchmarks/plan_ranking.py --profile results/hw-qwen05.json \
        --awq ~/.cache/mixserve/quantized/qwen2.5-coder-0.5b-instruct-awq-w4-g128-pystdlib-32x512 \
        --out results/plan_ranking.json
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

MIXES = [("sharegpt", "sharegpt", 32), ("humaneval", "humaneval", 32), ("synthetic", "SYNTH", 8)]
KV = "512MiB"


def run(cmd: list[str]) -> None:
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, stderr=subprocess.DEVNULL)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--awq", required=True, help="AWQ checkpoint folder of the same model")
    ap.add_argument("--profile", required=True)
    ap.add_argument("--out", default="results/plan_ranking.json")
    ap.add_argument("--synthetic", default="results/plan_vs_engine_r2.synthetic.jsonl",
                    help="the synthetic trace (mix sample --source synthetic-long-prompt --seed 0)")
    a = ap.parse_args()

    from mixserve.cli import machine_info
    from mixserve.engine.llm_engine import parse_bytes
    from mixserve.models.config import ModelConfig
    from mixserve.models.loader import convert_gguf
    from mixserve.models.registry import resolve_model
    from mixserve.plan.cost_model import WeightFormat
    from mixserve.plan.hardware import load_step_model
    from mixserve.plan.planner import PlanSettings, Planner, Variant, trace_requests
    from mixserve.plan.simulator import SpecSettings

    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    exe = [sys.executable, "-m", "mixserve.cli", "bench", "--kv-cache-memory", KV, "--max-model-len", "4096"]
    r = resolve_model(a.model)
    cfg = ModelConfig.from_folder(convert_gguf(r.path, progress=False) if r.kind == "gguf" else r.path)
    sm, hw = load_step_model(a.profile, cfg)
    mixes = [(n, a.synthetic if d == "SYNTH" else d, k) for n, d, k in MIXES]
    variants = {
        "baseline": ([], Variant("baseline")),
        "paging (vs contiguous max-model-len)": (["--kv-allocator", "contiguous", "--reserve", "max-model-len"],
                                                 Variant("c", allocator="contiguous", reserve="max-model-len")),
        "speculative (prompt lookup, auto k)": (["--draft-model", "ngram"], None),
        "AWQ w4 g128": (["--model", a.awq], Variant("awq", fmt=WeightFormat("int4", 128))),
    }

    preds = {"made_at": None, "profile": a.profile, "machine": machine_info(), "mixes": {}}
    for name, ds, num in mixes:
        sample = out.with_suffix(f".{name}.alpha.json")
        run(exe + ["--model", a.model, "--dataset", ds, "--num-prompts", "4", "--draft-model", "ngram",
                   "--output", str(sample)])
        alpha = json.loads(sample.read_text())["extra"]["spec_alpha"]
        reqs = trace_requests(ds, a.model, num, 0, 256, 1024)
        pl = Planner(cfg, sm, hw, reqs, PlanSettings(kv_bytes=parse_bytes(KV), max_model_len=4096, slo={}))
        thr = {}
        for vname, (_, v) in variants.items():
            v = v or Variant("spec", spec=SpecSettings(alpha, 4, 0.0, "auto"))
            thr[vname] = pl.run(v).report["output_tokens_per_s"]
        preds["mixes"][name] = {"alpha_sample": alpha, "output_tokens_per_s": thr}
        print(f"predicted {name}: alpha {alpha:.3f}, " + ", ".join(f"{k} {v:.1f}" for k, v in thr.items()), flush=True)
    preds["made_at"] = time.strftime("%Y-%m-%d %H:%M:%S")
    out.with_suffix(".predictions.json").write_text(json.dumps(preds, indent=1))

    rows, all_meas = [], {}
    for name, ds, num in mixes:
        meas = all_meas[name] = {}
        for i, (vname, (flags, _)) in enumerate(variants.items()):
            path = out.with_suffix(f".{name}.{i}.json")
            model = [] if "--model" in flags else ["--model", a.model]
            run(exe + model + flags + ["--dataset", ds, "--num-prompts", str(num), "--output", str(path)])
            meas[vname] = json.loads(path.read_text())["output_tokens_per_s"]
        p = preds["mixes"][name]["output_tokens_per_s"]
        for vname in list(variants)[1:]:
            # paging's gain is the baseline over the contiguous run; the others over the baseline
            inv = vname.startswith("paging")
            pg = p["baseline"] / p[vname] if inv else p[vname] / p["baseline"]
            mg = meas["baseline"] / meas[vname] if inv else meas[vname] / meas["baseline"]
            rows.append({"mix": name, "optimization": vname, "predicted_x": pg, "measured_x": mg})
        out.write_text(json.dumps({"predictions": preds, "rows": rows, "measured": all_meas}, indent=1))
    print(f"\n{'mix':10} {'optimization':38} {'predicted':>9} {'measured':>9}")
    for row in rows:
        print(f"{row['mix']:10} {row['optimization']:38} {row['predicted_x']:8.2f}x {row['measured_x']:8.2f}x")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
