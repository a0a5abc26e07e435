"""SIGTERM on `serve --replicas` (the command as a user runs it, in a subprocess): the replicas
drain as the single server does (a short stream finishes, a long one ends with a last "abort"
chunk when --shutdown-grace, 5 s, runs out), the command exits 0, and no process it started is left."""
import os
import signal
import socket
import subprocess
import sys
import time

import openai
import pytest

pytest.importorskip("ray.serve")

from tests.live_server import start_drain_streams, wait_healthy  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.ray]

NAME = "smol"


def _descendants(pid: int) -> set[int]:
    """Every live process below pid (from /proc's parent links)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_sigterm_drains_the_replicas_and_exits_clean(smollm2_path, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log_file = tmp_path / "serve.log"
    proc = subprocess.Popen([sys.executable, "-m", "mixserve.cli", "serve", "--model", smollm2_path, "--replicas", "1",
                             "--replica-cpus", "1", "--replica-threads", "1", "--dtype", "float32",
                             "--kv-cache-memory", "96MiB", "--max-model-len", "2048", "--port", str(port),
                             "--served-model-name", NAME, "--shutdown-grace", "5"],
                            stdout=log_file.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    # the command's own lines (its workers' Ray log lines and stack traces are many)
    log = lambda: "\n".join(ln for ln in log_file.read_text(errors="replace").splitlines()  # noqa: E731
                             if "mixserve" in ln or "Error" in ln)[-3000:]
    try:
        wait_healthy(url, proc, log)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)

        short, long, threads = start_drain_streams(client, NAME, wait_s=120)
        before = _descendants(proc.pid)
        assert before  # the local Ray instance runs under the command
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(90)
        assert short["finish"] == "length" and len(short["ids"]) == 12, (short, log())
        assert "error" not in long and long["finish"] == "abort" and len(long["ids"]) < 2000, (long, log())
        assert proc.wait(120) == 0, log()
        time.sleep(2)
        left = [p for p in before if _alive(p)]
        assert not left, (left, log())
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
