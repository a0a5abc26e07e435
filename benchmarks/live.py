"""A server process for the benchmarks that drive one over HTTP: a free port, and waiting for /health."""
from __future__ import annotations

import socket
import subprocess
import time

import httpx


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 600.0, interval_s: float = 0.5) -> None:
    """Return once GET url/health answers 200. Raises SystemExit if `proc` exits first or
    `timeout_s` seconds pass."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        time.sleep(interval_s)
    raise SystemExit(f"server at {url} not healthy after {timeout_s:.0f} s")
