"""Tests for mixserve.data.datasets and mixserve.bench.metrics.

Fast tests use a whitespace "tokenizer" and tiny synthetic files; the one
test that reads the packaged ShareGPT file is marked integration.
"""

import io
import json
import math
import os

import pytest

from mixserve.data.datasets import (
    ArrayScanStats,
    BenchRequest,
    iter_json_array,
    load_dataset,
    load_humaneval,
    load_humaneval_rows,
    load_jsonl,
    load_sharegpt,
    load_sharegpt_pairs,
)
from mixserve.bench.metrics import BenchReport, RequestMetrics, build_report, format_table, summarize


class WhitespaceTokenizer:
    """One token per whitespace-separated word."""

    def encode(self, text, add_special_tokens=False):
        assert add_special_tokens is False
        return text.split()


class CallableTokenizer:
    """HF-style: only __call__ returning input_ids."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": text.split()}


TOK = WhitespaceTokenizer()


# ---------------------------------------------------------------- parser


ITEMS = [
    {"id": "a", "v": "héllo wörld ☃ 😀"},  # multi-byte UTF-8, split by small chunks
    123456789,
    [1, 2, {"x": None}],
    "tail string",
    -0.5e3,
    True,
]


@pytest.mark.parametrize("chunk_size", [1, 2, 3, 7, 64, 1 << 20])
def test_iter_json_array_complete(tmp_path, chunk_size):
    p = tmp_path / "full.json"
    p.write_text("\ufeff[\n  " + ",\n  ".join(json.dumps(x, ensure_ascii=False) for x in ITEMS) + "\n]\n",
                 encoding="utf-8")
    stats = ArrayScanStats()
    assert list(iter_json_array(p, chunk_size=chunk_size, stats=stats)) == ITEMS
    assert stats.complete and stats.items == len(ITEMS) and stats.dropped_chars == 0
    assert 0 < stats.bytes_read <= p.stat().st_size  # reading stops at the closing bracket


@pytest.mark.parametrize("chunk_size", [1, 5, 4096])
def test_iter_json_array_truncated_mid_record(tmp_path, chunk_size):
    full = json.dumps(
        [{"id": i, "conversations": [{"from": "human", "value": "q ü " * i}]} for i in range(5)],
        ensure_ascii=False, indent=2,
    ).encode("utf-8")
    # Cut inside the last record's string (and inside a multi-byte char).
    cut = full.rindex("ü".encode()) + 1
    p = tmp_path / "cut.json"
    p.write_bytes(full[:cut])
    stats = ArrayScanStats()
    got = list(iter_json_array(str(p), chunk_size=chunk_size, stats=stats))
    assert [r["id"] for r in got] == [0, 1, 2, 3]
    assert not stats.complete
    assert stats.items == 4 and stats.dropped_chars > 0


@pytest.mark.parametrize("text,expected", [
    ('[{"a": 1}, ', [{"a": 1}]),       # cut right after a comma
    ('[{"a": 1}, {"b"', [{"a": 1}]),   # cut inside a key
    ("[12, 34", [12]),                 # a number at EOF may be cut: not trusted
    ("[", []),
    ("", []),
])
def test_iter_json_array_truncation_points(text, expected):
    stats = ArrayScanStats()
    assert list(iter_json_array(io.BytesIO(text.encode()), chunk_size=2, stats=stats)) == expected
    assert not stats.complete


def test_iter_json_array_every_cut_point():
    # Cut the file at every byte: never raises, always yields a prefix of the
    # items, and only the uncut file is reported complete.
    data = ("[" + ", ".join(json.dumps(x, ensure_ascii=False) for x in ITEMS) + "]").encode("utf-8")
    for cut in range(len(data) + 1):
        stats = ArrayScanStats()
        got = list(iter_json_array(io.BytesIO(data[:cut]), chunk_size=3, stats=stats))
        assert got == ITEMS[: len(got)], cut
        assert stats.complete == (cut == len(data)), cut
        if stats.complete:
            assert got == ITEMS


def test_iter_json_array_stream_and_empty():
    stats = ArrayScanStats()
    assert list(iter_json_array(io.BytesIO(b" [ ] "), stats=stats)) == []
    assert stats.complete
    assert list(iter_json_array(io.StringIO('[{"a": "é"}, 2]'), chunk_size=2)) == [{"a": "é"}, 2]


def test_iter_json_array_rejects_non_array():
    with pytest.raises(ValueError, match="top-level JSON array"):
        list(iter_json_array(io.BytesIO(b'{"a": 1}')))
    with pytest.raises(ValueError, match="between array items"):
        list(iter_json_array(io.BytesIO(b"[1 2]")))


# ---------------------------------------------------------------- ShareGPT (synthetic)


def _conv(*turns):
    return {"id": "x", "conversations": [{"from": f, "value": v} for f, v in turns]}


def _write_sharegpt(path, records, truncate=True):
    text = json.dumps(records, indent=2)
    if truncate:
        text = text[: text.rindex("]")].rstrip() + ',\n  {"id": "cut", "conversations": [{"from": "human", "value": "never fin'
    path.write_text(text, encoding="utf-8")


def _words(n, w="w"):
    return " ".join([w] * n)


def test_sharegpt_pairs_first_pair_rule_and_cache(tmp_path):
    src = tmp_path / "sg.json"
    records = [
        _conv(("human", "p1 " + _words(5)), ("gpt", "r1 " + _words(9)), ("human", "later"), ("gpt", "later")),
        _conv(("gpt", "greeting"), ("human", "p2 " + _words(5)), ("gpt", "r2 " + _words(9))),  # starts with gpt
        _conv(("human", "only human")),                                          # no reply: skipped
        _conv(("human", "p3"), ("human", "p3b"), ("gpt", "r3")),                 # first human wins
        _conv(("system", "s"), ("human", "p4"), ("gpt", "")),                    # empty reply: skipped
        {"id": "no-conv"},
    ]
    _write_sharegpt(src, records)
    cache = tmp_path / "cache"

    d = load_sharegpt_pairs(path=src, cache_dir=cache)
    assert not d.from_cache and d.records == len(records) and not d.complete
    assert [p[0].split()[0] for p in d.pairs] == ["p1", "p2", "p3"]
    assert d.pairs[2] == ("p3", "r3")
    assert (cache / "sharegpt_pairs.json").is_file()

    d2 = load_sharegpt_pairs(path=src, cache_dir=cache)
    assert d2.from_cache and d2.pairs == d.pairs and d2.records == d.records

    # A changed source invalidates the cache.
    _write_sharegpt(src, records[:1], truncate=False)
    os.utime(src, ns=(1, 1))
    d3 = load_sharegpt_pairs(path=src, cache_dir=cache)
    assert not d3.from_cache and d3.complete and len(d3.pairs) == 1

    # A corrupt cache is rebuilt, not fatal.
    (cache / "sharegpt_pairs.json").write_text("{not json")
    assert len(load_sharegpt_pairs(path=src, cache_dir=cache).pairs) == 1


def test_load_sharegpt_filters_and_seed(tmp_path):
    src = tmp_path / "sg.json"
    records = []
    for i in range(40):
        records.append(_conv(("human", _words(4 + i, f"q{i}")), ("gpt", _words(5 + 20 * i))))
    records.append(_conv(("human", _words(2)), ("gpt", _words(50))))     # prompt too short
    records.append(_conv(("human", _words(100)), ("gpt", _words(50))))   # prompt too long
    records.append(_conv(("human", _words(10)), ("gpt", _words(3))))     # reply too short
    _write_sharegpt(src, records)
    kw = dict(path=src, cache_dir=tmp_path / "c", max_prompt_len=60, max_output_len=256, min_len=4)

    a = load_sharegpt(TOK, 20, seed=1, **kw)
    b = load_sharegpt(TOK, 20, seed=1, **kw)
    c = load_sharegpt(TOK, 20, seed=2, **kw)
    assert [r.prompt for r in a] == [r.prompt for r in b]
    assert [r.prompt for r in a] != [r.prompt for r in c]
    assert len(a) == 20
    for r in a:
        assert isinstance(r, BenchRequest) and r.tag == "sharegpt"
        assert 4 <= r.prompt_len <= 60 and r.prompt_len == len(r.prompt.split())
        assert r.ref_output_len >= 4
        assert r.max_tokens == min(r.ref_output_len, 256)
    assert any(r.ref_output_len > 256 for r in a)  # the cap was exercised

    # Asking for more than pass the filters: warns, returns what exists
    # (40 records with prompt lengths 4..43, all <= 60).
    with pytest.warns(UserWarning, match="only 40 of 100"):
        assert len(load_sharegpt(CallableTokenizer(), 100, **kw)) == 40
    assert len(load_sharegpt(TOK, None, **kw)) == 40


# ---------------------------------------------------------------- HumanEval


def test_humaneval():
    rows = load_humaneval_rows()
    assert len(rows) == 164 and rows[0]["task_id"] == "HumanEval/0"
    assert {"prompt", "canonical_solution", "test", "task_id", "entry_point"} <= set(rows[0])

    reqs = load_humaneval(3, max_tokens=128)
    assert [r.prompt for r in reqs] == [r["prompt"] for r in rows[:3]]
    assert all(r.tag == "humaneval" and r.max_tokens == 128 and r.prompt_len == -1 for r in reqs)
    assert all(r.ref_output_len is None for r in reqs)

    reqs = load_humaneval(2, tokenizer=TOK)
    assert reqs[0].prompt_len == len(rows[0]["prompt"].split())
    assert reqs[0].ref_output_len == len(rows[0]["canonical_solution"].split())
    assert len(load_humaneval()) == 164


# ---------------------------------------------------------------- JSONL traces


def _write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def test_load_jsonl_ok(tmp_path):
    p = tmp_path / "trace.jsonl"
    _write_lines(p, [
        json.dumps({"prompt": "a b c", "max_tokens": 10, "tag": "chat"}),
        "",
        json.dumps({"prompt": "d e", "output_tokens": 7}),
        json.dumps({"prompt": "f", "max_tokens": 5, "output_tokens": 9}),
        json.dumps({"prompt": "g"}),
    ])
    reqs = load_jsonl(p, tokenizer=TOK, default_max_tokens=33)
    assert [(r.max_tokens, r.prompt_len, r.tag, r.ref_output_len) for r in reqs] == [
        (10, 3, "chat", None),
        (7, 2, "jsonl", 7),
        (5, 1, "jsonl", 9),
        (33, 1, "jsonl", None),
    ]
    assert load_jsonl(p)[0].prompt_len == -1


@pytest.mark.parametrize("bad,msg", [
    ("{not json", "invalid JSON"),
    ('["a list"]', "expected a JSON object"),
    ('{"max_tokens": 3}', "'prompt' must be a string"),
    ('{"prompt": "x", "max_tokens": 0}', "'max_tokens' must be a positive integer"),
    ('{"prompt": "x", "max_tokens": "12"}', "'max_tokens' must be a positive integer"),
    ('{"prompt": "x", "output_tokens": true}', "'output_tokens' must be a positive integer"),
    ('{"prompt": "x", "tag": 5}', "'tag' must be a string"),
])
def test_load_jsonl_errors_name_line(tmp_path, bad, msg):
    p = tmp_path / "bad.jsonl"
    _write_lines(p, [json.dumps({"prompt": "ok", "max_tokens": 1}), "", bad])
    with pytest.raises(ValueError, match=rf"bad\.jsonl:3: {msg}"):
        load_jsonl(p)


def test_load_dataset_dispatch(tmp_path):
    p = tmp_path / "t.jsonl"
    _write_lines(p, [json.dumps({"prompt": f"p{i}"}) for i in range(5)])
    reqs = load_dataset(str(p), TOK, 3, output_len_cap=17)
    assert [r.prompt for r in reqs] == ["p0", "p1", "p2"] and reqs[0].max_tokens == 17
    assert len(load_dataset(p, TOK, None)) == 5

    reqs = load_dataset("humaneval", TOK, 4, output_len_cap=64)
    assert len(reqs) == 4 and reqs[0].max_tokens == 64 and reqs[0].prompt_len > 0

    with pytest.raises(ValueError, match="unknown dataset"):
        load_dataset("mmlu", TOK, 1)
    with pytest.raises(ValueError, match="not found"):
        load_dataset(str(tmp_path / "missing.jsonl"), TOK, 1)


# ---------------------------------------------------------------- metrics


def test_summarize_known_values():
    s = summarize([5.0, 1.0, 4.0, 2.0, 3.0])
    assert s["count"] == 5
    assert s["mean"] == pytest.approx(3.0)
    assert s["p50"] == pytest.approx(3.0)
    assert s["p90"] == pytest.approx(4.6)   # linear: 1 + 0.9 * 4 = 4.6 -> between 4 and 5
    assert s["p99"] == pytest.approx(4.96)

    s = summarize(range(1, 101))
    assert s["p50"] == pytest.approx(50.5) and s["p90"] == pytest.approx(90.1) and s["p99"] == pytest.approx(99.01)

    e = summarize([])
    assert e["count"] == 0 and all(math.isnan(e[k]) for k in ("mean", "p50", "p90", "p99"))


def test_request_metrics_formula():
    m = RequestMetrics(arrival_s=10.0, first_token_s=10.5, finish_s=12.5, prompt_tokens=100, output_tokens=5)
    assert m.ttft == pytest.approx(0.5)
    assert m.e2e == pytest.approx(2.5)
    assert m.tpot == pytest.approx((2.5 - 0.5) / 4)
    assert RequestMetrics(0.0, 0.1, 0.1, 3, 1).tpot is None
    assert RequestMetrics(0.0, None, 0.3, 3, 0).ttft is None
    assert RequestMetrics(0.0, None, 0.3, 3, 0).tpot is None


def test_bench_report_and_table():
    reqs = [
        RequestMetrics(0.0, 0.1, 1.1, 10, 11),   # tpot 0.1
        RequestMetrics(0.5, 0.7, 1.7, 20, 6),    # tpot 0.2
        RequestMetrics(1.0, 1.2, 1.2, 30, 1),    # no tpot
    ]
    rep = build_report(reqs, 2.0, {"peak_kv_blocks": 42, "preemptions": 0})
    assert rep == BenchReport(reqs, 2.0, {"peak_kv_blocks": 42, "preemptions": 0}).to_dict()
    assert rep["num_requests"] == 3
    assert rep["requests_per_s"] == pytest.approx(1.5)
    assert rep["input_tokens_per_s"] == pytest.approx(30.0)
    assert rep["output_tokens_per_s"] == pytest.approx(9.0)
    assert rep["total_tokens_per_s"] == pytest.approx(39.0)
    assert rep["ttft_s"]["count"] == 3 and rep["ttft_s"]["mean"] == pytest.approx(0.5 / 3)
    assert rep["tpot_s"]["count"] == 2 and rep["tpot_s"]["mean"] == pytest.approx(0.15)
    assert rep["e2e_s"]["p50"] == pytest.approx(1.1)
    assert rep["extra"] == {"peak_kv_blocks": 42, "preemptions": 0}
    json.dumps(rep)  # serializable

    table = format_table(rep)
    assert "latency (ms)" in table and "peak_kv_blocks" in table
    tpot_row = next(line for line in table.splitlines() if line.startswith("TPOT"))
    assert "150.00" in tpot_row  # mean 0.15 s shown in ms

    empty = build_report([], 0.0)
    assert empty["num_requests"] == 0 and math.isnan(empty["requests_per_s"])
    assert "TTFT" in format_table(empty)


# ---------------------------------------------------------------- real ShareGPT


@pytest.mark.integration
def test_load_sharegpt_real():
    reqs = load_sharegpt(TOK, 5, seed=0, max_prompt_len=1024, max_output_len=256)
    assert len(reqs) == 5
    assert len({r.prompt for r in reqs}) == 5
    for r in reqs:
        assert r.tag == "sharegpt" and isinstance(r.prompt, str)
        assert 4 <= r.prompt_len <= 1024 and r.prompt_len == len(r.prompt.split())
        assert r.ref_output_len >= 4 and r.max_tokens == min(r.ref_output_len, 256)
    # Same seed, same sample (now served from the cache).
    assert [r.prompt for r in load_sharegpt(TOK, 5, seed=0)] == [r.prompt for r in reqs]
