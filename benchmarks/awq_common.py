"""What the AWQ study scripts (awq_ablation.py, awq_diagnose.py) share: a dense model in float32
and calibration tokens, loaded the way `mixserve quantize` loads them."""
from __future__ import annotations

from pathlib import Path

import torch


def load_dense_and_calib(model: str, calib: str, samples: int, seq_len: int):
    """(cfg, tokenizer, {HF name: float32 tensor}, calibration ids int64 [n, seq_len]) of a
    built-in model, GGUF path or HF folder; n <= samples when the source has fewer tokens."""
    from transformers import AutoTokenizer

    from mixserve.data.corpora import calibration_docs, token_stream
    from mixserve.models.config import ModelConfig
    from mixserve.models.weights import convert_gguf, load_hf_weights
    from mixserve.models.registry import resolve_model

    r = resolve_model(model)
    folder = convert_gguf(r.path) if r.kind == "gguf" else Path(r.path)
    cfg = ModelConfig.from_folder(folder)
    tok = AutoTokenizer.from_pretrained(str(folder))
    dense = {k: v.float() for k, v in load_hf_weights(folder).items()}
    ids = token_stream(calibration_docs(calib, tok), tok, samples * seq_len, tok.eos_token_id)
    n = len(ids) // seq_len
    return cfg, tok, dense, torch.tensor(ids[: n * seq_len]).view(n, seq_len)
