"""Opening a GGUF file with the `gguf` package's reader, three times faster.

`gguf.GGUFReader` builds a small numpy array for every value of the file's metadata (the 0.5B's
151,936 token strings and its merges: about 600,000 arrays) by slicing a `numpy.memmap`, whose
slices run Python code (`memmap.__array_finalize__`) and whose `_get` makes a scratch array per
call to learn an item size. Slicing a plain ndarray view of the same map, with the item sizes
looked up once, gives the same fields and tensors: 10.5 s -> 3.1 s for the 0.5B on this project's
AMD EPYC (AVX2), measured by hand on 2026-12-05. Every reader in mixserve comes from here.
"""
from __future__ import annotations

import os

import numpy as np

# (dtype as passed, byte order) -> the numpy dtype `_get` returns
_DTYPES: dict = {}


def open_gguf(path: str | os.PathLike):
    """A `gguf.GGUFReader` of `path` (fields, tensors, tensor data as read-only views of one memory
    map), equal in every field and tensor to `gguf.GGUFReader(path)`; tensor data are plain
    ndarrays rather than `numpy.memmap` views.

    Raises what `gguf.GGUFReader` raises: ValueError for a file that is not GGUF (bad magic, an
    unsupported version), OSError when it cannot be read.
    Source: the GGUF format as `gguf-py` (llama.cpp) reads it.
    """
    import gguf

    class _Reader(gguf.GGUFReader):
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

    return _Reader(str(path))
