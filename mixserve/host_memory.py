"""The engine's big, long-lived host tensors (weights, the KV cache) on transparent huge pages.

A decode step reads every weight once, from memory: on 4 KB pages that is a TLB miss every 4 KB of
each stream, and the native GGUF kernel reads up to six planes at once (layers/gguf_src.py). On 2 MB
pages the 1.5B's Q4_K gate+up tensors, one row, taken in turn, streamed at 58 GB/s against 34, and a
step's linears took 25 ms against 27-28 (a 2-core Zen 5 EPYC, 2026-12-06; BENCHMARKS.md "Issue 43,
sixth round"). The KV cache's maps are private too (Python's default anonymous map is shared memory). Linux gives an anonymous
map huge pages where `/sys/kernel/mm/transparent_hugepage/enabled` is "always", or "madvise" (the
usual default) and the map asks with madvise(MADV_HUGEPAGE) before its pages are touched: here
every such tensor is its own anonymous map, 2 MB-aligned, asked. "never", another OS, a map that
cannot ask, or MIXSERVE_HUGE_PAGES=0 leaves 4 KB pages: the same bytes, only slower.

Source: the kernel's Documentation/admin-guide/mm/transhuge.rst.

A step's big, short-lived tensors (a prefill chunk's activations) are the other side: `keep_freed_heap`
has glibc's malloc reuse the memory the step before freed instead of mapping fresh pages for each.
"""
from __future__ import annotations

import ctypes
import math
import mmap
import os
import threading
import weakref
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20  # x86-64's PMD size
_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
_mode: str | None = None
_placed: dict[int, int] = {}  # start -> end of each huge-page map alive (empty_zeroed)
# glibc's mallopt parameters (malloc.h) and the values keep_freed_heap sets
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
HEAP_MMAP_THRESHOLD = 1 << 30
HEAP_TRIM_THRESHOLD = 1 << 30
_heap_kept: bool | None = None


def thp_mode() -> str:
    """The OS's transparent huge page mode, the bracketed word of its sysfs file ("always",
    "madvise", "never"), or "unavailable" (no such file: not Linux, or no THP)."""
    global _mode
    if _mode is None:
        try:
            text = _THP.read_text()
            _mode = text[text.index("[") + 1:text.index("]")]
        except (OSError, ValueError):
            _mode = "unavailable"
    return _mode


def _huge(nbytes: int) -> bool:
    return (nbytes >= HUGE_PAGE and thp_mode() in ("always", "madvise") and hasattr(mmap, "MADV_HUGEPAGE")
            and os.environ.get("MIXSERVE_HUGE_PAGES", "1") != "0")


def _private_map(n: int) -> mmap.mmap:
    """n bytes of private anonymous memory: Python's default for mmap(-1, n) is a shared map, which
    Linux backs with shmem (no huge pages unless shmem_enabled says so, and counted as shared memory)."""
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    return mmap.mmap(-1, n, flags=flags) if flags else mmap.mmap(-1, n)


def empty_zeroed(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor of `shape` and `dtype` on an anonymous memory map, whose pages the OS
    zeroes on first touch (torch.zeros writes every byte now: a 0.5B's default KV cache took ~1-2 s
    of a warm start, issue 32). At least HUGE_PAGE bytes: on huge pages (module doc), its data
    2 MB-aligned. Its storage starts at its data (no storage offset: an offset would be one more
    size in a compiled decode graph). The tensor keeps the map alive."""
    n = dtype.itemsize * math.prod(shape)
    if n == 0:
        return torch.zeros(shape, dtype=dtype)
    if not _huge(n):
        return torch.frombuffer(_private_map(n), dtype=dtype).view(shape)
    # one huge page more than asked, so that an aligned start fits wherever the OS puts the map
    m = _private_map(n + HUGE_PAGE)
    base = torch.frombuffer(m, dtype=torch.uint8, count=1).data_ptr()
    offset = -base % HUGE_PAGE
    try:
        m.madvise(mmap.MADV_HUGEPAGE, offset, n)
    except OSError:  # a kernel without THP for anonymous maps: 4 KB pages
        pass
    start = base + offset
    _placed[start] = start + n
    weakref.finalize(m, _placed.pop, start, None)  # the map's range is forgotten with it
    # frombuffer's offset moves the storage's start, not the tensor's storage_offset
    return torch.frombuffer(m, dtype=torch.uint8, count=n, offset=offset).view(dtype).view(shape)


def placed(t: torch.Tensor) -> bool:
    """Whether `t`'s data lies in a huge-page map of empty_zeroed's that is still alive."""
    p = t.data_ptr()
    return any(a <= p < b for a, b in _placed.items())


def on_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """`t` (CPU, contiguous) copied onto huge pages where it is at least HUGE_PAGE bytes, the OS
    grants them (empty_zeroed) and it is not on them already (`placed`), else `t` itself. The copy
    has t's shape, dtype and values."""
    if t.device.type != "cpu" or not t.is_contiguous() or not _huge(t.numel() * t.element_size()) or placed(t):
        return t
    out = empty_zeroed(tuple(t.shape), t.dtype)
    out.copy_(t)
    return out


def own_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t` in memory of its own: on huge pages where `on_huge_pages` moves it, else a plain
    clone. For tensors read from a memory-mapped file (a safetensors store): once every tensor of the
    file is copied, the map goes, where a view kept would keep the whole file's pages resident."""
    c = on_huge_pages(t.contiguous())
    return c if c is not t else t.clone()


_MADV_POPULATE_WRITE = 23  # Linux 5.14+ (include/uapi/asm-generic/mman-common.h); not in Python's mmap before 3.14


def populate_in_background(tensors: list[torch.Tensor], name: str = "populate") -> threading.Thread | None:
    """Fault in the pages of CPU `tensors` (empty_zeroed's maps, whose pages the OS zeroes on first
    touch) on a daemon thread, without writing them: madvise(MADV_POPULATE_WRITE), one call per
    tensor, the GIL released (ctypes). Their contents never change, so the engine may write them
    meanwhile. Returns the thread (join it to wait), or None where there is nothing to do (not
    Linux, no tensors); a kernel without MADV_POPULATE_WRITE (before 5.14) makes the thread stop at
    its first call, leaving the pages to their first touch as before.

    Why: the lazily zeroed KV cache's pages were faulted in by the steps that first wrote them. On
    the 2-core AMX Xeon VM a first touch cost ~2 ms per 2 MB page (560 ms for 268 MB, by hand): the
    first request's 8-token prefill took 282 ms instead of ~60, and a step that wrote fresh blocks
    later paid it again (a 269-token prefill step 886 ms against 620; with prefix caching, freed
    blocks stay cached and fresh ones are handed out first) (BENCHMARKS.md, issue 34's fifth round).
    Populating costs about as much (676 ms for 268 MB, by hand: ~2.5 s of one core a GiB), once,
    beside the start-up instead of in steps."""
    ranges = []
    for t in tensors:
        if t.device.type == "cpu" and t.numel():
            start = t.data_ptr() - t.data_ptr() % mmap.PAGESIZE
            ranges.append((start, t.data_ptr() + t.numel() * t.element_size() - start))
    if not ranges or not hasattr(ctypes, "CDLL") or os.name != "posix" or not Path("/proc/self").is_dir():
        return None
    keep = list(tensors)  # the maps stay alive while the thread runs (its target holds this closure)

    def run():
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        for start, n in ranges:
            if libc.madvise(start, n, _MADV_POPULATE_WRITE) != 0:
                return  # EINVAL: an older kernel; the pages fault in when first written, as before
        del keep[:]

    th = threading.Thread(target=run, name=name, daemon=True)
    th.start()
    return th


def keep_freed_heap() -> bool:
    """Have glibc's malloc keep a step's freed temporaries for the next step: allocations up to
    HEAP_MMAP_THRESHOLD (1 GB) come from the heap, not from a map of their own, and up to
    HEAP_TRIM_THRESHOLD of free memory at the heap's top stays with the process. Returns whether
    the settings are in force (once a process; later calls return the first answer).

    Why: glibc maps every allocation above its mmap threshold (128 KB, raised by each such free up to
    32 MB) afresh and unmaps it at free, so each of a prefill chunk's big tensors (a 1536-row chunk's
    gate+up output on the 0.5B: 60 MB in float32) faults every 4 KB page in again, every layer. A
    1536-token prefill of the 0.5B: batch invariance on 3.26 -> 2.67 s, off 2.64 -> 2.16 s
    (benchmarks/host_memory_ab.py, Zen 5 EPYC, 2026-12-06; BENCHMARKS.md "Issue 43, seventh round").
    The cost: memory a step freed stays resident (+61 MB peak for one 0.5B engine; a process making
    engines in turn kept ~150 MB more of what they freed), and in a thread's own arena (the server's
    engine thread) blocks past glibc's 64 MB heaps are still mapped.

    Nothing is changed where the C library is not glibc (no `mallopt`), where the user tuned malloc
    (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_ or GLIBC_TUNABLES set, or another allocator
    (jemalloc, tcmalloc, mimalloc) preloaded), or with MIXSERVE_KEEP_HEAP=0. Source: mallopt(3).
    """
    global _heap_kept
    if _heap_kept is not None:
        return _heap_kept
    _heap_kept = False
    env = os.environ
    if (env.get("MIXSERVE_KEEP_HEAP", "1") == "0" or "malloc" in env.get("LD_PRELOAD", "")
            or any(k in env for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES"))):
        return False
    libc = ctypes.CDLL(None)  # the process's own symbols: the C library it runs on (no ldconfig run)
    if not hasattr(libc, "mallopt") or not hasattr(libc, "gnu_get_libc_version"):  # not glibc: no such tuning
        return False
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # the trim threshold first: setting either turns glibc's dynamic thresholds off
    _heap_kept = bool(mallopt(_M_TRIM_THRESHOLD, HEAP_TRIM_THRESHOLD)) and bool(
        mallopt(_M_MMAP_THRESHOLD, HEAP_MMAP_THRESHOLD))
    return _heap_kept
