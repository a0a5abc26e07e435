"""OpenAI's logprobs fields from the engine's TokenLogprobs: token strings, raw bytes, text offsets.

OpenAI (API reference, "logprobs"): a chat token's `bytes` are its UTF-8 bytes, which for a token
holding only part of a character (an emoji split over several tokens) are just those bytes and
do not decode on their own; a completion's `text_offset[i]` is the character index in the
returned text where token i starts. Tokenizers split characters in two ways, both handled here:
byte-level BPE (GPT-2, SmolLM2, Qwen: every byte is a printable stand-in character) and
SentencePiece byte fallback (a byte the vocabulary lacks is a token `<0xF0>`).
"""
from __future__ import annotations

import codecs
import re

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's bytes_to_unicode (Radford et al. 2019, encoder.py), inverted: stand-in char -> byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class TokenText:
    """Raw bytes and display strings of token ids, cached per id.

    tokenizer: a Hugging Face tokenizer (fast: its backend decoder tells byte-level BPE apart),
        used from one thread only (the event loop).
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._byte_level = _byte_level_alphabet() if backend is not None and "ByteLevel" in repr(backend.decoder) \
            else None
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self._added = {i for i in added}
        self._special = set(getattr(tokenizer, "all_special_ids", ()) or ())
        self._bytes: dict[int, bytes] = {}

    def bytes(self, token_id: int) -> bytes:
        """The token's raw bytes: a byte token `<0xNN>` is that one byte, a byte-level BPE piece
        maps back through GPT-2's byte alphabet, an added token is its UTF-8 text, and any other
        piece is its UTF-8 text with SentencePiece's '▁' read as a space."""
        b = self._bytes.get(token_id)
        if b is None:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            m = _BYTE_TOKEN.fullmatch(piece or "")
            if piece is None:
                b = b""
            elif m:
                b = bytes([int(m.group(1), 16)])
            elif token_id in self._added:
                b = piece.encode("utf-8")
            elif self._byte_level is not None and all(c in self._byte_level for c in piece):
                b = bytes(self._byte_level[c] for c in piece)
            else:
                b = piece.replace("\u2581", " ").encode("utf-8")
            self._bytes[token_id] = b
        return b

    def string(self, token_id: int) -> str:
        """The token as text; a token that is not whole UTF-8 characters is written OpenAI's way,
        `bytes:\\xf0\\x9f`."""
        b = self.bytes(token_id)
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{x:02x}" for x in b)

    def in_text(self, token_id: int) -> bool:
        """Whether the token's text is part of the returned text (special tokens are skipped)."""
        return token_id not in self._special


class OffsetCounter:
    """Character offsets, in a text made of consecutive tokens' bytes decoded as UTF-8, of where
    each token starts. A token that starts inside a character (its first byte continues the
    previous token's incomplete character) gets that character's offset, so offsets never
    point into the middle of a character and never decrease.

    start: the offset of the first token (characters already in the text before it).
    """

    def __init__(self, start: int = 0):
        self.chars = start
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def advance(self, data: bytes) -> int:
        """Offset (characters) of a token whose bytes are `data`; moves past it."""
        offset = self.chars
        self.chars += len(self._decoder.decode(data))
        return offset


def completion_logprobs(lps: list, text: TokenText | None, offsets: OffsetCounter) -> dict | None:
    """The `logprobs` object of a completion choice (or stream chunk) for TokenLogprobs `lps`;
    `offsets` carries the text offset across chunks. None when logprobs were not asked for."""
    if not lps or lps[0] is None:
        return None
    tokens, text_offset = [], []
    for lp in lps:
        tokens.append(text.string(lp.token_id) if text else "")
        text_offset.append(offsets.advance(text.bytes(lp.token_id) if text and text.in_text(lp.token_id) else b""))
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [_top(lp, text) for lp in lps], "text_offset": text_offset}


def _top(lp, text: TokenText | None) -> dict:
    return {(text.string(i) if text else ""): v for i, v in lp.top}


def empty_completion_logprobs() -> dict:
    """A completion `logprobs` object with no entries (asked for, and no token in the text)."""
    return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}


def prompt_logprobs(prompt_ids: list[int], lps: list | None, text: TokenText | None) -> dict:
    """The `logprobs` object of an echoed prompt (completions, echo + logprobs: how evaluation
    harnesses score a text): every prompt token, its logprob given the tokens before it and its
    top alternatives from the engine's prompt TokenLogprobs `lps` (one per token after the
    first), `null` for the first token, as OpenAI's legacy completions do; offsets from 0.
    Without `lps` (the request ended before its prefill) the lists are empty."""
    if lps is None or len(lps) != len(prompt_ids) - 1:
        return empty_completion_logprobs()
    offsets = OffsetCounter()
    # the echoed prompt holds its special tokens as written (`<|im_start|>`), unlike generated text
    return {"tokens": [text.string(i) if text else "" for i in prompt_ids],
            "token_logprobs": [None] + [lp.logprob for lp in lps],
            "top_logprobs": [None] + [_top(lp, text) for lp in lps],
            "text_offset": [offsets.advance(text.bytes(i) if text else b"") for i in prompt_ids]}


def join_logprobs(first: dict, second: dict | None) -> dict:
    """Two completion `logprobs` objects one after the other (an echoed prompt's, then the
    generated text's, whose offsets already count the prompt's characters)."""
    if second is None:
        return first
    return {k: first[k] + second[k] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


def chat_logprobs(lps: list, text: TokenText | None) -> dict | None:
    """The `logprobs` object of a chat choice (or stream chunk): per token its string, logprob,
    raw `bytes` and top alternatives. None when logprobs were not asked for."""
    if not lps or lps[0] is None:
        return None

    def entry(tok_id: int, logprob: float) -> dict:
        if text is None:
            return {"token": "", "logprob": logprob, "bytes": []}
        return {"token": text.string(tok_id), "logprob": logprob, "bytes": list(text.bytes(tok_id))}

    return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(i, v) for i, v in lp.top]}
                        for lp in lps]}
