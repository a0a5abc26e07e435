"""A one-block float32 llama GGUF made in a test, in a second: for the code that reads GGUF metadata,
converts a file or loads its tokenizer."""
from __future__ import annotations

import gguf
import numpy as np

HIDDEN, INTER, VOCAB = 64, 128, 96
TOKENIZER_VOCAB = 258  # 256 byte tokens, the merge "ab", an end token


def write_float_gguf(path, name: str | None = None, tokenizer: bool = False):
    """Write the GGUF to `path` and return `path`. name: its general.name. tokenizer: give it a
    byte-level BPE vocabulary (gpt2 type: the 256 byte tokens, one merge "a b", an end token that
    is also EOS) that transformers turns into a real tokenizer; the vocabulary is then 258, else 96."""
    vocab = TOKENIZER_VOCAB if tokenizer else VOCAB
    w = gguf.GGUFWriter(str(path), "llama")
    if name is not None:
        w.add_name(name)
    w.add_block_count(1)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTER)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_context_length(128)
    w.add_eos_token_id(vocab - 1 if tokenizer else 1)
    if tokenizer:
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        b2u = bytes_to_unicode()
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list([b2u[i] for i in range(256)] + ["ab", "<|end|>"])
        w.add_token_types([1] * (vocab - 1) + [3])
        w.add_token_merges(["a b"])
    rng = np.random.default_rng(0)
    r = lambda *s: (0.05 * rng.standard_normal(s)).astype(np.float32)  # noqa: E731
    w.add_tensor("token_embd.weight", r(vocab, HIDDEN))
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    for kind, shape in {"attn_q": (HIDDEN, HIDDEN), "attn_k": (HIDDEN // 2, HIDDEN), "attn_v": (HIDDEN // 2, HIDDEN),
                        "attn_output": (HIDDEN, HIDDEN), "ffn_gate": (INTER, HIDDEN), "ffn_up": (INTER, HIDDEN),
                        "ffn_down": (HIDDEN, INTER)}.items():
        w.add_tensor(f"blk.0.{kind}.weight", r(*shape))
    for norm in ("attn_norm", "ffn_norm"):
        w.add_tensor(f"blk.0.{norm}.weight", np.ones(HIDDEN, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
