"""OpenAI logprobs fields (token strings, raw bytes, text offsets) for tokens that split a
character, with tokenizers built in the test: SentencePiece-style byte fallback and byte-level BPE."""
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from mixserve.engine.sampler import TokenLogprobs
from mixserve.server.logprobs import OffsetCounter, TokenText, chat_logprobs, completion_logprobs

TEXT = "a😀b é 日"


def byte_fallback_tokenizer():
    vocab = {f"<0x{b:02X}>": b for b in range(256)}
    vocab.update({"a": 256, "b": 257, " ": 258})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def byte_level_tokenizer():
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def check_offsets(text: str, token_bytes: list[bytes], offsets: list[int]) -> None:
    """Each offset is the character in `text` holding the token's first byte."""
    start = 0
    for b, off in zip(token_bytes, offsets):
        assert len(text[:off].encode()) <= start < len(text[:off + 1].encode()), (b, off)
        start += len(b)


@pytest.mark.parametrize("make", [byte_fallback_tokenizer, byte_level_tokenizer])
def test_bytes_and_offsets_of_split_characters(make):
    tok = make()
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert tok.decode(ids) == TEXT
    assert len(ids) > len(TEXT)  # characters really are split over tokens
    tt = TokenText(tok)
    lps = [TokenLogprobs(i, -0.5, 1, [(i, -0.5)]) for i in ids]
    chat = chat_logprobs(lps, tt)["content"]
    raw = [bytes(e["bytes"]) for e in chat]
    assert b"".join(raw) == TEXT.encode()
    assert all(len(b) == 1 for b in raw[1:5])  # the emoji: one byte per token, F0 9F 98 80
    assert raw[1] == b"\xf0" and chat[1]["token"] == "bytes:\\xf0"
    assert chat[0]["token"] == "a" and chat[0]["top_logprobs"][0]["bytes"] == [97]
    whole = completion_logprobs(lps, tt, OffsetCounter())
    assert whole["text_offset"][:6] == [0, 1, 1, 1, 1, 2]
    check_offsets(TEXT, raw, whole["text_offset"])
    # streamed in chunks that cut characters: the same offsets
    counter, streamed = OffsetCounter(), []
    for cut in range(0, len(lps), 3):
        streamed += completion_logprobs(lps[cut:cut + 3], tt, counter)["text_offset"]
    assert streamed == whole["text_offset"]


@pytest.mark.integration
def test_smollm2_byte_level_tokens():
    from transformers import AutoTokenizer

    from mixserve.models.weights import convert_gguf
    from mixserve.models.registry import resolve_model

    r = resolve_model("smollm2-135m-instruct")
    tok = AutoTokenizer.from_pretrained(str(convert_gguf(r.path, progress=False)))
    text = "a 😀 b 日本"
    ids = tok.encode(text)
    tt = TokenText(tok)
    lps = [TokenLogprobs(i, -1.0, 1, []) for i in ids]
    raw = [bytes(e["bytes"]) for e in chat_logprobs(lps, tt)["content"]]
    assert b"".join(raw) == text.encode()
    check_offsets(text, raw, completion_logprobs(lps, tt, OffsetCounter())["text_offset"])


def test_echoed_prompt_offsets_count_special_tokens():
    """An echoed prompt holds its special tokens as written, so their characters count in the
    prompt's text_offset (generated text skips them: there they count zero)."""
    from tokenizers import AddedToken

    from mixserve.server.logprobs import prompt_logprobs

    tok = byte_level_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": [AddedToken("<|s|>", special=True)]})
    text = "<|s|>ab<|s|>c"
    ids = tok.encode(text, add_special_tokens=False)
    tt = TokenText(tok)
    lp = prompt_logprobs(ids, [TokenLogprobs(i, -1.0, 1, []) for i in ids[1:]], tt)
    assert "".join(lp["tokens"]) == text and lp["token_logprobs"][0] is None
    assert lp["text_offset"] == [text.index(t, o) for t, o in zip(lp["tokens"], [0, 5, 6, 7, 12])]
    gen = completion_logprobs([TokenLogprobs(i, -1.0, 1, []) for i in ids], tt, OffsetCounter())
    assert gen["text_offset"][:2] == [0, 0]  # generated: the special token adds no character
