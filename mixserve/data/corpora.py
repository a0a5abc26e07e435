"""Text corpora for calibration and held-out perplexity, each split so that calibration never sees
the evaluation documents.

Sources: Python's standard library (.py files of the running interpreter), HumanEval (prompt plus
canonical solution), ShareGPT V3 (first human turn and reply, through the model's chat template),
or a user's file (JSONL with "text", "prompt" or "messages", or plain text).

Splits are fixed functions of the document (path hash, task index, record index), so they agree
across runs and machines with the same packages. ShareGPT is cut into slices by content
(sharegpt_kind): non-English chat, odd formatting (markdown tables, JSON, markup tags, long
numbers), English chat (no code fences).
"""
from __future__ import annotations

import hashlib
import json
import re
import sysconfig
from pathlib import Path
from typing import Any

CALIB_SOURCES = ("pystdlib", "humaneval", "sharegpt")
EVAL_SLICES = ("code_stdlib", "code_humaneval", "chat_en", "chat_nonen", "odd_format")

_ODD = re.compile(r"^\s*\|.*\|.*\|\s*$|\{\s*\"[^\"]+\"\s*:|</?[a-zA-Z][\w-]*(?:\s[^<>]*)?>|\d{7,}", re.M)


def _bucket(key: str) -> int:
    return int(hashlib.sha1(key.encode()).hexdigest(), 16) % 10


def stdlib_docs(split: str) -> list[str]:
    """Source files of the standard library, sorted by path; split "eval" is the tenth whose
    path hashes to bucket 0 (tests and site-packages excluded), "calib" the rest."""
    root = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for f in sorted(root.rglob("*.py")):
        rel = f.relative_to(root).as_posix()
        if rel.startswith(("site-packages/", "test/", "idlelib/idle_test/")) or "/tests/" in rel:
            continue
        if (_bucket(rel) == 0) != (split == "eval"):
            continue
        try:
            text = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if len(text) >= 200:  # empty __init__.py files and stubs say nothing
            docs.append(text)
    return docs


def humaneval_docs(split: str) -> list[str]:
    """Prompt + canonical solution; "eval": even task numbers, "calib": odd ones."""
    from mixserve.data.datasets import load_humaneval_rows

    rows = load_humaneval_rows()
    return [r["prompt"] + r["canonical_solution"] for i, r in enumerate(rows) if (i % 2 == 0) == (split == "eval")]


_WORD = re.compile(r"[^\W\d_]+")
_EN = frozenset("the of and to a in is it you that for on with as are this be was have or by not at from your can "
                "i we what an will if my do but all they has so how which there about more one would their me "
                "should".split())
# frequent function words of the Latin-script languages common in ShareGPT (es, fr, de, it, pt, id/ms)
_OTHER = frozenset("de la que el en y los las un una por con para es del se le les et est pour dans une des du der "
                   "die und das ist nicht ich mit che di il per non sono della anche yang dan untuk ini itu dengan "
                   "adalah tidak não em os uma com ao".split())


def is_non_english(text: str) -> bool:
    """At least 30% of letters outside ASCII, or more foreign than English function words (>= 8%)."""
    letters = [c for c in text if c.isalpha()]
    if len(letters) < 30:
        return False
    if sum(ord(c) > 127 for c in letters) >= 0.3 * len(letters):
        return True
    words = _WORD.findall(text)
    if len(words) < 30:
        return False
    low = [w.lower() for w in words]
    en, other = sum(w in _EN for w in low), sum(w in _OTHER for w in low)
    return other > en and other >= 0.08 * len(low)


def sharegpt_kind(prompt: str, reply: str) -> str:
    """"nonen" (the reply is not English), "odd" (>= 3 table/JSON/markup/long-number features),
    "en" (no code fences) or "other" (code-heavy) for one exchange."""
    if is_non_english(reply):
        return "nonen"
    text = prompt + "\n" + reply
    if len(_ODD.findall(text)) >= 3:
        return "odd"
    return "en" if "```" not in text else "other"


def sharegpt_docs(split: str, tokenizer: Any = None, kind: str | None = None) -> list[str]:
    """ShareGPT first exchanges as chat-template text (plain "User:/Assistant:" without a
    tokenizer). "eval": records whose index is a multiple of 10, plus every non-English record
    (there are only about a hundred); "calib": the rest. `kind` filters by sharegpt_kind."""
    from mixserve.data.datasets import load_sharegpt_pairs

    docs = []
    for i, (p, r) in enumerate(load_sharegpt_pairs().pairs):
        k = sharegpt_kind(p, r)
        if (i % 10 == 0 or k == "nonen") != (split == "eval"):
            continue
        if kind is not None and k != kind:
            continue
        docs.append(_chat_text(tokenizer, p, r))
    return docs


def _chat_text(tokenizer: Any, prompt: str, reply: str) -> str:
    msgs = [{"role": "user", "content": prompt}, {"role": "assistant", "content": reply}]
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(msgs, tokenize=False)
    return f"User: {prompt}\nAssistant: {reply}\n"


def file_docs(path: str | Path, tokenizer: Any = None) -> list[str]:
    """Documents from a user's file: JSONL lines with "text", "prompt" (+ optional "output" /
    "completion") or "messages" (chat template applied), else the whole file as plain text.
    Raises FileNotFoundError, or ValueError naming the line that has none of those fields."""
    path = Path(path)
    raw = path.read_text(encoding="utf-8")
    if path.suffix not in (".jsonl", ".json"):
        return [raw]
    if raw.lstrip().startswith("["):  # a JSON array of records
        try:
            records = list(enumerate(json.loads(raw), 1))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not JSON ({e.msg} at line {e.lineno})") from None
    else:
        records = []
        for n, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            try:
                records.append((n, json.loads(line)))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from None
    docs = []
    for n, obj in records:
        if isinstance(obj, dict) and isinstance(obj.get("text"), str):
            docs.append(obj["text"])
        elif isinstance(obj, dict) and isinstance(obj.get("messages"), list):
            if tokenizer is not None and getattr(tokenizer, "chat_template", None):
                docs.append(tokenizer.apply_chat_template(obj["messages"], tokenize=False))
            else:
                docs.append("\n".join(str(m.get("content", "")) for m in obj["messages"] if isinstance(m, dict)))
        elif isinstance(obj, dict) and isinstance(obj.get("prompt"), str):
            docs.append(obj["prompt"] + str(obj.get("output", obj.get("completion", ""))))
        else:
            raise ValueError(f"{path}:{n}: needs a \"text\", \"prompt\" or \"messages\" field")
    return docs


def calibration_docs(source: str, tokenizer: Any = None) -> list[str]:
    """Calibration documents for a source name (CALIB_SOURCES) or a file path.
    Raises ValueError for an unknown name that is not a file."""
    if source == "pystdlib":
        return stdlib_docs("calib")
    if source == "humaneval":
        return humaneval_docs("calib")
    if source == "sharegpt":
        return sharegpt_docs("calib", tokenizer)
    if Path(source).is_file():
        return file_docs(source, tokenizer)
    raise ValueError(f"calib: {source!r} is neither one of {', '.join(CALIB_SOURCES)} nor a file")


def eval_docs(slice_name: str, tokenizer: Any = None) -> list[str]:
    """Held-out documents of one evaluation slice (EVAL_SLICES) or a user's file.
    Raises ValueError for an unknown slice that is not a file."""
    if slice_name == "code_stdlib":
        return stdlib_docs("eval")
    if slice_name == "code_humaneval":
        return humaneval_docs("eval")
    kinds = {"chat_en": "en", "chat_nonen": "nonen", "odd_format": "odd"}
    if slice_name in kinds:
        return sharegpt_docs("eval", tokenizer, kinds[slice_name])
    if Path(slice_name).is_file():
        return file_docs(slice_name, tokenizer)
    raise ValueError(f"slice: {slice_name!r} is neither one of {', '.join(EVAL_SLICES)} nor a file")


def token_stream(docs: list[str], tokenizer: Any, budget: int, sep_id: int | None, seed: int = 0) -> list[int]:
    """Token ids of documents (shuffled with `seed`) joined by `sep_id`, until `budget` tokens."""
    import random

    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    ids: list[int] = []
    for i in order:
        if len(ids) >= budget:
            break
        ids.extend(tokenizer.encode(docs[i], add_special_tokens=False))
        if sep_id is not None:
            ids.append(sep_id)
    return ids[:budget]
