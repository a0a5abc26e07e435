"""Why AWQ's scale search finds nothing on the built-in weights: the α curve of every linear group,
and the same curve with the weight's input channels shuffled (a control).

AWQ (Lin et al. 2024, §3.2) scales input channel j of a weight by s_j = mean|x_j|^α before
rounding, so channels with large activations get finer steps. That pays when salient channels
carry ordinary-sized weights: scaling them up barely moves the group's range. If instead the
channels with large activations already hold the largest weights, scaling them up widens the
range of every group they sit in and coarsens the step for all the other channels.

For every block and linear group (q/k/v, gate/up, down) this script reports, on calibration
tokens run through the float model:
- corr: the correlation over input channels of log mean|x_j| and log mean_i |W_ij|;
- the group's output MSE after w4 g128 rounding at α = 0.25 ... 1 (and, outside the paper's range,
  α = -0.5 and -0.25, which shrink the large-activation channels), relative to α = 0 (RTN);
- the same ratios with the weight's input channels randomly permuted (activations kept), which
  breaks the weight-activation link and keeps everything else.

    python benchmarks/awq_diagnose.py --model qwen2.5-coder-0.5b-instruct --out results/awq_diagnose.json
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

ALPHAS = (-0.5, -0.25, 0.25, 0.5, 0.75, 1.0)
GROUPS = {"qkv": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
          "gate_up": ["mlp.gate_proj", "mlp.up_proj"], "down": ["mlp.down_proj"]}


def curve(x: torch.Tensor, w: torch.Tensor, group_size: int) -> list[float]:
    """Output MSE at each α of ALPHAS over the MSE at α = 0, for inputs x [N, in], weight w [out, in]."""
    from mixserve.quant.groupwise import fake_quantize

    x_mean = x.abs().mean(0)
    ref = x @ w.t()
    errs = []
    for a in (0.0,) + ALPHAS:
        s = x_mean.pow(a).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        errs.append((x @ (fake_quantize(w * s, group_size, 4) / s).t() - ref).pow(2).mean().item())
    return [e / errs[0] for e in errs[1:]]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--calib", default="pystdlib")
    ap.add_argument("--calib-samples", type=int, default=8)
    ap.add_argument("--calib-seq-len", type=int, default=512)
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="results/awq_diagnose.json")
    a = ap.parse_args()

    from awq_common import load_dense_and_calib

    from mixserve.env import machine_info
    from mixserve.quant.awq import block_forward, rope_tables

    cfg, _, w, calib = load_dense_and_calib(a.model, a.calib, a.calib_samples, a.calib_seq_len)
    S, T = calib.shape
    cos, sin = rope_tables(cfg, T)
    x = F.embedding(calib, w["model.embed_tokens.weight"])
    gen = torch.Generator().manual_seed(a.seed)
    rows = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        with torch.no_grad():
            y, feats = block_forward(cfg, w, p, x, cos, sin, capture=True)
            for key, names in GROUPS.items():
                feat = feats[key].reshape(S * T, -1)
                W = torch.cat([w[p + n + ".weight"] for n in names])
                if W.shape[1] % a.group_size:
                    continue
                xm, wm = feat.abs().mean(0), W.abs().mean(0)
                corr = torch.corrcoef(torch.stack([xm.clamp(min=1e-8).log(), wm.clamp(min=1e-8).log()]))[0, 1].item()
                perm = torch.randperm(W.shape[1], generator=gen)
                rows.append({"layer": i, "group": key, "corr": corr, "ratio": curve(feat, W, a.group_size),
                             "ratio_shuffled": curve(feat, W[:, perm], a.group_size)})
                print(f"layer {i:2d} {key:8s} corr {corr:+.2f}  MSE vs alpha=0: "
                      + " ".join(f"{v:.2f}" for v in rows[-1]["ratio"]) + "  shuffled: "
                      + " ".join(f"{v:.2f}" for v in rows[-1]["ratio_shuffled"]), flush=True)
        x = y

    summary = {}
    for key in list(GROUPS) + ["all"]:
        sel = [r for r in rows if key in ("all", r["group"])]
        best = lambda rs: min(range(len(ALPHAS)), key=lambda j: rs[j])  # noqa: E731
        summary[key] = {
            "groups": len(sel),
            "median_corr": statistics.median(r["corr"] for r in sel),
            "median_ratio_by_alpha": [statistics.median(r["ratio"][j] for r in sel) for j in range(len(ALPHAS))],
            "median_ratio_by_alpha_shuffled": [statistics.median(r["ratio_shuffled"][j] for r in sel)
                                               for j in range(len(ALPHAS))],
            "share_where_some_alpha_beats_rtn": sum(min(r["ratio"]) < 1 for r in sel) / len(sel),
            "share_where_some_alpha_beats_rtn_shuffled": sum(min(r["ratio_shuffled"]) < 1 for r in sel) / len(sel),
            "median_best_ratio": statistics.median(r["ratio"][best(r["ratio"])] for r in sel),
            "median_best_ratio_shuffled": statistics.median(r["ratio_shuffled"][best(r["ratio_shuffled"])]
                                                            for r in sel),
        }
    print("\nalpha:", ", ".join(map(str, ALPHAS)))
    for key, s in summary.items():
        print(f"{key:8s} n={s['groups']:3d} corr {s['median_corr']:+.2f}  median MSE/RTN "
              + " ".join(f"{v:.2f}" for v in s["median_ratio_by_alpha"]) + "  shuffled "
              + " ".join(f"{v:.2f}" for v in s["median_ratio_by_alpha_shuffled"])
              + f"  some alpha beats RTN: {s['share_where_some_alpha_beats_rtn']:.0%} "
              f"(shuffled {s['share_where_some_alpha_beats_rtn_shuffled']:.0%})")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"config": vars(a), "machine": machine_info(), "alphas": ALPHAS,
                                       "summary": summary, "rows": rows}, indent=1))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
