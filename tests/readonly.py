"""Run a command with a folder made read-only for it alone (issue 32: "a read-only cache root works").

root passes every mode-bit check, so for root the folder is bind-mounted read-only in a mount
namespace of the command's own (`unshare -m`: writes there fail with EROFS, as on a read-only
image); another user gets the mode bits cleared for the command's time. Where neither can be done
the calling test is skipped, saying why.
"""
from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest


def run_read_only(folder: Path, argv: list[str], env: dict | None = None, timeout: float = 600,
                  cwd: str | None = None) -> subprocess.CompletedProcess:
    """`argv` run with `folder` read-only; its output captured as text. Skips the test where no
    read-only view can be made here."""
    folder = Path(folder)
    if os.geteuid() == 0:
        if shutil.which("unshare") is None:
            pytest.skip("no unshare(1) to mount a read-only view")
        probe = subprocess.run(["unshare", "-m", "sh", "-c", 'mount --bind -o ro "$0" "$0"', str(folder)],
                               capture_output=True, text=True)
        if probe.returncode:
            pytest.skip(f"cannot bind-mount read-only here: {probe.stderr.strip()}")
        return subprocess.run(["unshare", "-m", "sh", "-c", 'mount --bind -o ro "$0" "$0" && exec "$@"',
                               str(folder), *argv], capture_output=True, text=True, env=env, timeout=timeout,
                              cwd=cwd)
    modes = {p: p.stat().st_mode for p in [folder, *folder.rglob("*")] if p.is_dir()}
    try:
        for p, m in modes.items():
            p.chmod(m & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
        return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout, cwd=cwd)
    finally:
        for p, m in modes.items():
            p.chmod(m)
