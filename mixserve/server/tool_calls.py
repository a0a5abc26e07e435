"""OpenAI tool calling on the chat API (issue 33): `tools`, `tool_choice`, `parallel_tool_calls`.

The model's own chat template renders the tools (the Qwen2.5 family's: a `<tools>` list in the
system prompt). Its replies call a tool in Hermes' format, which that template asks for:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

and this module turns such text into `message.tool_calls` (and streamed tool-call deltas). With
`tool_choice: "required"` or a named function, the whole reply is grammar-constrained to calls of
the given tools (structured_output: the arguments validate against each tool's `parameters`); with
`"auto"` the model answers freely and a call it opens is constrained from its `<tool_call>` tag on
(StructuredOutputs.after); with `"none"` the tools are rendered and the reply is text.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from mixserve.server.protocol import CONSTRAINT_FIELDS, bad_request
from mixserve.structured_output import StructuredOutputs
from mixserve.structured_output.tools import CLOSE, OPEN, call_constraint

_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_CALL = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.S)


@dataclass
class ToolPlan:
    """A chat request's tools, checked: `tools` as the chat template takes them, the choice
    ("none", "auto", "required" or "named"), the named function, whether several calls may come,
    and the constraint the reply runs under (None for "none")."""

    tools: list[dict]
    choice: str
    name: str | None
    parallel: bool
    constraint: StructuredOutputs | None

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t["function"]["name"] for t in self.tools)


def plan(req, literal=lambda text: json.dumps(text), one_token=lambda text: True) -> ToolPlan | None:
    """The ToolPlan of a chat request (None without tools). Raises APIError(400) naming the field:
    a tool that is not a function with a name (letters, digits, _ and -, at most 64) and an object
    for parameters, two tools of one name, a tool_choice that is not none/auto/required or names an
    unknown function, tool_choice or parallel_tool_calls without tools, or tools beside
    response_format / structured_outputs. `literal(text)`: the Lark term for the call tags in
    this model's vocabulary (GrammarCompiler.lark_literal); `one_token(text)`: whether the opening
    tag is one token of it (GrammarCompiler.is_one_token): where it is not (a template without
    Hermes tool calls, SmolLM2's), `auto` replies are read for calls but not constrained."""
    tools = req.tools
    if tools is None:
        if req.tool_choice is not None and req.tool_choice != "none":
            raise bad_request("tool_choice", "tool_choice: needs tools")
        if req.parallel_tool_calls is not None:
            raise bad_request("parallel_tool_calls", "parallel_tool_calls: needs tools")
        return None
    if not isinstance(tools, list) or not tools:
        raise bad_request("tools", "tools: must be a non-empty list")
    fns = {}
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise bad_request("tools", f"tools[{i}]: must be {{\"type\": \"function\", \"function\": {{...}}}}")
        if set(t) - {"type", "function"}:
            raise bad_request("tools", f"tools[{i}].{sorted(set(t) - {'type', 'function'})[0]}: unknown field")
        f = t["function"]
        unknown = set(f) - {"name", "description", "parameters", "strict"}
        if unknown:
            raise bad_request("tools", f"tools[{i}].function.{sorted(unknown)[0]}: unknown field")
        name = f.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise bad_request("tools", f"tools[{i}].function.name: is required: letters, digits, _ and -, "
                                       f"at most 64 (got {name!r})")
        if name in fns:
            raise bad_request("tools", f"tools[{i}].function.name: {name!r} is given twice")
        params = f.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise bad_request("tools", f"tools[{i}].function.parameters: must be a JSON schema object")
        if f.get("description") is not None and not isinstance(f["description"], str):
            raise bad_request("tools", f"tools[{i}].function.description: must be a string")
        if f.get("strict") is not None and not isinstance(f["strict"], bool):
            raise bad_request("tools", f"tools[{i}].function.strict: must be true or false")
        text = json.dumps(params)
        if OPEN in text or CLOSE in text:  # the call's own tags inside it: the grammar cannot tell them apart
            raise bad_request("tools", f"tools[{i}].function.parameters: may not hold {OPEN} or {CLOSE}")
        fns[name] = params
    for other in CONSTRAINT_FIELDS:
        if getattr(req, other, None) is not None:
            raise bad_request(other, f"{other}: give tools or an output constraint, not both")
    tc = req.tool_choice if req.tool_choice is not None else "auto"
    name = None
    if isinstance(tc, dict):
        fn = tc.get("function") if tc.get("type") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise bad_request("tool_choice", "tool_choice: must be none, auto, required or "
                                             "{\"type\": \"function\", \"function\": {\"name\": ...}}")
        if name not in fns:
            raise bad_request("tool_choice", f"tool_choice: no tool named {name!r}")
        choice = "named"
    elif tc in ("none", "auto", "required"):
        choice = tc
    else:
        raise bad_request("tool_choice", f"tool_choice: must be none, auto, required or a named function (got {tc!r})")
    parallel = True if req.parallel_tool_calls is None else req.parallel_tool_calls
    constraint = call_constraint(fns, choice, name, parallel, literal, one_token)
    return ToolPlan(tools=[{"type": "function", "function": {k: v for k, v in t["function"].items()}} for t in tools],
                    choice=choice, name=name, parallel=parallel and choice != "named", constraint=constraint)


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.S)


def bare_calls(text: str, names) -> list[dict] | None:
    """The calls of a reply that is nothing but calls written without their tags: one JSON object
    per line, `{"name": <a tool's name>, "arguments": {...}}`, the whole optionally in a ```json
    fence (what Qwen2.5-Coder-0.5B writes under tool_choice auto), else None. Such calls are read,
    not constrained: no tag opened them."""
    body = text.strip()
    m = _FENCE.match(body)
    if m:
        body = m.group(1)
    if not body.startswith("{"):
        return None
    dec, calls, pos = json.JSONDecoder(), [], 0
    while pos < len(body):
        try:
            obj, end = dec.raw_decode(body, pos)
        except ValueError:
            return None
        if (not isinstance(obj, dict) or obj.get("name") not in names or not isinstance(obj.get("arguments", {}), dict)
                or set(obj) - {"name", "arguments"}):
            return None
        calls.append({"id": new_call_id(), "type": "function",
                      "function": {"name": obj["name"], "arguments": json.dumps(obj.get("arguments", {}),
                                                                                ensure_ascii=False)}})
        pos = end
        while pos < len(body) and body[pos] in " \t\r\n":
            pos += 1
    return calls or None


def split_calls(text: str, names=()) -> tuple[str | None, list[dict]]:
    """(the reply's text outside its tool calls, or None where nothing is left; its calls as OpenAI's
    `tool_calls`: id, type "function", function {name, arguments as a JSON string}). A `<tool_call>`
    block that is not a JSON object with a string name (the model wrote one freely and it broke, or
    it ended at max_tokens) stays in the text. Without tagged calls, a reply that is only calls of
    the tools `names` written bare (`bare_calls`) is read as those calls. The text is each stretch
    between calls stripped of the whitespace at its ends (the newlines around the tags), joined.""" 
    if OPEN not in text:
        bare = bare_calls(text, names) if names else None
        return (None, bare) if bare else (text.strip() or None, [])
    calls, kept, pos = [], [], 0
    for m in _CALL.finditer(text):
        call = _parse(m.group(1))
        if call is None:
            continue
        kept.append(text[pos:m.start()])
        pos = m.end()
        calls.append(call)
    tail = text[pos:]
    if calls and _unclosed(tail):  # a call cut off (max_tokens): not text, and not a call
        tail = tail[:tail.index(OPEN)]
    kept.append(tail)
    # each stretch of text between calls without its whitespace ends (what ToolStream sends)
    return "".join(k.strip() for k in kept) or None, calls


def _unclosed(text: str) -> bool:
    """Whether `text` ends inside a call: an opening tag with no closing tag after it."""
    i = text.rfind(OPEN)
    return i >= 0 and CLOSE not in text[i:]


def _parse(body: str) -> dict | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", {})
    return {"id": new_call_id(), "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


class ToolStream:
    """Streamed text -> OpenAI chat deltas: content until a `<tool_call>` opens, then each call as
    tool-call deltas once it closes (its index, id, type and name first, then its arguments), so the
    deltas join to split_calls' result. Text that may be the start of `<tool_call>` is held back."""

    def __init__(self, names=()):
        self.buf = ""
        self.index = 0
        self.calls: list[dict] = []
        self.content = ""
        self.names = tuple(names)
        self.held = None  # a reply that may be bare calls (bare_calls): all of it, held to its end
        self.seg_start = True  # at the reply's start or after a call: leading whitespace is dropped
        self.pending_ws = ""  # whitespace sent only if more text of the same stretch follows

    def _text(self, piece: str, out: list[dict]) -> None:
        """Send `piece` of the text between calls, less the whitespace at the stretch's ends."""
        if self.seg_start:
            piece = piece.lstrip()
            if not piece:
                return
            self.seg_start = False
        body = piece.rstrip()
        if body:
            out.append({"content": self.pending_ws + body})
            self.content += self.pending_ws + body
            self.pending_ws = ""
        self.pending_ws += piece[len(body):]

    def _call(self, call: dict) -> list[dict]:
        self.pending_ws, self.seg_start = "", True
        return self._call_deltas(call)

    def _call_deltas(self, call: dict) -> list[dict]:
        f = call["function"]
        out = [{"tool_calls": [{"index": self.index, "id": call["id"], "type": "function",
                                "function": {"name": f["name"], "arguments": ""}}]},
               {"tool_calls": [{"index": self.index, "function": {"arguments": f["arguments"]}}]}]
        self.calls.append(call)
        self.index += 1
        return out

    def feed(self, text: str, final: bool = False) -> list[dict]:
        """Deltas for `text` (the next piece of the reply); `final`: the reply ended, flush."""
        if self.held is not None or (self.names and not self.content and not self.calls
                                     and (self.buf + text).lstrip()[:1] in ("{", "`")):
            # what bare_calls may read: held whole until the end (streamed as split_calls reads it)
            self.held = (self.held or self.buf) + text
            self.buf = ""
            if not final:
                return []
            held, self.held = self.held, None
            if OPEN not in held:
                bare = bare_calls(held, self.names)
                if bare:
                    return [d for call in bare for d in self._call(call)]
            text = held
        self.buf += text
        out = []
        while True:
            i = self.buf.find(OPEN)
            if i < 0:
                keep = 0 if final else _partial_suffix(self.buf, OPEN)
                piece, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
                self._text(piece, out)
                return out
            if i:
                self._text(self.buf[:i], out)
                self.buf = self.buf[i:]
            m = _CALL.match(self.buf)
            if m is None:
                if final:  # an unclosed call: cut off after calls (split_calls' rule), else it stays text
                    if not self.calls:
                        self._text(self.buf, out)
                    self.buf = ""
                return out
            call = _parse(m.group(1))
            if call is None:  # a broken call stays text
                self._text(self.buf[:m.end()], out)
            else:
                out += self._call(call)
            self.buf = self.buf[m.end():]


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def template_messages(messages) -> list[dict]:
    """The chat's messages as the chat template takes them: an assistant's tool_calls with their
    arguments as objects (OpenAI sends JSON strings), a tool's reply with its tool_call_id.
    Raises APIError(400) naming `messages` for a tool call whose arguments are not JSON."""
    conv = []
    for i, m in enumerate(messages):
        d = {"role": m.role, "content": m.text()}
        if m.name:
            d["name"] = m.name
        if m.tool_calls:
            calls = []
            for j, tc in enumerate(m.tool_calls):
                fn = tc.get("function") if isinstance(tc, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise bad_request("messages", f"messages[{i}].tool_calls[{j}]: needs function.name")
                args = fn.get("arguments", "{}")
                try:
                    args = json.loads(args) if isinstance(args, str) else args
                except ValueError:
                    raise bad_request("messages", f"messages[{i}].tool_calls[{j}].function.arguments: "
                                                  f"not valid JSON") from None
                calls.append({"id": tc.get("id"), "type": "function",
                              "function": {"name": fn["name"], "arguments": args}})
            d["tool_calls"] = calls
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        conv.append(d)
    return conv
