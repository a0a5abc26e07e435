"""The ingress of `serve --replicas N`: one Ray Serve deployment in front of the engine replicas.

Every HTTP request is forwarded whole to one replica (replicas/replica.py), which answers it with
the single-engine server's own app; the ingress only adds routing, retries and the aggregated
/metrics:
- routing: for completions and chat it computes the route keys (routing.route_keys over the
  prompt's first full KV blocks, after the chat template, tokenized with the model's tokenizer)
  and passes it to the engine deployment's request router (replicas/ray_router.py).
- retries: a request whose replica dies (or is unreachable) before the first byte of its answer
  has been sent to the client is sent again, to another replica, up to `retries` times. A stream
  whose replica dies after that ends with an error event and [DONE], never a hang.
- cancellation: a client that goes away cancels the replica call; the replica's app aborts the
  request and frees its KV blocks.
- /metrics: the ingress's routing counters, plus every replica's engine metrics (from the routing
  stats Ray Serve polls) with a `replica` label.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Metric, generate_latest, CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

from mixserve.replicas.replica import REASON_HEADER, REPLICA_HEADER
from mixserve.replicas.routing import route_keys

log = logging.getLogger("mixserve.replicas")

_GENERATE = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}


@dataclass
class IngressSettings:
    """model: the model spec (its tokenizer computes route keys). block_size: the engines' KV
    block size (tokens). route_blocks: KV blocks' worth of tokens the route keys cover. max_body_bytes: as
    ServerConfig. retries: extra tries for a request whose replica died before answering.
    per_key_salt: the engines salt prefix blocks per API key, so the key is part of the route key.
    api_keys: ServerConfig.keys() (None: no key needed): a request too large to read is refused
    for its missing key first, as the single server does."""

    model: str
    block_size: int = 16
    route_blocks: int = 4
    max_body_bytes: int = 8 << 20
    retries: int = 2
    per_key_salt: bool = False
    api_keys: dict[str, str] | None = None


def _replica_errors() -> tuple:
    import ray.exceptions as rex

    return (rex.RayActorError, rex.ActorUnavailableError)


def _relay(content, status: int, headers: dict, on_close):
    """A StreamingResponse that calls on_close however it ends. Starlette drops its body iterator
    unclosed when the client goes mid-send, so the iterator's own `finally` would wait for the
    garbage collector; this cancels the replica call at once (the replica aborts, KV freed)."""
    from starlette.responses import StreamingResponse

    class Relay(StreamingResponse):
        async def __call__(self, scope, receive, send):
            try:
                await super().__call__(scope, receive, send)
            finally:
                on_close()

    return Relay(content, status_code=status, headers=headers)


class _ReplicaMetrics:
    """Collector: each live replica's Prometheus text (its last routing stats) relabelled with
    replica=<name>, one family per metric name across replicas."""

    def __init__(self, stats_fn):
        self.stats_fn = stats_fn

    def collect(self):
        families: dict[str, Metric] = {}
        # how old each replica's figures are: Ray Serve's controller relays them, and a stale
        # reading (a busy controller) must be told apart from a replica that holds blocks
        age = Metric("mixserve_replica_stats_age_seconds", "Seconds since the replica reported the figures "
                     "below (Ray Serve relays them through its controller).", "gauge")
        now = time.time()
        for name, stats in sorted(self.stats_fn().items()):
            text = stats.get("metrics")
            if not text:
                continue
            if isinstance(stats.get("time"), (int, float)):
                age.add_sample("mixserve_replica_stats_age_seconds", {"replica": name}, max(0.0, now - stats["time"]))
            for fam in text_string_to_metric_families(text):
                out = families.get(fam.name)
                if out is None:
                    out = families[fam.name] = Metric(fam.name, fam.documentation, fam.type)
                for s in fam.samples:
                    out.add_sample(s.name, {**s.labels, "replica": name}, s.value)
        yield from families.values()
        if age.samples:
            yield age


class Ingress:
    """Ray Serve deployment body (wrapped in replicas/app.py): `__call__` takes every HTTP
    request of the application (a starlette Request) and returns the replica's answer.

    replicas: the engine deployment's DeploymentHandle. settings: IngressSettings.
    """

    def __init__(self, replicas, settings: IngressSettings):
        self.replicas = replicas.options(stream=True)
        self.settings = settings
        self.tokenizer = None
        try:
            from mixserve.models.weights import load_tokenizer

            self.tokenizer = load_tokenizer(settings.model)
        except ValueError:  # no tokenizer: token-id prompts still route by prefix
            pass
        # one thread: a fast tokenizer used from two threads at once can fail ("Already borrowed")
        self._tokenize = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mixserve-route")
        r = self.registry = CollectorRegistry()
        self.routed = Counter("mixserve_router_requests", "Requests sent to each replica, by the router's reason "
                              "(affinity, load, no_prefix, pow2, round_robin).", ["replica", "reason"], registry=r)
        self.retried = Counter("mixserve_router_retries", "Requests sent again because their replica died or was "
                               "unreachable before answering.", registry=r)
        self.stream_errors = Counter("mixserve_router_stream_errors", "Streams ended with an error event because "
                                     "their replica died mid-answer.", registry=r)
        self.failed = Counter("mixserve_router_failed", "Requests no replica could answer (retries spent).",
                              registry=r)
        r.register(_ReplicaMetrics(self._replica_stats))

    # -- routing key -----------------------------------------------------------------------------
    def _prompt_ids(self, kind: str, body: dict) -> list[int] | None:
        """The prompt's leading token ids as the engine will see them (enough for route_blocks
        full blocks), or None when they cannot be known (the replica then answers the error)."""
        from mixserve.server.protocol import parse_request

        want = self.settings.block_size * self.settings.route_blocks
        req = parse_request(kind, body)
        tok = self.tokenizer
        if kind == "completions":
            p = req.prompt
            if isinstance(p, list) and p and not isinstance(p[0], int):
                p = p[0]
            if isinstance(p, list):
                return list(p[:want])
            text, special = p, True
        else:
            if tok is None or not getattr(tok, "chat_template", None) or not req.messages:
                return None
            conv = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
                    for m in req.messages]
            text, special = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True), False
        if tok is None or not isinstance(text, str):
            return None
        # a prefix of the text tokenizes like the whole except near the cut: tokens are rarely
        # longer than 16 characters, and the last few are dropped when the text was cut
        cut = want * 16
        ids = tok(text[:cut], add_special_tokens=special)["input_ids"]
        return ids[:-4] if len(text) > cut else ids

    def _route_keys(self, path: str, body: bytes, auth: str) -> list[int] | None:
        kind = _GENERATE.get(path)
        if kind is None:
            return None
        try:
            parsed = json.loads(body)
            ids = self._prompt_ids(kind, parsed)
        except Exception:  # noqa: BLE001 -- a bad body is the replica's to refuse, with its reason
            return None
        if not ids:
            return None
        salt = parsed.get("cache_salt")
        salt = salt if isinstance(salt, str) else None
        if self.settings.per_key_salt:
            salt = f"{auth}\n{salt or ''}"
        return route_keys(ids, self.settings.block_size, self.settings.route_blocks, salt) or None

    # -- metrics ---------------------------------------------------------------------------------
    def _replica_stats(self) -> dict[str, dict]:
        from mixserve.replicas.ray_router import live_routers

        out: dict[str, dict] = {}
        for r in live_routers():
            out.update(r.replicas_stats())
        return out

    # -- the request path ------------------------------------------------------------------------
    async def __call__(self, request):
        from starlette.responses import JSONResponse, Response

        from mixserve.server.protocol import APIError, check_api_key

        path = request.url.path
        if path == "/metrics" and request.method == "GET":
            if not self._replica_stats():  # the router is made on the first call: make it
                await self._forward("GET", "/health", b"", [], b"", None, probe=True)
            return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)
        try:
            body = await self._read_body(request)
        except APIError as e:
            try:  # as the single server: a request without a valid key is told that first
                check_api_key(self.settings.api_keys, request.headers.get("authorization", ""))
            except APIError as auth:
                e = auth
            return JSONResponse(e.body(), status_code=e.status)
        headers = [(k, v) for k, v in request.headers.raw if k.lower() != b"host"]
        key = None
        if request.method == "POST" and path in _GENERATE and body:
            auth = request.headers.get("authorization", "")
            key = await asyncio.get_running_loop().run_in_executor(self._tokenize, self._route_keys, path, body, auth)
        answer = await self._forward(request.method, path, request.url.query.encode(), headers, body, key)
        if isinstance(answer, Response):
            return answer
        status, hdrs, first, more, gen = answer
        if not more:
            return Response(first, status_code=status, headers=hdrs)
        hdrs.pop("content-length", None)
        state = {"done": False}
        return _relay(self._rest(first, gen, hdrs.get("content-type", ""), state), status, hdrs,
                      on_close=lambda: state["done"] or gen.cancel())

    async def _read_body(self, request) -> bytes:
        from mixserve.server.protocol import APIError

        limit = self.settings.max_body_bytes
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise APIError(413, f"the request body is {int(length)} bytes; this server accepts at most {limit} bytes",
                           code="request_too_large")
        parts, n = [], 0
        async for piece in request.stream():
            n += len(piece)
            if n > limit:
                raise APIError(413, f"the request body is over {limit} bytes; this server accepts at most {limit} "
                               "bytes", code="request_too_large")
            parts.append(piece)
        return b"".join(parts)

    async def _forward(self, method, path, query, headers, body, key, probe: bool = False):
        """Send to a replica and wait for its answer's start and first piece. Returns
        (status, headers, first bytes, more, generator) or a Response when no replica could
        answer. A replica that dies before its first piece is retried on another."""
        from starlette.responses import JSONResponse

        from mixserve.server.protocol import APIError

        errors = _replica_errors()
        why = ""
        for attempt in range(self.settings.retries + 1):
            if attempt:
                self.retried.inc()
                await asyncio.sleep(min(2.0, 0.25 * 2 ** attempt))  # let Ray see the dead replica
            gen = self.replicas.handle_http.remote(method, path, query, headers, body, route_keys=key)
            try:
                _, status, hdr_list = await gen.__anext__()
                _, first, more = await gen.__anext__()
            except errors as e:
                gen.cancel()
                why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                log.warning("replica unavailable before answering (%s); try %d of %d", why, attempt + 1,
                            self.settings.retries + 1)
                continue
            except StopAsyncIteration:
                why = "the replica ended the answer before it started"
                continue
            except BaseException:
                gen.cancel()
                raise
            hdrs = dict(hdr_list)
            if not probe and path in _GENERATE:  # generation requests only: /health would swell no_prefix
                self.routed.labels(hdrs.get(REPLICA_HEADER, "?"), hdrs.get(REASON_HEADER) or "?").inc()
            return status, hdrs, first, more, gen
        self.failed.inc()
        e = APIError(503, f"no replica could answer the request after {self.settings.retries + 1} tries ({why}); "
                     "retry later", type="server_error", code="replica_unavailable", headers={"Retry-After": "1"})
        return JSONResponse(e.body(), status_code=503, headers=e.headers)

    async def _rest(self, first: bytes, gen, content_type: str, state: dict):
        """The answer's remaining pieces; a replica that dies mid-stream ends it with an error
        event and [DONE] (server-sent events), or just ends it (other bodies). state["done"] is set
        once the replica's answer has ended (then nothing is left to cancel)."""
        errors = _replica_errors()
        try:
            yield first
            async for item in gen:
                yield item[1]
                if not item[2]:
                    break
            state["done"] = True
        except errors as e:
            self.stream_errors.inc()
            log.warning("replica died mid-stream: %s", type(e).__name__)
            if content_type.startswith("text/event-stream"):
                err = {"error": {"message": f"the replica serving this stream failed ({type(e).__name__}); the "
                                 "answer is incomplete", "type": "server_error", "param": None,
                                 "code": "replica_failed"}}
                yield f"data: {json.dumps(err)}\n\n".encode()
                yield b"data: [DONE]\n\n"
        finally:
            if not state["done"]:
                gen.cancel()
