"""OpenAI-compatible HTTP API (FastAPI) over the engine thread of engine_loop.py.

Endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health,
GET /metrics. Every request is checked completely (types, ranges, context and KV limits) before it
reaches the engine, so a bad request is an HTTP 400 naming the field and never an engine error.
Whatever ends a request early (client gone, --request-timeout, shutdown) aborts it in the engine,
which frees its KV blocks before the next step. Tokenization and chat templating run on one
worker thread, in arrival order, so a long prompt never stalls the event loop (other streams).
At shutdown (`app.state.drain`, called by serving.GracefulServer) requests get a grace period,
then end properly: a stream with a last chunk per unfinished choice (finish_reason "abort") and
[DONE], a non-streamed request with a JSON 503.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import time
import uuid
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from mixserve.engine.llm_engine import NO_TOKENS, LLMEngine, RequestOutput
from mixserve.server.engine_loop import EngineFailure, EngineLoop, ServerOverloaded
from mixserve.server.logprobs import (OffsetCounter, TokenText, chat_logprobs, completion_logprobs,
                                      empty_completion_logprobs, join_logprobs, prompt_logprobs)
from mixserve.server.metrics import ServerMetrics, decode_graph_pending
from mixserve.server import tool_calls
from mixserve.server.protocol import (CONSTRAINT_FIELDS, APIError, ChatCompletionRequest, CompletionRequest,
                                      bad_request, check_api_key, field_error, parse_request, sampling_params,
                                      structured)

log = logging.getLogger("mixserve.server")


@dataclass
class ServerConfig:
    """HTTP-side settings.

    served_model_name: the only `model` value accepted (and listed by /v1/models).
    api_key: if set, /v1/* and the API docs (/docs, /redoc, /openapi.json) require
        `Authorization: Bearer <api_key>` (else HTTP 401); /health and /metrics stay open.
    max_waiting: most requests waiting for admission; beyond it HTTP 503 with Retry-After
        (`retry_after` seconds). None: unbounded.
    request_timeout: seconds from arrival after which a request is aborted (HTTP 504, or an
        error event on a stream). None: no limit.
    max_n: largest `n` accepted.
    max_body_bytes: largest request body accepted (bytes); a larger one is refused with HTTP 413
        before it is read whole. The default, 8 MiB, holds a prompt at the longest context of
        any model here many times over (a 32k-token prompt is ~130 KB of text, ~400 KB as ids).
    api_keys: named keys ({key: name}), each accepted like api_key; the name tags the request
        (recorded mix) and, with prefix_cache_salt "per-key", salts its prefix-cache blocks.
    prefix_cache_salt: "none" (a request's own cache_salt only) or "per-key": every request's
        salt starts with its key's name, so one tenant never hits, and so can never time,
        another's cached prompts (the side channel of CVE-2025-46570).
    record_mix: a JSONL path the server appends one trace line per finished request to
        (server/mix_record.py); record_mix_text: with the prompt and output text;
        record_mix_t0: the time.time() its arrival_s counts from (default: the app's start; the
        replicas of serve --replicas share the command's, so their lines form one trace).
    tag_header: the request header whose value tags a request (else the key's name, else "serve").
    """

    served_model_name: str
    api_key: str | None = None
    max_waiting: int | None = None
    request_timeout: float | None = None
    max_n: int = 16
    retry_after: int = 1
    max_body_bytes: int = 8 << 20
    api_keys: dict[str, str] | None = None
    prefix_cache_salt: str = "none"
    record_mix: str | None = None
    record_mix_text: bool = False
    record_mix_t0: float | None = None
    tag_header: str = "x-mixserve-tag"

    def __post_init__(self):
        if self.prefix_cache_salt not in ("none", "per-key"):
            raise ValueError(f"prefix_cache_salt: none or per-key (got {self.prefix_cache_salt!r})")
        if self.prefix_cache_salt == "per-key" and not (self.api_keys or self.api_key):
            raise ValueError("prefix_cache_salt: per-key needs API keys (--api-keys FILE or --api-key)")

    def keys(self) -> dict[str, str] | None:
        """Every accepted key -> its name (api_key is named "default"); None: no key needed."""
        if self.api_key is None and not self.api_keys:
            return None
        out = dict(self.api_keys or {})
        if self.api_key is not None:
            out.setdefault(self.api_key, "default")
        return out


def read_api_keys(path: str) -> dict[str, str]:
    """`--api-keys FILE`: one named key per line, `NAME KEY` (whitespace between; blank lines and
    lines starting with # skipped). Returns {key: name}. Raises ValueError naming the line for a
    malformed line, a name or key given twice, or an empty file."""
    out: dict[str, str] = {}
    names = set()
    with open(path, encoding="utf-8-sig") as f:  # a BOM is not part of the first name
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            parts = line.split()
            if len(parts) != 2:
                raise ValueError(f"{path}:{n}: expected `NAME KEY`, got {len(parts)} fields")
            name, key = parts
            if len(name) > 256 or not all(c.isprintable() for c in name + key):
                raise ValueError(f"{path}:{n}: a name (at most 256 characters) and key must be printable text")
            if key in out or name in names:
                raise ValueError(f"{path}:{n}: {'key' if key in out else 'name ' + repr(name)} given twice")
            out[key] = name
            names.add(name)
    if not out:
        raise ValueError(f"{path}: no keys")
    return out


class _RequestTimeout(Exception):
    pass


class _ShuttingDown(Exception):
    """Put in a job's queue when the server ends it at shutdown."""


@dataclass
class _Choice:
    """One sample being generated (one engine request)."""

    index: int
    request_id: str
    prompt_index: int
    prompt_ids: list[int]
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    offsets: OffsetCounter = field(default_factory=OffsetCounter)  # text_offset of streamed logprobs
    prompt_logprobs: list | None = None  # echo + logprobs: the engine's prompt TokenLogprobs
    cached_tokens: int = 0  # prompt tokens the prefix cache served
    metrics: dict = field(default_factory=dict)  # the last output's
    tool_stream: object = None  # streaming with tools: its ToolStream (server/tool_calls.py)


@dataclass
class _Job:
    """Everything one HTTP request submitted: its choices share one output queue."""

    id: str
    kind: str  # "completions" | "chat"
    req: CompletionRequest | ChatCompletionRequest
    prompts: list[tuple[str | None, list[int]]]
    choices: list[_Choice]
    created: int
    logprobs: int | None
    params: list = field(default_factory=list)  # SamplingParams per choice
    queue: asyncio.Queue | None = None  # made on the event loop, at submit
    timer: asyncio.TimerHandle | None = None
    end_reason: str = "client_closed"  # why unfinished choices get aborted when the response ends
    salt: str | None = None  # the prefix-cache salt of its requests
    tag: str = "serve"
    arrival_wall: float = 0.0  # time.time() at arrival
    tools: object = None  # a chat request's ToolPlan (server/tool_calls.py), None without tools

    @property
    def calls_tools(self) -> bool:
        """Whether replies are read for tool calls (tools given, tool_choice not none)."""
        return self.tools is not None and self.tools.choice != "none"

    def by_id(self) -> dict[str, _Choice]:
        return {c.request_id: c for c in self.choices}


def create_app(engine: LLMEngine, cfg: ServerConfig, tokenizer=None) -> FastAPI:
    """The FastAPI app serving `engine`. Its lifespan starts the engine thread and, at shutdown,
    aborts what still runs and joins the thread. The engine must not be stepped elsewhere.

    tokenizer: what encodes prompts and applies the chat template, on the app's tokenization
    thread only (default: the model's, loaded again from engine.model_dir). `app.state.drain(s)`
    ends the requests still running after `s` seconds (see module docstring).
    """
    decoder = None
    if tokenizer is None and engine.tokenizer is not None:
        # Instances of our own: HF fast tokenizers can fail with "Already borrowed" when one
        # instance is used from two threads, and the engine thread decodes all the time. One
        # encodes on the tokenization thread, one decodes on the event loop.
        tokenizer = engine.new_tokenizer()
        decoder = engine.new_tokenizer()
    elif tokenizer is not None:
        decoder = tokenizer
    token_text = TokenText(decoder) if decoder is not None else None
    # one thread: prompts are tokenized (and so submitted) in arrival order
    tokenize_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mixserve-tokenize")
    # requests waiting on a grammar compile (each waits on GrammarCompiler's one compile thread)
    compile_pool = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="mixserve-compile")
    if hasattr(type(tokenizer), "prepare_chat_template"):
        # the light tokenizer (models/tokenizer.py) loads transformers' for the chat template on first
        # use (~2 s): now, on the thread that tokenizes, so that no chat request waits for it
        tokenize_pool.submit(tokenizer.prepare_chat_template)
    metrics: ServerMetrics | None = None
    loop = EngineLoop(engine, cfg.max_waiting, on_finish=lambda out: metrics.observe(out),
                      on_step=lambda seconds, tokens: metrics.observe_step(seconds, tokens),
                      on_fail=lambda rid: metrics.errored.labels("engine_step").inc())
    metrics = ServerMetrics(engine, lambda: loop.num_waiting)
    keys = cfg.keys()
    recorder = None
    if cfg.record_mix:
        from mixserve.server.mix_record import MixRecorder

        recorder = MixRecorder(cfg.record_mix, cfg.served_model_name, engine.args.block_size, cfg.record_mix_text,
                               t0=cfg.record_mix_t0)
    jobs: dict[str, _Job] = {}  # submitted and not yet answered, by id
    jobs_done = asyncio.Event()  # set while `jobs` is empty
    jobs_done.set()
    accepting = True

    @contextlib.asynccontextmanager
    async def lifespan(app):
        loop.start()
        yield
        await loop.stop()
        tokenize_pool.shutdown(wait=False, cancel_futures=True)
        compile_pool.shutdown(wait=False, cancel_futures=True)
        if recorder is not None:
            recorder.close()

    # the docs describe the API: behind the key when there is one
    docs_open = keys is None
    app = FastAPI(title="mixserve", lifespan=lifespan, docs_url="/docs" if docs_open else None,
                  redoc_url="/redoc" if docs_open else None, openapi_url="/openapi.json" if docs_open else None)
    app.state.engine_loop = loop
    app.state.metrics = metrics
    app.state.config = cfg
    app.state.recorder = recorder

    # -- errors in OpenAI's shape ----------------------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        if e.status in (429, 503):
            metrics.rejected.labels(str(e.status)).inc()
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        return JSONResponse(APIError(e.status_code, str(e.detail), type="invalid_request_error").body(),
                            status_code=e.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        return JSONResponse(bad_request(None, str(e)).body(), status_code=400)

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):
        log.exception("internal error")
        return JSONResponse(APIError(500, f"internal error: {type(e).__name__}: {e}", type="internal_error").body(),
                            status_code=500)

    def authorize(request: Request) -> str | None:
        """The name of the request's key (None when no key is needed); HTTP 401 without a valid one."""
        return check_api_key(keys, request.headers.get("authorization", ""))

    # -- plain endpoints -------------------------------------------------------------------------
    if not docs_open:
        @app.get("/openapi.json", include_in_schema=False)
        async def openapi(request: Request):
            authorize(request)
            return JSONResponse(app.openapi())

        @app.get("/docs", include_in_schema=False)
        async def docs(request: Request):
            authorize(request)
            return get_swagger_ui_html(openapi_url="/openapi.json", title="mixserve - docs")

        @app.get("/redoc", include_in_schema=False)
        async def redoc(request: Request):
            authorize(request)
            return get_redoc_html(openapi_url="/openapi.json", title="mixserve - docs")

    @app.get("/health")
    async def health():
        if not loop.alive:
            raise APIError(503, "the engine thread is not running", type="server_error")
        # decode_graph_pending: the graph still compiles in the background (steps run eager, slower,
        # beside the compile): a benchmark waits for false (benchmarks/suggest_vs_default.py)
        return {"status": "ok", "decode_graph_pending": decode_graph_pending(loop.engine)}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        return {"object": "list", "data": [{
            "id": cfg.served_model_name, "object": "model", "created": int(time.time()), "owned_by": "mixserve",
            "max_model_len": engine.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await serve(request, "completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await serve(request, "chat")

    # -- the generation path ---------------------------------------------------------------------
    def too_large(size: str) -> APIError:
        return APIError(413, f"the request body is {size}; this server accepts at most {cfg.max_body_bytes} bytes",
                        type="invalid_request_error", code="request_too_large")

    async def read_body(request: Request) -> bytes:
        """The body, refused with 413 past cfg.max_body_bytes: by its Content-Length before any
        of it is read, else (chunked) as soon as the bytes read pass the limit."""
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > cfg.max_body_bytes:
            raise too_large(f"{int(length)} bytes")
        parts, n = [], 0
        async for piece in request.stream():
            n += len(piece)
            if n > cfg.max_body_bytes:
                raise too_large(f"over {cfg.max_body_bytes} bytes")
            parts.append(piece)
        return b"".join(parts)

    async def serve(request: Request, kind: str):
        arrival, arrival_wall = time.perf_counter(), time.time()
        key_name = authorize(request)
        refuse_if_shutting_down()
        try:
            body = json.loads(await read_body(request))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise bad_request(None, f"the request body is not valid JSON: {e}") from None
        except RecursionError:
            raise bad_request(None, "the request body is nested too deeply") from None
        req = parse_request(kind, body)
        # an output constraint compiles first, on threads of its own, awaited here: a slow schema
        # must hold up neither the tokenizing thread nor a free request (which skips this)
        planned = None
        if has_constraint(kind, req):
            planned = await asyncio.get_running_loop().run_in_executor(compile_pool, compile_constraint, kind, req)
        # tokenization and templating off the event loop: a long prompt must not stall other streams
        job = await asyncio.get_running_loop().run_in_executor(tokenize_pool, prepare, kind, req, planned)
        job.salt = request_salt(req, key_name)
        job.tag = request.headers.get(cfg.tag_header) or key_name or "serve"
        job.arrival_wall = arrival_wall
        refuse_if_shutting_down()
        submit(job, arrival)
        if req.stream:
            return _EngineStream(stream_events(job), on_close=lambda: finish_job(job))
        try:
            return await collect(job, request)
        finally:
            finish_job(job)

    def request_salt(req, key_name: str | None) -> str | None:
        """The prefix-cache salt: the request's cache_salt, behind its key's name with per-key
        salting (a tenant cannot choose another's salt: the name comes first, then a separator
        no key name holds)."""
        if req.cache_salt is not None and (not req.cache_salt or len(req.cache_salt) > 1024):
            raise bad_request("cache_salt", "cache_salt: must be a non-empty string of at most 1024 characters")
        if cfg.prefix_cache_salt == "per-key":
            return f"key:{key_name}\n{req.cache_salt or ''}"
        return req.cache_salt

    def record(job: _Job) -> None:
        for c in job.choices:
            m = c.metrics
            n = len(c.token_ids)
            tpot = (m["e2e"] - m["ttft"]) / (n - 1) if m.get("e2e") is not None and m.get("ttft") is not None \
                and n > 1 else None
            recorder.record(arrival_wall=job.arrival_wall, prompt_ids=c.prompt_ids, output_ids=c.token_ids,
                            cached_tokens=c.cached_tokens, finish_reason=c.finish_reason, ttft_s=m.get("ttft"),
                            tpot_s=tpot, tag=job.tag, salt=job.salt,
                            prompt_text=prompt_text(job, c) if cfg.record_mix_text else None,
                            output_text="".join(c.text) if cfg.record_mix_text else None)

    def refuse_if_shutting_down() -> None:
        if not accepting:
            raise APIError(503, "server shutting down", type="server_error", code="server_shutting_down")

    def finish_job(job: _Job) -> None:
        abort(job, job.end_reason)
        if recorder is not None and jobs.get(job.id) is job:
            try:
                record(job)
            except Exception:  # a full disk must not fail the request that was served
                log.exception("record-mix: could not write the trace line")
        jobs.pop(job.id, None)
        if not jobs:
            jobs_done.set()

    async def drain(grace_s: float, flush_s: float = 5.0) -> None:
        """Shutdown: refuse new requests, give running ones `grace_s` seconds to finish, then end
        the rest (aborted in the engine; streams get a last chunk with finish_reason "abort" and
        [DONE], others a JSON 503) and wait up to `flush_s` seconds for those answers to go out."""
        nonlocal accepting
        accepting = False
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(jobs_done.wait(), grace_s)
        for job in list(jobs.values()):
            if any(c.finish_reason is None for c in job.choices):
                abort(job, "shutdown")
                job.queue.put_nowait(_ShuttingDown())
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(jobs_done.wait(), flush_s)

    app.state.drain = drain

    def has_constraint(kind: str, req) -> bool:
        return (kind == "chat" and req.tools is not None) or any(getattr(req, f) is not None for f in CONSTRAINT_FIELDS)

    def request_constraint(kind: str, req):
        """(the chat request's ToolPlan or None, the output constraint or None): its tools', else its
        response_format / structured_outputs / guided_*'s. Raises APIError(400) naming the field."""
        tools = None
        if kind == "chat":
            tools = (tool_calls.plan(req, engine.grammars.lark_literal, engine.grammars.is_one_token)
                     if engine.grammars is not None else tool_calls.plan(req))
        return tools, tools.constraint if tools is not None else structured(req)

    def compile_constraint(kind: str, req):
        """request_constraint's pair, its constraint compiled into the engine's cache (check_request
        then finds it there). Raises APIError(400) naming the field where it does not compile."""
        tools, spec = request_constraint(kind, req)
        if spec is not None and engine.grammars is not None:
            try:
                engine.grammars.compile(spec)
            except ValueError as e:
                raise bad_request(*field_error(req, e)) from None
        return tools, spec

    def prepare(kind: str, req, planned=None) -> _Job:
        """Check everything and build the job: one engine request per prompt and sample.

        n > 1 runs n engine requests (seeds seed, seed+1, ... when a seed is given); samples after
        the first wait for its prefill and take its full prompt blocks from the prefix cache
        (engine.add_request's share_prompt_with) instead of prefilling again. `planned`:
        request_constraint's pair where compile_constraint made it already.
        """
        if req.model != cfg.served_model_name:
            raise bad_request("model", f"model: {req.model!r} is not served here; use {cfg.served_model_name!r}",
                              "model_not_found")
        if not 1 <= req.n <= cfg.max_n:
            raise bad_request("n", f"n: must be in [1, {cfg.max_n}] (got {req.n})")
        if req.seed is not None and not 0 <= req.seed < 2**63:
            raise bad_request("seed", f"seed: must be an integer in [0, 2**63) (got {req.seed})")
        if req.stream_options is not None and not req.stream:
            raise bad_request("stream_options", "stream_options: only allowed with stream: true")
        tools, constraint = planned or request_constraint(kind, req)
        if kind == "completions":
            prompts = completion_prompts(req)
            logprobs = req.logprobs
        else:
            prompts = [chat_prompt(req, tools)]
            if req.top_logprobs is not None and not req.logprobs:
                raise bad_request("top_logprobs", "top_logprobs: requires logprobs: true")
            logprobs = (req.top_logprobs or 0) if req.logprobs else None
        if req.max_tokens is not None and getattr(req, "max_completion_tokens", None) is not None:
            raise bad_request("max_tokens", "max_tokens: give max_tokens or max_completion_tokens, not both")
        job_id = ("cmpl-" if kind == "completions" else "chatcmpl-") + uuid.uuid4().hex
        choices = []
        params = []
        for p, (_, ids) in enumerate(prompts):
            # `is None`, not `or`: a max_tokens of 0 is a value (refused below), not "no limit"
            max_tokens = req.max_tokens if kind == "completions" or req.max_tokens is not None \
                else req.max_completion_tokens
            if max_tokens is None:  # chat default: whatever context is left
                max_tokens = max(1, min(engine.max_model_len, engine.kv_capacity_tokens) - len(ids))
            for j in range(req.n):
                k = len(choices)
                seed = None if req.seed is None else (req.seed + k) % 2**63
                # echo + logprobs: the prompt's own token logprobs too (prompt scoring); every
                # sample of the prompt scores it in its own prefill (no shared prefill then)
                scored = logprobs if kind == "completions" and req.echo and logprobs is not None else None
                sp = sampling_params(req, max_tokens, seed, logprobs, scored, constraint=constraint)
                try:
                    engine.check_request(ids, sp)
                except ValueError as e:
                    raise bad_request(*field_error(req, e)) from None
                choices.append(_Choice(k, f"{job_id}-{k}", p, ids))
                params.append(sp)
        if loop.max_waiting is not None and len(choices) > loop.max_waiting:
            field = "n" if len(prompts) == 1 else "prompt"
            raise bad_request(field, f"{field}: {len(prompts)} prompt(s) x n={req.n} = {len(choices)} samples; "
                                     f"this server queues at most {loop.max_waiting} (--max-waiting)")
        return _Job(job_id, kind, req, prompts, choices, int(time.time()), logprobs, params, tools=tools)

    def completion_prompts(req: CompletionRequest) -> list[tuple[str | None, list[int]]]:
        raw = req.prompt
        if isinstance(raw, str) or (raw and isinstance(raw[0], int)):
            raw = [raw]
        if not raw:
            raise bad_request("prompt", "prompt: must not be empty")
        out = []
        for p in raw:
            if isinstance(p, str):
                if not p:
                    raise bad_request("prompt", "prompt: must not be empty")
                if tokenizer is None:
                    raise bad_request("prompt", "prompt: this model has no tokenizer; send token ids")
                ids = encode_text(p, "prompt")
                if not ids:  # e.g. only control characters, which this vocabulary drops
                    raise bad_request("prompt", NO_TOKENS)
                out.append((p, ids))
            else:
                if not p:
                    raise bad_request("prompt", "prompt: must not be empty")
                out.append((None, list(p)))
        return out

    def chat_prompt(req: ChatCompletionRequest, tools=None) -> tuple[str, list[int]]:
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise bad_request("messages", "messages: this model has no chat template; use /v1/completions")
        if not req.messages:
            raise bad_request("messages", "messages: must not be empty")
        conv = tool_calls.template_messages(req.messages)
        try:
            text = tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=True,
                                                 **({"tools": tools.tools} if tools is not None else {}))
        except Exception as e:  # the template's own checks (e.g. roles must alternate)
            raise bad_request("messages", f"messages: the chat template refused them: {e}") from None
        # The template writes BOS and the other special tokens itself: encoding must not add a second BOS.
        return text, encode_text(text, "messages", add_special_tokens=False)

    def encode_text(text: str, field: str, **kw) -> list[int]:
        """Token ids of `text`; a text the tokenizer cannot take (a lone UTF-16 surrogate, which
        JSON allows) is a 400 naming `field`, not a server error."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise bad_request(field, f"{field}: not valid Unicode text ({e.reason} at {e.start})") from None
        return tokenizer(text, **kw)["input_ids"] if kw else tokenizer.encode(text)

    def submit(job: _Job, arrival: float) -> None:
        job.queue = asyncio.Queue()
        added = []
        try:
            # all samples or none: a 503 after some were added would leave them aborted unseen
            # (preemption can still refill the queue in between: then the added ones are undone)
            loop.check_admission(len(job.choices))
            first: dict[int, str] = {}  # prompt index -> its first sample's request id
            for c, sp in zip(job.choices, job.params):
                loop.add(c.request_id, c.prompt_ids, sp, arrival, job.queue,
                         share_prompt_with=first.get(c.prompt_index), cache_salt=job.salt)
                first.setdefault(c.prompt_index, c.request_id)
                added.append(c)
        except ServerOverloaded as e:
            for c in added:
                loop.abort(c.request_id)
            raise APIError(503, f"server busy: {e}; retry later", type="server_error", code="server_busy",
                           headers={"Retry-After": str(cfg.retry_after)}) from None
        jobs[job.id] = job
        jobs_done.clear()
        if cfg.request_timeout is not None:
            job.timer = asyncio.get_running_loop().call_later(cfg.request_timeout, on_timeout, job)

    def on_timeout(job: _Job) -> None:
        job.timer = None
        if any(c.finish_reason is None for c in job.choices):
            abort(job, "timeout")
            job.queue.put_nowait(_RequestTimeout())

    def abort(job: _Job, reason: str) -> None:
        """Abort every unfinished choice (a no-op once all finished)."""
        if job.timer is not None:
            job.timer.cancel()
            job.timer = None
        for c in job.choices:
            if c.finish_reason is None:
                c.finish_reason = "abort"
                if loop.abort(c.request_id):
                    metrics.aborted.labels(reason).inc()

    async def next_output(job: _Job, by_id: dict) -> tuple[_Choice, RequestOutput]:
        item = await job.queue.get()
        if isinstance(item, _RequestTimeout):
            raise APIError(504, f"request timed out after {cfg.request_timeout} s and was aborted",
                           type="timeout_error", code="request_timeout")
        if isinstance(item, _ShuttingDown) or (isinstance(item, EngineFailure) and item.shutdown):
            raise APIError(503, "server shutting down: the request was aborted", type="server_error",
                           code="server_shutting_down")
        if isinstance(item, EngineFailure):
            by_id[item.request_id].finish_reason = "error"  # counted by the loop's on_fail
            job.end_reason = "error"
            raise APIError(500, str(item), type="server_error")
        return by_id[item.request_id], item

    def absorb(job: _Job, c: _Choice, out: RequestOutput) -> tuple[list[int], list]:
        """Record an output; returns the token ids and logprobs it added."""
        new_ids = out.token_ids[len(c.token_ids):]
        c.token_ids = out.token_ids  # a fresh list per output: no copy needed
        new_lps = []
        if out.logprobs is not None:
            new_lps = out.logprobs[len(c.logprobs):]
            c.logprobs = out.logprobs
        c.text.append(out.new_text)
        if out.prompt_logprobs is not None:
            c.prompt_logprobs = out.prompt_logprobs
        c.cached_tokens = out.metrics.get("cached_tokens", 0)
        c.metrics = out.metrics
        if out.finished:
            c.finish_reason = out.finish_reason
        return new_ids, new_lps

    async def collect(job: _Job, request: Request) -> JSONResponse:
        """Wait for every choice, or for the client to disconnect (then abort)."""
        async def gather():
            by_id, left = job.by_id(), len(job.choices)
            while left:
                c, out = await next_output(job, by_id)
                absorb(job, c, out)
                left -= out.finished
                if out.finish_reason == "error":  # its row's logits were not finite: the request fails
                    abort(job, "error")
                    raise APIError(500, f"generation failed: {out.stop_reason}", type="server_error",
                                   code="generation_error")

        work = asyncio.ensure_future(gather())
        gone = asyncio.ensure_future(wait_disconnect(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():
                work.cancel()
        if not work.done() or work.cancelled():
            abort(job, "client_closed")
            return JSONResponse({}, status_code=499)  # nobody reads it
        work.result()  # raises the APIError of a timeout or engine failure
        return JSONResponse(final_body(job))

    def final_body(job: _Job) -> dict:
        choices = []
        for c in job.choices:
            text = "".join(c.text)
            if job.kind == "completions":
                echoed = prompt_text(job, c) if job.req.echo else ""
                lp = completion_logprobs(c.logprobs, token_text, OffsetCounter(len(echoed)))
                if lp is None and job.logprobs is not None:  # asked for, and no token in the text
                    lp = empty_completion_logprobs()
                if job.req.echo and job.logprobs is not None:
                    lp = join_logprobs(prompt_logprobs(c.prompt_ids, c.prompt_logprobs, token_text), lp)
                text = echoed + text
                ch = {"index": c.index, "text": text, "logprobs": lp, "finish_reason": c.finish_reason}
            else:
                lp = chat_logprobs(c.logprobs, token_text)
                if lp is None and job.logprobs is not None:
                    lp = {"content": []}
                msg, finish = {"role": "assistant", "content": text}, c.finish_reason
                if job.calls_tools:
                    msg["content"], calls = tool_calls.split_calls(text, job.tools.names)
                    if calls:
                        msg["tool_calls"] = calls
                    finish = tool_finish(job, c, bool(calls))
                ch = {"index": c.index, "message": msg, "logprobs": lp, "finish_reason": finish}
            if job.req.return_token_ids:
                ch["token_ids"] = c.token_ids
                ch["prompt_token_ids"] = c.prompt_ids
            choices.append(ch)
        return {"id": job.id, "object": "text_completion" if job.kind == "completions" else "chat.completion",
                "created": job.created, "model": cfg.served_model_name, "choices": choices, "usage": usage(job)}

    def tool_finish(job: _Job, c: _Choice, called: bool) -> str | None:
        """OpenAI's finish_reason for a reply read for tool calls: "tool_calls" where it called one
        and ended of itself (auto, required); a forced named function ends with "stop"."""
        return "tool_calls" if called and c.finish_reason == "stop" and job.tools.choice != "named" \
            else c.finish_reason

    def usage(job: _Job) -> dict:
        prompt = sum(len(ids) for _, ids in job.prompts)
        completion = sum(len(c.token_ids) for c in job.choices)
        # a prompt counts once (as prompt_tokens does): its first sample's cached tokens
        cached, seen = 0, set()
        for c in job.choices:
            if c.prompt_index not in seen:
                seen.add(c.prompt_index)
                cached += c.cached_tokens
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def prompt_text(job: _Job, c: _Choice) -> str:
        text, ids = job.prompts[c.prompt_index]
        if text is None:
            text = decoder.decode(ids) if decoder is not None else ""
        return text

    # -- streaming -------------------------------------------------------------------------------
    async def stream_events(job: _Job):
        """Server-sent events: one chunk per engine output that adds text (the engine never
        splits a UTF-8 character and holds back what may start a stop string), a final chunk per
        choice with its finish_reason, the usage chunk if asked, then [DONE]."""
        req = job.req
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        obj = "text_completion" if job.kind == "completions" else "chat.completion.chunk"

        def chunk(choices: list[dict], usage_=None) -> str:
            d = {"id": job.id, "object": obj, "created": job.created, "model": cfg.served_model_name,
                 "choices": choices}
            if include_usage:
                d["usage"] = usage_
            return f"data: {json.dumps(d, ensure_ascii=False)}\n\n"

        def choice(c: _Choice, text: str, new_ids: list[int], new_lps: list, first: bool = False,
                   final: bool = False) -> dict:
            # only a choice's last chunk carries its finish_reason: an abort that lands while
            # earlier chunks still wait to be sent must not mark those as the end
            finish = c.finish_reason if final else None
            if job.kind == "completions":
                ch = {"index": c.index, "text": text,
                      "logprobs": completion_logprobs(new_lps, token_text, c.offsets) if job.logprobs is not None
                      else None, "finish_reason": finish}
            else:
                delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
                ch = {"index": c.index, "delta": delta,
                      "logprobs": chat_logprobs(new_lps, token_text) if job.logprobs is not None and new_lps else None,
                      "finish_reason": finish}
            if req.return_token_ids:
                ch["token_ids"] = new_ids
                if first:
                    ch["prompt_token_ids"] = c.prompt_ids
            return ch

        try:
            if job.kind == "chat":
                yield chunk([choice(c, "", [], [], first=True) for c in job.choices])
            elif req.echo and job.logprobs is None:
                yield chunk([choice(c, prompt_text(job, c), [], []) for c in job.choices])
            echo_due = {c.index for c in job.choices} if job.kind == "completions" and req.echo \
                and job.logprobs is not None else set()
            by_id, left = job.by_id(), len(job.choices)
            while left:
                c, out = await next_output(job, by_id)
                new_ids, new_lps = absorb(job, c, out)
                left -= out.finished
                if c.index in echo_due and c.prompt_logprobs is not None:
                    # the echo waits for the prefill that scores the prompt
                    echo_due.discard(c.index)
                    echoed = prompt_text(job, c)
                    yield chunk([{"index": c.index, "text": echoed, "finish_reason": None,
                                  "logprobs": prompt_logprobs(c.prompt_ids, c.prompt_logprobs, token_text)}])
                    c.offsets = OffsetCounter(len(echoed))
                if job.calls_tools:  # content deltas until a call opens, then tool-call deltas
                    if c.tool_stream is None:
                        c.tool_stream = tool_calls.ToolStream(job.tools.names)
                    deltas = c.tool_stream.feed(out.new_text, final=out.finished)
                    if not deltas and new_ids and (req.return_token_ids or job.logprobs is not None):
                        deltas = [{}]  # text held back: the tokens' entries go out now, on an empty delta
                    for k, d in enumerate(deltas):
                        ch = choice(c, "", new_ids if k == 0 else [], new_lps if k == 0 else [])
                        ch["delta"] = d
                        yield chunk([ch])
                    if out.finished:
                        yield chunk([{"index": c.index, "delta": {}, "logprobs": None,
                                      "finish_reason": tool_finish(job, c, bool(c.tool_stream.calls))}])
                elif out.new_text or out.finished or (new_ids and (req.return_token_ids or job.logprobs is not None)):
                    yield chunk([choice(c, out.new_text, new_ids, new_lps, final=out.finished)])
            if include_usage:
                yield chunk([], usage(job))
        except APIError as e:
            if e.code == "server_shutting_down":  # ended by the server: a proper end, not an error
                for c in job.choices:
                    if c.finish_reason in (None, "abort"):
                        c.finish_reason = "abort"
                        yield chunk([choice(c, "", [], [], final=True)])
                if include_usage:
                    yield chunk([], usage(job))
            else:  # headers are gone: the error becomes an event, as vLLM does
                yield f"data: {json.dumps(e.body())}\n\n"
        yield "data: [DONE]\n\n"

    return app


async def wait_disconnect(request: Request) -> None:
    """Return when the client has gone (its body is already read, so the next ASGI message of
    this request can only be the disconnect)."""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


class _EngineStream(StreamingResponse):
    """A server-sent-event response that calls `on_close` however it ends (done, client gone,
    cancelled at shutdown), so an unfinished request is always aborted."""

    def __init__(self, content, on_close):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()
