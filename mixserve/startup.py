"""Start-up phases: when each part of a start ended, counted from the process's own start.

Every user, test and replica pays start-up, so it is measured like any other cost. Code marks a
phase when it ends (`mark("weights")`); time inside a phase that happens in pieces (C++ builds,
kernel timing) is summed with `add`. Where $MIXSERVE_STARTUP_LOG names a file, every mark and sum is
appended to it as one JSON line, which benchmarks/startup.py reads; otherwise a mark costs one read
of /proc/self/stat. It imports nothing from mixserve, and no third-party package.
"""
from __future__ import annotations

import json
import os
import time

def process_age() -> float:
    """Seconds since this process started (the kernel's start time in /proc/self/stat, in clock
    ticks of 10 ms, against CLOCK_BOOTTIME), so the interpreter's own start and the imports before
    any of our code count too. Where /proc is unreadable: seconds since this module was imported."""
    try:
        with open("/proc/self/stat") as f:
            stat = f.read()
        start_ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22, starttime
        return time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return time.perf_counter() - _IMPORTED


_IMPORTED = time.perf_counter()


def _emit(record: dict) -> None:
    path = os.environ.get("MIXSERVE_STARTUP_LOG")
    if path:
        try:
            with open(path, "a") as f:
                f.write(json.dumps(record) + "\n")
        except OSError:  # a measurement aid: never a reason to fail a start
            pass


def mark(phase: str) -> float:
    """Record that `phase` ended now. Returns the process's age in seconds."""
    t = process_age()
    _emit({"phase": phase, "t": round(t, 4)})
    return t


def add(phase: str, seconds: float) -> None:
    """Add `seconds` to the time spent in `phase` (a phase that happens in pieces)."""
    _emit({"phase": phase, "add": round(seconds, 4)})
