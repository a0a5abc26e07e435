"""The engine on its own thread, driven from asyncio.

One thread owns the `LLMEngine` and is the only one that calls into it (add, abort, step). The
asyncio side sends it commands through a thread-safe queue; the thread applies all pending
commands between two steps (so an abort takes effect within one step) and hands each step's
outputs back to the event loop in ONE `call_soon_threadsafe` call, which keeps the per-step cost
of the HTTP side independent of how many streams are open.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass

from mixserve.engine.llm_engine import LLMEngine, RequestOutput
from mixserve.sampling_params import SamplingParams

log = logging.getLogger("mixserve.server")


class EngineFailure(Exception):
    """The engine raised while running request `request_id` (or refused it at add time), or
    `shutdown`: the loop stopped with the request unfinished; the message says why. The engine
    itself keeps serving other requests."""

    def __init__(self, request_id: str, message: str, shutdown: bool = False):
        super().__init__(message)
        self.request_id = request_id
        self.shutdown = shutdown


class ServerOverloaded(Exception):
    """The waiting queue holds `max_waiting` requests already; retry later."""


@dataclass
class _Stream:
    """Where one request's outputs go: an asyncio queue read by its HTTP handler."""

    queue: asyncio.Queue
    finished: bool = False


_STOP = object()


class EngineLoop:
    """Runs `engine.step()` on a dedicated thread while requests are added and aborted from an
    asyncio event loop.

    Args:
        engine: the engine; after `start()` no other thread may call it (reading its fixed
            settings, e.g. `check_request`, `max_model_len`, is fine).
        max_waiting: most requests waiting for admission (queued commands + the scheduler's
            waiting queue); `add` raises ServerOverloaded beyond it. None: no limit.
        on_finish: called on the event loop with each final RequestOutput (metrics).
        on_fail: called on the event loop with the id of each request a failing engine step
            ended (not at shutdown); a request is seen by exactly one of on_finish, on_fail and a
            True from abort().
        on_step: called on the engine thread after each step that ran, with its wall time
            (seconds, time.perf_counter) and the tokens the model ran in it (metrics).
    """

    def __init__(self, engine: LLMEngine, max_waiting: int | None = None, on_finish=None, on_step=None,
                 on_fail=None):
        self.engine = engine
        self.max_waiting = max_waiting
        self.on_finish = on_finish
        self.on_fail = on_fail
        self.on_step = on_step
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        # adds sent but not yet applied by the engine thread; each side only ever writes its own
        # counter, so no lock is needed to read their difference
        self._adds_sent = 0
        self._adds_applied = 0
        self.step_errors = 0

    # -- lifecycle (event loop side) -------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread; must be called from the running event loop."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="mixserve-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Abort whatever still runs, stop the engine thread and wait for it (seconds at most one
        engine step). Open streams receive an EngineFailure("server shutting down", shutdown=True)."""
        if self._thread is None:
            return
        self._commands.put(_STOP)
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
        self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def num_waiting(self) -> int:
        """Requests not yet admitted: sent adds the thread has not applied + the engine's
        waiting count (its scheduler queue and the n > 1 samples parked behind their leader's
        prefill); racy but atomic reads, at most one step stale."""
        return self._adds_sent - self._adds_applied + self.engine.num_waiting

    def check_admission(self, n: int = 1) -> None:
        """Raise ServerOverloaded when `n` more requests would pass `max_waiting` waiting ones
        (see num_waiting)."""
        if self.max_waiting is not None and self.num_waiting + n > self.max_waiting:
            raise ServerOverloaded(f"{self.num_waiting} requests are waiting (limit {self.max_waiting})")

    # -- requests (event loop side) --------------------------------------------------------------
    def add(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
            arrival_time: float | None = None, out: asyncio.Queue | None = None,
            share_prompt_with: str | None = None, cache_salt: str | None = None) -> asyncio.Queue:
        """Queue a request whose prompt and params passed `engine.check_request`.

        arrival_time: time.perf_counter() seconds of its arrival (default now). out: the queue
        that receives its RequestOutputs (the last one `finished`), or an EngineFailure if the
        engine fails it; several requests may share one (n > 1). share_prompt_with: an earlier
        request of the same prompt whose prompt KV blocks this one shares (engine.add_request).
        cache_salt: the prefix-cache salt (engine.add_request).
        Returns that queue.
        Raises ServerOverloaded when `max_waiting` requests already wait, RuntimeError when the
        loop is not running.
        """
        if not self.alive:
            raise RuntimeError("the engine loop is not running")
        self.check_admission()
        stream = _Stream(out if out is not None else asyncio.Queue())
        self._streams[request_id] = stream
        self._adds_sent += 1
        self._commands.put(("add", request_id, prompt_ids, params, arrival_time or time.perf_counter(),
                            share_prompt_with, cache_salt))
        return stream.queue

    def abort(self, request_id: str) -> bool:
        """Abort a request (no-op if it already finished); the engine frees its KV blocks before
        its next step. Its queue receives nothing more. Returns whether it was aborted: False
        when its final output had already come back (then `on_finish` saw it), so that a request
        is counted once, as finished or as aborted, whichever came first on the event loop."""
        stream = self._streams.pop(request_id, None)
        if stream is not None and not stream.finished:
            self._commands.put(("abort", request_id))
            return True
        return False

    # -- engine thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        eng = self.engine
        while True:
            # block only while idle: a busy engine must not wait for commands
            cmd = self._commands.get() if not eng.has_unfinished() else self._get_nowait()
            failures: list[tuple[str, str]] = []
            while cmd is not None:
                if cmd is _STOP:
                    self._shutdown()
                    return
                if cmd[0] == "add":
                    _, rid, ids, params, arrival, lead, salt = cmd
                    try:
                        eng.add_request(ids, params, request_id=rid, arrival_time=arrival, share_prompt_with=lead,
                                        cache_salt=salt)
                    except Exception as e:  # checked before sending, so only a race or a bug lands here
                        failures.append((rid, str(e)))
                    self._adds_applied += 1
                else:
                    eng.abort(cmd[1])
                cmd = self._get_nowait()
            outputs: list[RequestOutput] = []
            if eng.has_unfinished():
                t0 = time.perf_counter()
                eng.step_request_ids = None
                try:
                    outputs = eng.step()
                except Exception as e:
                    # The requests the step had scheduled fail (blocks freed); the others, which it
                    # did not touch, run on. Failing before it scheduled, it fails every request.
                    ids = eng.step_request_ids if eng.step_request_ids is not None else list(eng.requests)
                    ids = [rid for rid in ids if rid in eng.requests]
                    log.exception("engine step failed; failing its %d requests", len(ids))
                    self.step_errors += 1
                    for rid in ids:
                        eng.abort(rid)
                        failures.append((rid, f"engine error: {type(e).__name__}: {e}"))
                else:
                    if self.on_step is not None and eng.last_step_tokens:
                        self.on_step(time.perf_counter() - t0, eng.last_step_tokens)
            if outputs or failures:
                self._loop.call_soon_threadsafe(self._dispatch, outputs, failures)

    def _get_nowait(self):
        try:
            return self._commands.get_nowait()
        except queue.Empty:
            return None

    def _shutdown(self) -> None:
        failures = []
        for rid in list(self.engine.requests):
            self.engine.abort(rid)
            failures.append((rid, "server shutting down"))
        try:
            self._loop.call_soon_threadsafe(self._dispatch, [], failures, True)
        except RuntimeError:  # the event loop is already closed: nobody is listening
            pass

    # -- back on the event loop ------------------------------------------------------------------
    def _dispatch(self, outputs: list[RequestOutput], failures: list[tuple[str, str]], shutdown: bool = False) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if out.finished:
                self._streams.pop(out.request_id, None)
                # an aborted request (stream gone) was counted by abort(): not again as finished
                if self.on_finish is not None and stream is not None:
                    self.on_finish(out)
            if stream is not None:
                stream.finished = out.finished
                stream.queue.put_nowait(out)
        for rid, why in failures:
            stream = self._streams.pop(rid, None)
            if stream is not None:
                stream.finished = True
                stream.queue.put_nowait(EngineFailure(rid, why, shutdown))
                if self.on_fail is not None and not shutdown:  # each failed request once, here
                    self.on_fail(rid)
