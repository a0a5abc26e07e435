"""Facts about the machine and the process that every layer may need: where mixserve keeps its
files, and which CPU and torch build a measurement ran on.

It imports nothing from mixserve, so any module can use it without reaching upwards; torch is
imported only inside machine_info(), so the cache root stays cheap for the CLI and the registry.
"""
from __future__ import annotations

import os
import platform
import time
from pathlib import Path


def cache_root() -> Path:
    """Root of mixserve's cache (models, conversions, kernels, datasets, quantized checkpoints):
    ``$XDG_CACHE_HOME/mixserve``, else ``~/.cache/mixserve``.

    An empty or relative ``XDG_CACHE_HOME`` is ignored, as the XDG Base Directory spec says.
    The folder is not created here.
    """
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "mixserve"
    return Path.home() / ".cache" / "mixserve"


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (``platform.processor()`` where that is unreadable)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


_ISA_PREFIXES = ("avx", "amx", "sse", "ssse", "fma", "f16c", "bmi", "adx", "sha", "vaes", "vpclmul", "gfni",
                 "movbe", "popcnt", "abm", "lzcnt")


def cpu_isa_key() -> str:
    """8 hex digits naming this CPU's instruction-set extensions (the SIMD and bit-manipulation
    flags of /proc/cpuinfo): code built with -march=native on one set must not run on another
    (SIGILL), and a model name alone does not tell them apart ("AMD EPYC" has come with and
    without AVX-512). "noisa" where /proc/cpuinfo is unreadable."""
    import hashlib

    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = sorted(x for x in line.split(":", 1)[1].split() if x.startswith(_ISA_PREFIXES))
                    return hashlib.sha256(" ".join(flags).encode()).hexdigest()[:8]
    except OSError:
        pass
    return "noisa"


def machine_info() -> dict:
    """What a published timing must carry: {"cpu": model name, "cores": os.cpu_count(),
    "torch_threads": torch's intra-op threads, "torch": version, "date": YYYY-MM-DD}."""
    import torch

    return {"cpu": cpu_model(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
