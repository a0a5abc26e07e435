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
