"""A step that fails is never cached as done, and an entry that a failed step left is rebuilt
(issue 46), for each cache mixserve writes: converted and -meta folders of a GGUF, quantized
checkpoints, kernel choices and C++ builds. (Pulls and the ShareGPT cache: test_registry.py's
`test_pull_truncated_raises_and_leaves_nothing` / `..._fetch_error_...` and
test_bench_datasets.py's corrupt-cache case.)

The fault that found this: transformers could not import its `kernels` package (a module of ours
shadowed it), `_write_meta` wrote TOKENIZER_ERROR, and the conversion still wrote DONE: every
later load ran without a tokenizer until the cache was deleted by hand.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from mixserve import env
from mixserve.models import weights
from mixserve.models.weights import convert_gguf, gguf_meta_dir, load_tokenizer
from tests.tiny_gguf import write_float_gguf



def write_gguf(path, tokenizer: bool = True):
    """tests/tiny_gguf.py's GGUF, with a byte-level BPE vocabulary unless `tokenizer` is False."""
    return write_float_gguf(path, tokenizer=tokenizer)


def _break_the_tokenizer(monkeypatch):
    import transformers

    def broken(*a, **k):  # what a shadowed `kernels` package raised inside transformers
        raise ImportError("cannot import name 'CUDAProperties' from 'kernels' (benchmarks/kernels.py)")
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", broken)


def _siblings(folder):
    return sorted(p.name for p in folder.parent.iterdir() if p.name.startswith(folder.name))


@pytest.mark.parametrize("make", [convert_gguf, gguf_meta_dir], ids=["converted", "meta"])
def test_a_tokenizer_that_fails_to_load_is_an_error_and_leaves_nothing_done(tmp_path, monkeypatch, make):
    src = write_gguf(tmp_path / "m.gguf")
    name = "m.gguf.mixserve" + ("-meta" if make is gguf_meta_dir else "")
    with monkeypatch.context() as m:
        _break_the_tokenizer(m)
        with pytest.raises(RuntimeError, match="could not be loaded.*CUDAProperties.*Nothing was cached"):
            make(src, progress=False) if make is convert_gguf else make(src)
    assert [p.name for p in tmp_path.iterdir()] == ["m.gguf"], "a failed step left a folder"
    folder = make(src, progress=False) if make is convert_gguf else make(src)  # the next load tries again
    assert folder.name == name and (folder / "DONE").is_file() and (folder / "tokenizer.json").is_file()
    assert load_tokenizer(src).encode("ab", add_special_tokens=False) == [256]  # the merge: one token


@pytest.mark.parametrize("make", [convert_gguf, gguf_meta_dir], ids=["converted", "meta"])
def test_a_folder_poisoned_before_the_fix_is_rebuilt(tmp_path, make):
    src = write_gguf(tmp_path / "m.gguf")
    folder = make(src, progress=False) if make is convert_gguf else make(src)
    # what the old _write_meta left: DONE beside TOKENIZER_ERROR, and no tokenizer files
    for f in folder.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            f.unlink()
    (folder / "TOKENIZER_ERROR").write_text("ImportError(\"cannot import name 'CUDAProperties' from 'kernels'\")")
    again = make(src, progress=False) if make is convert_gguf else make(src)
    assert again == folder and (again / "tokenizer.json").is_file() and not (again / "TOKENIZER_ERROR").exists()
    assert _siblings(folder) == [folder.name]  # no temporary folder left


def test_a_gguf_without_a_vocabulary_is_cached_as_such(tmp_path):
    src = write_gguf(tmp_path / "m.gguf", tokenizer=False)
    folder = convert_gguf(src, progress=False)
    assert (folder / "DONE").is_file() and (folder / "NO_TOKENIZER").is_file()
    with pytest.raises(ValueError, match="has no tokenizer"):
        load_tokenizer(src)


def test_a_conversion_that_fails_midway_leaves_no_folder_and_keeps_the_old_one(tmp_path, monkeypatch):
    src = write_gguf(tmp_path / "m.gguf")

    def full_disk(tensors, path, **k):
        open(path, "wb").write(b"\0" * 100)  # a partly written file, then the error
        raise OSError(28, "No space left on device")
    with monkeypatch.context() as m:
        m.setattr(weights, "save_file", full_disk)
        with pytest.raises(OSError, match="No space"):
            convert_gguf(src, progress=False)
    assert [p.name for p in tmp_path.iterdir()] == ["m.gguf"]
    folder = convert_gguf(src, progress=False)
    assert (folder / "DONE").is_file()


# -- quantized checkpoints ---------------------------------------------------------------------
def test_a_quantize_that_fails_midway_leaves_nothing_and_a_checkpoint_missing_a_piece_is_redone(tmp_path, monkeypatch):
    from mixserve.quant import checkpoint
    from mixserve.quant.awq import AWQConfig

    src = write_gguf(tmp_path / "m.gguf")
    out = tmp_path / "q"
    qc = AWQConfig(method="rtn", group_size=32)

    def full_disk(sd, path, **k):
        open(path, "wb").write(b"\0" * 100)
        raise OSError(28, "No space left on device")
    with monkeypatch.context() as m:
        m.setattr(checkpoint, "save_file", full_disk)
        with pytest.raises(OSError, match="No space"):
            checkpoint.quantize(str(src), qc, out=out, progress=False, log=lambda s: None)
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith("q.")]

    lines = []
    checkpoint.quantize(str(src), qc, out=out, progress=False, log=lines.append)
    assert (out / "tokenizer.json").is_file() and json.loads((out / "mixserve_quant.json").read_text())["method"] == "rtn"
    lines.clear()
    checkpoint.quantize(str(src), qc, out=out, progress=False, log=lines.append)
    assert any("already quantized" in s for s in lines), lines  # a finished run is kept
    (out / "tokenizer.json").unlink()  # what a run from a poisoned source folder wrote
    lines.clear()
    checkpoint.quantize(str(src), qc, out=out, progress=False, log=lines.append)
    assert any("lacks tokenizer.json, so the run is redone" in s for s in lines), lines
    assert (out / "tokenizer.json").is_file()


# -- kernel choices ----------------------------------------------------------------------------
def test_a_kernel_timing_that_fails_is_not_cached(tmp_path, caplog, monkeypatch):
    import mixserve.env as env
    from mixserve.layers.kernel_choice import KernelChooser

    monkeypatch.setattr(env, "_unkept", {})

    path = tmp_path / "choices.json"

    def boom():
        raise RuntimeError("oneDNN primitive failed")
    c = KernelChooser(path, overrides={}, machine="cpu A | torch 1", timing="measure")
    with pytest.raises(RuntimeError, match="oneDNN primitive failed"):  # the caller falls back (eager)
        c.choose("dense_linear/x", {"plain": lambda: 2.0, "onednn": boom}, "plain")
    assert not path.exists() and "dense_linear/x" not in c.choices
    with caplog.at_level(logging.WARNING, "mixserve"):
        assert c.choose("dense_linear/x", {"plain": lambda: 2.0, "onednn": lambda: float("nan")}, "plain") == "plain"
    assert "timed as NaN" in caplog.text and "not cached" in caplog.text
    assert c.choices["dense_linear/x"].source.startswith("measured, not cached") and not path.exists()
    c = KernelChooser(path, overrides={}, machine="cpu A | torch 1", timing="measure")
    assert c.choose("dense_linear/x", {"plain": lambda: 2.0, "onednn": lambda: 1.0}, "plain") == "onednn"
    assert c.choices["dense_linear/x"].source == "measured" and path.exists()
    with pytest.raises(RuntimeError, match="every candidate"):
        KernelChooser(path, overrides={}, machine="cpu A | torch 1", timing="measure").choose("k/y", {"a": lambda: float("nan")}, "a")
    # a NaN that an older mixserve cached is measured again, not used
    data = json.loads(path.read_text())
    data["machines"]["cpu A | torch 1"]["dense_linear/x"]["timings"]["plain"] = float("nan")
    path.write_text(json.dumps(data))
    c = KernelChooser(path, overrides={}, machine="cpu A | torch 1", timing="measure")
    c.choose("dense_linear/x", {"plain": lambda: 2.0, "onednn": lambda: 1.0}, "plain")
    assert c.choices["dense_linear/x"].source == "measured"


def test_the_default_kernel_cache_key_names_the_instruction_set():
    from mixserve.env import cpu_isa_key
    from mixserve.layers.kernel_choice import KernelChooser

    key = cpu_isa_key()
    assert len(key) == 8 and f"[isa {key}]" in KernelChooser(overrides={}).machine


# -- C++ builds --------------------------------------------------------------------------------
def test_a_cpp_build_that_fails_leaves_no_folder_and_a_broken_library_is_rebuilt(tmp_path, monkeypatch, caplog):
    import torch.utils.cpp_extension as ext

    from mixserve.layers import cpp_build

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("MIXSERVE_NO_CPP_KERNELS", raising=False)
    calls = []

    def fake_load_inline(name, build_directory, **k):
        calls.append(build_directory)
        (tmp_path / "out").mkdir(exist_ok=True)
        open(f"{build_directory}/{name}.so", "wb").write(b"\x7fELF truncated")
        if len(calls) == 1:
            raise RuntimeError("g++ killed")  # a build that dies after writing part of its library
        return "module"
    monkeypatch.setattr(ext, "load_inline", fake_load_inline)
    monkeypatch.setattr(cpp_build, "_Ops", lambda name, functions: "module")  # the ops the build registered
    root = tmp_path / "mixserve" / "kernels"
    with caplog.at_level(logging.WARNING, "mixserve"):
        assert cpp_build.build_extension("mixserve_test_k", "// src", ["f"]) is None
    assert "g++ killed" in caplog.text
    cpu_dir = next(root.glob("torch-*/*"))
    assert cpu_dir.name.endswith(cpp_build.cpu_isa_key()) and list(cpu_dir.iterdir()) == []  # nothing built
    cpp_build._built.pop("mixserve_test_k")
    assert cpp_build.build_extension("mixserve_test_k", "// src", ["f"]) == "module"
    built = next(cpu_dir.iterdir())
    assert built.name.startswith("mixserve_test_k-") and (built / "mixserve_test_k.so").is_file()
    # the library on disk does not load (here: not an ELF at all; a truncated one fails the same way)
    cpp_build._built.pop("mixserve_test_k")
    caplog.clear()
    with caplog.at_level(logging.WARNING, "mixserve"):
        assert cpp_build.build_extension("mixserve_test_k", "// src", ["f"]) == "module"
    assert "does not load" in caplog.text and len(calls) == 3
    assert [p.name for p in cpu_dir.iterdir()] == [built.name]
    cpp_build._built.pop("mixserve_test_k")


# -- what a killed, raced or damaged step leaves -----------------------------------------------
def test_a_killed_builds_temporary_folder_is_removed_and_a_live_ones_kept(tmp_path):
    import subprocess

    from mixserve.env import remove_stale_tmp

    from mixserve.env import tmp_sibling

    out = tmp_path / "m.gguf.mixserve"
    dead = subprocess.Popen(["true"])
    dead.wait()
    here = tmp_sibling(out).name.rsplit(".", 1)[0]
    (tmp_path / f"{here}.{dead.pid}").mkdir()
    live = tmp_path / f"{here}.{os.getppid()}"
    live.mkdir()
    elsewhere = tmp_path / f"m.gguf.mixserve.tmp.other-host.{dead.pid}"  # a shared cache's other machine
    elsewhere.mkdir()
    remove_stale_tmp(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, elsewhere.name])


def test_a_file_cut_short_after_done_makes_the_folder_rebuilt(tmp_path):
    src = write_gguf(tmp_path / "m.gguf")
    folder = convert_gguf(src, progress=False)
    weights_file = folder / "model.safetensors"
    size = weights_file.stat().st_size
    with open(weights_file, "r+b") as f:
        f.truncate(size // 2)  # a full disk or a partial copy
    assert not weights._complete(folder)
    assert convert_gguf(src, progress=False) == folder and weights_file.stat().st_size == size


def test_a_publish_that_loses_a_race_keeps_the_winners_folder(tmp_path, monkeypatch):
    from mixserve import env

    out = tmp_path / "x"

    def fill(tmp):
        (tmp / "f").write_text("mine")
        out.mkdir()  # another process renamed its finished folder into place meanwhile
        (out / "f").write_text("theirs")
    import shutil

    real = shutil.rmtree
    # publish_dir clears `out` before its rename; the winner's folder arrives after that
    monkeypatch.setattr(shutil, "rmtree", lambda p, ignore_errors=False: None if Path(p) == out
                        else real(p, ignore_errors=ignore_errors))
    assert env.publish_dir(out, fill, lambda o: (o / "f").exists()) == out
    assert (out / "f").read_text() == "theirs" and sorted(p.name for p in tmp_path.iterdir()) == ["x"]


def test_a_tokenizer_type_transformers_cannot_build_is_noted_per_version(tmp_path, monkeypatch):
    import transformers

    src = write_gguf(tmp_path / "m.gguf")

    def unsupported(*a, **k):
        raise ValueError("Cannot build a tokenizer from GGUF files with type 'bert'")
    with monkeypatch.context() as m:
        m.setattr(transformers.AutoTokenizer, "from_pretrained", unsupported)
        folder = gguf_meta_dir(src)  # the model still runs on token ids
    note = json.loads((folder / "NO_TOKENIZER").read_text())
    assert "'bert'" in note["why"] and note["transformers"] == transformers.__version__
    with pytest.raises(ValueError, match="has no tokenizer.*cannot build this GGUF's tokenizer"):
        load_tokenizer(src)
    monkeypatch.setattr(weights, "_transformers_version", lambda: "99.0")  # another transformers: tried again
    assert not weights._complete(folder)
    assert (gguf_meta_dir(src) / "tokenizer.json").is_file()


def test_a_build_folder_without_a_library_is_replaced_by_one_build(tmp_path, monkeypatch):
    import torch.utils.cpp_extension as ext

    from mixserve.layers import cpp_build

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("MIXSERVE_NO_CPP_KERNELS", raising=False)
    calls = []

    def fake_load_inline(name, build_directory, **k):
        calls.append(build_directory)
        open(f"{build_directory}/{name}.so", "wb").write(b"\x7fELF")
        return "module"
    monkeypatch.setattr(ext, "load_inline", fake_load_inline)
    monkeypatch.setattr(cpp_build, "_Ops", lambda name, functions: "module")
    assert cpp_build.build_extension("mixserve_test_k2", "// src", ["f"]) == "module"
    built = next((tmp_path / "mixserve" / "kernels").glob("torch-*/*/mixserve_test_k2-*"))
    cpp_build._built.pop("mixserve_test_k2")
    (built / "mixserve_test_k2.so").unlink()
    (built / "build.ninja").write_text("stale")  # a folder left by a build of before the fix
    assert cpp_build.build_extension("mixserve_test_k2", "// src", ["f"]) == "module"
    assert sorted(p.name for p in built.iterdir()) == ["mixserve_test_k2.so"] and len(calls) == 2
    cpp_build._built.pop("mixserve_test_k2")


def test_compiled_graphs_go_under_the_cache_root_even_after_torch_wrote_its_default(tmp_path, monkeypatch):
    from mixserve import env

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(env, "_USER_INDUCTOR_DIR", None)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/tmp/torchinductor_root")  # what Inductor's first call stores
    assert env.pin_inductor_cache() == str(tmp_path / "mixserve" / "inductor") == os.environ["TORCHINDUCTOR_CACHE_DIR"]
    monkeypatch.setattr(env, "_USER_INDUCTOR_DIR", "/srv/inductor")  # the user's own setting stands
    assert env.pin_inductor_cache() == "/srv/inductor"
    monkeypatch.setattr(env, "_USER_INDUCTOR_DIR", "/tmp/torchinductor_root")  # torch wrote it before our import
    assert env.pin_inductor_cache() == str(tmp_path / "mixserve" / "inductor")


def test_a_transient_failure_while_loading_the_tokenizer_is_not_cached_as_no_tokenizer(tmp_path, monkeypatch):
    import transformers

    src = write_gguf(tmp_path / "m.gguf")

    def oom(*a, **k):
        raise MemoryError()
    with monkeypatch.context() as m:
        m.setattr(transformers.AutoTokenizer, "from_pretrained", oom)
        with pytest.raises(RuntimeError, match="MemoryError.*Nothing was cached"):
            gguf_meta_dir(src)
    assert (gguf_meta_dir(src) / "tokenizer.json").is_file()


def test_converted_copies_in_the_cache_are_keyed_by_the_files_identity(tmp_path, monkeypatch):
    # a GGUF in a read-only folder converts under the cache root: two files of one name and size
    # (other folders, or one replaced in place) must not share a copy
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(env, "writable_dir", lambda p: PermissionError(13, "Permission denied"))
    a = write_gguf((tmp_path / "a").mkdir() or tmp_path / "a" / "m.gguf")
    b = write_gguf((tmp_path / "b").mkdir() or tmp_path / "b" / "m.gguf")
    assert a.stat().st_size == b.stat().st_size
    assert weights.converted_dir(a) != weights.converted_dir(b)
    assert weights.converted_dir(a).parent == tmp_path / "xdg" / "mixserve" / "converted"


def test_a_cpu_without_the_instructions_builds_nothing(monkeypatch):
    # on an AVX2-only CPU the kernel's C++ build (~40 s cold) only found out it could not run
    from mixserve.layers import bf16_gemv, cpp_build, gguf_kernels, int4_vnni

    builds = []
    monkeypatch.delenv("MIXSERVE_NO_CPP_KERNELS", raising=False)
    monkeypatch.setattr(cpp_build, "_import_built", lambda *a: None)
    monkeypatch.setattr(cpp_build, "_build", lambda name, text, ops, *a: builds.append(name) or dict.fromkeys(ops, "module"))
    monkeypatch.setattr(cpp_build, "cpu_flags", lambda: {"avx2", "fma"})
    assert cpp_build.build_extension("mixserve_test_needs", "// src", ["f"], needs=frozenset({"avx512_vnni"})) is None
    assert builds == []
    cpp_build._built.pop("mixserve_test_needs")
    monkeypatch.setattr(cpp_build, "cpu_flags", set)  # /proc/cpuinfo unreadable: the build decides
    assert cpp_build.build_extension("mixserve_test_needs", "// src", ["f"], needs=frozenset({"avx512_vnni"})) == "module"
    assert builds == ["mixserve_test_needs"]
    cpp_build._built.pop("mixserve_test_needs")
    # the AVX-512 kernels say what they need
    assert int4_vnni.NEEDS == {"avx512_vnni", "avx512bw"}
    assert gguf_kernels.NEEDS == {"avx2", "fma", "f16c"}  # its AVX2 variant's; -march=native picks VNNI where there
    assert bf16_gemv.NEEDS == {"avx512_bf16", "avx512f"}
    for mod in (gguf_kernels, int4_vnni, bf16_gemv):
        seen = []
        saved = dict(mod._state)
        monkeypatch.setattr(mod, "build_extension", lambda *a, **k: seen.append(k.get("needs")) or None)
        try:
            mod._state.clear()
            mod._load()
        finally:
            mod._state.clear()
            mod._state.update(saved)
        assert seen == [mod.NEEDS]


def test_a_quantize_with_other_settings_replaces_the_checkpoint_in_its_folder(tmp_path):
    from mixserve.quant import checkpoint
    from mixserve.quant.awq import AWQConfig

    src, out = write_gguf(tmp_path / "m.gguf"), tmp_path / "q"
    checkpoint.quantize(str(src), AWQConfig(method="rtn", group_size=32), out=out, progress=False, log=lambda s: None)
    checkpoint.quantize(str(src), AWQConfig(method="rtn", group_size=64), out=out, progress=False, log=lambda s: None)
    assert json.loads((out / "config.json").read_text())["quantization_config"]["group_size"] == 64


def test_a_kernel_built_in_the_background_is_built_once(tmp_path, monkeypatch):
    """build_in_background starts a build that the engine's own call then waits for: one compile,
    both callers get the module (issue 32: a cold start's builds run beside the GGUF conversion)."""
    import threading
    import time

    import torch.utils.cpp_extension as ext

    from mixserve.layers import cpp_build

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("MIXSERVE_NO_CPP_KERNELS", raising=False)
    calls, started = [], threading.Event()

    def slow_load_inline(name, build_directory, **k):
        calls.append(threading.current_thread().name)
        started.set()
        time.sleep(0.5)
        open(f"{build_directory}/{name}.so", "wb").write(b"\x7fELF")
        return "module"
    monkeypatch.setattr(ext, "load_inline", slow_load_inline)
    monkeypatch.setattr(cpp_build, "_Ops", lambda name, functions: "module")
    build = lambda: cpp_build.build_extension("mixserve_test_k3", "// src", ["f"])  # noqa: E731
    t = cpp_build.build_in_background([build])
    assert len(t) == 1  # one build: one thread, however many cores
    assert started.wait(10)
    assert build() == "module"  # waited for the background build instead of starting another
    t[0].join(10)
    assert calls == ["mixserve-kernel-build-0"]
    cpp_build._built.pop("mixserve_test_k3")


def test_the_bundled_kernels_build_as_one_library_with_what_this_cpu_can_run(tmp_path, monkeypatch):
    """cpp_build.BUNDLED: asking for one of them builds them all in one compile (one parse of the
    torch headers, issue 32), later calls load nothing more; a kernel whose instructions this CPU
    lacks is left out of the library."""
    import torch.utils.cpp_extension as ext

    from mixserve.layers import cpp_build, gguf_kernels, invariant_linear, paged_decode, rmsnorm

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("MIXSERVE_NO_CPP_KERNELS", raising=False)
    monkeypatch.delenv("MIXSERVE_ISA", raising=False)
    monkeypatch.setattr(cpp_build, "_built", {})
    monkeypatch.setattr(cpp_build, "_bundle", None)
    sources = []

    def fake_load_inline(name, build_directory, cpp_sources, **k):
        sources.append(cpp_sources)
        open(f"{build_directory}/{name}.so", "wb").write(b"\x7fELF")
        return "module"
    monkeypatch.setattr(ext, "load_inline", fake_load_inline)
    monkeypatch.setattr(cpp_build, "_Ops", lambda name, functions: f"ops of {name}")
    monkeypatch.setattr(gguf_kernels, "may_default_native", lambda: True)  # GGUF files load natively here
    names = [m.kernel().name for m in (gguf_kernels, paged_decode, invariant_linear, rmsnorm)]
    assert paged_decode.build() == f"ops of {names[1]}"
    assert gguf_kernels.build() == f"ops of {names[0]}" and invariant_linear.build() == f"ops of {names[2]}"
    assert len(sources) == 1 and all(f"TORCH_LIBRARY({n}, m)" in sources[0] for n in names)
    assert sources[0].count("#include <torch/library.h>") == 1  # the heavy headers once
    assert next((tmp_path / "mixserve" / "kernels").glob(f"torch-*/*/{cpp_build.BUNDLE_NAME}-*")).is_dir()
    # decided once a process: another answer of bundled() later (MIXSERVE_ISA changed) changes nothing,
    # where a second library would register the same ops again and abort the process
    monkeypatch.setattr(gguf_kernels, "may_default_native", lambda: False)
    assert cpp_build._bundle_with(names[0]) is not None and len(sources) == 1
    monkeypatch.setattr(gguf_kernels, "may_default_native", lambda: True)
    # an AVX-only CPU: the GGUF kernel (AVX2, FMA, F16C) is not in its library
    monkeypatch.setattr(cpp_build, "_built", {})
    monkeypatch.setattr(cpp_build, "_bundle", None)
    monkeypatch.setattr(cpp_build, "cpu_flags", lambda: {"avx", "sse4_2"})
    assert gguf_kernels.build() is None and paged_decode.build() == f"ops of {names[1]}"
    assert len(sources) == 2 and f"TORCH_LIBRARY({names[0]}, m)" not in sources[1]
    # a CPU that dequantizes GGUF files by default: the GGUF kernel is left out, built alone if asked for
    monkeypatch.setattr(cpp_build, "_built", {})
    monkeypatch.setattr(cpp_build, "_bundle", None)
    monkeypatch.setattr(cpp_build, "cpu_flags", lambda: {"avx2", "fma", "f16c"})
    monkeypatch.setattr(gguf_kernels, "may_default_native", lambda: False)
    assert invariant_linear.build() == f"ops of {names[2]}" and len(sources) == 3
    assert f"TORCH_LIBRARY({names[0]}, m)" not in sources[2] and f"TORCH_LIBRARY({names[1]}, m)" in sources[2]
    assert gguf_kernels.build() == f"ops of {names[0]}" and len(sources) == 4
    assert f"TORCH_LIBRARY({names[0]}, m)" in sources[3] and f"namespace k_{names[0]}" not in sources[3]  # its own
    # a start whose model is no GGUF file leaves it out too (llm_engine: fix_bundle(without=...))
    monkeypatch.setattr(cpp_build, "_built", {})
    monkeypatch.setattr(cpp_build, "_bundle", None)
    monkeypatch.setattr(gguf_kernels, "may_default_native", lambda: True)
    cpp_build.fix_bundle(without=(gguf_kernels.__name__,))
    cpp_build.fix_bundle()  # decided already: no change
    assert [k.name for k in cpp_build._bundle] == names[1:]


def test_no_cpp_kernels_reads_no_gguf_for_a_native_load_it_cannot_run(monkeypatch):
    from mixserve.models.loader import use_native_gguf

    from mixserve.layers import gguf_kernels

    monkeypatch.setenv("MIXSERVE_NO_CPP_KERNELS", "1")
    assert not use_native_gguf(None, None, built=False)
    # asked for by name: the kernel's own check decides at once (no kernel in a process without any)
    monkeypatch.setattr(gguf_kernels, "available", lambda: False)
    with pytest.raises(ValueError, match="not available"):
        use_native_gguf("native", None, built=False)


def test_a_bundled_kernel_may_not_include_a_header_inside_its_code():
    from mixserve.layers.cpp_build import Kernel, bundle_source

    ok = bundle_source([Kernel("a", "#include <cmath>\nint f() { return 1; }", ("f",)),
                        Kernel("b", "#include <cmath>\n#include <vector>\nint f() { return 2; }", ("f",))])
    assert ok.count("#include <cmath>") == 1 and ok.index("#include <vector>") < ok.index("namespace k_a {")
    assert "m.def(\"f\", &k_b::f);" in ok
    with pytest.raises(ValueError, match="an #include after its code"):
        bundle_source([Kernel("c", "int g();\n#include <vector>\n", ("g",))])


def test_the_gguf_kernels_variant_is_kept_when_mixserve_isa_changes(monkeypatch, caplog):
    """Both GGUF kernel variants register the same ops: a second library of them aborts the process
    (a break-it helper's case: an engine, then MIXSERVE_ISA=avx2, then another engine). The first
    call's variant is kept, and the change is logged."""
    from mixserve.layers import gguf_kernels

    monkeypatch.setattr(gguf_kernels, "_state", {})
    monkeypatch.delenv("MIXSERVE_ISA", raising=False)
    first = gguf_kernels.kernel().name
    monkeypatch.setenv("MIXSERVE_ISA", "avx2")
    with caplog.at_level(logging.WARNING, "mixserve"):
        assert gguf_kernels.kernel().name == first == "mixserve_gguf_v6"
    assert "MIXSERVE_ISA changed" in caplog.text
    monkeypatch.setattr(gguf_kernels, "_state", {})
    assert gguf_kernels.kernel().name == "mixserve_gguf_v6_avx2"  # a new process's first call


def test_a_forced_isa_has_kernel_choices_of_its_own(monkeypatch):
    """$MIXSERVE_ISA=avx2 runs other kernels (the GGUF kernel's AVX2 build, oneDNN capped at AVX2):
    their timed choices are cached apart from the CPU's own ISA's, both ways."""
    from mixserve.layers.kernel_choice import KernelChooser

    monkeypatch.delenv("MIXSERVE_ISA", raising=False)
    native = KernelChooser(overrides={}).machine
    monkeypatch.setenv("MIXSERVE_ISA", "avx2")
    forced = KernelChooser(overrides={}).machine
    assert forced != native and forced.startswith(native) and forced.endswith("forced avx2")
    monkeypatch.setenv("MIXSERVE_ISA", "native")
    assert KernelChooser(overrides={}).machine == native

