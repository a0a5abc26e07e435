"""Incremental detokenization and stop-string handling.

Decoding the whole output every step is quadratic; decoding token by token breaks multi-byte
characters and BPE pieces that only make sense next to their neighbours. The usual fix (as in
HF text-generation-inference and vLLM): decode a short window of recent tokens twice, with and
without the new ones, and emit the difference once it no longer ends in an incomplete
character (U+FFFD).
"""
from __future__ import annotations

import bisect
import os

from mixserve.sequence import Sequence

# How many already-emitted tokens to keep as left context, so that tokenizers which strip or
# merge leading spaces decode the new piece the same way they would in the full text.
_CONTEXT = 5


def detokenize_incrementally(tokenizer, seq: Sequence) -> str:
    """Append the text of newly generated tokens to `seq.text`; returns the new text ("" while a
    character is still incomplete). Uses and advances seq.prefix_offset / seq.read_offset, which
    index into the sequence's output token ids, and records in seq.token_starts where each newly
    decoded token's text starts in seq.text (a token whose text is empty, such as a skipped
    special token, is recorded with the next token that adds text, or never)."""
    out = seq.output_token_ids
    skip = seq.params.skip_special_tokens
    prefix_text = tokenizer.decode(out[seq.prefix_offset:seq.read_offset], skip_special_tokens=skip)
    new_text = tokenizer.decode(out[seq.prefix_offset:], skip_special_tokens=skip)
    if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
        delta = new_text[len(prefix_text):]
        base = len(seq.text)
        # where each token of the group starts (only logprobs need it): the first at the delta's
        # start; later ones (the rest of a multi-byte character) after what the earlier decode to
        for j in range(seq.read_offset, len(out)):
            if j == seq.read_offset or seq.params.logprobs is None:
                seq.token_starts.append(base)
                continue
            # what the group's earlier tokens decode to, as far as it agrees with the whole: an
            # incomplete character (U+FFFD there, a real one in the whole) is where token j starts
            # too, while a byte that is invalid for good stays U+FFFD in both and is before it
            part = tokenizer.decode(out[seq.prefix_offset:j], skip_special_tokens=skip)
            common = len(os.path.commonprefix([part, new_text]))
            seq.token_starts.append(base + min(len(delta), max(0, common - len(prefix_text))))
        seq.read_offset = len(out)
        seq.prefix_offset = max(seq.prefix_offset, seq.read_offset - _CONTEXT)
        seq.text += delta
        return delta
    return ""


def tokens_in_text(seq: Sequence, end: int) -> int:
    """How many leading output tokens have text that starts before character `end` of seq.text:
    the tokens that make up text[:end] (the end token that stopped the sequence has no text, so it
    is never among them; a token cut by a stop string is)."""
    return bisect.bisect_left(seq.token_starts, end)


def find_stop_string(text: str, new_len: int, stops: list[str]) -> tuple[int, str] | None:
    """Earliest stop string that ends inside the last `new_len` characters of `text`.

    A stop string may span several tokens, so the search starts len(stop) - 1 characters
    before the new text. Returns (index where it starts, the stop string) or None.
    """
    best = None
    for stop in stops:
        start = max(0, len(text) - new_len - len(stop) + 1)
        i = text.find(stop, start)
        if i != -1 and (best is None or i < best[0]):
            best = (i, stop)
    return best
