"""AWQ ablation, side by side in one run: which part of AWQ (scale search, clipping search,
objective) moves held-out perplexity, against RTN on the same grid.

Every variant runs `quant.awq.quantize_weights` with some AWQConfig fields changed, then all
block linears are fake-quantized (quantize, dequantize) and perplexity is computed with a float32
reference forward (`quant.awq.block_forward`), so no checkpoint is written and the int4 kernels
are out of the picture (awq_quality.py measures those). Variants are NAME=field:value,...

    python benchmarks/awq_ablation.py --model qwen2.5-coder-0.5b-instruct \
        --variant awq= --variant noclip=max_shrink:0 --out results/awq_ablation.json
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F


def forward_logits(cfg, w, ids: torch.Tensor) -> torch.Tensor:
    """float32 logits [B, T, vocab] of token ids [B, T] through the reference blocks."""
    from mixserve.quant.awq import _rms, block_forward, rope_tables

    cos, sin = rope_tables(cfg, ids.shape[1])
    x = F.embedding(ids, w["model.embed_tokens.weight"])
    for i in range(cfg.num_layers):
        x = block_forward(cfg, w, f"model.layers.{i}.", x, cos, sin)
    x = _rms(x, w["model.norm.weight"], cfg.rms_norm_eps)
    return F.linear(x, w.get("lm_head.weight", w["model.embed_tokens.weight"]))


def nll_windows(cfg, w, windows, batch=4):
    out = []
    with torch.inference_mode():
        for i in range(0, len(windows), batch):
            ids = torch.tensor(windows[i:i + batch])
            logp = torch.log_softmax(forward_logits(cfg, w, ids)[:, :-1], -1)
            nll = -logp.gather(2, ids[:, 1:, None]).squeeze(-1).sum(1)
            out += [(v, ids.shape[1] - 1) for v in nll.tolist()]
    return out


def score(cfg, w, slices: dict, base: dict) -> dict:
    """Perplexity per slice of weights w, and the paired increase over the baseline's window NLLs:
    {slice: {"ppl", "ci95", "delta", "delta_ci95"}}."""
    from mixserve.bench.ppl import bootstrap

    row = {}
    for s, wins in slices.items():
        nll = nll_windows(cfg, w, wins)
        est, lo, hi = bootstrap(nll)
        d, dlo, dhi = bootstrap(nll, base[s])
        row[s] = {"ppl": est, "ci95": [lo, hi], "delta": d, "delta_ci95": [dlo, dhi]}
    return row


def describe(row: dict, slices) -> dict:
    """{slice: "ppl (+delta [lo, hi])"} for printing."""
    return {s: f"{row[s]['ppl']:.3f} (+{row[s]['delta']:.3f} [{row[s]['delta_ci95'][0]:+.3f}, "
               f"{row[s]['delta_ci95'][1]:+.3f}])" for s in slices}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--calib", default="pystdlib")
    ap.add_argument("--calib-samples", type=int, default=32)
    ap.add_argument("--calib-seq-len", type=int, default=512)
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME=field:value,... of AWQConfig (empty: defaults); rtn and the baseline always run")
    ap.add_argument("--slices", default="code_stdlib,chat_nonen")
    ap.add_argument("--tokens-per-slice", type=int, default=3072)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--out", default="results/awq_ablation.json")
    a = ap.parse_args()

    from awq_common import load_dense_and_calib

    from mixserve.bench.ppl import bootstrap, slice_windows
    from mixserve.env import machine_info
    from mixserve.quant.awq import LINEARS, AWQConfig, quantize_weights
    from mixserve.quant.groupwise import fake_quantize, quantizable

    cfg, tok, dense, calib = load_dense_and_calib(a.model, a.calib, a.calib_samples, a.calib_seq_len)
    slices = {s: slice_windows(tok, s, a.tokens_per_slice, a.seq_len) for s in a.slices.split(",")}

    variants = [("rtn", AWQConfig(method="rtn"))]
    for spec in a.variant:
        name, _, fields = spec.partition("=")
        kw = {}
        for f in filter(None, fields.split(",")):
            k, v = f.split(":")
            cur = getattr(AWQConfig(), k)
            kw[k] = type(cur)(v) if not isinstance(cur, bool) else v.lower() in ("1", "true", "yes")
        variants.append((name, replace(AWQConfig(), **kw)))

    res = {"config": vars(a), "machine": machine_info(), "runs": {}}
    base = {s: nll_windows(cfg, dense, wins) for s, wins in slices.items()}
    res["runs"]["baseline"] = {s: bootstrap(v)[0] for s, v in base.items()}
    print("baseline", res["runs"]["baseline"], flush=True)
    for name, qc in variants:
        t = time.perf_counter()
        w, rep = quantize_weights(cfg, dense, calib if qc.method == "awq" else None, qc, progress=False)
        secs = time.perf_counter() - t
        w = dict(w)
        for i in range(cfg.num_layers):
            for ln in LINEARS:
                k = f"model.layers.{i}.{ln}.weight"
                if not quantizable(w[k].shape[1], w[k].shape[0], qc.group_size):
                    w[k] = fake_quantize(w[k].float(), qc.group_size, qc.bits)
        row = {"seconds": round(secs, 1), "config": vars(qc), "alphas": rep.alphas, **score(cfg, w, slices, base)}
        res["runs"][name] = row
        print(name, describe(row, slices), f"{secs:.0f} s", flush=True)
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
