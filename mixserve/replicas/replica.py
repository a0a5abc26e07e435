"""One engine replica: a Ray Serve deployment class that owns one LLMEngine and the same
OpenAI-compatible app as `mixserve serve` (server/api.create_app), driven in-process.

The ingress forwards each HTTP request whole (method, path, headers, body) and the replica runs
it through the app's ASGI interface, yielding what the app sends: first ("start", status,
headers), then ("body", bytes) pieces. So every endpoint, parameter, error and stream behaves as
in the single-engine server, by construction. When the caller cancels (client gone, ingress
retry), the app sees `http.disconnect` and aborts the request: its KV blocks are freed before the
engine's next step.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time

log = logging.getLogger("mixserve.replicas")

REPLICA_HEADER = "x-mixserve-replica"
PID_HEADER = "x-mixserve-replica-pid"
REASON_HEADER = "x-mixserve-route"
DRAIN_NAMESPACE = "mixserve"  # the Ray namespace of the command's DrainSignal actor (replicas/app.py)


class EngineReplica:
    """Ray Serve deployment body (wrapped by `serve.deployment` in replicas/app.py).

    engine_args: EngineArgs for this replica's engine. server_cfg: server.api.ServerConfig.
    threads: torch intra-op threads (the replica's CPU share). grace_s: seconds running requests
    get at shutdown before they are ended (as `serve --shutdown-grace`). drain_signal: the name of
    the command's DrainSignal actor (replicas/app.py): when it is set the replica drains.
    """

    async def __init__(self, engine_args, server_cfg, threads: int | None = None, grace_s: float = 5.0,
                       drain_signal: str | None = None):
        import torch
        from ray import serve

        from mixserve.engine.llm_engine import LLMEngine
        from mixserve.server.api import create_app

        if threads:
            torch.set_num_threads(threads)
        self.grace_s = grace_s
        try:
            self.name = serve.get_replica_context().replica_id.unique_id
        except Exception:  # constructed outside Ray Serve (unit tests)
            self.name = f"local-{os.getpid()}"
        self.engine = LLMEngine(engine_args)
        self.engine.populate_kv_cache()  # beside the rest of the start-up, not in the first requests' steps
        log.info("replica %s (pid %d): %s", self.name, os.getpid(), self.engine.describe())
        self.app = create_app(self.engine, server_cfg)
        self._lifespan = self.app.router.lifespan_context(self.app)
        await self._lifespan.__aenter__()
        self._closed = False
        self._drain_task = asyncio.get_running_loop().create_task(self._drain_on_signal(drain_signal)) \
            if drain_signal else None

    async def _drain_on_signal(self, name: str) -> None:
        import ray

        try:
            sig = ray.get_actor(name, namespace=DRAIN_NAMESPACE)
            # its handle: the command's drain stops waiting for a replica that has died
            await sig.wait.remote(self.name, ray.get_runtime_context().current_actor)
        except Exception as e:  # noqa: BLE001 -- the command is gone: Ray's own stop follows
            log.info("replica %s: no drain signal (%s)", self.name, type(e).__name__)
            return
        log.info("replica %s: draining (grace %.1f s)", self.name, self.grace_s)
        try:
            await self.app.state.drain(self.grace_s)
        finally:
            with contextlib.suppress(Exception):
                await sig.done.remote(self.name)

    async def handle_http(self, method: str, path: str, query: bytes, headers: list[tuple[bytes, bytes]],
                          body: bytes, route_keys: list[int] | None = None, routed: str = ""):
        """Run one HTTP request through the app. Yields ("start", status, [(name, value)...])
        once, then ("body", bytes) pieces (what the app sent since the last one, joined), the last
        one ending the response. route_keys are read by the router only; routed is the router's
        reason, echoed in the x-mixserve-route header."""
        sent: asyncio.Queue = asyncio.Queue()
        gone = asyncio.Event()
        body_given = False

        async def receive():
            nonlocal body_given
            if not body_given:
                body_given = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(msg):
            sent.put_nowait(msg)

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
                 "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": query,
                 "root_path": "", "headers": headers, "client": ("ray-serve", 0), "server": ("replica", 0)}
        task = asyncio.ensure_future(self.app(scope, receive, send))
        try:
            while True:
                msg = await self._next(sent, task)
                if msg is None:  # the app returned without finishing the response
                    return
                if msg["type"] == "http.response.start":
                    hdrs = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in msg.get("headers", [])]
                    hdrs += [(REPLICA_HEADER, self.name), (PID_HEADER, str(os.getpid())), (REASON_HEADER, routed)]
                    yield ("start", msg["status"], hdrs)
                    continue
                if msg["type"] != "http.response.body":
                    continue
                chunk, more = [msg.get("body", b"")], msg.get("more_body", False)
                while more and not sent.empty():  # join what is already there: one Ray item
                    m = sent.get_nowait()
                    chunk.append(m.get("body", b""))
                    more = m.get("more_body", False)
                yield ("body", b"".join(chunk), more)
                if not more:
                    return
        finally:
            gone.set()  # a cancelled caller: the app aborts the request (KV freed)
            try:
                await asyncio.wait_for(task, 10)
            except BaseException:  # noqa: BLE001 -- cleanup of a cancelled or failed request
                task.cancel()

    @staticmethod
    async def _next(sent: asyncio.Queue, task: asyncio.Future):
        if not sent.empty():
            return sent.get_nowait()
        get = asyncio.ensure_future(sent.get())
        done, _ = await asyncio.wait({get, task}, return_when=asyncio.FIRST_COMPLETED)
        if get in done:
            return get.result()
        get.cancel()
        task.result()  # raises what the app raised
        return sent.get_nowait() if not sent.empty() else None

    def record_routing_stats(self) -> dict:
        """Ray Serve polls this (request_routing_stats_period_s) and hands it to the routers: the
        replica's name and pid and its whole Prometheus text (engine gauges included), which the
        ingress's /metrics relabels with replica=<name>."""
        from prometheus_client import generate_latest

        return {"name": self.name, "pid": os.getpid(), "time": time.time(),
                "metrics": generate_latest(self.app.state.metrics.registry).decode()}

    def check_health(self) -> None:
        """Ray Serve's health check: a replica whose engine thread died is restarted."""
        if not self.app.state.engine_loop.alive:
            raise RuntimeError("the engine thread is not running")

    async def __del__(self):
        """At shutdown (Ray Serve calls it once the replica stops taking requests): running
        requests get grace_s seconds, then end as in `serve` (last chunk "abort", or a 503)."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        if self._drain_task is not None and not self._drain_task.done():
            self._drain_task.cancel()
        await self.app.state.drain(self.grace_s)
        await self._lifespan.__aexit__(None, None, None)
