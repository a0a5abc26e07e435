"""Where a model's weights come from: whether they are already the output of AWQ or GPTQ.

AWQ (Lin et al., MLSys 2024, §3.2) folds per-channel scales into the weights before rounding. A
release made that way and shipped again (dequantized, or re-encoded as GGUF) carries those scales
already: running AWQ on it redoes work that is done, and its "unquantized" baseline is itself a
rounded model. mixserve's 0.5B is such a file (GGUF `general.name` "Qwen2.5 Coder 0.5B Instruct
AWQ"). That is not, as measured, why AWQ gains nothing there: the 1.5B, made from the original
weights, shows the same weight/activation correlation (benchmarks/awq_diagnose.py, BENCHMARKS.md).

Read from: the GGUF general.* keys (GGUF spec, "General metadata"), an HF folder's
config.json `quantization_config.quant_method` (transformers' convention), a mixserve checkpoint's
mixserve_quant.json, and a dequantized GGUF copy's source file beside it.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

# the token may touch digits and punctuation ("AWQ4bit", "Int4-AWQ"), not letters ("Hawq")
QUANT_RELEASE = re.compile(r"(?<![a-z])(awq|gptq)(?![a-z])", re.IGNORECASE)
GGUF_KEYS = ("general.name", "general.finetune", "general.basename", "general.source.url",
             "general.source.repo_url", "general.source.huggingface.repository", "general.tags")
SOURCE_FILE = "mixserve_source.json"  # written by models/weights.py beside a dequantized copy


def gguf_release(path: str | Path) -> str | None:
    """The GGUF metadata that names an AWQ/GPTQ release, e.g. 'general.name "Qwen2.5 Coder 0.5B
    Instruct AWQ"', or None. Raises what gguf.GGUFReader raises for a file that is not a GGUF."""
    from mixserve.models.gguf_file import open_gguf

    reader = open_gguf(path)
    for key in GGUF_KEYS:
        f = reader.fields.get(key)
        if f is None:
            continue
        value = f.contents()
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, str) and QUANT_RELEASE.search(v):
                return f'GGUF {key} "{v}"'
    return None


def folder_release(folder: str | Path) -> str | None:
    """The same for an HF folder: its quantization_config's quant_method (when the folder is not
    a mixserve checkpoint), the release a mixserve checkpoint was made from, or the GGUF a
    dequantized copy (`<file>.gguf.mixserve`) came from. None when nothing says so."""
    folder = Path(folder)
    made = _read_json(folder / "mixserve_quant.json")
    if made is not None:
        src = made.get("source_release")
        return f"made from {made.get('model')}, whose {src}" if isinstance(src, str) and src else None
    qcfg = (_read_json(folder / "config.json") or {}).get("quantization_config")
    method = qcfg.get("quant_method") if isinstance(qcfg, dict) else None
    if isinstance(method, str) and QUANT_RELEASE.fullmatch(method.strip()):
        return f"config.json quantization_config.quant_method {method!r}"
    source = _read_json(folder / SOURCE_FILE)
    src = Path(source["gguf"]) if source and isinstance(source.get("gguf"), str) and source["gguf"] else None
    if src is None and folder.name.endswith(".mixserve"):  # copies made before the source file existed
        src = folder.with_name(folder.name[: -len(".mixserve")])
    try:
        return gguf_release(src) if src is not None and src.is_file() else None
    except Exception:  # a truncated or foreign file, a path too long: its provenance is unknown, not an error
        return None


def _read_json(path: Path) -> dict | None:
    """A JSON object from `path`, or None when it is missing, unreadable or not an object."""
    try:
        obj = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        return None
    return obj if isinstance(obj, dict) else None


def quantized_release(model: str | Path) -> str | None:
    """Whether `model` (built-in name, GGUF path or HF folder) already comes from an AWQ or GPTQ
    release: the evidence as a phrase, or None. Never downloads; an unknown or unreadable model
    gives None (loading it reports the real error)."""
    from mixserve.models.registry import resolve_model

    try:
        r = resolve_model(model, download=False)
        return gguf_release(r.path) if r.kind == "gguf" else folder_release(r.path)
    except Exception:  # provenance is advice: it must never stop a load or a quantize run
        return None


def release_warning(model: str | Path, src: str | None, action: str) -> str | None:
    """A one-line warning for `action` ("quantize", "eval-ppl") on `model`, given its
    quantized_release evidence `src`; None when src is None."""
    if src is None:
        return None
    if action == "quantize":
        return (f"warning: {model} already comes from an AWQ/GPTQ release ({src}): its weights carry that "
                "release's scales and rounding, so AWQ on them redoes work already done and can gain little "
                "over RTN")
    return (f"warning: {model} comes from an AWQ/GPTQ release ({src}): the dense weights it starts from are "
            "already a rounded model, so quality changes are measured against that, not the original weights")
