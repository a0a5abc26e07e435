"""AWQ §3.1's motivating experiment on our weights: keep 1% of every linear's input channels in float
and round the rest (RTN, w4 g128), choosing the kept channels by activation magnitude, by weight
magnitude, or at random; held-out perplexity with the float32 reference forward.

Lin et al. (MLSys 2024, Table 1) find that 1% of channels picked by activation recovers most of
RTN's loss, while picking by weight is no better than random: that is the premise the scale search
(§3.2) builds on. §3.2 then protects a salient channel j by scaling it up by s > 1, which lowers
its relative rounding error only while the group's range stays put (Δ' ≈ Δ), i.e. while channel j
does not hold the group's largest weights. So the script also reports, over every (output row,
group) that contains an activation-salient channel, how often that channel holds the group's
max |w| (the chance level for a random channel is 1/128), and the overlap of the activation- and
weight-chosen channel sets.

    python benchmarks/awq_salient.py --model qwen2.5-coder-1.5b-instruct --out results/awq_salient_15b.json
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

GROUPS = {"qkv": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], "o": ["self_attn.o_proj"],
          "gate_up": ["mlp.gate_proj", "mlp.up_proj"], "down": ["mlp.down_proj"]}


def holds_group_max(w: torch.Tensor, keep: torch.Tensor, g: int) -> tuple[int, int]:
    """(row-groups where a kept channel holds the group's max |w|, row-groups containing a kept
    channel) for w [out, in] and kept input channels `keep`."""
    out_f, in_f = w.shape
    arg = w.abs().view(out_f, in_f // g, g).argmax(-1) + torch.arange(0, in_f, g)  # [out, ng] channel index
    is_kept = torch.zeros(in_f, dtype=torch.bool)
    is_kept[keep] = True
    has = torch.zeros(in_f // g, dtype=torch.bool)
    has[keep // g] = True
    return int(is_kept[arg][:, has].sum()), int(has.sum()) * out_f


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--calib", default="pystdlib")
    ap.add_argument("--calib-samples", type=int, default=8)
    ap.add_argument("--calib-seq-len", type=int, default=512)
    ap.add_argument("--keep", type=float, default=0.01, help="share of input channels kept in float")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--slices", default="code_stdlib,chat_nonen")
    ap.add_argument("--tokens-per-slice", type=int, default=3072)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="results/awq_salient.json")
    a = ap.parse_args()

    from awq_ablation import describe, nll_windows, score
    from awq_common import load_dense_and_calib

    from mixserve.bench.ppl import bootstrap, slice_windows
    from mixserve.env import machine_info
    from mixserve.quant.awq import block_forward, rope_tables
    from mixserve.quant.groupwise import fake_quantize

    t0 = time.perf_counter()
    cfg, tok, dense, calib = load_dense_and_calib(a.model, a.calib, a.calib_samples, a.calib_seq_len)
    slices = {s: slice_windows(tok, s, a.tokens_per_slice, a.seq_len) for s in a.slices.split(",")}
    S, T = calib.shape
    cos, sin = rope_tables(cfg, T)
    x = F.embedding(calib, dense["model.embed_tokens.weight"])
    gen = torch.Generator().manual_seed(a.seed)
    picks = {"activation": {}, "weight": {}, "random": {}}
    stats = {"max_held": 0, "row_groups": 0, "overlap": 0, "kept": 0}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        with torch.no_grad():
            y, feats = block_forward(cfg, dense, p, x, cos, sin, capture=True)
        for key, names in GROUPS.items():
            xm = feats[key].reshape(S * T, -1).abs().mean(0)
            W = torch.cat([dense[p + n + ".weight"] for n in names])
            n_keep = max(1, round(a.keep * xm.numel()))
            act = xm.topk(n_keep).indices
            picks["activation"][(i, key)] = act
            wsel = W.abs().mean(0).topk(n_keep).indices
            picks["weight"][(i, key)] = wsel
            picks["random"][(i, key)] = torch.randperm(xm.numel(), generator=gen)[:n_keep]
            held, rg = holds_group_max(W, act, a.group_size)
            stats["max_held"] += held
            stats["row_groups"] += rg
            stats["overlap"] += len(set(act.tolist()) & set(wsel.tolist()))
            stats["kept"] += n_keep
        x = y
        del feats
    print(f"activation-salient channels hold their group's max |w| in {stats['max_held'] / stats['row_groups']:.1%} of "
          f"{stats['row_groups']} row-groups (chance 1/{a.group_size} = {1 / a.group_size:.1%}); activation and "
          f"weight choices overlap in {stats['overlap'] / stats['kept']:.0%} of {stats['kept']} channels", flush=True)

    res = {"config": vars(a), "machine": machine_info(), "salient_stats": stats, "runs": {}}
    base = {s: nll_windows(cfg, dense, wins) for s, wins in slices.items()}
    res["runs"]["baseline"] = {s: bootstrap(v)[0] for s, v in base.items()}
    print("baseline", res["runs"]["baseline"], flush=True)
    for name in ("rtn", "activation", "weight", "random"):
        w = dict(dense)
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            for key, names in GROUPS.items():
                for n in names:
                    k = p + n + ".weight"
                    q = fake_quantize(dense[k], a.group_size, 4)
                    if name != "rtn":
                        keep = picks[name][(i, key)]
                        q[:, keep] = dense[k][:, keep]
                    w[k] = q
        res["runs"][name] = row = score(cfg, w, slices, base)
        print(name, describe(row, slices), flush=True)
        del w
    res["seconds"] = round(time.perf_counter() - t0, 1)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
