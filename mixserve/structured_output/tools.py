"""Tool calls as grammars (issue 33): the constraint a reply runs under, given the tools and tool_choice.

Calls are in Hermes' format, which the Qwen2.5 chat templates ask for:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The server's tool calling (server/tool_calls.py: checking the request, reading calls out of a reply)
and the offline bench (a trace line's `tools`) take their constraint from `call_constraint`.
"""
from __future__ import annotations

import json

from mixserve.structured_output.spec import JSON_OPTIONS, StructuredOutputs

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def call_constraint(fns: dict[str, dict], choice: str, name: str | None, parallel: bool,
                    literal=lambda text: json.dumps(text), one_token=lambda text: True) -> StructuredOutputs | None:
    """The constraint of a reply given tools `fns` ({name: parameters schema}) and `choice`: "none"
    (None: free text), "named" (one call of `name`, from the reply's start), "required" (calls of the
    tools from the start; several with `parallel`), "auto" (free until the model writes OPEN, the
    calls constrained from there: StructuredOutputs.after; None where OPEN is not one token of the
    vocabulary, `one_token`). `literal(text)`: the Lark term of a tag (GrammarCompiler.lark_literal)."""
    if choice == "none" or (choice == "auto" and not one_token(OPEN)):
        return None
    if choice == "named":
        return StructuredOutputs(grammar=call_grammar({name: fns[name]}, False, False, literal), source="tools")
    return StructuredOutputs(grammar=call_grammar(fns, parallel, choice == "auto", literal), source="tools",
                             after=OPEN if choice == "auto" else None)


def call_grammar(fns: dict[str, dict], parallel: bool, opened: bool, literal=lambda text: json.dumps(text)) -> str:
    """Lark (llguidance's, with %json) for one tool call, or several with `parallel`, in the
    Hermes format: `<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`, calls joined by a
    newline; `opened`: the first call's `<tool_call>` is already out (the constraint starts after
    it). Each call's JSON is one of the tools: its name a constant and its arguments its schema.
    `literal(text)`: the Lark term of a tag (plan's)."""
    alts = [{"type": "object", "properties": {"name": {"const": n}, "arguments": _arguments_schema(n, p)},
             "required": ["name", "arguments"], "additionalProperties": False} for n, p in fns.items()]
    schema = {"x-guidance": JSON_OPTIONS, **(alts[0] if len(alts) == 1 else {"anyOf": alts})}
    o, c = literal(OPEN), literal(CLOSE)
    first = f'"\\n" call_json "\\n" {c}' if opened else "call"
    rest = ' ("\\n" call)*' if parallel else ""
    return (f"start: {first}{rest}\n"
            f'call: {o} "\\n" call_json "\\n" {c}\n'
            f"call_json: %json {json.dumps(schema)}\n")


def _arguments_schema(name: str, params: dict) -> dict:
    """A tool's `parameters` as the schema of a call's `arguments`: an object (OpenAI's arguments are
    one, even where `parameters` leaves the type open), with an `$id` of its own so that its `$ref`s
    ("#/$defs/...", "#") resolve inside it rather than against the call's wrapper; its own
    `x-guidance` options dropped (the server's apply)."""
    p = {k: v for k, v in params.items() if k != "x-guidance"}
    if "type" not in p and not any(k in p for k in ("anyOf", "oneOf", "allOf", "$ref", "enum", "const")):
        p["type"] = "object"
    p.setdefault("$id", f"urn:mixserve:tool:{name}")
    return p
