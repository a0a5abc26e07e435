"""Bounded waits for tests: a test that waits for a server, an engine step or a stream fails with a
message at a deadline, never hangs the run (issue 46; pytest-timeout is the outer bound)."""
from __future__ import annotations

import asyncio
import time
from typing import Callable


def wait_until(pred: Callable[[], object], timeout_s: float, what: str, poll_s: float = 0.01) -> None:
    """Poll `pred()` every `poll_s` seconds until it is true. Raises AssertionError naming `what`
    once `timeout_s` seconds have passed."""
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(poll_s)


async def await_until(pred: Callable[[], object], timeout_s: float, what: str, poll_s: float = 0.01) -> None:
    """wait_until for a coroutine: yields to the event loop between polls."""
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        await asyncio.sleep(poll_s)
