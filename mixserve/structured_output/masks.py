"""A step's token masks: filled by llguidance for the constrained rows, applied to the logits in one op.

A mask is llguidance's bitmask: int32 words, bit b of word w allowing token 32w + b. `fill` computes
the rows' masks on the LLExecutor's threads (Rust, without the GIL), each row at its matcher's state
plus a draft prefix (speculative verification scores a draft's positions in one pass: position t
is masked as the grammar stands after the draft's first t tokens). `apply` then sets every
disallowed logit of those rows to -inf in one batched masked_fill; rows without a grammar are not
touched and no Python loop runs over the vocabulary.

What may run off the engine's thread (fill, and the compiler's masks) is numpy, never torch: one
torch op on a second thread gave it an OpenMP team of its own, and from then on every decode step
of the engine's thread ran 15.4 -> 25 ms on the 0.5B (2 cores: more OpenMP threads than cores, and
libgomp stops spinning at its barriers), found by benchmarks/structured_cost.py.
"""
from __future__ import annotations

import numpy as np
import torch

def words(vocab_size: int) -> int:
    """int32 words per row's mask."""
    return (vocab_size + 31) // 32


def fill(executor, rows: list[tuple[int, object, list[int]]], num_rows: int, vocab_size: int) -> torch.Tensor:
    """The masks of a step's rows: int32 [num_rows, words(vocab_size)]; for each (row, matcher,
    prefix) of `rows`, that row masks the next token after the matcher's output plus `prefix` (a
    speculative position: the draft tokens before it). Rows not listed are all ones.

    Consecutive rows of one matcher whose prefixes grow by one token from empty (a draft's
    positions in verification) are filled in one pass along the draft; a row whose prefix is not
    such a continuation (a draft model's later steps) is filled from a copy of the matcher that
    consumed its prefix. A prefix the grammar does not accept leaves its row all ones: the
    position before it forbids the token, so verification never reaches it. The matchers'
    states are unchanged. Runs on the executor's threads, without the GIL."""
    mask = np.full((num_rows, words(vocab_size)), -1, dtype=np.int32)
    entries: list[tuple[object, int, list[int]]] = []
    for k, m, prefix in rows:
        last = entries[-1] if entries else None
        if (last is not None and last[0] is m and last[1] + len(last[2]) + 1 == k and len(prefix) == len(last[2]) + 1
                and list(prefix[:-1]) == last[2]):
            last[2].append(prefix[-1])  # the next position along the same draft
        elif not prefix:
            entries.append((m, k, []))
        else:
            c = m.deep_copy()
            if c.consume_tokens(list(prefix)) and not c.is_error():
                entries.append((c, k, []))
    if not entries:
        return torch.from_numpy(mask)
    valid = []
    for m, k, d in entries:  # a draft the grammar stops accepting is filled up to there
        n = m.validate_tokens(d) if d else 0
        valid.append((m, k, d[:n]))
    ptr, row_bytes = mask.ctypes.data, mask.shape[1] * 4
    drafted = [e for e in valid if e[2]]  # llguidance's draft pass takes non-empty drafts only
    if drafted:
        executor.unsafe_compute_mask_ptr_with_draft_token(drafted, ptr, row_bytes, num_rows)
    plain = [(m, k) for m, k, d in valid if not d]
    if plain:
        executor.unsafe_compute_mask_ptr(plain, ptr, row_bytes, num_rows)
    return torch.from_numpy(mask)


def allowed(mask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [R, vocab_size]: which tokens the int32 [R, W] bitmask allows."""
    return torch.from_numpy(allowed_np(np.ascontiguousarray(mask.cpu().numpy()), vocab_size))


def allowed_np(mask: np.ndarray, vocab_size: int) -> np.ndarray:
    """numpy: bool [..., vocab_size] of an int32 [..., W] bitmask (unpackbits: one pass, ~10x the
    shift-and-mask ops on a 152k vocabulary)."""
    return np.unpackbits(mask.view(np.uint8), axis=-1, bitorder="little")[..., :vocab_size].view(bool)


def pack_np(allowed: np.ndarray) -> np.ndarray:
    """numpy: bool [V] -> int32 [words(V)] bitmask (allowed_np's inverse)."""
    bits = np.zeros(words(allowed.shape[0]) * 32, dtype=bool)
    bits[:allowed.shape[0]] = allowed
    return np.packbits(bits, bitorder="little").view(np.int32)


def apply(logits: torch.Tensor, rows: list[int], mask: torch.Tensor) -> torch.Tensor:
    """`logits` [N, V] (float) with each listed row's disallowed tokens at -inf: a new tensor where
    any row is listed (the input is never modified), else `logits` itself. mask: int32 [N, W]
    (fill's), rows: the constrained rows' indices."""
    if not rows:
        return logits
    ok = allowed(mask[rows], logits.shape[1]).to(logits.device)
    # torch.where against a tensor of -inf: half masked_fill's time here (0.22 against 0.51 ms a
    # 152k-token row on the Zen 5 EPYC, timed by hand)
    if len(rows) == logits.shape[0] and rows == list(range(len(rows))):  # every row: one op
        return torch.where(ok, logits, torch.full_like(logits, float("-inf")))
    out = logits.clone()
    idx = torch.tensor(rows, dtype=torch.long, device=logits.device)
    sub = out.index_select(0, idx)
    out.index_copy_(0, idx, torch.where(ok, sub, torch.full_like(sub, float("-inf"))))
    return out
