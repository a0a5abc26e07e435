"""Building our few C++ kernels once with torch.utils.cpp_extension, cached per torch version.

Each is a plain shared library (ATen, `torch::` types and the op registry, no pybind11: three builds
took 32 s on a 2-core AVX2 EPYC against 139 s with `<torch/extension.h>`, benchmarks/startup.py),
loaded with torch.ops.load_library; the functions a caller names are registered as ops
`torch.ops.<name>.<function>`. A kernel whose instructions (`needs`) this CPU lacks is not built.
The kernels every CPU start needs (BUNDLED) are one library, so the torch headers are parsed once.

A kernel is compiled for this machine (-march=native) into `<cache root>/kernels/torch-<version>`;
`MIXSERVE_NO_CPP_KERNELS=1` or a failed build (no compiler, no headers) gives None, and callers
fall back to eager PyTorch ops.
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass

import torch

import mixserve.startup as startup
from mixserve.env import (cache_root, cannot_write, cpu_flags, cpu_isa_key, cpu_model, forced_isa, note_unkept,
                          remove_stale_tmp, scratch_dir, tmp_sibling, usable_cores)

log = logging.getLogger("mixserve")
_built: dict[str, object] = {}
_building: dict[str, threading.Lock] = {}  # one per kernel: a second caller waits for the build under way
_guard = threading.Lock()
_FLAGS = ("-O3", "-march=native", "-fopenmp")


def build_extension(name: str, source: str, functions: list[str], needs: frozenset[str] = frozenset(),
                    extra_flags: tuple[str, ...] = ()):
    """The compiled module `name` (its C++ `source` exporting `functions`), or None where it cannot
    be built. The build folder is keyed by the CPU's model and instruction set (-march=native code
    is not portable: two machines named "AMD EPYC" differ in AVX-512) and by a hash of the source,
    so a process after the first imports the built library directly instead of asking
    load_inline, which spends ~20 s re-checking the build every time.

    A kernel of BUNDLED is built with the others of BUNDLED, as one library (`bundle_source`): the
    first to be asked for builds them all, later calls get theirs from it.

    A build happens in a temporary folder renamed into place once the library loads, so a build
    that fails or is killed leaves no folder that a later start would take as built; a library
    already there that does not load (truncated, foreign) is built again (issue 46)."""
    if name in _built:
        return _built[name]
    bundle = _bundle_with(name)
    key = BUNDLE_NAME if bundle else name
    with _guard:
        lock = _building.setdefault(key, threading.Lock())
    with lock:
        if name not in _built:
            if bundle:
                flags = tuple(dict.fromkeys(f for k in bundle for f in k.extra_flags))
                _built.update(_build_or_load(BUNDLE_NAME, bundle, bundle_source, flags))
            else:
                _built.update(_build_or_load(name, [Kernel(name, source, tuple(functions), needs, extra_flags)],
                                             lambda ks: _lite_source(name, source, functions), extra_flags))
    return _built[name]


@dataclass(frozen=True)
class Kernel:
    """One C++ kernel: its op namespace `name`, its `source` (which may start with
    `#include <torch/extension.h>`, replaced by LITE_HEAD), the `functions` registered as
    `torch.ops.<name>.<function>`, the CPU flags it `needs` (/proc/cpuinfo's names) and its own
    compiler flags."""
    name: str
    source: str
    functions: tuple[str, ...]
    needs: frozenset[str] = frozenset()
    extra_flags: tuple[str, ...] = ()


# The kernels a CPU start builds, compiled as one translation unit: each build of its own parsed
# the torch headers again (~3 s of 4.0-7.7 s each on a 2-core Zen 5 EPYC); one unit took 9.6-9.9 s
# against 16.0-16.3 s for the three (benchmarks/cpp_headers.py; issue 32). Each module has `kernel()`.
BUNDLED = ("mixserve.layers.gguf_kernels", "mixserve.layers.paged_decode", "mixserve.layers.invariant_linear",
           "mixserve.layers.rmsnorm")
BUNDLE_NAME = "mixserve_kernels"


_bundle: list[Kernel] | None = None  # this process's bundle, decided once (fix_bundle)


def fix_bundle(without: tuple[str, ...] = ()) -> None:
    """Decide this process's bundle now, leaving out the kernels of the BUNDLED modules named in
    `without` (a start that will not run them: a model that is no GGUF file); a no-op once decided.
    A module may also stay out by itself where starts do not usually need it (`bundled()`: the GGUF
    kernel on a CPU that dequantizes GGUF files by default). A kernel left out is built alone where
    asked for. Decided once, because a kernel loaded from one library and again from another
    registers its ops twice, which aborts the process ($MIXSERVE_ISA changed in between, say).
    A module that cannot say (an invalid $MIXSERVE_ISA) stays out, and raises where asked for."""
    import importlib

    global _bundle
    with _guard:
        if _bundle is not None:
            return
        kernels = []
        for m in BUNDLED:
            if m in without:
                continue
            try:
                mod = importlib.import_module(m)
                if getattr(mod, "bundled", lambda: True)():
                    kernels.append(mod.kernel())
            except ValueError as e:
                log.warning("C++ kernel bundle: %s left out (%s)", m, e)
        _bundle = kernels


def _bundle_with(name: str) -> list[Kernel] | None:
    """This process's bundle (fix_bundle), where `name` is one of its kernels; else None."""
    fix_bundle()
    return _bundle if any(k.name == name for k in _bundle) else None


def build_in_background(loaders) -> list[threading.Thread]:
    """Call each of `loaders` (a kernel module's `build`: build_extension only, no op registration,
    which stays on the caller's thread) on daemon threads, now, in their order, as many at once as
    this process has cores (at most): the builds run as compiler processes beside what the caller
    does next (a cold start's GGUF conversion or repack, issue 32), and the first, which the caller
    needs first, has a core of its own (the 0.5B's native cold start: three builds, 51 s one after
    another on 2 AVX2 cores). A caller that needs a kernel before its build ends waits for that
    build (build_extension), never starts a second. Returns the threads."""
    import queue

    todo: queue.SimpleQueue = queue.SimpleQueue()
    for f in loaders:
        todo.put(f)

    def run():
        while True:
            try:
                f = todo.get_nowait()
            except queue.Empty:
                return
            try:
                f()
            except Exception as e:  # noqa: BLE001 -- the caller's own call reports it
                log.debug("background kernel build: %s", e)

    threads = [threading.Thread(target=run, name=f"mixserve-kernel-build-{i}", daemon=True)
               for i in range(max(1, min(len(loaders), usable_cores())))]
    for t in threads:
        t.start()
        _background.append(t)
    return threads


_background: list[threading.Thread] = []


def _children_now() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


_children_cpu = [_children_now()]  # RUSAGE_CHILDREN's CPU seconds when last counted (_build)


def wait_for_background_builds(timeout: float | None = None) -> None:
    """Wait for the builds `build_in_background` started (a kernel timing must not share the CPUs
    with our own compiler processes, which its load check would count as another's work)."""
    for t in list(_background):
        t.join(timeout)
        if not t.is_alive():
            _background.remove(t)


def _build_or_load(lib: str, kernels: list[Kernel], unit, extra: tuple[str, ...] = ()) -> dict[str, object]:
    """{kernel name: its ops, or None} for `kernels` built (or loaded) as the library `lib`, whose
    translation unit is unit(those of `kernels` this CPU can run)."""
    flags = cpu_flags()
    extra = tuple(dict.fromkeys(extra + forced_isa_flags()))
    out: dict[str, object] = {k.name: None for k in kernels}
    lacking = {k.name: set(k.needs) - flags for k in kernels if k.needs and flags and not set(k.needs) <= flags}
    for k, miss in lacking.items():
        # a CPU without them (/proc/cpuinfo's names): no build only to learn the kernel cannot run
        # here; where the flags are unreadable the build and the kernel's own check decide
        log.info("C++ kernel %s: this CPU lacks %s; not built", k, ", ".join(sorted(miss)))
    kernels = [k for k in kernels if k.name not in lacking]
    if not kernels:
        return out
    t0 = time.perf_counter()
    if not os.environ.get("MIXSERVE_NO_CPP_KERNELS"):
        cpu = "".join(c if c.isalnum() else "-" for c in cpu_model())[:48] + "-" + cpu_isa_key()
        try:
            text = unit(kernels)
            ops = {k.name: list(k.functions) for k in kernels}
            digest = hashlib.sha256((text + repr(_FLAGS + extra)).encode()).hexdigest()[:12]
            build = cache_root() / "kernels" / f"torch-{torch.__version__}" / cpu / f"{lib}-{digest}"
            mods = _import_built(lib, build / f"{lib}.so", ops)
            if mods is None:
                try:
                    mods = _build(lib, text, ops, build, extra)
                except Exception as e:  # noqa: BLE001 -- OSError, or another carrying the OS's (cannot_write)
                    if not cannot_write(e):
                        raise
                    # a read-only or full cache root: built for this process only
                    note_unkept(f"C++ kernel {lib}", f"{build.parent}: {getattr(e, 'strerror', None) or e}")
                    mods = _build(lib, text, ops, scratch_dir() / "kernels" / build.name, extra)
            out.update(mods)
        except Exception as e:  # no compiler, no headers: the eager path still works
            log.warning("C++ kernel %s unavailable (%s); using eager ops", lib, e)
    startup.add("C++ kernels", time.perf_counter() - t0)
    return out


def forced_isa_flags() -> tuple[str, ...]:
    """The compiler flags of $MIXSERVE_ISA (env.forced_isa): under "avx2" every kernel is built
    -march=native less AVX-512, as an AVX2-only CPU would build it. Before 2026-12-07 only the GGUF
    kernel was: the paged attention kernel kept its AVX-512 path for prefill groups and the
    invariant GEMM its 32 vector registers, so the forced arm was faster than the machine it
    stands for. The flags are part of a build's key (its folder's digest)."""
    return ("-mno-avx512f",) if forced_isa() == "avx2" else ()


def _import_built(lib: str, so, ops: dict[str, list[str]]):
    """{kernel name: its ops} from an already built library, or None where there is none or it does
    not load (then its folder is removed, to be built again)."""
    if not so.exists():
        return None
    try:
        torch.ops.load_library(str(so))
        return {name: _Ops(name, functions) for name, functions in ops.items()}
    except Exception as e:  # noqa: BLE001 -- a truncated or foreign .so: rebuild, never keep failing
        log.warning("C++ kernel %s: the cached build %s does not load (%s); building it again", lib, so, e)
        shutil.rmtree(so.parent, ignore_errors=True)
        return None


# what our kernels use of ATen, and no more: <torch/types.h> (all of ATen's ops, ATen.h) took 11.8 s
# of each build's compile on the 2-core EPYC, these 7.5 s (benchmarks/cpp_headers.py; issue 32)
LITE_HEAD = """#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/addmm.h>
namespace torch { using at::Tensor; using at::empty; using at::empty_like; }"""


def _lite_source(name: str, source: str, functions: list[str]) -> str:
    """`source` as a plain shared library: the few ATen headers of LITE_HEAD and the op registry
    instead of `<torch/extension.h>` (which brings pybind11 and the whole C++ frontend; issue 32), and each of
    `functions` registered as an op
    `torch.ops.<name>.<function>` with its schema inferred from the C++ signature."""
    head = LITE_HEAD
    body = source.replace("#include <torch/extension.h>", head) if "<torch/extension.h>" in source \
        else head + "\n" + source
    defs = "\n".join(f'  m.def("{f}", &{f});' for f in functions)
    return f"{body}\nTORCH_LIBRARY({name}, m) {{\n{defs}\n}}\n"


def bundle_source(kernels: list[Kernel]) -> str:
    """`kernels` as one translation unit: LITE_HEAD once, then their other `#include`s, then each
    kernel's code in a C++ namespace of its own (their helpers share names) with its `functions`
    registered as `torch.ops.<name>.<function>`. Raises ValueError for an `#include` that is not at
    the start of a line before any code (it cannot move out of its namespace)."""
    heads: list[str] = []
    units = []
    for k in kernels:
        body, code = [], False
        for line in k.source.splitlines():
            if line.startswith("#include") and not code:
                if "<torch/extension.h>" not in line and line not in heads:
                    heads.append(line)
                continue
            if "#include" in line:
                raise ValueError(f"C++ kernel {k.name}: an #include after its code: {line.strip()}")
            code = code or bool(line.strip())
            body.append(line)
        ns = f"k_{k.name}"
        defs = "\n".join(f'  m.def("{f}", &{ns}::{f});' for f in k.functions)
        units.append(f"namespace {ns} {{\n" + "\n".join(body) + f"\n}}  // namespace {ns}\n"
                     f"TORCH_LIBRARY({k.name}, m) {{\n{defs}\n}}\n")
    return "\n".join([LITE_HEAD, *heads, *units])


class _Ops:
    """The functions of a library built by `_lite_source`, called through its op namespace."""

    def __init__(self, name: str, functions: list[str]):
        ns = getattr(torch.ops, name)
        for f in functions:
            setattr(self, f, getattr(ns, f))


def _build(lib: str, text: str, ops: dict[str, list[str]], build, extra: tuple[str, ...] = ()):
    from torch.utils.cpp_extension import load_inline

    log.warning("compiling C++ kernel %s (once per machine and source; cached in %s)", lib, build.parent)
    remove_stale_tmp(build)
    shutil.rmtree(build, ignore_errors=True)  # a folder without a loadable library: not a build
    tmp = tmp_sibling(build)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        load_inline(lib, cpp_sources=text, extra_cflags=list(_FLAGS + extra),
                    extra_ldflags=["-fopenmp"], build_directory=str(tmp), verbose=False,
                    is_python_module=False, no_implicit_headers=True)
        # the compilers' own CPU time: what the builds cost whatever runs beside them (on a cold
        # start the GGUF's repack shares the cores and stretches their wall time). RUSAGE_CHILDREN
        # is the process's: each build adds what it grew by since the last one counted, so two
        # builds at once are not counted twice
        with _guard:
            total = _children_now()
            startup.add("C++ compiler CPU", total - _children_cpu[0])
            _children_cpu[0] = total
        mods = {name: _Ops(name, functions) for name, functions in ops.items()}
        try:
            tmp.rename(build)
        except OSError:  # another process finished the same build first: keep theirs
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return mods


# C++ shared by the int8-activation kernels (layers/int4_vnni.py, layers/gguf_kernels.py): one
# activation row's int8 quantization with one scale, max |x| / 127, per B channels (round half to
# even); `rest`, when given, receives what the rounding left over (the next level's input). A block
# holding a NaN or an infinity gets a NaN scale, so the product is NaN too and the engine's check
# of non-finite logits fails the request (std::max would drop a NaN and the cast of one to int8
# is undefined: the output came out finite and wrong)
QUANTIZE_ROW_SRC = r"""
template <int B>
static void quantize_row(const float* xr, int64_t K, int8_t* q, float* d, float* rest) {
  for (int64_t c = 0; c < K / B; ++c) {
    const float* xc = xr + c * B;
    float amax = 0.f;
    bool finite = true;
    for (int i = 0; i < B; ++i) {
      const float a = std::fabs(xc[i]);
      finite &= std::isfinite(a);
      amax = std::max(amax, a);
    }
    float dc = finite ? amax / 127.f : NAN, inv = dc > 0.f ? 1.f / dc : 0.f;
    if (std::isinf(inv)) dc = inv = 0.f;  // a subnormal scale: q = 0 and the rest carries x (never inf * x)
    d[c] = dc;
    for (int i = 0; i < B; ++i) {
      float qi = std::nearbyint(xc[i] * inv);
      qi = qi == qi ? std::fmin(std::fmax(qi, -127.f), 127.f) : 0.f;  // never -128 or a cast of NaN
      q[c * B + i] = (int8_t)qi;
      // one rounding, written out: whether a compiler contracts x - q * d depends on its flags and ISA
      if (rest) rest[c * B + i] = std::fma(-qi, dc, xc[i]);
    }
  }
}
"""
