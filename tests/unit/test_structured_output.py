"""Structured output's mechanics (issue 33) on a tiny random model made here, with SmolLM2's tokenizer.

A random model babbles, so whatever it emits under a grammar is the grammar's doing: every output
that ends with "stop" must match its constraint. The engine's other paths (speculation, preemption,
mixed batches) must give the same tokens as the plain path.
"""
from __future__ import annotations

import json
import re
import shutil

import jsonschema
import pytest
import torch

from mixserve import SamplingParams
from mixserve.llm import LLM
from mixserve.structured_output import StructuredOutputs
from mixserve.structured_output import masks

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                                    "maxItems": 3},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "age", "ok"], "additionalProperties": False}
SCHEMAS = [
    SCHEMA,
    {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"kind": {"const": "point"}, "x": {"type": "number"}, "y": {"type": "number"}},
     "required": ["kind", "x", "y"], "additionalProperties": False},
    {"anyOf": [{"type": "string", "pattern": "^[a-z]{1,8}$"}, {"type": "null"}]},
    {"type": "object", "properties": {"when": {"type": "string", "format": "date"}}, "required": ["when"],
     "additionalProperties": False},
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm2_path):
    from tests.unit.test_engine_tiny import make_tiny_smol

    return make_tiny_smol(tmp_path_factory.mktemp("so") / "tiny-smol-vocab", smollm2_path)


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(tiny, dtype="float32", kv_cache_memory="16MiB", progress=False)


def json_params(schema, t, seed, max_tokens=96, **kw):
    return SamplingParams(temperature=t, seed=seed, max_tokens=max_tokens, structured=StructuredOutputs(json=schema),
                          **kw)


def test_every_finished_output_matches_its_schema_greedy_and_sampled(llm):
    sps = [json_params(s, t, seed) for s in SCHEMAS for t in (0.0, 1.0) for seed in range(3)]
    outs = llm.generate(["Reply in JSON:"] * len(sps), sps)
    stopped = 0
    for sp, o in zip(sps, outs):
        if o.finish_reason == "stop":
            stopped += 1
            jsonschema.validate(json.loads(o.text), sp.structured.json)
        else:
            assert o.finish_reason == "length"
    assert stopped >= len(sps) * 3 // 4, f"only {stopped} of {len(sps)} finished"


def test_regex_and_choice_and_lark_grammar(llm):
    sps = [SamplingParams(temperature=1.0, seed=s, max_tokens=40, structured=StructuredOutputs(regex=r"[0-9]{3}-[a-z]{2,4}"))
           for s in range(3)]
    sps += [SamplingParams(temperature=1.0, seed=s, max_tokens=20,
                           structured=StructuredOutputs(choice=["yes", "no", "maybe not"])) for s in range(3)]
    lark = 'start: "(" num ("+" num)* ")"\nnum: /[1-9][0-9]?/\n'
    sps += [SamplingParams(temperature=1.0, seed=s, max_tokens=40, structured=StructuredOutputs(grammar=lark))
            for s in range(3)]
    gbnf = 'root ::= "x" [0-9] [0-9]'
    sps += [SamplingParams(temperature=1.0, seed=0, max_tokens=10, structured=StructuredOutputs(grammar=gbnf))]
    outs = llm.generate(["Answer:"] * len(sps), sps)
    for o in outs[:3]:
        assert o.finish_reason == "stop" and re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", o.text), o.text
    for o in outs[3:6]:
        assert o.finish_reason == "stop" and o.text in ("yes", "no", "maybe not"), o.text
    for o in outs[6:9]:
        assert o.finish_reason == "length" or re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", o.text), o.text
    assert outs[9].finish_reason == "stop" and re.fullmatch(r"x[0-9][0-9]", outs[9].text), outs[9].text


def test_a_finished_grammar_ends_the_request_even_with_ignore_eos(llm):
    sp = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True, structured=StructuredOutputs(choice=["alpha", "beta"]))
    o = llm.generate(["Pick:"], sp)[0]
    assert o.finish_reason == "stop" and o.text in ("alpha", "beta")
    assert len(o.token_ids) < 50


def test_free_rows_beside_constrained_ones_are_untouched(llm):
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = llm.generate(["Tell me:"], free)[0].token_ids
    mixed = llm.generate(["Tell me:", "Reply in JSON:", "Tell me:"],
                         [free, json_params(SCHEMA, 1.0, 7), SamplingParams(temperature=1.0, seed=3, max_tokens=24)])
    assert mixed[0].token_ids == alone


def test_constrained_output_is_the_same_with_speculation_and_under_preemption(tiny, llm):
    sps = [json_params(s, t, seed) for s in SCHEMAS[:3] for t in (0.0, 1.0) for seed in (0, 1)]
    prompts = ["Reply in JSON:"] * len(sps)
    plain = [o.token_ids for o in llm.generate(prompts, sps)]
    spec = LLM(tiny, dtype="float32", kv_cache_memory="16MiB", progress=False, draft_model="ngram",
               speculation="fixed", num_speculative_tokens=4)
    got = spec.generate(prompts, sps)
    assert [o.token_ids for o in got] == plain
    # drafts were proposed and some checked against the grammar (a random model's n-grams repeat)
    assert sum(o.metrics["spec_proposed"] for o in got) > 0
    # a cache of a few blocks: the sequences preempt one another and recompute, matchers kept
    from mixserve.models.config import ModelConfig

    block_bytes = 4 * ModelConfig.from_folder(tiny).kv_bytes_per_token(4)  # 40 blocks of 4 tokens
    small = LLM(tiny, dtype="float32", kv_cache_memory=40 * block_bytes, block_size=4, progress=False)
    got = small.generate(prompts, sps)
    assert [o.token_ids for o in got] == plain
    assert sum(o.metrics["num_preemptions"] for o in got) > 0


def test_logprobs_are_those_of_the_masked_logits(llm):
    sp = SamplingParams(temperature=1.0, seed=1, max_tokens=10, logprobs=5,
                        structured=StructuredOutputs(choice=["yes", "no"]))
    o = llm.generate(["Pick:"], sp)[0]
    tok = llm.engine.tokenizer
    first = o.logprobs[0]
    # only the tokens that start "yes" or "no" are allowed: every alternative with a finite
    # logprob is one of them, and the allowed ones' probabilities sum to 1
    finite = [(t, lp) for t, lp in first.top if lp > float("-inf")]
    assert finite and all(("yes".startswith(tok.decode([t])) or "no".startswith(tok.decode([t]))) for t, _ in finite)
    assert abs(sum(torch.tensor([lp for _, lp in finite]).exp().tolist()) - 1.0) < 1e-4 or len(finite) == 5


def test_bad_constraints_are_refused_naming_the_field_and_the_engine_serves_on(llm):
    bad = [StructuredOutputs(json={"type": "object", "properties": {"a": {"type": "nonsense"}}}, source="response_format"),
           StructuredOutputs(regex="(unclosed", source="structured_outputs.regex"),
           StructuredOutputs(grammar="start: undefined_rule\n", source="structured_outputs.grammar")]
    for spec in bad:
        with pytest.raises(ValueError, match=re.escape(spec.source) + ":"):
            llm.generate(["x"], SamplingParams(max_tokens=4, structured=spec))
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutputs(json="{not json")
    assert llm.engine.block_manager.num_used_blocks == 0
    o = llm.generate(["x"], SamplingParams(temperature=0, max_tokens=4, structured=StructuredOutputs(choice=["ok"])))[0]
    assert o.text == "ok"


def test_a_constraint_compiles_once_and_its_copies_are_independent(llm):
    g = llm.engine.grammars
    spec = StructuredOutputs(json={"type": "array", "items": {"type": "integer"}, "maxItems": 2})
    before = len(g.compile_times)
    a, b = g.matcher(spec), g.matcher(StructuredOutputs(json=json.dumps(spec.json)))
    assert len(g.compile_times) == before + 1  # the same schema as text: the same key
    assert a.consume_token(llm.engine.tokenizer.encode("[")[0])
    assert not b.is_stopped() and b.validate_tokens(llm.engine.tokenizer.encode("[")) == 1


def test_mask_application_matches_the_bitmask_bit_for_bit():
    torch.manual_seed(0)
    vocab = 70  # not a multiple of 32: the last word's high bits are past the vocabulary
    mask = torch.randint(-2**31, 2**31 - 1, (3, masks.words(vocab)), dtype=torch.int32)
    logits = torch.randn(3, vocab)
    out = masks.apply(logits, [0, 2], mask)
    for r in range(3):
        for t in range(vocab):
            bit = (int(mask[r, t // 32]) >> (t % 32)) & 1
            if r == 1 or bit:
                assert out[r, t] == logits[r, t]
            else:
                assert out[r, t] == float("-inf")
    assert masks.apply(logits, [], mask) is logits


def test_a_trace_line_may_carry_response_format_and_bench_runs_it_constrained(llm, tmp_path):
    from mixserve.bench.offline import run_offline
    from mixserve.data.datasets import load_jsonl

    rf = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "array", "items": {"type": "integer"},
                                                                       "maxItems": 3}}}
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"prompt": "Numbers:", "max_tokens": 60, "response_format": rf}) + "\n"
                    + json.dumps({"prompt": "Text:", "max_tokens": 20}) + "\n")
    reqs = load_jsonl(path)
    assert reqs[0].response_format == rf and reqs[1].response_format is None
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "x", "response_format": {"type": "xml"}}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: response_format.type"):
        load_jsonl(bad)
    report, outs = run_offline(llm.engine, reqs, progress=False)
    assert outs[0].finish_reason == "stop" and len(json.loads(outs[0].text)) <= 3  # ended by its grammar
    assert len(outs[1].token_ids) == 20  # ignore_eos: the free one runs its budget


def test_sampled_constrained_distribution_is_the_same_with_a_draft_model(tiny, tmp_path):
    """Temperature 1 under a regex, with a mismatched draft model (another random model of the same
    vocabulary, its drafts masked by the grammar too) and without: the texts come from the same
    distribution (total variation over the 8 possible texts)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(1)
    cfg = Qwen2Config(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      tie_word_embeddings=True, initializer_range=0.3, eos_token_id=2, bos_token_id=1)
    draft = tmp_path / "draft"
    Qwen2ForCausalLM(cfg).float().eval().save_pretrained(draft)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{tiny}/{f}", draft / f)
    n = 1000
    spec = StructuredOutputs(regex="[ab][ab][ab]")
    plain = LLM(tiny, dtype="float32", kv_cache_memory="32MiB", progress=False)
    a = [o.text for o in plain.generate(["Go:"] * n, [SamplingParams(temperature=1.0, max_tokens=8, seed=i,
                                                                     structured=spec) for i in range(n)])]
    sd = LLM(tiny, dtype="float32", kv_cache_memory="32MiB", draft_model=str(draft), num_speculative_tokens=2,
             speculation="fixed", progress=False)
    outs = sd.generate(["Go:"] * n, [SamplingParams(temperature=1.0, max_tokens=8, seed=10_000 + i, structured=spec)
                                    for i in range(n)])
    b = [o.text for o in outs]
    assert sum(o.metrics["spec_proposed"] for o in outs) > 0
    assert all(re.fullmatch("[ab]{3}", t) for t in a + b)
    keys = sorted(set(a) | set(b))
    tv = 0.5 * sum(abs(a.count(k) - b.count(k)) / n for k in keys)
    assert tv < 0.08, (tv, {k: (a.count(k), b.count(k)) for k in keys})


def test_hw_probe_measures_what_masks_cost(smollm2_path):
    from mixserve.plan.hardware import probe_masks

    prof = probe_masks(smollm2_path, 49152, [2], steps=3, log=lambda *a: None)
    a, b = prof["fit"]
    assert a >= 0 and b >= 0 and a + b > 0
    assert prof["seconds"]["1"] > 0 and prof["seconds"]["24"] >= prof["seconds"]["1"] * 0.5


def test_what_a_break_it_round_found_is_refused_or_served(llm):
    """Found by trying the API from outside: each a 400-style ValueError naming the field, or served
    right, never a crash."""
    g = llm.engine.grammars
    # a chain of $refs / Lark rules: llguidance recurses; it killed the process on an 8 MB stack
    n = 1500
    chain = {"$defs": {f"d{i}": {"type": "array", "items": {"$ref": f"#/$defs/d{i + 1}"}} for i in range(n)}
             | {f"d{n}": {"type": "null"}}, "$ref": "#/$defs/d0"}
    g.compile(StructuredOutputs(json=chain))
    g.compile(StructuredOutputs(grammar="start: r0\n" + "".join(f'r{i}: "x" r{i + 1}\n' for i in range(5000))
                                + 'r5000: "a"\n'))
    for kw, field in ((dict(choice="abc"), "choice"), (dict(regex="ab\\"), "backslash"),
                      (dict(json="[" * 5000 + "]" * 5000), "nested"), (dict(json="true"), "object")):
        with pytest.raises(ValueError, match=field):
            StructuredOutputs(**kw)
    deep: dict = {}
    for _ in range(3000):
        deep = {"type": "array", "items": deep}
    with pytest.raises(ValueError, match="nested too deeply|structured_outputs"):
        g.compile(StructuredOutputs(json=deep))
    with pytest.raises(ValueError, match="too many expressions"):  # a lexer that explodes at its first step
        g.compile(StructuredOutputs(regex="(a{1000}){1000}b"))
    with pytest.raises(ValueError, match="^stop:"):
        llm.generate(["x"], SamplingParams(stop=["]"], structured=StructuredOutputs(choice=["a]"])))
    with pytest.raises(ValueError, match="^stop_token_ids:"):
        llm.generate(["x"], SamplingParams(stop_token_ids=[5], structured=StructuredOutputs(choice=["a]"])))
    # a constraint that starts after a token leaves the text before it free: stop strings apply there
    llm.generate(["x"], SamplingParams(max_tokens=3, stop=["zz"],
                                       structured=StructuredOutputs(choice=["a"], after="<|im_start|>")))
    with pytest.raises(ValueError, match="end token"):
        g.compile(StructuredOutputs(grammar='start: "a" <[2]>\n'))
    # 3,000 choices (a parser row of over 2,000 items failed after the first token), a choice that is a
    # special token's text (spelled with ordinary tokens), logprobs where fewer tokens are allowed
    # than asked for (no -inf alternatives)
    sps = [SamplingParams(temperature=1.0, seed=1, max_tokens=12,
                          structured=StructuredOutputs(choice=[f"c{i}" for i in range(3000)])),
           SamplingParams(temperature=0, max_tokens=30, structured=StructuredOutputs(choice=["ok", "ok<|im_end|>!"])),
           SamplingParams(temperature=1.0, seed=2, max_tokens=30, logprobs=20,
                          structured=StructuredOutputs(regex="[0-9]{2}"))]
    outs = llm.generate(["x"] * 3, sps)
    assert outs[0].finish_reason == "stop" and re.fullmatch(r"c[0-9]+", outs[0].text)
    # text that spells a special token's: generated with ordinary tokens where llguidance offers them,
    # else the request ends with the reason; never a crash
    assert (outs[1].finish_reason == "stop" and outs[1].text in ("ok", "ok<|im_end|>!")) or (
        outs[1].finish_reason == "error" and "special token" in outs[1].stop_reason), outs[1]
    with pytest.raises(ValueError, match="special token"):
        llm.generate(["x"], SamplingParams(max_tokens=4, structured=StructuredOutputs(choice=["<|im_end|>!"])))
    assert outs[2].finish_reason == "stop" and re.fullmatch("[0-9]{2}", outs[2].text)
    assert all(lp > float("-inf") for e in outs[2].logprobs for _, lp in e.top)
    assert llm.engine.block_manager.num_used_blocks == 0


def test_the_second_break_it_round(llm, tiny):
    """Found by the second round: the engine thread never compiles (an evicted grammar is kept with
    its request), a request's x-guidance options are not its to set, padding ids are never named,
    and a position whose grammar allows nothing under speculation ends with a reason, not NaN."""
    g = llm.engine.grammars
    spec = StructuredOutputs(choice=["yes", "no"])
    m = g.compile(spec)
    g._cache.clear()  # as an eviction would
    before = len(g.compile_times)
    assert g.matcher(spec) is not None and len(g.compile_times) == before  # kept with the spec
    with pytest.raises(ValueError, match="uniqueItems"):
        g.compile(StructuredOutputs(json={"x-guidance": {"lenient": True}, "type": "array", "uniqueItems": True}))
    # logits wider than the vocabulary (the 0.5B's 151,936 against 151,665): the padding ids
    from mixserve.structured_output.compiler import GrammarCompiler

    wide = GrammarCompiler(llm.engine.new_tokenizer, 49152 + 64, [2])
    with pytest.raises(ValueError, match="past this vocabulary"):
        wide.compile(StructuredOutputs(grammar="start: <[49200]>\n"))
    keep = masks.allowed(wide.keep_mask(StructuredOutputs(choice=["a"])).unsqueeze(0), 49152 + 64)[0]
    assert not keep[49152:].any() and keep[100:200].all()
    assert m is not None
    spec_llm = LLM(tiny, dtype="float32", kv_cache_memory="16MiB", progress=False, draft_model="ngram",
                   speculation="fixed", num_speculative_tokens=4)
    o = spec_llm.generate([[49, 50, 51, 49, 50, 51, 49, 50, 51]], SamplingParams(
        temperature=0, max_tokens=10, logprobs=1, structured=StructuredOutputs(regex="abc<\\|im_start\\|>")))[0]
    assert o.finish_reason in ("stop", "error") and all(
        e.logprob == e.logprob for e in o.logprobs)  # no NaN
    if o.finish_reason == "error":
        assert "grammar" in o.stop_reason


def test_a_trace_line_may_carry_tools(tiny, tmp_path):
    """A trace line's tools: its prompt a chat message with the tools, its reply constrained as
    tool_choice asks (required: a call of one of the tools)."""
    from mixserve.bench.offline import run_offline
    from mixserve.data.datasets import load_jsonl
    from mixserve.server.tool_calls import split_calls

    tools = [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}}}]
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"prompt": "Add.", "max_tokens": 80, "tools": tools, "tool_choice": "required"}) + "\n")
    reqs = load_jsonl(path)
    assert reqs[0].tools == tools and reqs[0].tool_choice == "required"
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "x", "tools": tools, "tool_choice": {"type": "function",
                                                                            "function": {"name": "nope"}}}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:1: 'tool_choice'"):
        load_jsonl(bad)
    # SmolLM2's chat template (it ignores tools; the grammar holds all the same)
    chat = LLM(tiny, dtype="float32", kv_cache_memory="16MiB", progress=False)
    _, outs = run_offline(chat.engine, reqs, progress=False)
    content, calls = split_calls(outs[0].text, ("add",))
    assert outs[0].finish_reason == "length" or (len(calls) >= 1 and calls[0]["function"]["name"] == "add")
