"""What a request's output must match: a JSON schema, any JSON object, a regex, a choice or a grammar.

The request's side of structured output (issue 33), with no engine in it: `SamplingParams.structured`
holds one, the server builds one from OpenAI's `response_format` or vLLM's `structured_outputs`,
and `grammar()` turns it into the llguidance grammar text that `compiler.GrammarCompiler` compiles.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

# JSON's separators as `json.dumps` writes them, and no other whitespace: generated JSON is
# compact and cannot run away in indentation (the known failure of flexible whitespace), and
# ", " / ": " are what models trained on Python-written JSON put most mass on
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class StructuredOutputs:
    """One request's output constraint (exactly one of the fields is set).

    Attributes:
        json: a JSON schema (a dict, or its text): the output is one JSON value that validates
            against it (llguidance's JSON Schema subset; an unsupported keyword is refused).
        json_object: the output is any JSON object (OpenAI's `{"type": "json_object"}`).
        regex: the output matches this regular expression (Rust `regex` syntax, anchored).
        choice: the output is exactly one of these strings.
        grammar: a context-free grammar: Lark as llguidance reads it, or llama.cpp's GBNF (told
            apart and converted by llguidance's any_to_lark).
        after: where the constraint starts: at the first time the output holds this text, which
            must be one token of the model's vocabulary (a tool call's opening tag, `<tool_call>`);
            the output before it is free. None: from the first output token.
        source: the request field it came from, named in error messages (`response_format`,
            `structured_outputs.json`, ...); not part of its identity.

    Raises:
        ValueError: from `validate()`: none or several fields set, or a field of the wrong type,
            naming `source`.
    """

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    after: str | None = None
    source: str = field(default="structured_outputs", compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        try:
            self.validate()
        except RecursionError:
            raise ValueError(f"{self.source}: the schema is nested too deeply") from None

    def __getstate__(self) -> dict:
        # pickled (a replica's request) without what one process made of it: its key, its compiled
        # grammar and masks (GrammarCompiler keeps them here; an llguidance matcher does not pickle)
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}

    def validate(self) -> None:
        """Raise ValueError naming `source` unless exactly one constraint of the right type is set."""
        given = [n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(f"{self.source}: give exactly one of json, json_object, regex, choice, grammar "
                             f"(got {', '.join(given) or 'none'})")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(f"{self.source}: a JSON schema must be an object (got {type(self.json).__name__})")
        if isinstance(self.json, str):
            try:
                parsed = json.loads(self.json)
            except json.JSONDecodeError as e:
                raise ValueError(f"{self.source}: the JSON schema is not valid JSON: {e}") from None
            if not isinstance(parsed, dict):
                raise ValueError(f"{self.source}: a JSON schema must be an object (got {json.dumps(parsed)[:40]})")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"{self.source}: {name} must be a non-empty string")
        if self.regex is not None and (len(self.regex) - len(self.regex.rstrip("\\"))) % 2:
            # llguidance drops a lone trailing backslash instead of refusing the regex
            raise ValueError(f"{self.source}: the regex ends with a lone backslash")
        if self.choice is not None and (not isinstance(self.choice, tuple) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError(f"{self.source}: choice must be a non-empty list of non-empty strings")
        if self.after is not None and (not isinstance(self.after, str) or not self.after):
            raise ValueError(f"{self.source}: after must be a non-empty string")

    @property
    def kind(self) -> str:
        """"json", "json_object", "regex", "choice" or "grammar"."""
        return next(n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None) \
            if not self.json_object else "json_object"

    def key(self) -> str:  # noqa: D401
        """A canonical text of the constraint: equal constraints (a schema's keys in any order) give
        equal keys, so a compiled grammar is cached once per constraint. Made once (a step asks for
        it per constrained row)."""
        k = self.__dict__.get("_key")
        if k is None:
            k = self._make_key()
            object.__setattr__(self, "_key", k)
        return k

    def _make_key(self) -> str:
        value = {"json": lambda: json.loads(self.json) if isinstance(self.json, str) else self.json,
                 "json_object": lambda: True, "regex": lambda: self.regex,
                 "choice": lambda: list(self.choice), "grammar": lambda: self.grammar}[self.kind]()
        return json.dumps([self.kind, value], sort_keys=True, ensure_ascii=False)

    def grammar_text(self) -> str:
        """llguidance's grammar text for this constraint (not yet checked: the compiler checks it).

        Raises ValueError naming `source` where llguidance refuses to read the schema."""
        from llguidance import LLMatcher
        from llguidance.gbnf_to_lark import any_to_lark

        kind = self.kind
        try:
            if kind in ("json", "json_object"):
                schema = {"type": "object"} if kind == "json_object" else self.json
                schema = json.loads(schema) if isinstance(schema, str) else schema
                # llguidance's own options ("x-guidance") are the server's, not the request's: a
                # request's would switch off the keyword checks (lenient) or bring back free whitespace
                schema = {k: v for k, v in schema.items() if k != "x-guidance"}
                return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS, overrides=JSON_OPTIONS)
            if kind == "regex":
                return LLMatcher.grammar_from_regex(self.regex)
            if kind == "choice":
                # one regex lexeme (the lexer's automaton), not a rule of N alternatives: llguidance's
                # parser refuses rows of over 2,000 items, and would only say so after the first token
                alts = "|".join("".join(ch if ch.isascii() and ch.isalnum() else f"\\x{{{ord(ch):x}}}" for ch in c)
                                for c in self.choice)
                return LLMatcher.grammar_from_lark(f"start: /(?:{alts})/\n")
            # Lark as it is; GBNF (llama.cpp's, "name ::= ...") converted by llguidance
            return LLMatcher.grammar_from_lark(any_to_lark(self.grammar))
        except RecursionError:
            raise ValueError(f"{self.source}: the schema is nested too deeply") from None
        except Exception as e:  # noqa: BLE001 -- llguidance's own error text, as a 400
            raise ValueError(f"{self.source}: {short_error(str(e))}") from None


def from_response_format(rf) -> StructuredOutputs | None:
    """OpenAI's `response_format` as a constraint: {"type": "text"} -> None, {"type": "json_object"},
    {"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}} (a name
    without a schema: any JSON object; `strict: false` gets the same grammar, as vLLM does).
    Raises ValueError naming the field ("response_format.type: ..."): not an object, an unknown
    type or field, a json_schema without its name, a schema that is not an object."""
    if not isinstance(rf, dict):
        raise ValueError("response_format: must be an object")
    kind = rf.get("type")
    extra = set(rf) - {"type", "json_schema"}
    if extra:
        raise ValueError(f"response_format.{sorted(extra)[0]}: unknown field")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs(json_object=True, source="response_format")
    if kind != "json_schema":
        raise ValueError(f"response_format.type: must be text, json_object or json_schema (got {kind!r})")
    js = rf.get("json_schema")
    if not isinstance(js, dict):
        raise ValueError("response_format.json_schema: is required with type json_schema and must be an object")
    unknown = set(js) - {"name", "schema", "strict", "description"}
    if unknown:
        raise ValueError(f"response_format.json_schema.{sorted(unknown)[0]}: unknown field")
    if not isinstance(js.get("name"), str) or not js["name"]:
        raise ValueError("response_format.json_schema.name: is required (a string)")
    if js.get("strict") is not None and not isinstance(js["strict"], bool):
        raise ValueError("response_format.json_schema.strict: must be true or false")
    schema = js.get("schema")
    if schema is None:  # a name alone: any JSON object (OpenAI's schema is optional)
        return StructuredOutputs(json_object=True, source="response_format")
    if not isinstance(schema, dict):
        raise ValueError("response_format.json_schema.schema: must be an object")
    return StructuredOutputs(json=schema, source="response_format")


def short_error(msg: str, limit: int = 600) -> str:
    """llguidance's error text for a client: without the parser state and grammar it appends
    (`<state>...`, `<grammar>...`, which can be hundreds of KB) and at most `limit` characters."""
    for cut in ("\n<state>", "<state>", "\n<grammar>", "<grammar>"):
        if cut in msg:
            msg = msg[:msg.index(cut)]
    msg = msg.strip()
    return msg if len(msg) <= limit else msg[:limit] + " ..."
