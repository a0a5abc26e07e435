"""Building our few C++ kernels once with torch.utils.cpp_extension, cached per torch version.

A kernel is compiled for this machine (-march=native) into `<cache root>/kernels/torch-<version>`;
`MIXSERVE_NO_CPP_KERNELS=1` or a failed build (no compiler, no headers) gives None, and callers
fall back to eager PyTorch ops.
"""
from __future__ import annotations

import logging
import os

import torch

from mixserve.env import cache_root, cpu_model

log = logging.getLogger("mixserve")
_built: dict[str, object] = {}


def build_extension(name: str, source: str, functions: list[str]):
    """The compiled module `name` (its C++ `source` exporting `functions`), or None where it cannot
    be built. The build folder is keyed by CPU model too, since -march=native code is not portable."""
    if name in _built:
        return _built[name]
    mod = None
    if not os.environ.get("MIXSERVE_NO_CPP_KERNELS"):
        try:
            from torch.utils.cpp_extension import load_inline

            cpu = "".join(c if c.isalnum() else "-" for c in cpu_model())[:48]
            build = cache_root() / "kernels" / f"torch-{torch.__version__}" / cpu
            build.mkdir(parents=True, exist_ok=True)
            mod = load_inline(name, cpp_sources=source, functions=functions,
                              extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
                              build_directory=str(build), verbose=False)
        except Exception as e:  # no compiler, no headers: the eager path still works
            log.warning("C++ kernel %s unavailable (%s); using eager ops", name, e)
    _built[name] = mod
    return mod
