"""Calibration and held-out corpora: splits never overlap, slices are what they say."""
import json

import pytest

from mixserve.data import corpora


def test_stdlib_and_humaneval_splits_are_disjoint():
    for fn in (corpora.stdlib_docs, corpora.humaneval_docs):
        calib, held = fn("calib"), fn("eval")
        assert calib and held
        assert not set(calib) & set(held)
    assert len(corpora.humaneval_docs("eval")) == 82


def test_sharegpt_kinds():
    es = "Claro, aquí tienes una receta para la cena de hoy con los ingredientes que tienes en casa. " * 3
    assert corpora.sharegpt_kind("hola", es) == "nonen"
    assert corpora.sharegpt_kind("翻译", "这是一个很长的中文回答，" * 20) == "nonen"
    table = "| a | b |\n|---|---|\n| 1 | 2 |\n| 3 | 4 |\n"
    assert corpora.sharegpt_kind("make a table", "Here it is:\n" + table) == "odd"
    prose = "The quick brown fox jumps over the lazy dog and then it runs away from the farm. " * 3
    assert corpora.sharegpt_kind("tell me a story", prose) == "en"
    assert corpora.sharegpt_kind("code please", "```python\nprint(1)\n```") == "other"


def test_file_docs(tmp_path):
    f = tmp_path / "t.jsonl"
    f.write_text(json.dumps({"text": "a"}) + "\n\n" + json.dumps({"prompt": "p", "output": "o"}) + "\n"
                 + json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    assert corpora.file_docs(f) == ["a", "po", "hi"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"nope": 1}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        corpora.file_docs(bad)
    txt = tmp_path / "plain.txt"
    txt.write_text("just text")
    assert corpora.calibration_docs(str(txt)) == ["just text"]
    with pytest.raises(ValueError, match="neither"):
        corpora.calibration_docs("no-such-source")
    with pytest.raises(ValueError, match="neither"):
        corpora.eval_docs("no-such-slice")


class _Tok:
    def encode(self, text, add_special_tokens=False):
        return [len(w) for w in text.split()]


def test_token_stream_budget_and_separators():
    docs = ["a bb ccc", "dddd eeeee", "f"]
    ids = corpora.token_stream(docs, _Tok(), budget=5, sep_id=0, seed=1)
    assert len(ids) == 5 and 0 in ids
    assert sorted(corpora.token_stream(docs, _Tok(), budget=100, sep_id=None)) == [1, 1, 2, 3, 4, 5]
