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
"""
from __future__ import annotations

import math
import mmap
import os
import weakref
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20  # x86-64's PMD size
_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
_mode: str | None = None
_placed: dict[int, int] = {}  # start -> end of each huge-page map alive (empty_zeroed)


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
