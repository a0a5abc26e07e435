"""Traces: prompt_tokens synthesis, trace parsing, `mix describe` statistics, `mix sample`."""
import json

import pytest

from mixserve.data.datasets import MAX_TRACE_PROMPT_TOKENS, BenchRequest, count_tokens, load_jsonl, \
    synthetic_prompt
from mixserve.data.trace import add_arrivals, describe_requests, format_description, plot_histograms, \
    sample_requests, write_trace
from mixserve.cli import main


class WhitespaceTokenizer:
    def encode(self, text, add_special_tokens=False):
        return text.split()


class ShortPiecesTokenizer:
    """Words longer than 3 letters are two tokens (as rarer words are in BPE): the word filter
    must drop them or the count comes out long."""

    def encode(self, text, add_special_tokens=False):
        return [piece for w in text.split() for piece in ([w] if len(w) <= 3 else [w[:3], w[3:]])]


TOK = WhitespaceTokenizer()


def _write(path, objs):
    path.write_text("".join((o if isinstance(o, str) else json.dumps(o)) + "\n" for o in objs), encoding="utf-8")


@pytest.mark.parametrize("tok", [TOK, ShortPiecesTokenizer()])
@pytest.mark.parametrize("n", [1, 2, 17, 1500])
def test_synthetic_prompt_exact_length_and_deterministic(tok, n):
    text = synthetic_prompt(tok, n, seed=3)
    assert count_tokens(tok, text) == n
    assert synthetic_prompt(tok, n, seed=3) == text
    assert n < 5 or synthetic_prompt(tok, n, seed=4) != text


@pytest.mark.integration
@pytest.mark.parametrize("model", ["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"])
def test_synthetic_prompt_real_tokenizer(model):
    from mixserve.models.weights import load_tokenizer

    tok = load_tokenizer(model)
    for n in (1, 64, 2999):
        assert len(tok.encode(synthetic_prompt(tok, n, seed=n), add_special_tokens=False)) == n


def test_load_jsonl_prompt_tokens_and_arrivals(tmp_path):
    p = tmp_path / "t.jsonl"
    _write(p, [
        {"prompt_tokens": 40, "output_tokens": 8, "arrival_s": 0, "tag": "doc"},
        {"prompt": "a b c", "max_tokens": 4, "arrival_s": 1.5},
        {"prompt_tokens": 40, "max_tokens": 2},
    ])
    reqs = load_jsonl(p, tokenizer=TOK)
    assert [(r.prompt_len, r.max_tokens, r.ref_output_len, r.tag, r.arrival_s) for r in reqs] == [
        (40, 8, 8, "doc", 0.0), (3, 4, None, "jsonl", 1.5), (40, 2, None, "jsonl", None)]
    assert len(reqs[0].prompt.split()) == 40
    assert reqs[0].prompt != reqs[2].prompt  # seeded by line: not 200 copies of one document
    assert [r.synthetic for r in reqs] == [True, False, True]  # made-up text is marked (plan --measure says so)
    assert [r.prompt for r in load_jsonl(p, tokenizer=TOK)] == [r.prompt for r in reqs]


@pytest.mark.parametrize("bad,msg", [
    ({"prompt": "x", "prompt_tokens": 3}, "give 'prompt' or 'prompt_tokens', not both"),
    ({"prompt_tokens": 0}, "'prompt_tokens' must be a positive integer"),
    ({"prompt_tokens": 2.5}, "'prompt_tokens' must be a positive integer"),
    ({"max_tokens": 3}, r"'prompt' must be a string \(or give 'prompt_tokens'\)"),
    ({"prompt": "x", "arrival_s": -1}, "'arrival_s' must be a number of seconds >= 0"),
    ({"prompt": "x", "arrival_s": "0.5"}, "'arrival_s' must be a number of seconds >= 0"),
    ('{"prompt": "x", "arrival_s": NaN}', "'arrival_s' must be a number of seconds >= 0"),
])
def test_load_jsonl_trace_errors_name_path_line(tmp_path, bad, msg):
    p = tmp_path / "bad.jsonl"
    _write(p, [{"prompt": "ok"}, "", bad])
    with pytest.raises(ValueError, match=rf"bad\.jsonl:3: {msg}"):
        load_jsonl(p, tokenizer=TOK)


def test_prompt_tokens_needs_a_tokenizer(tmp_path):
    p = tmp_path / "t.jsonl"
    _write(p, [{"prompt_tokens": 5}])
    with pytest.raises(ValueError, match=r"t\.jsonl:1: 'prompt_tokens' needs a tokenizer"):
        load_jsonl(p)


def test_huge_prompt_tokens_and_non_utf8_name_the_line(tmp_path):
    # 1e8 tokens once made synthetic_prompt build a 100M-word text: the tokenizer died of memory
    p = tmp_path / "huge.jsonl"
    _write(p, [{"prompt_tokens": 5}, {"prompt_tokens": MAX_TRACE_PROMPT_TOKENS + 1}])
    with pytest.raises(ValueError, match=rf"huge\.jsonl:2: 'prompt_tokens' must be at most {MAX_TRACE_PROMPT_TOKENS}"):
        load_jsonl(p, tokenizer=TOK)
    p = tmp_path / "latin1.jsonl"
    p.write_bytes(b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=r"latin1\.jsonl:2: not UTF-8 text \(byte 0xe9 at byte 16\)"):
        load_jsonl(p, tokenizer=TOK)
    p.write_bytes(b'{"prompt": "ok"}\r\n\r\n{"prompt": "caf\xc3\xa9"}\r\n')  # CRLF and UTF-8 still read
    assert [r.prompt for r in load_jsonl(p)] == ["ok", "caf\u00e9"]


def _req(plen, out, arrival=None, tag="a"):
    return BenchRequest("x", out, plen, tag, None, arrival)


def test_describe_hand_made_trace():
    # prompts 10, 20, ..., 100; outputs 1..10 -- percentiles by linear interpolation over ranks 0..9:
    # p10 at rank 0.9 -> 10 + 0.9 * 10 = 19; p50 at 4.5 -> 55; p90 at 8.1 -> 91; p99 at 8.91 -> 99.1
    reqs = [_req(10 * (i + 1), i + 1, arrival=0.5 * i, tag="a" if i < 7 else "b") for i in range(10)]
    d = describe_requests(reqs, prompt_bands=(40, 55, 101), output_bands=(3,))
    assert d["count"] == 10
    p = d["prompt_tokens"]
    assert (p["p10"], p["p50"], p["p90"], p["max"], p["mean"]) == pytest.approx((19, 55, 91, 100, 55))
    assert p["p99"] == pytest.approx(99.1)
    assert p["below"] == {"40": 0.3, "55": 0.5, "101": 1.0}  # strictly below: 40 is not < 40
    o = d["output_tokens"]
    assert (o["p50"], o["max"], o["below"]) == (5.5, 10, {"3": 0.2})
    assert d["tags"] == {"a": 7, "b": 3}
    assert d["arrival"] == {"span_s": 4.5, "rate_per_s": pytest.approx(2.0)}
    text = format_description(d, "t")
    assert "30% prompts < 40 tokens" in text and "20% outputs < 3 tokens" in text and "2.00 requests/s" in text
    assert "arrival" not in describe_requests([_req(5, 1), _req(6, 1, arrival=1.0)])


def test_describe_refuses_uncounted_or_empty():
    with pytest.raises(ValueError, match="no requests"):
        describe_requests([])
    with pytest.raises(ValueError, match="tokenizer"):
        describe_requests([_req(-1, 4)])


def test_histogram_png(tmp_path):
    out = plot_histograms([_req(10 * i + 1, i + 1) for i in range(30)], tmp_path / "sub" / "h.png", "t")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sample_synthetic_is_seeded_and_in_range(tmp_path):
    a = sample_requests("synthetic-long-prompt", 50, seed=7)
    assert a == sample_requests("synthetic-long-prompt", 50, seed=7)
    assert a != sample_requests("synthetic-long-prompt", 50, seed=8)
    assert all(1500 <= x["prompt_tokens"] <= 3000 and 16 <= x["output_tokens"] <= 64 for x in a)
    add_arrivals(a, request_rate=4.0, seed=7)
    times = [x["arrival_s"] for x in a]
    assert times[0] == 0 and times == sorted(times) and len(set(times)) == 50
    path = write_trace(a, tmp_path / "long.jsonl")
    reqs = load_jsonl(path, tokenizer=TOK)
    assert [(r.prompt_len, r.max_tokens, r.arrival_s) for r in reqs] == [
        (x["prompt_tokens"], x["output_tokens"], x["arrival_s"]) for x in a]
    with pytest.raises(ValueError, match="request_rate"):
        add_arrivals(a, 0)
    with pytest.raises(ValueError, match="source: unknown"):
        sample_requests("mmlu", 3)


def test_sample_humaneval_and_sharegpt_seeded():
    he = sample_requests("humaneval", 3, output_len_cap=99)
    assert [x["max_tokens"] for x in he] == [99] * 3 and he[0]["prompt"].lstrip().startswith("from typing")
    with pytest.raises(ValueError, match="needs a tokenizer"):
        sample_requests("sharegpt", 3)


def test_cli_sample_is_deterministic(tmp_path, capsys):
    for name in ("a", "b"):
        assert main(["mix", "sample", "--source", "synthetic-long-prompt", "--num", "12", "--seed", "5",
                     "--request-rate", "3", "--out", str(tmp_path / f"{name}.jsonl")]) == 0
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    assert len((tmp_path / "a.jsonl").read_text().splitlines()) == 12
    assert main(["mix", "sample", "--source", "humaneval", "--num", "0", "--out", str(tmp_path / "c.jsonl")]) == 2
    assert "num: must be >= 1" in capsys.readouterr().err


def test_cli_unwritable_out_is_an_error_not_a_traceback(tmp_path, capsys):
    (tmp_path / "t.jsonl").mkdir()  # once: IsADirectoryError escaped main as a traceback
    assert main(["mix", "sample", "--source", "synthetic-long-prompt", "--num", "2", "--out",
                 str(tmp_path / "t.jsonl")]) == 2
    assert "mixserve mix: error: [Errno 21] Is a directory" in capsys.readouterr().err
