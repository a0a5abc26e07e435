"""A real mixserve HTTP server on a free loopback port, uvicorn in a background thread."""
from __future__ import annotations

import threading
import time

import torch
import uvicorn

from mixserve.server.api import ServerConfig, create_app
from mixserve.server.serving import GracefulServer


class LiveServer:
    """Serve `engine` at http://127.0.0.1:<free port>; `stop()` runs the same shutdown path as
    SIGTERM (GracefulServer: `grace_s` for running requests, then the app's lifespan stops the
    engine thread). tokenizer: passed to create_app (stubs in tests)."""

    def __init__(self, engine, cfg: ServerConfig, timeout_s: float = 60.0, grace_s: float = 5.0, tokenizer=None):
        self.engine = engine
        self.app = create_app(engine, cfg, tokenizer=tokenizer)
        self.server = GracefulServer(uvicorn.Config(self.app, host="127.0.0.1", port=0, log_level="warning",
                                                    timeout_graceful_shutdown=5), grace_s=grace_s)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        t0 = time.monotonic()
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() - t0 > timeout_s:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"

    @property
    def loop(self):
        return self.app.state.engine_loop

    @property
    def config(self) -> ServerConfig:
        return self.app.state.config

    def wait_idle(self, timeout_s: float = 10.0) -> bool:
        """True once the engine has nothing left and every KV block is free."""
        bm = self.engine.block_manager
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if not self.engine.has_unfinished() and bm.num_free_blocks == bm.num_blocks:
                return True
            time.sleep(0.02)
        return False

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def gap_logits(logprobs) -> list[torch.Tensor]:
    """Per generated token, a 2-vector of the raw distribution's top-2 log-probabilities: their
    difference is the top-2 logit gap that tests.reference.compare_greedy's tie rule reads."""
    return [torch.tensor([lp.top[0][1], lp.top[1][1]]) for lp in logprobs]


def start_drain_streams(client, model: str, wait_s: float = 60.0) -> tuple[dict, dict, list[threading.Thread]]:
    """For shutdown tests: a long (2000 tokens) and a short (12 tokens) greedy completion stream
    through the `openai` client, both under way on return. Returns (short, long, threads); each
    sink holds "ids" (token ids so far), "finish" (the last finish_reason) and "error" (if the
    stream broke instead of ending). The long one needs ~10x any grace period a test uses
    (SmolLM2 ran 230 tokens in 5 s on a CI machine). Raises AssertionError if one never starts."""
    def stream(max_tokens, sink, started):
        try:
            for c in client.completions.create(model=model, prompt="Once upon a time", max_tokens=max_tokens,
                                               temperature=0, stream=True,
                                               extra_body={"ignore_eos": True, "return_token_ids": True}):
                sink["ids"] += c.choices[0].token_ids
                sink["finish"] = c.choices[0].finish_reason
                started.set()
        except Exception as e:  # noqa: BLE001 -- the test asserts there is none
            sink["error"] = e

    short, long = {"ids": []}, {"ids": []}
    s_started, l_started = threading.Event(), threading.Event()
    threads = [threading.Thread(target=stream, args=(2000, long, l_started)),
               threading.Thread(target=stream, args=(12, short, s_started))]
    threads[0].start()
    assert l_started.wait(wait_s), "the long stream never started"
    threads[1].start()
    assert s_started.wait(wait_s), "the short stream never started"
    return short, long, threads


def wait_healthy(url: str, proc, log, timeout_s: float = 600.0) -> None:
    """Poll url + /health until it answers 200. Raises AssertionError (with `log()`, a callable
    giving the server's output) when the process `proc` exits first or timeout_s passes; start-up
    includes torch.compile and, with replicas, Ray: minutes with a cold cache on 2 cores."""
    import httpx

    t0 = time.monotonic()
    while True:
        try:
            if httpx.get(url + "/health", timeout=10).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert proc.poll() is None and time.monotonic() - t0 < timeout_s, log()
        time.sleep(0.3)
