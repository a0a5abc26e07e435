"""Tool calling's pieces (issue 33): checking tools and tool_choice, the call grammar, reading calls
out of a reply, streamed and whole."""
from __future__ import annotations

import json
import random

import pytest

from mixserve.server.protocol import APIError, parse_request
from mixserve.server.tool_calls import ToolStream, bare_calls, plan, split_calls
from mixserve.structured_output.tools import call_grammar

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
MSG = [{"role": "user", "content": "hi"}]


def req(**kw):
    return parse_request("chat", {"model": "m", "messages": MSG, **kw})


@pytest.mark.parametrize("kw,param", [
    (dict(tools=[]), "tools"), (dict(tools=[{"type": "function"}]), "tools"),
    (dict(tools=[{"type": "function", "function": {"description": "no name"}}]), "tools"),
    (dict(tools=[{"type": "function", "function": {"name": "has space"}}]), "tools"),
    (dict(tools=[WEATHER, WEATHER]), "tools"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": []}}]), "tools"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "extra": 1}}]), "tools"),
    (dict(tools=[{"type": "function", "function": {"name": "get\n"}}]), "tools"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "strict": "yes"}}]), "tools"),
    (dict(tools=[{"type": "function", "function": {"name": "f"}, "extra": 1}]), "tools"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"const": "</tool_call>"}}}]), "tools"),
    (dict(tools=[WEATHER], tool_choice="always"), "tool_choice"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
    (dict(tools=[WEATHER], tool_choice={"type": "function"}), "tool_choice"),
    (dict(tool_choice="required"), "tool_choice"), (dict(parallel_tool_calls=False), "parallel_tool_calls"),
    (dict(tools=[WEATHER], response_format={"type": "json_object"}), "response_format"),
])
def test_bad_tools_are_400_naming_the_field(kw, param):
    with pytest.raises(APIError) as e:
        plan(req(**kw))
    assert e.value.status == 400 and e.value.param == param and e.value.message.startswith(param)


def test_plans_for_each_choice():
    assert plan(req()) is None
    p = plan(req(tools=[WEATHER, ADD]))
    assert p.choice == "auto" and p.constraint.after == "<tool_call>" and p.parallel
    p = plan(req(tools=[WEATHER, ADD], tool_choice="none"))
    assert p.constraint is None and len(p.tools) == 2
    p = plan(req(tools=[WEATHER, ADD], tool_choice="required", parallel_tool_calls=False))
    assert p.constraint.after is None and not p.parallel
    # a vocabulary where the opening tag is no single token (SmolLM2's): auto replies are read, not constrained
    assert plan(req(tools=[WEATHER, ADD]), one_token=lambda t: False).constraint is None
    assert plan(req(tools=[WEATHER, ADD], tool_choice="required"), one_token=lambda t: False).constraint is not None
    p = plan(req(tools=[WEATHER, ADD], tool_choice={"type": "function", "function": {"name": "add"}}))
    assert p.choice == "named" and p.name == "add" and '"const": "add"' in p.constraint.grammar
    assert "get_weather" not in p.constraint.grammar


def test_the_call_grammar_takes_exactly_the_tools_calls(smollm2_path):
    from llguidance import LLMatcher

    from mixserve.models.weights import load_tokenizer
    from mixserve.structured_output.compiler import GrammarCompiler

    tok = load_tokenizer(smollm2_path)
    gc = GrammarCompiler(lambda: tok, 49152, [2])
    fns = {"get_weather": WEATHER["function"]["parameters"], "add": ADD["function"]["parameters"]}

    def accepts(grammar: str, text: str) -> bool:
        m = LLMatcher(gc.view(), grammar, log_level=0)
        return m.consume_tokens(gc.view().tokenize_str(text)) and m.is_accepting()

    one = LLMatcher.grammar_from_lark(call_grammar(fns, False, False, gc.lark_literal))
    many = LLMatcher.grammar_from_lark(call_grammar(fns, True, False, gc.lark_literal))
    opened = LLMatcher.grammar_from_lark(call_grammar(fns, True, True, gc.lark_literal))
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    assert accepts(one, call) and accepts(many, call + "\n" + call)
    assert not accepts(one, call + "\n" + call)
    assert not accepts(one, '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>')  # b required
    assert not accepts(one, '<tool_call>\n{"name": "mul", "arguments": {}}\n</tool_call>')
    assert accepts(opened, call[len("<tool_call>"):])


def test_split_calls_and_bare_calls():
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    content, calls = split_calls(text)
    assert content == "Let me check." and len(calls) == 1
    assert split_calls("  just text \n") == ("just text", [])
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"
    broken = '<tool_call>\n{"name": "get_weather", "argu'
    assert split_calls(broken) == (broken, [])
    cut = '<tool_call>\n{"name": "add", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "ad'
    assert split_calls(cut)[0] is None and len(split_calls(cut)[1]) == 1  # a call cut off after calls: dropped
    two = 'a\n<tool_call>\n{"name": "add", "arguments": {}}\n</tool_call>\n\n b c \n'
    assert split_calls(two)[0] == "ab c"
    bare = '```json\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n```'
    assert [c["function"]["arguments"] for c in bare_calls(bare, ("add",))] == ['{"a": 1, "b": 2}', '{"a": 3, "b": 4}']
    assert bare_calls(bare, ("get_weather",)) is None
    assert bare_calls('{"name": "add", "arguments": {}, "x": 1}', ("add",)) is None
    assert split_calls('{"a": 1}', ("add",)) == ('{"a": 1}', [])


@pytest.mark.parametrize("text", [
    'Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n<tool_call>\n'
    '{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>',
    '{"name": "add", "arguments": {"a": 1, "b": 2}}', "plain text with a < sign and <tool", "<tool_call>\nnot json\n</tool_call> after",
    '```json\n{"name": "add", "arguments": {"a": 5, "b": 6}}\n```', '{"not": "a call"}',
    '\n\n  text  with  spaces \n<tool_call>\n{"name": "add", "arguments": {}}\n</tool_call>\n\n<tool_call>\n{"na'])
def test_streamed_deltas_join_to_the_whole_reply(text):
    names = ("add", "get_weather")
    want_content, want_calls = split_calls(text, names)
    rng = random.Random(0)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 8))))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        st = ToolStream(names)
        deltas = [d for i, p in enumerate(pieces) for d in st.feed(p, final=i == len(pieces) - 1)]
        content = "".join(d.get("content", "") for d in deltas)
        calls = {}
        for d in deltas:
            for tc in d.get("tool_calls", []):
                c = calls.setdefault(tc["index"], {"name": "", "arguments": ""})
                c["name"] += tc.get("function", {}).get("name", "")
                c["arguments"] += tc.get("function", {}).get("arguments", "")
        assert (content or None) == want_content
        assert [calls[i] for i in sorted(calls)] == [c["function"] for c in want_calls]
        assert all("id" in d["tool_calls"][0] for d in deltas if "tool_calls" in d and "name" in
                   d["tool_calls"][0].get("function", {}))
