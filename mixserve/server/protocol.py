"""OpenAI request bodies, their validation, and OpenAI's error shape.

Bodies are checked strictly (a string where a number belongs is an error, not a conversion).
A parameter we do not implement is refused with HTTP 400 naming it unless it is null, so a
client never gets an answer computed without what it asked for.
"""
from __future__ import annotations

import secrets
from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from mixserve.sampling_params import SamplingParams


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
    "chat": {"tools", "tool_choice", "functions", "function_call", "parallel_tool_calls", "response_format",
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
    cached KV blocks)."""

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
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

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


def sampling_params(req: CompletionRequest | ChatCompletionRequest, max_tokens: int, seed: int | None,
                    logprobs: int | None, prompt_logprobs: int | None = None) -> SamplingParams:
    """SamplingParams for one choice. Raises APIError(400) naming the field (in the request's
    own words: `top_logprobs` for chat, `max_completion_tokens` if that was given)."""
    if max_tokens == 0 and isinstance(req, ChatCompletionRequest):
        field = "max_completion_tokens" if req.max_tokens is None else "max_tokens"
        raise bad_request(field, f"{field}: must be >= 1 (a reply of no tokens is not a reply)")
    try:
        return SamplingParams(prompt_logprobs=prompt_logprobs,
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
