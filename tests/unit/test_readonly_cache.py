"""A read-only cache root works (issue 32): the engine runs with what is there, does the rest in a
scratch folder of its own that goes at exit, and says what it could not keep. Each cache mixserve
writes on a start: the GGUF's float32 copy and tokenizer folder, the C++ kernels' builds, kernel
choices and Inductor's compiled graphs."""
from __future__ import annotations

import errno
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mixserve import env
from tests.readonly import run_read_only
from tests.tiny_gguf import write_float_gguf

REPO = Path(__file__).resolve().parents[2]


def _child_env(root: Path) -> dict:
    e = dict(os.environ, XDG_CACHE_HOME=str(root), PYTHONPATH=str(REPO))
    e.pop("TORCHINDUCTOR_CACHE_DIR", None)
    return e


_CONVERT = """
import json, sys
from mixserve import env
from mixserve.models.weights import convert_gguf, gguf_meta_dir
from safetensors.torch import load_file
out = convert_gguf(sys.argv[1], progress=False)
meta = gguf_meta_dir(sys.argv[1])
n = len(load_file(str(out / "model.safetensors")))
print(json.dumps({"out": str(out), "meta": str(meta), "tensors": n, "unkept": env.unkept(),
                  "scratch": str(env.scratch_dir())}))
"""


def test_a_read_only_root_converts_in_scratch_says_so_and_leaves_nothing(tmp_path):
    root = tmp_path / "xdg"
    gguf = write_float_gguf((root / "mixserve" / "tiny").mkdir(parents=True) or root / "mixserve" / "tiny" / "t.gguf",
                            tokenizer=True)
    before = sorted(p.relative_to(root) for p in root.rglob("*"))
    r = run_read_only(root, [sys.executable, "-c", _CONVERT, str(gguf)], env=_child_env(root))
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.splitlines()[-1])
    assert got["tensors"] > 0 and Path(got["out"]).parent == Path(got["scratch"])
    assert any("float32 copy of t.gguf" in k for k in got["unkept"]), got["unkept"]
    assert "Read-only file system" in " ".join(got["unkept"].values()) or os.geteuid() != 0
    assert "not kept in the cache: the float32 copy of t.gguf" in r.stderr
    assert not Path(got["scratch"]).exists()  # removed at exit
    assert sorted(p.relative_to(root) for p in root.rglob("*")) == before  # nothing written, nothing left


def test_a_cache_prepared_beside_its_file_is_read_from_a_read_only_root(tmp_path):
    from mixserve.models.weights import convert_gguf

    root = tmp_path / "xdg"
    gguf = write_float_gguf((root / "mixserve" / "tiny").mkdir(parents=True) or root / "mixserve" / "tiny" / "t.gguf",
                            tokenizer=True)
    prepared = convert_gguf(gguf, progress=False)  # beside the file: the folder was writable then
    r = run_read_only(root, [sys.executable, "-c", _CONVERT, str(gguf)], env=_child_env(root))
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.splitlines()[-1])
    assert got["out"] == str(prepared) and got["meta"] == str(prepared) and got["unkept"] == {}


def test_unwritable_kernel_choices_are_used_and_named(tmp_path, caplog, monkeypatch):
    from mixserve.layers.kernel_choice import KernelChooser

    monkeypatch.setattr(env, "_unkept", {})
    path = tmp_path / "choices.json"
    KernelChooser(path, overrides={}, machine="m", timing="measure").choose("k/a", {"x": lambda: 1.0, "y": lambda: 2.0}, "y")
    cached = path.read_text()

    def refuse(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system")
    monkeypatch.setattr(Path, "write_text", refuse)
    c = KernelChooser(path, overrides={}, machine="m", timing="measure")
    assert c.choose("k/a", {"x": lambda: 1.0, "y": lambda: 2.0}, "y") == "x"  # read from the cache
    with caplog.at_level(logging.WARNING, "mixserve"):
        assert c.choose("k/b", {"x": lambda: 3.0, "y": lambda: 2.0}, "y") == "y"
    assert c.choices["k/b"].source == "measured" and path.read_text() == cached
    assert "kernel choices" in env.unkept() and "Read-only file system" in env.unkept()["kernel choices"]
    assert "not kept in the cache: kernel choices" in caplog.text


def test_a_cpp_build_the_root_cannot_keep_is_built_in_scratch(tmp_path, monkeypatch):
    from mixserve.layers import cpp_build

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("MIXSERVE_NO_CPP_KERNELS", raising=False)
    monkeypatch.setattr(env, "_unkept", {})
    monkeypatch.setattr(cpp_build, "_built", {})
    places = []

    def build(name, source, ops, folder, extra=()):
        places.append(folder)
        if len(places) == 1:
            raise OSError(errno.EROFS, "Read-only file system", str(folder))
        return dict.fromkeys(ops, "module")
    monkeypatch.setattr(cpp_build, "_build", build)
    assert cpp_build.build_extension("ro_probe", "int f(int x) { return x; }", ["f"]) == "module"
    assert places[0].is_relative_to(tmp_path / "xdg") and places[1].is_relative_to(env.scratch_dir())
    assert "C++ kernel ro_probe" in env.unkept()


def test_publish_or_scratch_raises_what_is_not_a_read_only_fault(tmp_path, monkeypatch):
    def broken(out, fill, complete):
        raise OSError(errno.EIO, "Input/output error")
    monkeypatch.setattr(env, "publish_dir", broken)
    with pytest.raises(OSError, match="Input/output"):
        env.publish_or_scratch(tmp_path / "x", lambda t: None, lambda o: False, "x")


def test_the_probe_of_a_read_only_mount_says_erofs(tmp_path):
    (tmp_path / "ro").mkdir()
    code = ("import sys; from pathlib import Path; from mixserve.env import writable_dir; "
            "e = writable_dir(Path(sys.argv[1])); print(type(e).__name__, getattr(e, 'errno', None))")
    r = run_read_only(tmp_path / "ro", [sys.executable, "-c", code, str(tmp_path / "ro")],
                      env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[0] in ("OSError", "PermissionError") and int(r.stdout.split()[1]) in (errno.EROFS,
                                                                                                   errno.EACCES)
    assert subprocess.run([sys.executable, "-c", code, str(tmp_path / "ro")], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(REPO))).stdout.split()[0] == "NoneType"


def test_prepare_fills_the_caches_and_a_read_only_root_serves_from_them(tmp_path):
    """`mixserve prepare` on a new cache root, then `generate` with that root read-only: the eager
    engine's tokens, the kernel choices and the compiled graph read from it, and only
    Inductor's folder named as not kept (it is read from a scratch copy: Inductor writes lock files
    beside what it loads)."""
    import shutil

    root = tmp_path / "xdg"
    folder = root / "mixserve" / "tiny"
    folder.mkdir(parents=True)
    gguf = write_float_gguf(folder / "t.gguf", tokenizer=True)
    built = env.cache_root() / "kernels"  # the suite's C++ builds, shared by hard links: nothing built twice
    if built.is_dir():
        shutil.copytree(built, root / "mixserve" / "kernels", copy_function=os.link)
    e = _child_env(root)
    for k in ("MIXSERVE_KERNEL_CACHE", "MIXSERVE_KERNEL_TIMING", "MIXSERVE_KERNEL_BUDGET", "MIXSERVE_PACKED_CACHE",
              "MIXSERVE_NATIVE_CACHE"):
        e.pop(k, None)
    # dequantized on every CPU (an AVX-512 one loads a GGUF natively by default, and a native GGUF's
    # float tensors have no packed store): the packed weights are one of the caches checked here
    engine = ["--model", str(gguf), "--dtype", "float32", "--kv-cache-memory", "4MiB", "--max-model-len", "128",
              "--gguf-weights", "dequantize"]
    cli = [sys.executable, "-m", "mixserve.cli"]
    r = subprocess.run(cli + ["prepare", *engine], capture_output=True, text=True, env=e, timeout=600)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"prepared {gguf}") and "not kept" not in r.stderr
    # its decode graph timed within a 128-token context (it ran past the RoPE tables, an IndexError)
    assert "compile failed" not in r.stderr and "unavailable" not in r.stderr, r.stderr
    choices = json.loads((root / "mixserve" / "kernels" / "choices.json").read_text())
    keys = [k for m in choices["machines"].values() for k in m]
    assert any(k.startswith("decode_graph/") for k in keys), keys
    assert any((root / "mixserve" / "packed").glob("*/packed.safetensors")), "no packed weights kept"
    assert f"kept: packed weights in {root / 'mixserve' / 'packed'}" in r.stderr, r.stderr[-2000:]
    # timing the graph compiled it, whichever way the timing went
    assert any((root / "mixserve" / "inductor").rglob("*.py")), "prepare compiled no graph into the cache"
    # the graph forced on, so that the read-only start loads it from Inductor's folder
    gen = cli + ["generate", *engine, "--prompt", "ab ab", "--max-tokens", "12", "--graph-warmup", "foreground",
                 "--kernels", "decode_graph=compiled"]
    ro = run_read_only(root, gen, env=e)
    assert ro.returncode == 0, ro.stderr
    # batch invariance on: the compiled graph's tokens are the eager engine's, bit for bit
    from mixserve import SamplingParams
    from mixserve.llm import LLM

    eager = LLM(str(gguf), dtype="float32", kv_cache_memory="4MiB", max_model_len=128, kernels="eager",
                gguf_weights="dequantize", progress=False).generate(["ab ab"], SamplingParams(temperature=0, max_tokens=12))[0]
    assert ro.stdout == "ab ab" + eager.text + "\n"
    assert "timing kernels" not in ro.stderr and "compiling C++" not in ro.stderr
    assert "decode graph: compiled" in ro.stderr
    notes = [line for line in ro.stderr.splitlines() if "not kept in the cache:" in line]
    assert notes and all("Inductor" in line for line in notes), notes


def test_a_full_disk_reported_by_a_library_is_a_cache_that_cannot_be_written(tmp_path, monkeypatch):
    # safetensors reports ENOSPC as its own SafetensorError "... (os error 28)": the conversion went
    # to no scratch folder and the engine failed to start (found by a break-it helper)
    assert env.cannot_write(RuntimeError("I/O error: No space left on device (os error 28)"))
    assert not env.cannot_write(RuntimeError("I/O error: Input/output error (os error 5)"))
    monkeypatch.setattr(env, "_unkept", {})

    def full(out, fill, complete):
        raise RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")
    monkeypatch.setattr(env, "publish_dir", full)
    got = env.publish_or_scratch(tmp_path / "x", lambda t: (t / "f").write_text("y"), lambda o: False, "a thing")
    assert (got / "f").read_text() == "y" and got.parent == env.scratch_dir() and "a thing" in env.unkept()


def test_a_dead_processs_scratch_folder_is_removed(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    left = tmp_path / f"mixserve-scratch-{dead}-abc"
    live = tmp_path / f"mixserve-scratch-{os.getpid()}-def"
    (left / "big").mkdir(parents=True)
    live.mkdir()
    env._remove_dead_scratch(tmp_path)
    assert not left.exists() and live.exists()


def test_the_graph_timing_fits_any_context_limit(tmp_path, monkeypatch):
    """max_model_len 3 ran the timing's steps past the RoPE tables (IndexError, graph "compile
    failed"); below 8 positions nothing is timed and the steps run eager."""
    from mixserve.engine.decode_graph import decode_graph_candidates

    assert set(decode_graph_candidates(None, None, 8, max_model_len=3)) == {"eager"}
