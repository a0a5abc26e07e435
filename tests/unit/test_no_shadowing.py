"""No module of the checkout shadows an installed package, and nothing changes sys.path (issue 46).

`benchmarks/kernels.py` once sat in front of the `kernels` package that transformers imports to
load a GGUF tokenizer: a test had put benchmarks/ first on sys.path, and `python benchmarks/X.py`
does the same for every script. The load failed, and the failure was cached as a finished
conversion.
"""
from __future__ import annotations

import ast
import importlib.metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _top_level_names(folder: Path) -> set[str]:
    """What `import NAME` can find with `folder` on sys.path: modules, packages and (namespace)
    package folders."""
    names = {p.stem for p in folder.glob("*.py")}
    names |= {p.name for p in folder.iterdir() if p.is_dir() and p.name.isidentifier()}
    return names


def test_no_script_or_test_module_has_the_import_name_of_an_installed_distribution():
    installed = importlib.metadata.packages_distributions()
    assert "torch" in installed and "transformers" in installed  # the map is real, not empty
    clashes = []
    # benchmarks/ is sys.path[0] for `python benchmarks/X.py`; the checkout's root is on it for
    # pytest (rootdir insertion) and for gpu_check.sh (PYTHONPATH=.)
    for folder in (ROOT / "benchmarks", ROOT):
        for name in sorted(_top_level_names(folder)):
            if name in installed and name != "mixserve":
                clashes.append(f"{folder.relative_to(ROOT.parent)}/{name} shadows {installed[name]}")
    assert not clashes, clashes


def _mutates_sys_path(tree: ast.AST) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        target = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            target = node.func.value  # sys.path.insert(...), sys.path.append(...), ...
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                target = t.value if isinstance(t, ast.Subscript) else t
        if (isinstance(target, ast.Attribute) and target.attr == "path" and isinstance(target.value, ast.Name)
                and target.value.id == "sys"):
            lines.append(node.lineno)
    return sorted(lines)


def test_no_test_or_script_changes_sys_path():
    found = []
    for path in sorted([*(ROOT / "tests").rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py")]):
        for line in _mutates_sys_path(ast.parse(path.read_text(), str(path))):
            found.append(f"{path.relative_to(ROOT)}:{line}")
    assert not found, f"these change sys.path for the rest of the process: {found}"


def test_the_sys_path_check_sees_each_form():
    src = "import sys\nsys.path.insert(0, 'x')\nsys.path.append('y')\nsys.path[:0] = ['z']\nsys.path += ['w']\n"
    assert _mutates_sys_path(ast.parse(src)) == [2, 3, 4, 5]
    assert _mutates_sys_path(ast.parse("import sys\nprint(sys.path[0])\nx = list(sys.path)\n")) == []
