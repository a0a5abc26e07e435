"""host_memory.py: the weights and KV cache on transparent huge pages (issue 43, sixth round), and malloc
keeping a step's freed temporaries (seventh round)."""
import os
import re
import subprocess
import sys

import pytest
import torch

from mixserve import host_memory


def _smaps_kb(ptr: int, field: str) -> int | None:
    """`field` (kB, e.g. "AnonHugePages", "Rss") of the /proc/self/smaps mapping holding `ptr`, None
    where unreadable."""
    try:
        lines = open("/proc/self/smaps").read().splitlines()
    except OSError:
        return None
    inside = False
    for line in lines:
        m = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if m:
            inside = int(m.group(1), 16) <= ptr < int(m.group(2), 16)
        elif inside and line.startswith(field + ":"):
            return int(line.split()[1])
    return None


def _huge_kb(ptr: int) -> int | None:
    return _smaps_kb(ptr, "AnonHugePages")


def _rss_kb(ptr: int) -> int | None:
    return _smaps_kb(ptr, "Rss")


def test_a_big_zeroed_tensor_is_zero_aligned_and_on_huge_pages_where_the_os_grants_them():
    t = host_memory.empty_zeroed((3, 1 << 20), torch.bfloat16)  # 6 MB
    assert t.shape == (3, 1 << 20) and t.dtype == torch.bfloat16 and t.storage_offset() == 0
    assert int(t.abs().sum()) == 0
    t.fill_(1.5)  # touch every page
    if host_memory.thp_mode() in ("always", "madvise"):
        assert t.data_ptr() % host_memory.HUGE_PAGE == 0
        kb = _huge_kb(t.data_ptr())
        if kb is not None:
            assert kb >= 2048, "no huge page was granted for a madvised, aligned private map"
    small = host_memory.empty_zeroed((5, 7), torch.float32)
    assert small.shape == (5, 7) and int(small.abs().sum()) == 0


def _kernel() -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", os.uname().release) if sys.platform == "linux" else None
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def test_populating_faults_the_pages_in_and_changes_no_byte():
    """The KV cache's pages are faulted in beside the start-up, not by the steps that first write
    them (a first touch cost ~2 ms per 2 MB page on the AMX Xeon VM: 150-400 ms stalls)."""
    t = host_memory.empty_zeroed((6, 1 << 20), torch.uint8)  # 6 MB, never touched
    t[0, 0] = 7  # written before (or while) the thread runs: kept
    before = _rss_kb(t.data_ptr())
    th = host_memory.populate_in_background([t])
    if th is None or before is None:
        pytest.skip("no /proc or no madvise here")
    th.join(30)
    after = _rss_kb(t.data_ptr())
    if _kernel() < (5, 14):
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (before Linux 5.14): pages fault in when first written")
    assert before < 6 * 1024 <= after
    assert int(t[0, 0]) == 7 and int(t.sum()) == 7


def test_a_serving_engine_populates_its_kv_cache(tmp_path):
    from mixserve.engine.args import EngineArgs
    from mixserve.engine.llm_engine import LLMEngine
    from tests.unit.test_engine_tiny import make_tiny

    folder, _ = make_tiny(tmp_path, "qwen2", tie=False)
    eng = LLMEngine(EngineArgs(model=folder, dtype="float32", kv_cache_memory="8MiB", progress=False))
    assert eng.runner.kv_populate is None  # an engine that does not serve touches only what it uses
    eng.populate_kv_cache(wait=True)  # serve, a replica and bench ask for it
    th = eng.runner.kv_populate
    assert th is not None and not th.is_alive()
    rss = _rss_kb(eng.runner.k_caches[-1].data_ptr())
    size_kb = eng.runner.k_caches[-1].numel() * eng.runner.k_caches[-1].element_size() // 1024
    if rss is not None and _kernel() >= (5, 14):
        assert rss >= size_kb  # every page of a layer's cache is in before any step wrote it


def test_huge_pages_off_by_environment_keeps_the_bytes(monkeypatch):
    monkeypatch.setenv("MIXSERVE_HUGE_PAGES", "0")
    x = torch.randn(1 << 20)
    assert host_memory.on_huge_pages(x) is x  # nothing moved
    t = host_memory.empty_zeroed((1 << 20,), torch.float32)
    assert int(t.abs().sum()) == 0


def test_moved_tensors_keep_values_and_small_or_strided_ones_stay():
    x = torch.randn(1 << 20)  # 4 MB
    y = host_memory.on_huge_pages(x)
    assert torch.equal(x, y) and (y is x or y.data_ptr() != x.data_ptr())
    small = torch.randn(100)
    assert host_memory.on_huge_pages(small) is small
    strided = torch.randn(2048, 1024).t()
    assert host_memory.on_huge_pages(strided) is strided


def test_gguf_weights_moved_give_the_same_products_and_stay_shared():
    from mixserve.layers import gguf_linear

    try:
        w = gguf_linear.random_weight("Q4_K", 4096, 1024)  # lo plane 2 MB
    except RuntimeError as e:
        pytest.skip(f"native GGUF kernel unavailable: {e}")
    lin = gguf_linear.GGUFLinear([w], None, torch.float32)
    emb = gguf_linear.GGUFEmbedding(w, torch.float32)  # a tied head shares the weight
    model = torch.nn.ModuleDict({"lin": lin, "emb": emb})
    x = torch.randn(3, 1024)
    before = w.matmul(x, 2)
    old = w.lo
    moved = gguf_linear.weights_on_huge_pages(model)
    assert lin.parts[0] is emb.weight_q and torch.equal(old, w.lo)
    if host_memory.thp_mode() in ("always", "madvise"):
        assert moved >= w.lo.nbytes and w.lo.data_ptr() % host_memory.HUGE_PAGE == 0
    assert torch.equal(w.matmul(x, 2), before)


_FAULTS = r"""
import resource, sys, torch
from mixserve import host_memory
kept = host_memory.keep_freed_heap()
def faults_of_fill():
    t = torch.empty(10 << 20)  # 40 MB: above glibc's default mmap threshold's ceiling (32 MB)
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t.fill_(1.0)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
# the first few of a run of equal tensors still take fresh memory (small allocations made between
# them split the freed block: 6-7 of 16 here); after that each reuses the one before's pages
print(kept, max([faults_of_fill() for _ in range(16)][-4:]))
"""


def _run_faults(env_extra: dict) -> tuple[bool, int]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("MIXSERVE_KEEP_HEAP", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")}
    env.update(env_extra)
    out = subprocess.run([sys.executable, "-c", _FAULTS], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    kept, faults = out.stdout.split()[-2:]
    return kept == "True", int(faults)


def test_a_freed_big_temporary_is_reused_without_faulting_its_pages_in_again():
    kept, faults = _run_faults({})
    if not kept:
        pytest.skip("not glibc's malloc: keep_freed_heap changes nothing here")
    # 40 MB is 10,240 pages of 4 KB: a fresh map faults each in again, the kept heap none
    assert faults < 1000, f"a 40 MB tensor after 12 others faulted {faults} pages in"
    off, faults_off = _run_faults({"MIXSERVE_KEEP_HEAP": "0"})
    assert not off and faults_off > 5000, "without the setting glibc maps the tensor afresh (the test's premise)"


@pytest.mark.parametrize("env", [{"MIXSERVE_KEEP_HEAP": "0"}, {"MALLOC_MMAP_THRESHOLD_": "65536"},
                                 {"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}])
def test_keep_freed_heap_leaves_a_users_malloc_tuning_alone(env):
    code = "from mixserve import host_memory; print(host_memory.keep_freed_heap())"
    e = {k: v for k, v in os.environ.items() if k not in ("MIXSERVE_KEEP_HEAP", "GLIBC_TUNABLES")}
    e.update(env)
    out = subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True, timeout=120)
    assert out.stdout.split()[-1] == "False", out.stdout + out.stderr[-2000:]
