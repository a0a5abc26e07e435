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

The grid control (every linear on its own, with the GGUF block type it was stored in): the output
MSE of RTN at group 32 relative to RTN at group 128, in two forms. "int zero" is mixserve's (and
AutoAWQ's) grid, (q - z) * scale with an integer zero point and a float16 scale. "float min" is the
Q4_K form, q * scale + min with both kept in float32. A Q4_K sub-block is 32 weights q * d_s - m_s
with q in 0..15; where its integers span 0..15, min-max rounding at group 32 in the float-min form
recovers it exactly, so the control says how far RTN's error is grid misalignment. Also the share
of weights each form reproduces exactly.

    python benchmarks/awq_diagnose.py --model qwen2.5-coder-0.5b-instruct --out results/awq_diagnose.json
    python benchmarks/awq_diagnose.py --model qwen2.5-coder-1.5b-instruct --out results/awq_diagnose_15b.json
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
    """Output MSE at each α of ALPHAS over the MSE at α = 0, for inputs x [N, in], weight w [out, in]
    (the error X (Q(W) - W)^T, as quant/awq.py's objective computes it)."""
    from mixserve.quant.awq import _out_error
    from mixserve.quant.groupwise import fake_quantize

    x_mean = x.abs().mean(0)
    errs = []
    for a in (0.0,) + ALPHAS:
        s = x_mean.pow(a).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        errs.append(_out_error(x, fake_quantize(w * s, group_size, 4) / s, w))
    return [e / errs[0] for e in errs[1:]]


def float_min_rtn(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """Min-max 4-bit rounding per group in the Q4_K form: q * scale + min, scale and min float32."""
    g = w.reshape(w.shape[0], -1, group_size)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    scale = ((hi - lo) / 15).clamp(min=1e-12)
    return (torch.round((g - lo) / scale).clamp(0, 15) * scale + lo).reshape(w.shape)


def grid_control(x: torch.Tensor, w: torch.Tensor) -> dict:
    """RTN g32 (int zero, float min) against RTN g128 on one linear: output MSE ratios and the share
    of weights each reproduces exactly (to 1e-6 of the weight's scale)."""
    from mixserve.quant.awq import _out_error
    from mixserve.quant.groupwise import fake_quantize

    tol = 1e-6 * w.abs().max().item()
    variants = {"g128": fake_quantize(w, 128, 4), "g32_int_zero": fake_quantize(w, 32, 4),
                "g32_float_min": float_min_rtn(w, 32)}
    err = {k: _out_error(x, v, w) for k, v in variants.items()}
    return {"mse_g32_int_zero_vs_g128": err["g32_int_zero"] / err["g128"],
            "mse_g32_float_min_vs_g128": err["g32_float_min"] / err["g128"],
            **{f"exact_{k}": ((v - w).abs() <= tol).float().mean().item() for k, v in variants.items()}}


def gguf_types(model: str) -> dict[str, str]:
    """{HF weight name: GGUF block type} of a GGUF model; empty for other models."""
    import gguf

    from mixserve.models.registry import resolve_model
    from mixserve.models.weights import _hf_name

    r = resolve_model(model)
    if r.kind != "gguf":
        return {}
    out = {}
    for t in gguf.GGUFReader(str(r.path)).tensors:
        try:
            out[_hf_name(t.name)] = t.tensor_type.name
        except ValueError:
            pass
    return out


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
    types = gguf_types(a.model)
    rows, grid = [], []
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
                for n in names:
                    gc = grid_control(feat, w[p + n + ".weight"])
                    grid.append({"layer": i, "linear": n, "gguf_type": types.get(p + n + ".weight", "?"), **gc})
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
        if not sel:  # no linear of this group fits the group size
            continue
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
    grid_summary = {}
    print("\ngrid control: RTN g32 against RTN g128 (output MSE ratio, median) and weights reproduced exactly")
    for t in sorted({g["gguf_type"] for g in grid}) + ["all"]:
        sel = [g for g in grid if t in ("all", g["gguf_type"])]
        med = lambda k: statistics.median(g[k] for g in sel)  # noqa: E731
        grid_summary[t] = {"linears": len(sel), **{k: med(k) for k in sel[0] if k not in ("layer", "linear", "gguf_type")}}
        gs = grid_summary[t]
        print(f"{t:6s} n={len(sel):3d}  int zero {gs['mse_g32_int_zero_vs_g128']:.3f}x "
              f"(exact {gs['exact_g32_int_zero']:.0%})  float min {gs['mse_g32_float_min_vs_g128']:.3f}x "
              f"(exact {gs['exact_g32_float_min']:.0%})  g128 exact {gs['exact_g128']:.0%}")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"config": vars(a), "machine": machine_info(), "alphas": ALPHAS,
                                       "summary": summary, "rows": rows, "grid_summary": grid_summary,
                                       "grid": grid}, indent=1))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
