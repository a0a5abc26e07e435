"""Loading a script under benchmarks/ in a test without touching sys.path.

Inserting benchmarks/ at the front of sys.path made every later `import X` in the pytest process
find benchmarks/X.py first: transformers' `import kernels` got our benchmark script (issue 46).
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_script(name: str):
    """The module benchmarks/<name>.py, loaded by its path under the name `benchmarks_<name>`
    (registered in sys.modules, which dataclasses and pickling need). Raises FileNotFoundError
    where there is no such script."""
    path = ROOT / "benchmarks" / f"{name}.py"
    if not path.is_file():
        raise FileNotFoundError(path)
    key = f"benchmarks_{name}"
    if key in sys.modules:
        return sys.modules[key]
    spec = importlib.util.spec_from_file_location(key, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[key] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules[key]
        raise
    return mod
