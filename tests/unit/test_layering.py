"""The package's dependency rules (README "Layout"), checked on the source with `ast`.

Every import counts: module-level, inside functions (lazy imports are still dependencies),
relative, and `importlib.import_module("mixserve...")` with a literal name. Importing a module
also runs its parents' __init__ files; those edges are not counted, since the package
__init__ files hold no code that imports back (mixserve/__init__.py's lazy LLM is the one
explicit edge, and it is counted where a module names it).
"""
from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "mixserve"

CORE = ("engine", "kv", "layers", "models", "quant", "spec_decode", "data", "structured_output")
OUTER = ("server", "replicas", "bench", "plan", "cli")
FORBIDDEN = {core: OUTER for core in CORE}
FORBIDDEN["layers"] += ("models",)
FORBIDDEN["kv"] += ("models",)
FORBIDDEN["quant"] += ("engine",)
# README "Layout", right column: the packages of ours each one may import ("" is the top-level
# modules env, device, host_memory, startup, sampling_params, sequence, open to all; llm is mixserve/llm.py)
OPEN = {"env", "device", "host_memory", "startup", "sampling_params", "sequence", ""}
ALLOWED = {
    "env": set(), "layers": set(), "kv": set(), "data": {"kv", "structured_output"}, "structured_output": set(),
    "quant": {"layers", "models", "data"},
    "models": {"layers", "quant"},
    "spec_decode": {"engine", "kv"},
    "engine": {"kv", "layers", "models", "spec_decode", "structured_output"},
    "llm": {"engine"},
    "bench": {"engine", "kv", "models", "data", "structured_output"},
    "plan": {"engine", "kv", "layers", "models", "spec_decode", "bench", "data", "replicas", "structured_output"},
    "server": {"engine", "kv", "structured_output"},
    "replicas": {"engine", "kv", "server", "models"},
}


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of dotted `name` that is a module of ours."""
    parts = name.split(".")
    while parts:
        cand = ".".join(parts)
        if cand in modules:
            return cand
        parts.pop()
    return None


def imported_names(path: Path, this: str, is_pkg: bool) -> list[str]:
    """Dotted names (modules, or module.attribute) that the file imports, relative ones resolved."""
    tree = ast.parse(path.read_text(), str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = this.split(".")
                base = base if is_pkg else base[:-1]
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            # `from pkg import sub` names the submodule pkg.sub when there is one
            out += [f"{mod}.{a.name}" for a in node.names] + [mod]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            f = node.func
            fname = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
            if fname == "import_module" and isinstance(node.args[0].value, str):
                out.append(node.args[0].value)
    return [n for n in out if n == "mixserve" or n.startswith("mixserve.")]


def import_graph() -> dict[str, set[str]]:
    modules = all_modules()
    graph = {}
    for name, path in modules.items():
        deps = set()
        for n in imported_names(path, name, path.name == "__init__.py"):
            target = _resolve(n, modules)
            if target is not None and target != name:
                deps.add(target)
        graph[name] = deps
    return graph


def _area(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_graph_sees_known_edges():
    g = import_graph()
    # module level, lazy (inside a function), relative-free `from pkg import name` forms
    assert "mixserve.engine.scheduler" in g["mixserve.engine.llm_engine"]
    assert "mixserve.models.registry" in g["mixserve.models.loader"]
    assert "mixserve.engine.model_runner" in g["mixserve.plan.hardware"]  # a lazy import
    assert "mixserve.llm" in g["mixserve"]


def test_resolution_of_relative_and_importlib_forms(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("from . import sampler\nfrom ..kv.block_manager import BlockManager\n"
                 "import importlib\nimportlib.import_module('mixserve.plan.planner')\n")
    names = imported_names(f, "mixserve.engine.m", False)
    assert "mixserve.engine.sampler" in names
    assert "mixserve.kv.block_manager.BlockManager" in names
    assert "mixserve.plan.planner" in names


@pytest.mark.parametrize("area", sorted(FORBIDDEN))
def test_core_never_imports_upwards(area):
    g = import_graph()
    bad = sorted(f"{m} -> {d}" for m, deps in g.items() if _area(m) == area
                 for d in deps if _area(d) in FORBIDDEN[area])
    assert not bad, f"{area} may not import {FORBIDDEN[area]}: {bad}"


def find_cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one file (Tarjan): each is a set of files
    that import one another, directly or through others."""
    index, low, stack, on, sccs = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                sccs.append(sorted(comp))

    for v in g:
        if v not in index:
            visit(v)
    return sccs


def test_packages_import_only_what_the_readme_allows():
    g = import_graph()
    bad = sorted(f"{m} -> {d}" for m, deps in g.items() if _area(m) in ALLOWED for d in deps
                 if _area(d) != _area(m) and _area(d) not in ALLOWED[_area(m)] | OPEN)
    assert not bad, f"imports outside README's Layout table: {bad}"


def test_no_import_cycles():
    cycles = find_cycles(import_graph())
    assert not cycles, f"import cycles: {cycles}"


def test_cycle_detector_finds_a_cycle():
    g = {"a": {"b"}, "b": {"c", "d"}, "c": {"a"}, "d": set(), "e": {"e"}}
    assert find_cycles(g) == [["a", "b", "c"]]


def _benchmark_imports():
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith("mixserve"):
                for a in node.names:
                    yield path.name, node.module, a.name
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("mixserve"):
                        yield path.name, a.name, None
            elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
                f = node.func
                fname = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
                v = node.args[0].value
                if fname == "import_module" and isinstance(v, str) and v.startswith("mixserve"):
                    yield path.name, v, None


def test_benchmark_scripts_import_names_that_exist():
    """The scripts are not run by the suite, so a moved module or name would break them silently."""
    seen, missing = 0, []
    for script, mod, name in _benchmark_imports():
        seen += 1
        try:
            m = importlib.import_module(mod)
        except ImportError as e:
            missing.append(f"{script}: {mod} ({e})")
            continue
        if name is not None and not hasattr(m, name):
            try:
                importlib.import_module(f"{mod}.{name}")
            except ImportError:
                missing.append(f"{script}: {mod}.{name}")
    assert seen > 20  # the walk found the scripts' imports at all
    assert not missing, missing
