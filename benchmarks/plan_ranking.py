"""What each optimization buys for each mix: the planner's predicted throughput gains against the
engine's measured ones, side by side (issue 6).

For each mix (ShareGPT, HumanEval, synthetic long prompt / short output) and each optimization
(paging, vs a contiguous max-model-len reservation; speculative decoding with prompt lookup;
AWQ w4 weights) the planner predicts the offline output-token throughput relative to the
baseline (paged, bf16), from the saved `hw probe` profile only. Speculation's acceptance rate α
is measured first on a sample of each mix (8 requests, k fixed at 4, `plan.measure.measure_speculation`,
as `plan --measure` does). All predictions are written to `<out>.predictions.json`
before the measured runs; then every (mix, variant) runs through the real `mixserve bench`.
Single stream (the seed's claim that quantization and speculation pay there): the first 2 requests
of each mix, output capped at 128 tokens, `--max-num-seqs 1`, baseline / speculation / AWQ, the
planner run with max_num_seqs = 1 on the same requests.

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
# single stream (--max-num-seqs 1): the first requests of each mix, output capped, fewer to keep it short
SINGLE = (2, 128)
SINGLE_VARIANTS = ("baseline", "speculative (prompt lookup, auto k)", "AWQ w4 g128")


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
    ap.add_argument("--alpha-requests", type=int, default=8,
                    help="requests of each mix sampled to measure speculation's alpha (as plan --measure)")
    a = ap.parse_args()

    from mixserve.data.datasets import load_dataset
    from mixserve.env import machine_info
    from mixserve.models.weights import load_tokenizer
    from mixserve.plan.measure import measure_speculation, sample_trace
    from mixserve.engine.args import parse_bytes
    from mixserve.models.config import ModelConfig
    from mixserve.models.weights import convert_gguf
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
    tok = load_tokenizer(a.model)
    for name, ds, num in mixes:
        # as `plan --measure`: k fixed at 4 on a seeded sample of the mix, through the real engine
        sample = sample_trace(load_dataset(ds, tok, num, seed=0, output_len_cap=256, max_prompt_len=1024),
                              a.alpha_requests, seed=0)
        m = measure_speculation(a.model, sample, "ngram", 4, max_tokens=128, max_model_len=4096)
        alpha = m["alpha"]
        out.with_suffix(f".{name}.alpha.json").write_text(json.dumps(m, indent=1))
        reqs = trace_requests(ds, a.model, num, 0, 256, 1024)
        pl = Planner(cfg, sm, hw, reqs, PlanSettings(kv_bytes=parse_bytes(KV), max_model_len=4096, slo={}))
        one = Planner(cfg, sm, hw, trace_requests(ds, a.model, SINGLE[0], 0, SINGLE[1], 1024),
                      PlanSettings(kv_bytes=parse_bytes(KV), max_model_len=4096, max_num_seqs=1, slo={}))
        thr, thr1 = {}, {}
        for vname, (_, v) in variants.items():
            v = v or Variant("spec", spec=SpecSettings(alpha, 4, 0.0, "auto"))
            thr[vname] = pl.run(v).report["output_tokens_per_s"]
            if vname in SINGLE_VARIANTS:
                thr1[vname] = one.run(v).report["output_tokens_per_s"]
        preds["mixes"][name] = {"alpha_sample": alpha, "output_tokens_per_s": thr,
                                "single_stream_output_tokens_per_s": thr1}
        print(f"predicted {name}: alpha {alpha:.3f}, " + ", ".join(f"{k} {v:.1f}" for k, v in thr.items())
              + "; single stream " + ", ".join(f"{k} {v:.1f}" for k, v in thr1.items()), flush=True)
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
        meas1 = all_meas[name + " (single stream)"] = {}
        for i, (vname, (flags, _)) in enumerate(variants.items()):
            if vname not in SINGLE_VARIANTS:
                continue
            path = out.with_suffix(f".{name}.single{i}.json")
            model = [] if "--model" in flags else ["--model", a.model]
            run(exe + model + flags + ["--dataset", ds, "--num-prompts", str(SINGLE[0]), "--output-len-cap",
                                       str(SINGLE[1]), "--max-num-seqs", "1", "--output", str(path)])
            meas1[vname] = json.loads(path.read_text())["output_tokens_per_s"]
        p = preds["mixes"][name]["output_tokens_per_s"]
        p1 = preds["mixes"][name]["single_stream_output_tokens_per_s"]
        for vname in list(variants)[1:]:
            # paging's gain is the baseline over the contiguous run; the others over the baseline
            inv = vname.startswith("paging")
            pg = p["baseline"] / p[vname] if inv else p[vname] / p["baseline"]
            mg = meas["baseline"] / meas[vname] if inv else meas[vname] / meas["baseline"]
            row = {"mix": name, "optimization": vname, "predicted_x": pg, "measured_x": mg}
            if vname in SINGLE_VARIANTS:
                row.update(single_predicted_x=p1[vname] / p1["baseline"], single_measured_x=meas1[vname] / meas1["baseline"])
            rows.append(row)
        out.write_text(json.dumps({"predictions": preds, "rows": rows, "measured": all_meas}, indent=1))
    print(f"\n{'mix':10} {'optimization':38} {'batch pred':>10} {'meas':>7} {'single pred':>11} {'meas':>7}")
    for row in rows:
        sp, sm_ = row.get("single_predicted_x"), row.get("single_measured_x")
        print(f"{row['mix']:10} {row['optimization']:38} {row['predicted_x']:9.2f}x {row['measured_x']:6.2f}x "
              + (f"{sp:10.2f}x {sm_:6.2f}x" if sp else f"{'-':>11} {'-':>7}"))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
