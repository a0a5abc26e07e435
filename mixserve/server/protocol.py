"""OpenAI request bodies, their validation, and OpenAI's error shape.

Bodies are checked strictly (a string where a number belongs is an error, not a conversion).
A parameter we do not implement is refused with HTTP 400 naming it unless it is null, so a
client never gets an answer computed without what it asked for.
"""
from __future__ import annotations

import secrets
from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from mixserve.sampling_params import SamplingParams
from mixserve.structured_output import StructuredOutputs
from mixserve.structured_output.spec import from_response_format


class APIError(Exception):
    """An error answered as `{"error": {"message", "type", "param", "code"}}` with HTTP `status`."""

    def __init__(self, status: int, message: str, param: str | None = None, type: str = "invalid_request_error",
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(param: str | None, message: str, code: str | None = None) -> APIError:
    return APIError(400, message, param, code=code)


# OpenAI parameters that exist but are not implemented here: refused unless null
UNSUPPORTED = {
    "completions": {"best_of", "logit_bias", "suffix"},
    "chat": {"functions", "function_call",
             "logit_bias", "audio", "modalities", "prediction", "reasoning_effort", "service_tier", "store",
             "metadata", "web_search_options", "verbosity", "prompt_cache_key", "safety_identifier"},
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    """Fields shared by both endpoints (OpenAI's, then vLLM's extensions min_tokens,
    ignore_eos, top_k, min_p, repetition_penalty, return_token_ids, and cache_salt: a string
    mixed into the prefix cache's block hashes, so only requests with the same salt share
    cached KV blocks). Structured output: OpenAI's `response_format` (on completions too, as
    vLLM), vLLM's `structured_outputs` and its older `guided_json` / `guided_regex` /
    `guided_choice` / `guided_grammar` (`structured`)."""

    model: str
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    return_token_ids: bool = False
    cache_salt: str | None = None
    response_format: dict | None = None
    structured_outputs: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(_Sampling):
    """POST /v1/completions. max_tokens defaults to 16 as in OpenAI's API."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    """A chat message; an assistant's may carry the tool calls it made, a tool's answers one
    (`tool_call_id`)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _tool_fields_where_they_belong(self):
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls: only an assistant message carries them")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError("tool_call_id: only a tool message carries one")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions. Without max_tokens / max_completion_tokens a reply may use
    whatever context is left after the prompt."""

    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None


_FIELD_HINTS = {
    "prompt": "must be a string, a list of strings, a list of token ids or a list of lists of token ids",
    "stop": "must be a string or a list of strings",
}


def parse_request(kind: str, body) -> CompletionRequest | ChatCompletionRequest:
    """Validate a decoded JSON body for `kind` ("completions" | "chat").

    Raises APIError(400) naming the first bad field: wrong type, unknown or unsupported
    parameter (null values of unsupported ones are accepted as "not used").
    """
    model = CompletionRequest if kind == "completions" else ChatCompletionRequest
    if not isinstance(body, dict):
        raise bad_request(None, "the request body must be a JSON object")
    known = set(model.model_fields)
    clean = {}
    for key, value in body.items():
        if key in known:
            if value is not None:  # null means "default", as OpenAI treats it
                clean[key] = value
        elif value is None:
            continue
        elif key in UNSUPPORTED[kind]:
            raise bad_request(key, f"{key}: this parameter is not supported by this server", "unsupported_parameter")
        else:
            raise bad_request(key, f"{key}: unknown parameter", "unknown_parameter")
    try:
        return model.model_validate(clean)
    except ValidationError as e:
        err = e.errors()[0]
        loc = [str(x) for x in err["loc"]]
        field = loc[0] if loc else None
        if field in _FIELD_HINTS:
            msg = f"{field}: {_FIELD_HINTS[field]}"
        elif err["type"] == "missing":
            msg = f"{field}: is required"
        elif err["type"] == "extra_forbidden":
            msg = f"{'.'.join(loc)}: unknown or unsupported field"
        else:
            msg = f"{'.'.join(loc)}: {err['msg'][0].lower()}{err['msg'][1:]}"
        raise bad_request(field, msg) from None


# the request fields that constrain the output (at most one a request; tools apart)
CONSTRAINT_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar")
# vLLM's StructuredOutputsParams fields served here, and the StructuredOutputs field each fills
_STRUCTURED_KEYS = {"json": "json", "regex": "regex", "choice": "choice", "grammar": "grammar",
                    "json_object": "json_object"}


def structured(req: CompletionRequest | ChatCompletionRequest) -> StructuredOutputs | None:
    """The request's output constraint, from whichever of response_format, structured_outputs or
    guided_* it gives (None: free text). `strict: false` in a json_schema is served with the
    same grammar, as vLLM does.

    Raises APIError(400) naming the field: more than one of them, an unknown response_format
    type, a json_schema without its schema's object, a structured_outputs key not served, or a
    constraint StructuredOutputs refuses (its wrong type or JSON)."""
    given = [f for f in CONSTRAINT_FIELDS if getattr(req, f) is not None]
    if len(given) > 1:
        raise bad_request(given[1], f"{given[1]}: give one output constraint, not {' and '.join(given)}")
    if not given:
        return None
    field = given[0]
    try:
        if field == "response_format":
            return from_response_format(req.response_format)
        if field == "structured_outputs":
            so = req.structured_outputs
            keys = [k for k, v in so.items() if v is not None and v is not False]
            bad = [k for k in keys if k not in _STRUCTURED_KEYS]
            if bad:
                raise bad_request("structured_outputs", f"structured_outputs.{bad[0]}: not supported by this server "
                                                        f"(json, regex, choice, grammar or json_object)")
            if len(keys) != 1:
                raise bad_request("structured_outputs", "structured_outputs: give exactly one of json, regex, choice, "
                                                        f"grammar, json_object (got {', '.join(keys) or 'none'})")
            k = keys[0]
            value = so[k]
            if k == "json_object" and value is not True:
                raise bad_request("structured_outputs", "structured_outputs.json_object: must be true")
            return StructuredOutputs(**{_STRUCTURED_KEYS[k]: value}, source=f"structured_outputs.{k}")
        return StructuredOutputs(**{field.removeprefix("guided_"): getattr(req, field)}, source=field)
    except RecursionError:
        raise bad_request(field, f"{field}: nested too deeply") from None
    except (TypeError, ValueError) as e:  # StructuredOutputs' own checks name their source
        msg = str(e)
        raise bad_request(field, msg if msg.startswith(field) else f"{field}: {msg}") from None


_FROM_REQUEST = object()


def sampling_params(req: CompletionRequest | ChatCompletionRequest, max_tokens: int, seed: int | None,
                    logprobs: int | None, prompt_logprobs: int | None = None,
                    constraint=_FROM_REQUEST) -> SamplingParams:
    """SamplingParams for one choice. Raises APIError(400) naming the field (in the request's
    own words: `top_logprobs` for chat, `max_completion_tokens` if that was given). `constraint`:
    the output constraint (a tool plan's), else the request's own (`structured`)."""
    if max_tokens == 0 and isinstance(req, ChatCompletionRequest):
        field = "max_completion_tokens" if req.max_tokens is None else "max_tokens"
        raise bad_request(field, f"{field}: must be >= 1 (a reply of no tokens is not a reply)")
    if constraint is _FROM_REQUEST:
        constraint = structured(req)
    try:
        return SamplingParams(prompt_logprobs=prompt_logprobs, structured=constraint,
            temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
            presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty, seed=seed, max_tokens=max_tokens,
            min_tokens=req.min_tokens, ignore_eos=req.ignore_eos, stop=req.stop, logprobs=logprobs)
    except ValueError as e:
        raise bad_request(*field_error(req, e)) from None


def field_error(req, err: ValueError) -> tuple[str | None, str]:
    """(param, message) for an engine / SamplingParams ValueError "field: why", with the field
    renamed to what this request called it."""
    msg = str(err)
    field = msg.split(":", 1)[0] if ":" in msg else None
    if field is not None and field.startswith("structured_outputs."):
        field = "structured_outputs"  # the request's own field; the message names the key
    rename = {}
    if isinstance(req, ChatCompletionRequest):
        rename["logprobs"] = "top_logprobs"
        if req.max_completion_tokens is not None and req.max_tokens is None:
            rename["max_tokens"] = "max_completion_tokens"
    if field in rename:
        msg = rename[field] + msg[len(field):]
        field = rename[field]
    if field == "prompt" and isinstance(req, ChatCompletionRequest):
        field = "messages"
        msg = "messages: " + msg
    return field, msg


def check_api_key(keys: dict[str, str] | None, authorization: str) -> str | None:
    """The name of the key in an Authorization header ("Bearer <key>"), None when `keys` is None
    (no key needed). Raises APIError 401 without a valid one. Every key is compared, each in
    constant time, so the time taken does not tell how much of a guess was right."""
    if keys is None:
        return None
    scheme, _, token = authorization.partition(" ")
    given = token.strip().encode()
    name = None
    for key, n in keys.items():
        if secrets.compare_digest(given, key.encode()) and scheme.lower() == "bearer":
            name = n
    if name is None:
        raise APIError(401, "invalid or missing API key (Authorization: Bearer ...)", type="authentication_error",
                       code="invalid_api_key")
    return name
