"""Greedy-equality checks against HF transformers with the near-tie rule.

A divergence counts only where the reference's two largest logits differ by >= 0.01 (TIE_GAP);
below that, float rounding order can legitimately flip the argmax.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

TIE_GAP = 0.01


@dataclass
class Comparison:
    equal: bool  # identical token sequences
    ok: bool  # identical, or first divergence at a near tie
    tie_used: bool
    position: int | None
    gap: float | None


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos_ids=None):
    """Greedy tokens and per-step logits from an HF causal LM (no early stop unless eos_ids)."""
    inp = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = model.generate(inp, attention_mask=torch.ones_like(inp), max_new_tokens=max_new_tokens, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, eos_token_id=eos_ids,
                             pad_token_id=0)
    toks = out.sequences[0, len(prompt_ids):].tolist()
    return toks, [l[0].float() for l in out.logits]


def compare_greedy(ours: list[int], ref: list[int], ref_logits: list[torch.Tensor]) -> Comparison:
    """Compare our greedy tokens with the reference's under the near-tie rule."""
    n = min(len(ours), len(ref))
    for i in range(n):
        if ours[i] != ref[i]:
            top2 = torch.topk(ref_logits[i], 2).values
            gap = float(top2[0] - top2[1])
            return Comparison(False, gap < TIE_GAP, gap < TIE_GAP, i, gap)
    same_len = len(ours) == len(ref)
    return Comparison(same_len, same_len, False, None if same_len else n, None)
