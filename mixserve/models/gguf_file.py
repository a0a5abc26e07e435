"""Opening a GGUF file with the `gguf` package's reader, three times faster.

`gguf.GGUFReader` builds a small numpy array for every value of the file's metadata (the 0.5B's
151,936 token strings and its merges: about 600,000 arrays) by slicing a `numpy.memmap`, whose
slices run Python code (`memmap.__array_finalize__`) and whose `_get` makes a scratch array per
call to learn an item size. Slicing a plain ndarray view of the same map, with the item sizes
looked up once, gives the same fields and tensors: 10.4-11.6 s -> 2.1-2.4 s for the 0.5B on this
project's AMD EPYC (AVX2), 2026-12-05 (benchmarks/gguf_read.py). Every reader in mixserve comes from here, and
transformers' GGUF tokenizer load gets it too (`package_reader_is_fast`).
"""
from __future__ import annotations

import contextlib
import os
import threading

import numpy as np

# (dtype as passed, byte order) -> the numpy dtype `_get` returns
_DTYPES: dict = {}
_READER = None  # the subclass, made on first use (importing gguf costs ~0.3 s)
_PATCH_LOCK = threading.Lock()
_PATCHES = 0  # package_reader_is_fast blocks open now (under _PATCH_LOCK), and what they replaced
_SAVED = None


def _reader_class():
    global _READER
    if _READER is None:
        import gguf

        class FastGGUFReader(gguf.GGUFReader):
            """gguf.GGUFReader whose slices are of a plain ndarray view of its memory map."""

            def _get(self, offset, dtype, count=1, override_order=None):
                data = self.data
                if type(data) is not np.ndarray:
                    # the memmap stays alive as this view's base
                    self.data = data = data.view(np.ndarray)
                order = self.byte_order if override_order is None else override_order
                dt = _DTYPES.get((dtype, order))
                if dt is None:
                    dt = _DTYPES[(dtype, order)] = np.dtype(dtype).newbyteorder(order)
                return data[offset:offset + dt.itemsize * int(count)].view(dt)

        _READER = FastGGUFReader
    return _READER


def open_gguf(path: str | os.PathLike):
    """A `gguf.GGUFReader` of `path` (fields, tensors, tensor data as read-only views of one memory
    map), equal in every field and tensor to `gguf.GGUFReader(path)`; tensor data are plain
    ndarrays rather than `numpy.memmap` views.

    Raises what `gguf.GGUFReader` raises: ValueError for a file that is not GGUF (bad magic, an
    unsupported version), OSError when it cannot be read.
    Source: the GGUF format as `gguf-py` (llama.cpp) reads it.
    """
    return _reader_class()(str(path))


@contextlib.contextmanager
def package_reader_is_fast():
    """Within the block, `gguf.GGUFReader` is the fast reader: for library code that opens a GGUF
    itself (transformers' `load_gguf_checkpoint` imports the name at each call), such as loading a
    GGUF's tokenizer (10 s of its 13 s for the 0.5B were the reader). Other threads see it too for
    the duration, which is harmless: it reads the same fields and tensors."""
    import gguf

    global _PATCHES, _SAVED
    fast = _reader_class()
    with _PATCH_LOCK:  # counted, so that overlapping blocks on two threads restore the package's own
        if _PATCHES == 0:
            _SAVED = gguf.GGUFReader
            gguf.GGUFReader = fast
        _PATCHES += 1
    try:
        yield
    finally:
        with _PATCH_LOCK:
            _PATCHES -= 1
            if _PATCHES == 0:
                gguf.GGUFReader = _SAVED
