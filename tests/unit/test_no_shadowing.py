"""No module of the checkout shadows an installed package, and nothing changes sys.path (issue 46).

`benchmarks/kernels.py` once sat in front of the `kernels` package that transformers imports to
load a GGUF tokenizer: a test had put benchmarks/ first on sys.path, and `python benchmarks/X.py`
does the same for every script. The load failed, and the failure was cached as a finished
conversion.
"""
from __future__ import annotations

import ast
import importlib.metadata
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _top_level_names(folder: Path) -> set[str]:
    """What `import NAME` can find with `folder` on sys.path: modules, packages and (namespace)
    package folders."""
    names = {p.stem for p in folder.glob("*.py")}
    names |= {p.name for p in folder.iterdir() if p.is_dir() and p.name.isidentifier()}
    return names


def test_no_script_or_test_module_has_the_import_name_of_an_installed_distribution_or_the_stdlib():
    installed = importlib.metadata.packages_distributions()
    assert "torch" in installed and "transformers" in installed  # the map is real, not empty
    clashes = []
    # benchmarks/ is sys.path[0] for `python benchmarks/X.py`; the checkout's root is on it for
    # pytest (rootdir insertion) and for gpu_check.sh (PYTHONPATH=.)
    for folder in (ROOT / "benchmarks", ROOT):
        for name in sorted(_top_level_names(folder)):
            if name in installed and name != "mixserve":
                clashes.append(f"{folder.relative_to(ROOT.parent)}/{name} shadows {installed[name]}")
            elif name in sys.stdlib_module_names:  # benchmarks/tokenize.py would break `import tokenize`
                clashes.append(f"{folder.relative_to(ROOT.parent)}/{name} shadows the standard library's")
    assert not clashes, clashes


_MUTATORS = {"insert", "append", "extend", "remove", "pop", "clear", "reverse", "sort", "__setitem__",
             "__delitem__", "__iadd__"}


def _mutates_sys_path(tree: ast.AST) -> list[int]:
    """Lines that change sys.path: its mutating methods, assignment to it or an item or slice of
    it, `del` of an item, through any name `sys` or `sys.path` was imported as; and
    site.addsitedir or setattr(sys, "path", ...)."""
    sys_names, path_names = {"sys"}, set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            sys_names |= {a.asname for a in node.names if a.name == "sys" and a.asname}
        elif isinstance(node, ast.ImportFrom) and node.module == "sys":
            path_names |= {a.asname or a.name for a in node.names if a.name == "path"}

    def is_path(e) -> bool:
        return ((isinstance(e, ast.Attribute) and e.attr == "path" and isinstance(e.value, ast.Name)
                 and e.value.id in sys_names) or (isinstance(e, ast.Name) and e.id in path_names))

    lines = []
    for node in ast.walk(tree):
        hit = False
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            f = node.func
            hit = ((f.attr in _MUTATORS and is_path(f.value))
                   or (f.attr == "addsitedir" and isinstance(f.value, ast.Name) and f.value.id == "site"))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
            hit = (len(node.args) >= 2 and isinstance(node.args[0], ast.Name) and node.args[0].id in sys_names
                   and isinstance(node.args[1], ast.Constant) and node.args[1].value == "path")
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            hit = any(is_path(t.value if isinstance(t, ast.Subscript) else t) for t in targets)
        if hit:
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
    aliased = ("import sys as s\nfrom sys import path as p\nimport site\ns.path.insert(0, 'x')\np.append('y')\n"
               "site.addsitedir('z')\nsetattr(s, 'path', [])\ndel p[0]\n")
    assert _mutates_sys_path(ast.parse(aliased)) == [4, 5, 6, 7, 8]
    reads = "import sys\nprint(sys.path[0])\nx = list(sys.path)\ni = sys.path.index('a')\nc = sys.path.copy()\n"
    assert _mutates_sys_path(ast.parse(reads)) == []


def test_every_benchmark_that_writes_its_out_file_makes_its_folder_first():
    """BENCHMARKS.md's commands write `--out results/...`, and a fresh clone has no results/ (it is
    ignored): a script that opened the file without making its folder lost its whole run at the end
    (benchmarks/gguf_many_rows.py, found by a new-user trial)."""
    writes = [p for p in sorted((ROOT / "benchmarks").glob("*.py"))
              if 'open(a.out, "w")' in p.read_text() or "open(args.out, \"w\")" in p.read_text()]
    assert len(writes) >= 5  # the check sees the scripts
    missing = [p.name for p in writes if "mkdir(" not in p.read_text()]
    assert not missing, f"open --out without making its folder: {missing}"
