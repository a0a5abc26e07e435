"""Dense weights in the batch-invariant GEMM's panel layout, kept on disk and memory-mapped at the
next start (issue 32).

With batch invariance on, every dense linear runs `layers/invariant_linear.py`, whose weight is a
copy in panels of 16 output columns ([ceil(N/16), K, 16], `invariant_linear.pack`). Making that copy
took 4.1 s of the 1.5B's 12.7 s warm start (6 GB of float32 weights) and ~1 s of the 0.5B's. So the
first start writes every packed weight of the model to one safetensors file under
`<cache root>/packed/`, on a thread once its engine is ready, and later starts map it: the kernel
reads the file's pages, which the OS shares between processes (replicas) and keeps warm.

The file is keyed by the source weights' files (path, size, modification time), the dtype, the
quantization and the layout's version (`LAYOUT`, with `invariant_linear.PANEL`). A folder that a
finished write did not complete (no DONE, a file of another size: `weights._complete`) is not
read; a tensor missing, of another shape or dtype, or whose sampled panels differ from a fresh
packing of the source weight (a foreign or corrupt file) is packed again, and the file rewritten.
Each tensor's checksum (`checksum`: its bytes summed as int64 words, ~0.1 s per 2 GB) is written
in the file's metadata and checked at load, so a changed panel that the sampling misses is caught
too (a break-it helper's case: one unsampled panel scaled, same size). Where the cache root cannot
be written the engine packs in memory, as before, and says so (env.note_unkept).
"""
from __future__ import annotations

import hashlib
import json
import logging
import threading
from pathlib import Path

import torch

from mixserve.env import cache_root, cannot_write, note_unkept, publish_dir
from mixserve.layers import invariant_linear

log = logging.getLogger("mixserve")

LAYOUT = 1  # bump when invariant_linear.pack's layout changes
FILE = "packed.safetensors"
SLOT = "__mixserve_slot__"  # metadata: what a store stands for apart from its source's version
_writing: list[threading.Thread] = []  # save_in_background's threads (finish_writing waits for them)
_at_exit: list[bool] = []  # non-empty once finish_writing is registered with atexit
kept: list[tuple[str, Path]] = []  # (what, store) for each store this process wrote (`prepare` lists them)


def store_path(folder: str | Path, dtype: torch.dtype, quant=None) -> Path | None:
    """Where the packed weights of the model loaded from `folder` (an HF folder: its *.safetensors
    files; or a GGUF file loaded natively, whose float linears are packed too) in `dtype` are kept:
    under $MIXSERVE_PACKED_CACHE, else `<cache root>/packed`; None where the folder has no
    safetensors."""
    files = [Path(folder)] if Path(folder).is_file() else sorted(Path(folder).glob("*.safetensors"))
    if not files:
        return None
    ident = []
    for f in files:
        st = f.stat()
        ident.append([str(f.resolve()), st.st_size, st.st_mtime_ns])
    key = json.dumps({"files": ident, "dtype": str(dtype), "quant": repr(quant), "layout": LAYOUT,
                      "panel": invariant_linear.PANEL})
    import os

    base = Path(os.environ["MIXSERVE_PACKED_CACHE"]) if os.environ.get("MIXSERVE_PACKED_CACHE") else \
        cache_root() / "packed"
    return base / f"{Path(folder).name}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def checksum(t: torch.Tensor) -> str:
    """The sum of a contiguous tensor's bytes read as int64 words, wrapping (any one changed word
    changes it; order-free, so threads may split it): ~0.1 s per 2 GB here, against ~0.6 s for CRC-32.
    A size that is not a whole number of words (the native GGUF layout's scales) adds its last
    bytes as a second sum."""
    b = t.reshape(-1).view(torch.uint8)
    whole = b.numel() // 8 * 8
    head = str(int(b[:whole].view(torch.int64).sum()))
    return head if whole == b.numel() else f"{head}+{int(b[whole:].sum())}"


def load(path: Path | None) -> dict[str, torch.Tensor]:
    """{module name: packed weight} memory-mapped from a complete store at `path`, each tensor
    whose checksum (written beside it) still holds; {} where there is none, or it is cut short
    or unreadable. What is left out is packed again and the store rewritten."""
    return read_store(path)[0]


def read_store(path: Path | None, place=None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata) of a complete store at `path` (save_tensors_in_background), keeping
    only the tensors whose checksum holds; ({}, {}) where there is none, or it is cut short or
    unreadable (logged: the caller builds the tensors again and rewrites the store). The tensors
    are views of the file's memory map unless `place` (tensor -> its copy) copies each, after its
    checksum: then the map is released on return (host_memory.own_copy)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    from mixserve.models.weights import _complete

    if path is None or not _complete(path):
        return {}, {}
    try:
        with safe_open(str(path / FILE), framework="pt") as f:
            meta = f.metadata() or {}
        tensors = load_file(str(path / FILE))
    except Exception as e:  # noqa: BLE001 -- a damaged header: build again, rewrite
        log.warning("stored weights in %s unreadable (%s: %s); building them again", path, type(e).__name__, e)
        return {}, {}
    good = {n: t for n, t in tensors.items() if meta.get(n) == checksum(t)}
    if len(good) < len(tensors):
        log.warning("stored weights in %s: %d of %d tensors fail their checksum; building them again", path,
                    len(tensors) - len(good), len(tensors))
    if place is not None:
        del tensors  # the views' last other reference: each is freed as it is copied
        for n in list(good):
            good[n] = place(good[n])
    return good, meta


def slot(folder: str | Path, dtype: torch.dtype, quant=None) -> str:
    """What a store of `store_path(folder, dtype, quant)` stands for apart from the weight files'
    version and the layout's: a later version replaces it (remove_stale)."""
    return json.dumps({"folder": str(Path(folder).resolve()), "dtype": str(dtype), "quant": repr(quant)})


def save_in_background(path: Path, model, slot: str | None = None) -> threading.Thread:
    """Write every packed dense weight of `model` (module name -> DenseLinear.inv_packed) to a
    store at `path` on a daemon thread, replacing what is there (the caller packed anew because it
    was missing or wanting), and, once written, the older stores of the same `slot`. Returns the
    thread."""
    tensors = {name: m.inv_packed for name, m in model.named_modules() if getattr(m, "inv_packed", None) is not None}
    return save_tensors_in_background(path, tensors, {}, "packed weights", slot=slot)


def save_tensors_in_background(path: Path, tensors: dict[str, torch.Tensor], meta, what: str,
                               slot: str | None = None) -> threading.Thread:
    """Write `tensors` (contiguous, none sharing memory) with `meta` (string keys other than the
    tensors' names; or a function returning them, called on the writer's thread) and each tensor's checksum to a store at `path` on a daemon thread, replacing
    what is there. publish_dir: a temporary folder renamed into place, so a process that exits
    first leaves nothing that a later start would read. Where the cache root cannot be written,
    `what` is named as not kept (env.note_unkept). `slot`: what the store stands for apart from
    its source's version (a file's path, a dtype); once written, the stores beside it of the same
    slot (an earlier version of the file, an older layout) are removed, so a re-pulled or touched
    file leaves no stale copy of its size behind. Returns the thread."""
    for t in _writing:  # a draft that is the target model: one writer per store (they share a temp path)
        if t.is_alive() and getattr(t, "store", None) == path:
            return t

    def write():
        import os

        from safetensors.torch import save_file

        from mixserve.models.weights import _write_done

        def fill(tmp: Path) -> None:
            extra = {**(meta() if callable(meta) else meta), **({SLOT: slot} if slot is not None else {})}
            save_file(tensors, str(tmp / FILE),
                      metadata={**extra, **{n: checksum(t) for n, t in tensors.items()}})
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp / FILE, 0o666 & ~umask)  # safetensors writes 0600: other users' starts read it too
            _write_done(tmp, f"{len(tensors)} tensors: {what}")
        try:
            # replace whatever is there: it was found wanting (cut, foreign, unreadable), or another
            # process wrote the same bits meanwhile
            publish_dir(path, fill, lambda out: False)
            kept.append((what, path))
            if slot is not None:
                remove_stale(path, slot)
        except Exception as e:  # noqa: BLE001 -- a cache write: never a reason to fail (safetensors' ENOSPC is its own error)
            if cannot_write(e):
                note_unkept(what, f"{path.parent}: {getattr(e, 'strerror', None) or e}")
            else:
                log.warning("%s not kept in %s: %s: %s", what, path, type(e).__name__, e)

    t = threading.Thread(target=write, name="mixserve-stored-weights", daemon=True)
    t.store = path
    if not _at_exit:
        # a library user's process that exits mid-write (a short first script) would kill the
        # writer inside torch's C++ and abort (exit 134, "terminate called without an active
        # exception"): its exit waits for the write as the CLI's does
        import atexit

        atexit.register(finish_writing)
        _at_exit.append(True)
    t.start()
    _writing.append(t)
    return t


def remove_stale(path: Path, slot: str) -> list[Path]:
    """Remove the stores beside `path` (folders of the same name up to the key's last "-") written
    for the same `slot`: other versions of the same source. Returns those removed."""
    import shutil

    from safetensors import safe_open

    stem = path.name.rsplit("-", 1)[0] + "-"
    gone = []
    for other in path.parent.glob(stem + "*"):
        if other == path or not other.is_dir() or ".tmp." in other.name or ".old." in other.name:
            continue
        try:
            with safe_open(str(other / FILE), framework="pt") as f:
                theirs = (f.metadata() or {}).get(SLOT)
        except Exception:  # noqa: BLE001 -- unreadable: not ours to judge (a later start rewrites its own)
            continue
        if theirs == slot:
            shutil.rmtree(other, ignore_errors=True)
            gone.append(other)
    if gone:
        log.info("removed %d stale store(s) beside %s: %s", len(gone), path, ", ".join(g.name for g in gone))
    return gone


def finish_writing() -> None:
    """Wait for the stores save_in_background is still writing (the CLI, before its exit skips
    every thread: a short first run would otherwise never keep them; and at any process's exit,
    registered with atexit), saying so."""
    left = [t for t in _writing if t.is_alive()]
    if left:
        log.warning("keeping the weights' ready layout for the next start (%d stores being written)", len(left))
    for t in left:
        t.join()
    _writing.clear()
