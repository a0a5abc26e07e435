"""Does AWQ's small win on its objective hold on text it did not see? For every linear group where an
AWQ checkpoint's search chose α > 0, the group's output MSE after w4 rounding with that α against
RTN's, on the calibration tokens (what the search saw) and on a held-out slice.

If the held-out ratio stays below 1, the scales do lower the layers' output error in general and a
perplexity that still rises means the per-layer MSE is the wrong objective here; if it goes to 1 or
above, the search fitted its calibration sample. The scales are rebuilt from the checkpoint's α and
the calibration activations exactly as `quant.awq.quantize_weights` built them.

    python benchmarks/awq_heldout.py --model qwen2.5-coder-1.5b-instruct \
        --awq ~/.cache/mixserve/quantized/qwen2.5-coder-1.5b-instruct-awq-w4-g128-pystdlib-16x512 \
        --heldout code_stdlib,chat_nonen,odd_format --out results/awq_heldout_15b.json
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

GROUPS = {"qkv": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
          "gate_up": ["mlp.gate_proj", "mlp.up_proj"], "down": ["mlp.down_proj"], "o": ["self_attn.o_proj"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--awq", required=True, help="an AWQ checkpoint folder made by `mixserve quantize`")
    ap.add_argument("--heldout", default="code_stdlib", help="comma-separated eval slices (data/corpora.py)")
    ap.add_argument("--heldout-tokens", type=int, default=2048, help="tokens per held-out slice")
    ap.add_argument("--out", default="results/awq_heldout.json")
    a = ap.parse_args()

    from awq_common import load_dense_and_calib

    from mixserve.bench.ppl import slice_windows
    from mixserve.env import machine_info
    from mixserve.quant.awq import _out_error, block_forward, rope_tables
    from mixserve.quant.groupwise import fake_quantize

    meta = json.loads((Path(a.awq).expanduser() / "mixserve_quant.json").read_text())
    qc = meta["config"]
    if qc.get("duo") or qc.get("skip_first") or qc.get("clip"):
        raise SystemExit("only checkpoints of the default search (no duo, skip_first or clip) are rebuilt here")
    alpha = {(g["layer"], g["group"]): g["alpha"] for g in meta["groups"]}
    cfg, tok, w, calib = load_dense_and_calib(a.model, meta["calib"], meta["calib_samples"], meta["calib_seq_len"])
    streams = {"calib": calib}
    for name in a.heldout.split(","):
        streams[name] = torch.tensor(slice_windows(tok, name, a.heldout_tokens, meta["calib_seq_len"]))
    xs = {k: F.embedding(v, w["model.embed_tokens.weight"]) for k, v in streams.items()}
    ropes = {k: rope_tables(cfg, v.shape[1]) for k, v in streams.items()}
    g = qc["group_size"]
    rows = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        feats = {}
        with torch.no_grad():
            for k in streams:
                xs[k], f = block_forward(cfg, w, p, xs[k], *ropes[k], capture=True)
                feats[k] = {n: v.reshape(-1, v.shape[-1]) for n, v in f.items()}
        for key, names in GROUPS.items():
            a_ = alpha.get((i, key))
            if not a_:
                continue
            W = torch.cat([w[p + n + ".weight"] for n in names])
            s = feats["calib"][key].abs().mean(0).pow(a_).clamp(min=1e-4)
            s = s / (s.max() * s.min()).sqrt()
            w_awq, w_rtn = fake_quantize(W * s, g) / s, fake_quantize(W, g)
            row = {"layer": i, "group": key, "alpha": a_}
            for k in streams:
                x = feats[k][key]
                row[f"ratio_{k}"] = _out_error(x, w_awq, W) / _out_error(x, w_rtn, W)
            rows.append(row)
            print(f"block {i:2d} {key:8s} α {a_:.2f}  AWQ/RTN output MSE: "
                  + "  ".join(f"{k} {row[f'ratio_{k}']:.3f}" for k in streams), flush=True)
    summary = {"groups_with_alpha": len(rows)}
    if rows:
        for k in streams:
            summary[f"median_ratio_{k}"] = statistics.median(r[f"ratio_{k}"] for r in rows)
            summary[f"share_below_1_{k}"] = sum(r[f"ratio_{k}"] < 1 for r in rows) / len(rows)
    print(summary)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"config": vars(a), "machine": machine_info(), "summary": summary,
                                       "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
