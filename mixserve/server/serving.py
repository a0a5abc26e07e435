"""uvicorn with a shutdown that ends requests properly.

uvicorn's own graceful shutdown (SIGINT/SIGTERM) waits `timeout_graceful_shutdown` seconds for
running requests and then cancels their tasks: a stream is cut without its last chunk or
[DONE], and a non-streamed request gets uvicorn's plain-text 500. Here the app ends them itself
first (api.create_app's `app.state.drain`): stop accepting, wait up to `grace_s` seconds, then
streams get a last chunk with finish_reason "abort" and [DONE], other requests a JSON 503.
"""
from __future__ import annotations

import uvicorn


class GracefulServer(uvicorn.Server):
    """A uvicorn.Server for an app made by api.create_app.

    grace_s: seconds running requests may take to finish after shutdown starts (SIGTERM, or
        `should_exit = True`) before the app ends them. uvicorn's own timeout_graceful_shutdown
        (in `config`) then only has to cover sending those last answers.
    """

    def __init__(self, config: uvicorn.Config, grace_s: float):
        super().__init__(config)
        self.grace_s = grace_s

    async def shutdown(self, sockets=None) -> None:
        for server in self.servers:  # stop accepting connections before the grace period
            server.close()
        drain = getattr(getattr(self.config.app, "state", None), "drain", None)
        if drain is not None:
            await drain(self.grace_s)
        await super().shutdown(sockets)
