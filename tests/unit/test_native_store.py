"""A GGUF's native layout kept on disk (models/native_store.py, issue 32): a later start reads it
instead of the GGUF and gives the same bits; a store cut short, corrupt or written for another file
is repacked and rewritten, never used."""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from mixserve import SamplingParams
from mixserve.layers import gguf_kernels
from mixserve.models import native_store, packed_weights, weights
from tests.unit.test_gguf_native import VOCAB, write_tiny_gguf

pytestmark = pytest.mark.skipif(not gguf_kernels.available(), reason="native GGUF kernel needs AVX2 (or AVX512-VNNI)")


@pytest.fixture
def gguf_file(tmp_path, monkeypatch):
    monkeypatch.setenv("MIXSERVE_NATIVE_CACHE", str(tmp_path / "native"))
    return write_tiny_gguf(tmp_path / "tiny-llama.gguf")


def _start(path, repack=True):
    """An engine's tokens and logprobs, with the store's write waited for. repack=False: reading
    the GGUF's tensors fails the test."""
    from mixserve.llm import LLM

    with pytest.MonkeyPatch.context() as mp:
        if not repack:
            def refuse(*a, **k):
                raise AssertionError("the GGUF was read and repacked")
            mp.setattr(weights, "read_gguf_native", refuse)
        llm = LLM(str(path), dtype="float32", kv_cache_memory="2MiB", progress=False, gguf_weights="native",
                  kernels="eager")
    packed_weights.finish_writing()
    ids = np.random.default_rng(5).integers(2, VOCAB, (3, 20)).tolist()
    outs = llm.generate(ids, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2))
    return llm, [(o.token_ids, [lp.logprob for lp in o.logprobs]) for o in outs]


def test_a_later_start_reads_the_kept_layout_and_gives_the_same_bits(gguf_file, monkeypatch):
    first, ref = _start(gguf_file)
    store = native_store.store_path(gguf_file)
    assert (store / packed_weights.FILE).is_file()
    second, out = _start(gguf_file, repack=False)
    assert out == ref
    assert second.engine.model.cfg == first.engine.model.cfg
    assert second.engine.describe().count("GGUF weights native") == 1  # the same start-up line
    assert "the repacked layout kept in" in second.engine.describe()
    # a changed file (same path, new modification time) has a store of its own, which replaces the old
    os.utime(gguf_file, ns=(1, 1))
    assert native_store.store_path(gguf_file) != store
    assert native_store.load(store, gguf_file) is None  # the old store names the old identity
    third, out = _start(gguf_file)
    assert out == ref and "repacked from the file" in third.engine.describe()
    assert native_store.load(native_store.store_path(gguf_file), gguf_file) is not None
    assert native_store.store_path(gguf_file).parent == store.parent  # the test's own folder
    assert not store.exists()  # the stale store removed once the new one was written
    # every tensor read is a copy of its own, none a view of the file's memory map (a view would
    # keep the whole file resident beside the copies)
    _, read, _ = native_store.load(native_store.store_path(gguf_file), gguf_file)
    for w in read.values():
        for t in ([getattr(w, n) for n in w.TENSORS] if hasattr(w, "TENSORS") else [w]):
            assert t.untyped_storage().nbytes() == t.nbytes, "a view of the store's map"


def test_a_cut_corrupt_or_foreign_store_is_repacked_and_rewritten(gguf_file, tmp_path, monkeypatch):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    _, ref = _start(gguf_file)
    store = native_store.store_path(gguf_file)
    f = store / packed_weights.FILE

    def rewritten():  # the next start repacked (the GGUF read), wrote a whole store, and gave the same bits
        _, out = _start(gguf_file)
        assert out == ref
        assert native_store.load(store, gguf_file) is not None

    # cut short: DONE's sizes no longer hold
    with open(f, "r+b") as fh:
        fh.truncate(f.stat().st_size // 2)
    assert native_store.load(store, gguf_file) is None
    rewritten()

    # one plane's bytes changed, same size: its checksum fails
    with safe_open(str(f), framework="pt") as fh:
        meta = fh.metadata()
    tensors = load_file(str(f))
    name = next(n for n in tensors if n.endswith("#lo"))
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[7] ^= 0x11
    save_file(tensors, str(f), metadata=meta)
    weights._write_done(store, "edited")
    assert native_store.load(store, gguf_file) is None
    rewritten()

    # the description edited (a block type), the tensors' checksums intact: its own checksum fails
    meta = dict(meta)
    meta[native_store.META] = meta[native_store.META].replace('"Q4_K"', '"Q5_0"', 1)
    save_file(load_file(str(f)), str(f), metadata=meta)
    weights._write_done(store, "edited")
    assert native_store.load(store, gguf_file) is None
    rewritten()

    # the file replaced in place by another of the same size and modification time
    st = os.stat(gguf_file)
    data = bytearray(gguf_file.read_bytes())
    data[-5000] ^= 0x40  # a weight's byte
    gguf_file.write_bytes(bytes(data))
    os.utime(gguf_file, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert native_store.store_path(gguf_file) == store  # the same key
    assert native_store.load(store, gguf_file) is None  # but not the same content
    _, changed = _start(gguf_file)
    assert native_store.load(store, gguf_file) is not None
    data[-5000] ^= 0x40
    gguf_file.write_bytes(bytes(data))
    os.utime(gguf_file, ns=(st.st_atime_ns, st.st_mtime_ns))
    rewritten()

    # the same content under a new inode with the same time (a copy that kept it, as an image's): taken,
    # after the whole file's digest
    copy = tmp_path / "copy.gguf"
    shutil.copy2(gguf_file, copy)
    os.replace(copy, gguf_file)
    assert native_store.load(store, gguf_file) is not None

    # foreign: the store of another file (same content, another path) put in this one's place
    other = shutil.copy(gguf_file, tmp_path / "other.gguf")
    _start(other)
    shutil.rmtree(store)
    shutil.copytree(native_store.store_path(other), store)
    assert native_store.load(store, gguf_file) is None
    facts = json.loads(packed_weights.read_store(store)[1][native_store.META])
    assert facts["source"] == native_store.source_id(other)
    rewritten()
