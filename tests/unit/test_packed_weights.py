"""The dense weights' invariant-GEMM copies kept on disk (models/packed_weights.py, issue 32): a later
start maps them instead of packing, with the same output bit for bit; a copy cut short, foreign or
unreadable is packed again and rewritten, never used."""
from __future__ import annotations

import json
import os

import pytest

from mixserve import SamplingParams
from mixserve.layers import batch_invariance
from mixserve.llm import LLM
from mixserve.models import packed_weights
from tests.unit.test_engine_tiny import make_tiny, prompts

_SUITE_XDG = os.environ.get("XDG_CACHE_HOME")  # before a fixture points it at a test's own folder

pytestmark = pytest.mark.skipif(batch_invariance.unavailable() is not None,
                                reason=f"batch invariance unavailable: {batch_invariance.unavailable()}")


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    folder, _ = make_tiny(tmp_path, "llama", tie=False)
    return folder


def _start(folder):
    llm = LLM(folder, dtype="float32", kv_cache_memory="2MiB", progress=False, graph_warmup="off")
    for t in llm.engine.packed_saves:
        t.join(60)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    outs = llm.generate(prompts(3, seed=4), sp)
    return llm, [(o.token_ids, [lp.logprob for lp in o.logprobs]) for o in outs]


def _store(folder):
    import torch

    return packed_weights.store_path(folder, torch.float32)


def test_a_later_start_maps_the_packed_weights_and_gives_the_same_bits(tiny):
    first, ref = _start(tiny)
    assert len(first.engine.packed_saves) == 1  # packed anew, and kept
    store = _store(tiny)
    names = {n for n, m in first.engine.model.named_modules() if getattr(m, "inv_packed", None) is not None}
    assert set(packed_weights.load(store)) == names and len(names) == 2 * 4 + 1  # 4 linears a layer, the head
    second, out = _start(tiny)
    assert second.engine.packed_saves == [] and out == ref  # every copy taken: nothing packed, nothing written
    # the weights replaced in place (a new modification time): a new store, and the stale one removed
    import os

    f = next(p for p in os.scandir(tiny) if p.name.endswith(".safetensors"))
    os.utime(f.path, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns + 1))
    third, out = _start(tiny)
    assert len(third.engine.packed_saves) == 1 and out == ref
    assert _store(tiny) != store and packed_weights.load(_store(tiny)) and not store.exists()


def test_a_cut_foreign_or_unreadable_copy_is_packed_again_and_rewritten(tiny):
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    _, ref = _start(tiny)
    store = _store(tiny)
    f = store / packed_weights.FILE

    def done_sizes():  # DONE lists the sizes a finished write left
        d = json.loads((store / "DONE").read_text())
        d["sizes"][packed_weights.FILE] = f.stat().st_size
        (store / "DONE").write_text(json.dumps(d))

    def unsampled_panel():  # panel 1 of layers.0.mlp's 8 (panels 0, 4 and 7 are sampled): same size
        tensors = load_file(str(f))
        with safe_open(str(f), framework="pt") as g:
            meta = g.metadata()
        t = tensors["layers.0.gate_up_proj"].clone()
        assert t.shape[0] == 16
        t[1] *= 3
        tensors["layers.0.gate_up_proj"] = t
        save_file(tensors, str(f), metadata=meta)
        done_sizes()

    damages = {
        "unsampled panel": unsampled_panel,
        "cut": lambda: f.write_bytes(f.read_bytes()[: f.stat().st_size // 2]),
        # another model's numbers in the same names and shapes, DONE made to agree
        "foreign": lambda: (save_file({k: torch.randn_like(v) for k, v in load_file(str(f)).items()}, str(f)),
                            done_sizes()),
        "unreadable header": lambda: (f.write_bytes(b"\xff" * f.stat().st_size), done_sizes()),
    }
    for what, damage in damages.items():
        damage()
        llm, out = _start(tiny)
        assert len(llm.engine.packed_saves) == 1, what  # packed anew and rewritten
        assert out == ref, what
        kept = packed_weights.load(store)
        assert kept and all(torch.equal(kept[n], m.inv_packed) for n, m in llm.engine.model.named_modules()
                            if getattr(m, "inv_packed", None) is not None), what


def test_the_store_is_keyed_by_the_source_files_and_the_dtype(tiny, tmp_path):
    import os

    import torch

    a = packed_weights.store_path(tiny, torch.float32)
    assert a == packed_weights.store_path(tiny, torch.float32)
    assert a != packed_weights.store_path(tiny, torch.bfloat16)
    f = next(p for p in os.scandir(tiny) if p.name.endswith(".safetensors"))
    os.utime(f.path, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns + 1))  # the weights replaced in place
    assert packed_weights.store_path(tiny, torch.float32) != a
    assert packed_weights.store_path(tmp_path, torch.float32) is None  # no safetensors: nothing kept


def test_a_script_that_exits_while_the_store_is_written_exits_cleanly(tiny, tmp_path):
    """A library user's first start that exits at once: the writer thread was killed inside torch's
    C++ and the process aborted (exit 134, "terminate called without an active exception"). Its exit
    now waits for the write: exit 0, and the next start finds the store."""
    import os
    import subprocess
    import sys

    # the write held for 2 s, so that the script's end comes first (a real model's takes seconds)
    code = ("import sys, time, safetensors.torch as st; save = st.save_file; "
            "st.save_file = lambda *a, **k: (time.sleep(2), save(*a, **k))[1]; from mixserve.llm import LLM; "
            "LLM(sys.argv[1], dtype='float32', kv_cache_memory='2MiB', progress=False, graph_warmup='off')")
    # the suite's cache root (its C++ builds: a new root built two kernels, 14 s of this test's 20 s);
    # the store goes to a folder of the test's own
    env = {**os.environ, "MIXSERVE_PACKED_CACHE": str(tmp_path / "packed")}
    env.pop("XDG_CACHE_HOME")
    if _SUITE_XDG is not None:
        env["XDG_CACHE_HOME"] = _SUITE_XDG
    r = subprocess.run([sys.executable, "-c", code, str(tiny)], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0 and "terminate called" not in r.stderr, r.stderr[-2000:]
    assert list((tmp_path / "packed").rglob(packed_weights.FILE))


def test_a_gguf_loaded_natively_keeps_its_float_linears_packed_too(tmp_path, monkeypatch):
    """A GGUF's F32/F16 linears run the invariant GEMM when the file loads natively: their packed
    copies are kept under the file's identity (its folder holds only the tokenizer), so a later
    start maps them instead of packing again, with the same bits."""
    from mixserve.layers import gguf_kernels
    from tests.tiny_gguf import VOCAB, write_float_gguf

    if not gguf_kernels.available():
        pytest.skip("native GGUF kernel needs AVX2 (or AVX512-VNNI)")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    path = write_float_gguf(tmp_path / "float.gguf")

    def start():
        from mixserve.models import native_store  # noqa: F401 -- its store is written beside

        llm = LLM(str(path), dtype="float32", kv_cache_memory="2MiB", progress=False, gguf_weights="native",
                  graph_warmup="off")
        for t in llm.engine.packed_saves:
            t.join(60)
        packed_weights.finish_writing()
        assert "GGUF weights native" in llm.engine.describe()
        import numpy as np

        ids = np.random.default_rng(3).integers(2, VOCAB, (3, 12)).tolist()
        outs = llm.generate(ids, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2))
        return llm, [(o.token_ids, [lp.logprob for lp in o.logprobs]) for o in outs]

    first, ref = start()
    assert len(first.engine.packed_saves) == 1  # packed anew, and kept
    import torch

    store = packed_weights.store_path(path, torch.float32)
    assert store is not None and packed_weights.load(store)
    second, out = start()
    assert second.engine.packed_saves == [] and out == ref
