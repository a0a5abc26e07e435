"""Greedy-equality checks against HF transformers with the near-tie rule.

A divergence counts only where the reference's two largest logits differ by >= 0.01 (TIE_GAP);
below that, float rounding order can legitimately flip the argmax.
"""
from __future__ import annotations

import functools
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


@functools.lru_cache(maxsize=2)
def hf_gguf_model(gguf_path: str):
    """transformers' float32 model of a GGUF file (its own GGUF loader: the reference for our
    conversion too), loaded once per session and shared by the tests that read it (SmolLM2's took
    ~20 s a load, three tests load it). The file is read through mixserve's fast reader, whose
    fields and tensors equal gguf.GGUFReader's (tests/unit/test_gguf_file.py)."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from mixserve.models.gguf_file import package_reader_is_fast

    p = Path(gguf_path)
    with package_reader_is_fast():
        return AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32).eval()


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos_ids=None):
    """Greedy tokens and per-step logits from an HF causal LM (no early stop unless eos_ids)."""
    inp = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = model.generate(inp, attention_mask=torch.ones_like(inp), max_new_tokens=max_new_tokens, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, eos_token_id=eos_ids,
                             pad_token_id=0)
    toks = out.sequences[0, len(prompt_ids):].tolist()
    return toks, [l[0].float() for l in out.logits]


def hf_logits_along(model, prompt_ids: list[int], out_ids: list[int]) -> torch.Tensor:
    """An HF causal LM's next-token logits at each position of `out_ids` given the prompt and
    out_ids before it: one forward of prompt + out_ids[:-1], float32 [len(out_ids), vocab]. The
    reference for compare_along: one pass where hf_greedy's generate ran one per token (the 0.5B's
    two 64-token comparisons took 13 s of HF decoding; issue 32)."""
    ids = torch.tensor([list(prompt_ids) + list(out_ids[:-1])])
    with torch.inference_mode():
        logits = model(ids, attention_mask=torch.ones_like(ids)).logits[0]
    return logits[len(prompt_ids) - 1:].float()


def compare_along(ours: list[int], ref_logits: torch.Tensor) -> Comparison:
    """Our greedy tokens against the reference's logits along them (hf_logits_along): at every
    position our token must be the reference's argmax, or within TIE_GAP of its largest logit (a
    near tie that float rounding order may flip). Stricter than compare_greedy, which stops at the
    first divergence: every position is checked, each given our own tokens before it. `position`
    and `gap`: the first failing position, else the first near tie used."""
    if not ours or len(ours) != len(ref_logits):
        return Comparison(False, False, False, 0, None)  # nothing compared, or misaligned
    first_tie = None
    for i, t in enumerate(ours):
        row = ref_logits[i]
        top = float(row.max())
        gap = top - float(row[t])
        if gap != gap:  # a NaN in the reference's row: nothing can be judged there
            return Comparison(False, False, first_tie is not None, i, gap)
        if gap > 0:
            if gap >= TIE_GAP:
                return Comparison(False, False, first_tie is not None, i, gap)
            first_tie = first_tie or (i, gap)
    if first_tie is None:
        return Comparison(True, True, False, None, None)
    return Comparison(False, True, True, *first_tie)


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


def engine_logits_along(engine, prompt: list[int], out: list[int]) -> list[torch.Tensor]:
    """An LLMEngine's own next-token logits at each position of `out` (one prefill of
    prompt + out[:-1] through its model runner, in a scratch sequence freed afterwards): the
    reference logits for the tie rule when one engine configuration is the reference."""
    from mixserve.engine.model_runner import BatchItem

    ids = list(prompt) + list(out)
    bm, sid = engine.block_manager, -1
    bm.append_slots(sid, 0, len(ids) - 1)
    try:
        logits, _ = engine.runner.run([BatchItem(sid, ids, 0, len(ids) - 1, len(out))])
    finally:
        bm.free(sid)
    return list(logits)
