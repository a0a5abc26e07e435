"""Facts about the machine and the process that every layer may need: where mixserve keeps its
files, and which CPU and torch build a measurement ran on.

It imports nothing from mixserve, so any module can use it without reaching upwards; torch is
imported only inside machine_info(), so the cache root stays cheap for the CLI and the registry.
"""
from __future__ import annotations

import errno
import logging
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


# the user's own choice, read before torch could write its default there: Inductor's cache_dir()
# stores /tmp/torchinductor_<user> in the environment on its first call, which made a later
# setdefault a no-op, and compiled graphs landed outside the cache root (unkept by it, shared by
# every checkout and CI run)
_USER_INDUCTOR_DIR = os.environ.get("TORCHINDUCTOR_CACHE_DIR")


def _is_torch_default(path: str) -> bool:
    """Inductor's own default (<tmp>/torchinductor_<user>), which its first call writes into the
    environment: a value found there is torch's, not a choice of the user's."""
    import tempfile

    p = Path(path)
    return p.name.startswith("torchinductor_") and str(p.parent) == tempfile.gettempdir()


def pin_inductor_cache() -> str:
    """Point Inductor's compiled-code cache at `<cache root>/inductor`, unless the user set
    TORCHINDUCTOR_CACHE_DIR before mixserve was imported (that folder is the user's to keep
    writable). Where `<cache root>/inductor` cannot be written (a read-only cache root), a copy of
    it in scratch_dir() is used instead, so compiled graphs still load (Inductor writes lock files
    beside what it reads) and new ones last as long as the process; note_unkept says so. Returns
    the folder in force."""
    if _USER_INDUCTOR_DIR and not _is_torch_default(_USER_INDUCTOR_DIR):
        return _USER_INDUCTOR_DIR
    folder = cache_root() / "inductor"
    if _scratch is not None and os.environ.get("TORCHINDUCTOR_CACHE_DIR") == str(_scratch / "inductor"):
        return str(_scratch / "inductor")  # pinned to the copy already
    err = writable_dir(folder)
    if err is not None and cannot_write(err):
        import shutil

        copy = scratch_dir() / "inductor"
        if folder.is_dir():
            shutil.copytree(folder, copy, symlinks=True, dirs_exist_ok=True)
        note_unkept("compiled decode graphs (Inductor's cache)", f"{folder}: {err.strerror or err}")
        folder = copy
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
    return str(folder)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # alive, another user's
        return True
    return True


def tmp_sibling(out: Path) -> Path:
    """Where a build of `out` is written before it is renamed into place: `<out>.tmp.<host>.<pid>`.
    The host name keeps a build of another machine or container (a shared cache, whose pids mean
    nothing here) from ever looking dead to remove_stale_tmp."""
    import socket

    host = "".join(c if c.isalnum() or c == "-" else "-" for c in socket.gethostname()) or "host"
    return out.with_name(f"{out.name}.tmp.{host}.{os.getpid()}")


def remove_stale_tmp(out: Path) -> None:
    """Remove `<out>.tmp.<host>.<pid>` siblings of this host whose process is gone: what a build
    killed mid-way (SIGKILL, out of memory) left. A live process's folder, and any other host's,
    is left alone."""
    import shutil

    prefix = tmp_sibling(out).name.rsplit(".", 1)[0] + "."
    for p in out.parent.glob(f"{out.name}.tmp.*"):
        pid = p.name[len(prefix):] if p.name.startswith(prefix) else ""
        if pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
            shutil.rmtree(p, ignore_errors=True)


def publish_dir(out: Path, fill, complete) -> Path:
    """Build a cache folder in tmp_sibling(out) with `fill(tmp)`, then move it to `out`: a fill
    that raises (or a process killed mid-way) leaves no folder under the name later loads look
    for, and `out`, if any, as it was. Stale temporary siblings of dead processes are removed
    first. Where another process published a complete `out` meanwhile, its folder is kept and
    ours dropped; an incomplete `out` is moved aside before ours is renamed in, so a reader sees
    a missing folder for two renames' time at most, never a half-written one. Returns `out`.
    Raises what `fill` raises, or OSError."""
    import shutil

    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_tmp(out)
    tmp = tmp_sibling(out)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        fill(tmp)
        if complete(out):  # another process finished the same build first
            shutil.rmtree(tmp, ignore_errors=True)
            return out
        old = out.with_name(tmp.name.replace(".tmp.", ".old.", 1))
        if out.is_symlink() or out.is_file():
            out.unlink()
        elif out.exists():
            out.rename(old)
        try:
            tmp.rename(out)
        except OSError:
            if not complete(out):
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another process won the race with the same result
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


# What this process could not keep in the cache root (a read-only or full one), as (what, why):
# the engine runs with what is there, builds the rest in a scratch folder of its own, and says so
_unkept: dict[str, str] = {}
_scratch: Path | None = None


def cannot_write(e: BaseException) -> bool:
    """Whether `e` says that a cache folder cannot be written here (a read-only file system, no
    permission, no space or quota), as opposed to a fault that must be reported. Besides OSError,
    a library's own error that carries the OS's ("... (os error 28)": safetensors' SafetensorError
    on a full disk)."""
    import re

    code = e.errno if isinstance(e, OSError) else None
    if code is None:
        m = re.search(r"\(os error (\d+)\)", str(e))
        code = int(m.group(1)) if m else None
    # ENOTDIR: a cache path below a file (MIXSERVE_*_CACHE pointing into one)
    return code in (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT, errno.ENOTDIR)


def note_unkept(what: str, why: str) -> None:
    """Record (and log once, as a warning) that `what` could not be kept in the cache: `why` names
    the folder and the error. unkept() lists them; the engine's describe() prints them."""
    if what not in _unkept:
        _unkept[what] = why
        logging.getLogger("mixserve").warning("not kept in the cache: %s (%s); this process keeps it in memory or "
                                              "a scratch folder, and the next start does the work again", what, why)


def unkept() -> dict[str, str]:
    """{what: why} for everything this process could not keep in the cache (note_unkept)."""
    return dict(_unkept)


def scratch_dir() -> Path:
    """A folder of this process's own under the system's temporary folder, for what the cache root
    could not keep: removed at exit (atexit, and the CLI's own exit, which skips atexit)."""
    global _scratch
    if _scratch is None:
        import atexit
        import tempfile

        _remove_dead_scratch(Path(tempfile.gettempdir()))
        _scratch = Path(tempfile.mkdtemp(prefix=f"mixserve-scratch-{os.getpid()}-"))
        atexit.register(remove_scratch)
    return _scratch


def _remove_dead_scratch(tmp: Path) -> None:
    """Remove the scratch folders of processes that are gone without removing theirs (SIGTERM,
    SIGKILL: a float32 copy of a model is gigabytes of the temporary folder)."""
    import shutil

    for p in tmp.glob("mixserve-scratch-*-*"):
        pid = p.name.split("-")[2]
        if pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
            shutil.rmtree(p, ignore_errors=True)


def remove_scratch() -> None:
    """Remove scratch_dir()'s folder, if one was made."""
    import shutil

    global _scratch
    if _scratch is not None:
        shutil.rmtree(_scratch, ignore_errors=True)
        _scratch = None


def writable_dir(path: Path) -> OSError | None:
    """None where files can be made in `path` (made if missing), else the error that says why not.
    os.access is not enough: root passes it on a read-only file system's folders' mode bits."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".probe.{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
        return None
    except OSError as e:
        return e


def publish_or_scratch(out: Path, fill, complete, what: str) -> Path:
    """publish_dir(out, fill, complete), or, where the cache cannot be written (cannot_write), the
    same fill in a folder of scratch_dir() that lives as long as this process; note_unkept says
    which. Returns the folder. Raises what `fill` raises, or another OSError."""
    try:
        return publish_dir(out, fill, complete)
    except Exception as e:  # noqa: BLE001 -- OSError, or a library's error carrying one (cannot_write)
        if not cannot_write(e):
            raise
        note_unkept(what, f"{out.parent}: {getattr(e, 'strerror', None) or e}")
    import shutil

    tmp = scratch_dir() / out.name
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    fill(tmp)
    return tmp


_CPU_MAX = "/sys/fs/cgroup/cpu.max"  # cgroup v2: "<quota> <period>" in microseconds, or "max <period>"


def usable_cores() -> int:
    """CPUs this process may run on: its affinity mask (os.cpu_count() where that is unknown), capped
    by a cgroup v2 CPU quota (/sys/fs/cgroup/cpu.max: a container's --cpus leaves the mask as it is,
    and threads past the quota are throttled)."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    try:
        with open(_CPU_MAX) as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            n = min(n, max(1, -(-int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return n


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


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (e.g. "avx2", "avx512_vnni"); empty where that is
    unreadable (callers then cannot rule a feature out)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_isa_key() -> str:
    """8 hex digits naming this CPU's instruction-set extensions (the SIMD and bit-manipulation
    flags of /proc/cpuinfo): code built with -march=native on one set must not run on another
    (SIGILL), and a model name alone does not tell them apart ("AMD EPYC" has come with and
    without AVX-512). "noisa" where /proc/cpuinfo is unreadable."""
    import hashlib

    flags = cpu_flags()
    if not flags:
        return "noisa"
    isa = sorted(x for x in flags if x.startswith(_ISA_PREFIXES))
    return hashlib.sha256(" ".join(isa).encode()).hexdigest()[:8]


# the instruction sets a published figure names (what picks mixserve's and oneDNN's kernels)
_NAMED_ISA = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile",
              "amx_int8", "amx_bf16")


def _family_model() -> str:
    """/proc/cpuinfo's "cpu family/model" of the first CPU (e.g. "26/2", an AMD Zen 5), "" if unreadable:
    "AMD EPYC" alone has named Zen 3 and Zen 5 machines here."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    got = {}
    for line in text.splitlines():
        k, _, v = line.partition(":")
        if k.strip() in ("cpu family", "model") and k.strip() not in got:
            got[k.strip()] = v.strip()
        if len(got) == 2:
            break
    return f"{got.get('cpu family', '?')}/{got.get('model', '?')}" if got else ""


def machine_info() -> dict:
    """What a published timing must carry: {"cpu": model name, "family_model": /proc/cpuinfo's
    family/model, "isa": the named instruction sets this CPU has (space-separated), "cores":
    os.cpu_count(), "torch_threads": torch's intra-op threads, "torch": version, "date": YYYY-MM-DD}."""
    import torch

    flags = cpu_flags()
    return {"cpu": cpu_model(), "family_model": _family_model(), "isa": " ".join(f for f in _NAMED_ISA if f in flags),
            "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d")}


def forced_isa() -> str | None:
    """$MIXSERVE_ISA: "avx2" runs the AVX2 variants of mixserve's kernels (every C++ kernel built
    without AVX-512: cpp_build.forced_isa_flags; the native GGUF kernel's build of its own) and caps
    oneDNN and MKL at AVX2 (kernel_choice.cap_isa) on a CPU with AVX-512 too, so that any machine can
    test that path (issue 43); unset or "native": the best the CPU has.
    Raises ValueError for another value."""
    v = os.environ.get("MIXSERVE_ISA", "").strip().lower()
    if v in ("", "native"):
        return None
    if v != "avx2":
        raise ValueError(f"MIXSERVE_ISA (environment): avx2 or native (got {v!r})")
    return v
