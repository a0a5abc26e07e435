"""Held-out perplexity per slice, with bootstrap intervals, through the engine's own model runner
(so the int4 kernels under test are the ones measured).

Each slice's token stream (corpora.token_stream: documents shuffled with a fixed seed, joined by
EOS, cut at a fixed token budget) is split into non-overlapping windows of `seq_len` tokens; every
window is scored from its first token, so a window of T tokens contributes T - 1 predictions.
Perplexity = exp(total NLL / predicted tokens). Intervals are percentile bootstraps over windows
(Efron & Tibshirani 1993, ch. 13); the difference between two models is bootstrapped *paired*
(the same resampled windows for both), which is what makes small increases detectable.
"""
from __future__ import annotations

import math

import torch

from mixserve.engine.model_runner import BatchItem


def window_nll(engine, windows: list[list[int]]) -> list[tuple[float, int]]:
    """(summed NLL in nats, predicted tokens) per window, scored one window per forward pass."""
    out = []
    bm = engine.block_manager
    for ids in windows:
        sid = -7_000_000 - len(out)
        bm.append_slots(sid, 0, len(ids))
        try:
            logits, _ = engine.runner.run([BatchItem(sid, ids, 0, len(ids), len(ids))])
        finally:
            bm.free(sid)
        logp = torch.log_softmax(logits[:-1].float(), -1)
        tgt = torch.tensor(ids[1:])
        out.append((-logp.gather(1, tgt[:, None]).sum().item(), len(ids) - 1))
    return out


def ppl(nll: list[tuple[float, int]], idx=None) -> float:
    idx = range(len(nll)) if idx is None else idx
    s = sum(nll[i][0] for i in idx)
    n = sum(nll[i][1] for i in idx)
    return math.exp(s / n)


def bootstrap(nll: list[tuple[float, int]], base: list[tuple[float, int]] | None = None, n_boot: int = 1000,
              seed: int = 0) -> tuple[float, float, float]:
    """(estimate, low, high) 95% percentile interval of the perplexity, or with `base` (same
    windows) of the paired increase ppl(nll) - ppl(base)."""
    g = torch.Generator().manual_seed(seed)
    n = len(nll)
    stat = (lambda ix: ppl(nll, ix) - ppl(base, ix)) if base is not None else (lambda ix: ppl(nll, ix))
    vals = sorted(stat(torch.randint(0, n, (n,), generator=g).tolist()) for _ in range(n_boot))
    return stat(range(n)), vals[int(0.025 * n_boot)], vals[int(0.975 * n_boot) - 1]


def slice_windows(tokenizer, slice_name: str, budget: int, seq_len: int, seed: int = 0) -> list[list[int]]:
    """The fixed windows of one slice (corpora.EVAL_SLICES or a file). Raises ValueError when the
    slice has fewer than `seq_len` tokens."""
    from mixserve.data.corpora import eval_docs, token_stream

    ids = token_stream(eval_docs(slice_name, tokenizer), tokenizer, budget, tokenizer.eos_token_id, seed)
    if len(ids) < seq_len:
        raise ValueError(f"slice {slice_name!r}: only {len(ids)} tokens, fewer than one window of {seq_len}")
    return [ids[i:i + seq_len] for i in range(0, len(ids) - seq_len + 1, seq_len)]


def evaluate(engine, slices: list[str], budget: int = 8192, seq_len: int = 512, progress: bool = True) -> dict:
    """Perplexity per slice: {slice: {"tokens", "windows", "ppl", "ci95", "nll"}} (nll: per window
    [nats, tokens], kept so that runs can be compared pairwise later)."""
    from tqdm import tqdm

    res = {}
    for name in slices:
        wins = slice_windows(engine.tokenizer, name, budget, seq_len)
        nll = window_nll(engine, tqdm(wins, desc=name, unit="window", disable=not progress))
        est, lo, hi = bootstrap(nll)
        res[name] = {"tokens": sum(n for _, n in nll), "windows": len(nll), "ppl": est, "ci95": [lo, hi],
                     "nll": [list(x) for x in nll]}
    return res


def compare(run: dict, base: dict) -> dict:
    """Paired increase over a baseline run (same slices and windows): {slice: {"delta", "ci95",
    "significant"}}. Raises ValueError when the windows differ."""
    out = {}
    for name, r in run.items():
        if name not in base:
            continue
        b = base[name]
        if r["windows"] != b["windows"] or r["tokens"] != b["tokens"]:
            raise ValueError(f"slice {name!r}: the runs scored different windows")
        d, lo, hi = bootstrap([tuple(x) for x in r["nll"]], [tuple(x) for x in b["nll"]])
        out[name] = {"delta": d, "ci95": [lo, hi], "significant": lo > 0 or hi < 0}
    return out
