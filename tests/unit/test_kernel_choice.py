"""Kernels chosen by measurement (layers/kernel_choice.py): the rule, the cache, overrides, AMX,
and the fast path's output against the eager path on a tiny random model."""
import json
import logging
import math

import pytest
import torch

from mixserve import SamplingParams
from mixserve.layers.kernel_choice import EAGER, KernelChooser, amx_permitted, cap_threads, parse_overrides
from mixserve.llm import LLM
from tests.reference import compare_greedy, engine_logits_along
from tests.unit.test_engine_tiny import make_tiny, prompts


def stub(seconds, calls):
    def t():
        calls.append(seconds)
        return seconds
    return t


def test_a_timing_taken_while_other_processes_ran_is_not_cached(tmp_path, monkeypatch):
    """hw probe's load check guards each measurement (issue 32): where other processes used more
    than BUSY_CORES while a key was timed (read from /proc/stat and /proc/self/stat), its choice
    serves this process only, and the next start times it again; a quiet timing is cached."""
    import os

    import mixserve.env as env
    import mixserve.layers.kernel_choice as kc

    monkeypatch.setattr(env, "_unkept", {})  # the uncached choice is named there (prepare's exit 1)
    cpus = os.cpu_count() or 1
    tick = os.sysconf("SC_CLK_TCK")
    # one second of the machine: every CPU busy with another process's work; then only this one's
    samples = iter([(0, 0, 0), (tick * cpus, tick * cpus, 0), (0, 0, 0), (tick, tick * cpus, tick)])
    monkeypatch.setattr(kc, "cpu_ticks", lambda: next(samples))
    path = tmp_path / "choices.json"
    calls = []
    c = KernelChooser(path, overrides={}, machine="cpu A | torch 1", timing="measure")
    pick = c.choose("dense_linear/x", {"plain": stub(2.0, calls), "onednn": stub(1.0, calls)}, "plain")
    assert pick == "onednn" and not path.exists()
    src = c.choices["dense_linear/x"].source
    assert src.startswith("measured, not cached") and f"used {cpus:.1f} cores" in src
    assert "kernel choices" in env.unkept()
    # the same timing with nothing else running (this process the only busy one) is cached
    c2 = KernelChooser(path, overrides={}, machine="cpu A | torch 1", timing="measure")
    assert c2.choose("dense_linear/x", {"plain": stub(2.0, calls), "onednn": stub(1.0, calls)}, "plain") == "onednn"
    assert c2.choices["dense_linear/x"].source == "measured" and path.exists() and len(calls) == 4
    # the reading itself: this process's own work is not another's
    a = kc.other_cores((0, 0, 0), (tick * cpus, tick * cpus, tick * cpus))
    assert a == 0.0 and kc.other_cores(None, (1, 2, 3)) is None and kc.other_cores((0, 0, 0), (1, 1, 0)) is None


def test_faster_candidate_chosen_and_cached(tmp_path):
    path = tmp_path / "choices.json"
    calls = []
    c = KernelChooser(path, overrides={}, machine="cpu A | torch 1", timing="measure")
    assert c.choose("dense_linear/x", {"plain": stub(2.0, calls), "onednn": stub(1.0, calls)}, "plain") == "onednn"
    assert c.choices["dense_linear/x"].source == "measured"
    assert len(calls) == 2
    saved = json.loads(path.read_text())
    assert saved["machines"]["cpu A | torch 1"]["dense_linear/x"]["name"] == "onednn"
    # a new process on the same machine reads the cache and measures nothing
    c2 = KernelChooser(path, overrides={}, machine="cpu A | torch 1", timing="measure")
    assert c2.choose("dense_linear/x", {"plain": stub(2.0, calls), "onednn": stub(1.0, calls)}, "plain") == "onednn"
    assert c2.choices["dense_linear/x"].source == "cache" and len(calls) == 2
    # another CPU model (or torch version) measures for itself, beside the first
    c3 = KernelChooser(path, overrides={}, machine="cpu B | torch 1", timing="measure")
    assert c3.choose("dense_linear/x", {"plain": stub(1.0, calls), "onednn": stub(3.0, calls)}, "plain") == "plain"
    assert len(calls) == 4
    saved = json.loads(path.read_text())
    assert set(saved["machines"]) == {"cpu A | torch 1", "cpu B | torch 1"}
    # a kernel added since the cache was written is measured, not ignored
    c4 = KernelChooser(path, overrides={}, machine="cpu A | torch 1", timing="measure")
    three = {"plain": stub(2.0, calls), "onednn": stub(1.0, calls), "gemv": stub(0.5, calls)}
    assert c4.choose("dense_linear/x", three, "plain") == "gemv" and len(calls) == 7


def test_eager_kept_unless_beaten_by_the_margin(tmp_path):
    c = KernelChooser(tmp_path / "c.json", overrides={}, machine="m", timing="measure")
    # 1% faster is timing noise: never trade the eager path for it
    assert c.choose("k1", {"sdpa": lambda: 1.0, "bmm": lambda: 0.99}, "sdpa") == "sdpa"
    assert c.choose("k2", {"sdpa": lambda: 1.0, "bmm": lambda: 0.5}, "sdpa") == "bmm"


@pytest.mark.parametrize("garbage", ["{not json", "[]", '{"version": 1, "machines": {"m": {"k": {"name": "gone"}}}}',
                                     '{"version": 1, "machines": {"m": {"k": {"name": "a", "timings": "x"}}}}',
                                     '{"version": 1, "machines": ["m"]}', ""])
def test_corrupt_cache_is_ignored_and_remeasured(tmp_path, garbage):
    path = tmp_path / "c.json"
    path.write_text(garbage)
    calls = []
    c = KernelChooser(path, overrides={}, machine="m", timing="measure")
    assert c.choose("k", {"a": stub(2.0, calls), "b": stub(1.0, calls)}, "a") == "b"
    assert len(calls) == 2 and c.choices["k"].source == "measured"
    assert json.loads(path.read_text())["machines"]["m"]["k"]["name"] == "b"  # and repaired


def test_unwritable_cache_still_chooses(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    c = KernelChooser(blocker / "sub" / "c.json", overrides={}, machine="m", timing="measure")  # a file where a folder should be
    assert c.choose("k", {"a": lambda: 2.0, "b": lambda: 1.0}, "a") == "b"


def test_cache_that_is_a_folder_or_another_version_is_left_alone(tmp_path, caplog):
    """A folder at the cache path, or a newer mixserve's cache, is not overwritten (nor a stray
    temporary file left): the choice is made, a warning says why it is not cached."""
    folder = tmp_path / "dir.json"
    folder.mkdir()
    other = tmp_path / "v9.json"
    other.write_text(json.dumps({"version": 9, "machines": {"m": {"k": {"name": "zzz"}}}}))
    for path in (folder, other):
        c = KernelChooser(path, overrides={}, machine="m", timing="measure")
        with caplog.at_level("WARNING", logger="mixserve"):
            assert c.choose("k", {"a": lambda: 2.0, "b": lambda: 1.0}, "a") == "b"
        assert "not cached" in caplog.text
    assert folder.is_dir() and json.loads(other.read_text())["version"] == 9
    assert not list(tmp_path.glob("*.tmp"))


def test_overrides(tmp_path):
    calls = []
    c = KernelChooser(tmp_path / "c.json", overrides=parse_overrides("dense_linear=plain,dense_linear/bf16/9x9=onednn"),
                      machine="m", timing="measure")
    # the longest matching key prefix wins; nothing is measured
    assert c.choose("dense_linear/bf16/9x9", {"plain": stub(1, calls), "onednn": stub(2, calls)}, "plain") == "onednn"
    assert c.choose("dense_linear/bf16/4x4", {"plain": stub(2, calls), "onednn": stub(1, calls)}, "plain") == "plain"
    assert calls == [] and c.choices["dense_linear/bf16/4x4"].source == "override"
    with pytest.raises(ValueError, match="no candidate 'fast'"):
        KernelChooser(tmp_path / "c.json", overrides={"k": "fast"}, machine="m", timing="measure").choose("k", {"a": lambda: 1}, "a")
    assert parse_overrides("eager") == EAGER
    with pytest.raises(ValueError, match="KEY=NAME"):
        parse_overrides("onednn")
    for typo in ("dense=onednn", "foo=bar", "=plain", "dense_linear="):
        with pytest.raises(ValueError, match="must start with one of dense_linear"):
            parse_overrides(typo)


def test_env_override(tmp_path, monkeypatch):
    monkeypatch.setenv("MIXSERVE_KERNELS", "decode_attention=bmm")
    c = KernelChooser(tmp_path / "c.json", machine="m", timing="measure")
    assert c.choose("decode_attention/bf16/1x1x1", {"sdpa": lambda: 1.0, "bmm": lambda: 2.0}, "sdpa") == "bmm"
    monkeypatch.setenv("MIXSERVE_KERNELS", "fastest")
    with pytest.raises(ValueError, match="MIXSERVE_KERNELS .environment.: kernels: 'fastest' is not KEY=NAME"):
        KernelChooser(tmp_path / "c.json", machine="m", timing="measure")


def test_amx_only_where_the_permission_request_succeeds(monkeypatch):
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    assert amx_permitted("flags fpu avx512f", request=lambda: True) is False  # no AMX on this CPU
    assert amx_permitted("flags avx512f amx_tile amx_bf16", request=lambda: True) is True
    import os

    assert "ONEDNN_MAX_CPU_ISA" not in os.environ

    def refused():
        raise OSError("arch_prctl: operation not permitted")

    assert amx_permitted("flags avx512f amx_tile amx_bf16", request=refused) is False
    assert os.environ["ONEDNN_MAX_CPU_ISA"] == "AVX512_CORE_BF16"  # oneDNN capped below AMX
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    assert amx_permitted("flags amx_tile", request=lambda: False) is False
    assert os.environ["ONEDNN_MAX_CPU_ISA"] == "AVX512_CORE_BF16"


def test_usable_cores_is_capped_by_a_cgroup_cpu_quota(monkeypatch, tmp_path):
    """A container's --cpus (cgroup v2 cpu.max) caps the cores the affinity mask shows."""
    import mixserve.env as env

    f = tmp_path / "cpu.max"
    monkeypatch.setattr(env, "_CPU_MAX", str(f))
    f.write_text("max 100000\n")
    mask = env.usable_cores()
    f.write_text("50000 100000\n")  # half a CPU: one core
    assert env.usable_cores() == 1
    f.write_text("150000 100000\n")  # 1.5 CPUs: two, where the mask has them
    assert env.usable_cores() == min(mask, 2)
    f.write_text("garbage\n")
    assert env.usable_cores() == mask


def test_threads_never_exceed_cores(monkeypatch):
    import mixserve.layers.kernel_choice as kc

    before = torch.get_num_threads()
    try:
        monkeypatch.setattr(kc, "usable_cores", lambda: 1)
        torch.set_num_threads(2)
        assert cap_threads() == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_real_candidates_time_something(tmp_path):
    """The timers the model uses return positive seconds for every candidate."""
    from mixserve.layers.attention import decode_candidates
    from mixserve.layers.linear import dense_candidates, int4_candidates

    for cands in (dense_candidates(64, 32, torch.float32), decode_candidates(4, 2, 16, torch.float32, context=32),
                  int4_candidates(32, 64, 32, torch.float32)):
        ts = {k: f() for k, f in cands.items()}
        assert all(t > 0 for t in ts.values()), ts
    assert set(int4_candidates(32, 64, 32, torch.float32)) >= {"never", "16", "512"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("kc"), "qwen2", tie=True)


FAST = ["dense_linear=onednn,decode_attention=bmm", "dense_linear=plain,decode_attention=sdpa",
        "decode_attention=paged,decode_graph=compiled"]


@pytest.mark.parametrize("kernels", FAST)
@pytest.mark.parametrize("quant", [None, "rtn"])
def test_fast_path_equals_eager_path(tiny, kernels, quant):
    """Greedy in float32, token for token (tie rule), at batch sizes 1, 3, 5 and 11 (decode groups
    of several sizes), for each kernel against the eager one; int4 with the dequantize path from 4
    rows against the int4 kernel at every row count."""
    folder, _ = tiny
    # the measured kernels and their row switches: batch invariance off (it fixes them)
    common = dict(dtype="float32", kv_cache_memory="8MiB", block_size=8, progress=False, quantization=quant,
                  quant_group_size=32, batch_invariant="off")
    eager = LLM(folder, kernels="eager", **common)
    fast = LLM(folder, kernels=kernels + (",int4_dense_rows=4" if quant else ""), **common)
    if quant:
        assert any(getattr(m, "dense_rows", None) == 4 for m in fast.engine.model.modules())
    graph = fast.engine.runner.graph
    if "decode_graph=compiled" in kernels:  # with int4 layers switching at 4 rows, up to 3 rows are captured
        assert graph is not None and graph.max_rows == (3 if quant else 256)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for n in (1, 3, 5, 11):
        ps = prompts(n, seed=n)
        a, b = eager.generate(ps, sp), fast.generate(ps, sp)
        assert all(len(x.token_ids) == 24 for x in a + b)
        for x, y in zip(a, b):
            # the eager engine's own logits for the tie rule: rerun its tokens as a prompt
            if x.token_ids != y.token_ids:
                ref = eager.engine
                logits = engine_logits_along(ref, x.prompt_token_ids, x.token_ids)
                c = compare_greedy(y.token_ids, x.token_ids, logits)
                assert c.ok, f"batch {n}: diverged at {c.position} (gap {c.gap})"
    if graph is not None:
        assert set(graph.compile_s) == {"graph"} and graph.num_steps > 0
        # one compiled graph served every row count (1 to 11, or up to 3 with int4): no recompile
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list

        assert len(_debug_get_cache_entry_list(graph.fn._torchdynamo_orig_callable.__code__)) == 1

def test_engine_describes_its_kernels(tiny):
    folder, _ = tiny
    with pytest.raises(ValueError, match="batch invariance pins"):
        LLM(folder, dtype="float32", kv_cache_memory="4MiB", progress=False, kernels="dense_linear=onednn")
    llm = LLM(folder, dtype="float32", kv_cache_memory="4MiB", progress=False,
              kernels="dense_linear=onednn,decode_attention=bmm", batch_invariant="off")
    text = llm.engine.describe()
    assert "override" in text and "dense_linear onednn" in text and "decode_attention bmm" in text
    assert all(getattr(m, "impl", "onednn") == "onednn" for m in llm.engine.model.modules())
    assert all(layer.decode_attention == "bmm" for layer in llm.engine.model.layers)
    with pytest.raises(ValueError, match="KEY=NAME"):
        LLM(folder, dtype="float32", kv_cache_memory="4MiB", progress=False, kernels="fastest")


@pytest.mark.parametrize("impl", ["plain", "onednn", "gemv"])
def test_dense_kernels_agree(impl):
    """Each dense kernel against float32 math on the same bf16 weight, at rows around the gemv
    limit, and switching back and forth keeps the weight."""
    from mixserve.layers.linear import DenseLinear

    w = torch.randn(72, 100).to(torch.bfloat16)
    b = torch.randn(72).to(torch.bfloat16)
    lin = DenseLinear(w.clone(), b)
    lin.set_impl(impl)
    for rows in (1, 3, 4, 5, 17):
        x = torch.randn(rows, 100).to(torch.bfloat16)
        ref = x.float() @ w.float().t() + b.float()
        torch.testing.assert_close(lin(x).float(), ref, atol=0.05, rtol=0.02)
    lin.set_impl("plain")
    assert torch.equal(lin.dense_weight(), w)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kv_heads,block", [(4, 2, 8), (6, 6, 16), (8, 1, 4)])
def test_paged_decode_equals_gathered_attention(dtype, tol, heads, kv_heads, block):
    """The paged kernel, reading K/V through scattered block tables, against float32 attention
    over the gathered context; rows of different lengths, including one token and a full last
    block."""
    from mixserve.layers.attention import _decode_sdpa
    from mixserve.layers.paged_decode import available, paged_decode

    if not available():
        pytest.skip("no C++ compiler")
    g = torch.Generator().manual_seed(heads * 10 + block)
    d, nb = 16, 64
    kc = torch.randn(nb, block, kv_heads, d, generator=g).to(dtype)
    vc = torch.randn(nb, block, kv_heads, d, generator=g).to(dtype)
    lens = torch.tensor([1, block, 3 * block + 1, 5 * block])
    m = 5
    tables = torch.randperm(nb, generator=g)[:len(lens) * m].view(len(lens), m)
    q = torch.randn(len(lens), heads, d, generator=g).to(dtype)
    out = paged_decode(q, kc, vc, tables, lens, d ** -0.5)
    bias = torch.zeros(len(lens), m * block).masked_fill_(torch.arange(m * block)[None] >= lens[:, None],
                                                          float("-inf"))
    ref = _decode_sdpa(q.float(), kc[tables].flatten(1, 2).float(), vc[tables].flatten(1, 2).float(),
                       bias[:, None, None, :], d ** -0.5)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
    with pytest.raises(RuntimeError, match="shapes"):
        paged_decode(q[..., :8], kc, vc, tables, lens, 1.0)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kv_heads,d", [(14, 2, 64), (12, 2, 128), (6, 2, 32), (10, 1, 16), (4, 2, 40),
                                               (3, 1, 56)])
def test_paged_rows_equal_causal_attention_at_every_heads_per_pass(dtype, tol, heads, kv_heads, d):
    """A prefill chunk through paged_rows, and decode rows through paged_decode, against float32
    causal attention over the gathered context. The head layouts take the V sums' every split: 4 + 3
    and 2 + 2 + 2 query heads a pass (the 0.5B's d 64, the 1.5B's d 128), 3 and 4 + 4 + 2 at d 32 and
    16, and the 8-lane loop's partial widths (d 40 and 56: 5 and 7 registers); the scores' head pairs
    with an odd head left over (7, 3 query heads a KV head)."""
    from mixserve.layers.paged_decode import available, paged_decode, paged_rows

    if not available():
        pytest.skip("no C++ compiler")
    g = torch.Generator().manual_seed(heads * 100 + d)
    bs, nb, L, past = 16, 24, 37, 20
    kc = torch.randn(nb, bs, kv_heads, d, generator=g).to(dtype)
    vc = torch.randn(nb, bs, kv_heads, d, generator=g).to(dtype)
    table = torch.randperm(nb, generator=g)[:4].view(1, -1)
    q = torch.randn(L, heads, d, generator=g).to(dtype)
    lens = torch.arange(past + 1, past + L + 1)  # the chunk's rows: positions past .. past + L - 1
    out = paged_rows(q, kc, vc, table, torch.zeros(L, dtype=torch.long), lens, d ** -0.5)
    k = kc[table[0]].flatten(0, 1)[: past + L].float().repeat_interleave(heads // kv_heads, 1)  # [T, H, d]
    v = vc[table[0]].flatten(0, 1)[: past + L].float().repeat_interleave(heads // kv_heads, 1)
    s = torch.einsum("qhd,khd->hqk", q.float(), k) * d ** -0.5
    s = s.masked_fill(torch.arange(past + L)[None, None, :] >= lens[None, :, None], float("-inf"))
    ref = torch.einsum("hqk,khd->qhd", s.softmax(-1), v)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
    rows = [0, 16, L - 1]
    dec = paged_decode(q[rows], kc, vc, table.expand(len(rows), -1).contiguous(), lens[rows], d ** -0.5)
    torch.testing.assert_close(dec.float(), ref[rows], atol=tol, rtol=tol)


def test_int4_vnni_kernel_against_float_math():
    """The int8-activation int4 kernel against float32 math on the same int4 weight (error from the
    int8 activations only, ~1%), its dequantization exact, and switching layouts back and forth
    keeps the weight; one layout resident at a time."""
    from mixserve.layers import int4_vnni
    from mixserve.layers.linear import Int4Linear

    if not int4_vnni.available():
        pytest.skip("no AVX512-VNNI here")
    g = torch.Generator().manual_seed(0)
    n, k, gs = 48, 512, 128
    q = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=g)
    sc = torch.rand(n, k // gs, generator=g) * 0.01 + 0.001
    z = torch.randint(0, 16, (n, k // gs), dtype=torch.int32, generator=g)
    lin = Int4Linear(q, sc, z, gs, torch.randn(n, generator=g), torch.float32)
    w = lin.dense_weight().clone()
    bytes_torch = lin.weight_bytes()
    lin.set_kernel("vnni")
    assert lin.kernel == "vnni" and lin.packed is None and lin.weight_bytes() <= 1.1 * bytes_torch
    torch.testing.assert_close(lin.dense_weight(), w, atol=1e-4, rtol=1e-3)  # fp16 scales
    for rows in (1, 3, 4, 5, 9):
        x = torch.randn(rows, k, generator=g)
        ref = x @ w.t() + lin.bias
        rel = ((lin(x) - ref).norm() / ref.norm()).item()
        assert rel < 0.02, (rows, rel)
    lin.set_kernel("torch")
    assert lin.vq is None and torch.equal(lin.dense_weight(), w)
    assert not int4_vnni.supported(96, 32) and int4_vnni.supported(256, 128)
    with pytest.raises(ValueError, match="unknown kernel"):
        lin.set_kernel("fast")


def test_primitive_caches_bounded_unless_the_user_set_them(monkeypatch):
    from mixserve.layers.kernel_choice import PRIMITIVE_CACHE_CAPACITY, bound_primitive_caches

    monkeypatch.delenv("LRU_CACHE_CAPACITY", raising=False)
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "300")
    bound_primitive_caches()
    import os

    assert os.environ["LRU_CACHE_CAPACITY"] == str(PRIMITIVE_CACHE_CAPACITY)
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "300"  # the user's value stands


def test_prior_timing_times_nothing_caches_nothing_and_uses_the_cache(tmp_path, monkeypatch):
    path, calls = tmp_path / "c.json", []
    c = KernelChooser(path, overrides={}, machine="m", timing="prior")
    assert c.choose("dense_linear/x", {"plain": stub(2.0, calls), "onednn": stub(1.0, calls)}, "plain") == "plain"
    assert calls == [] and c.choices["dense_linear/x"].source == "prior" and not path.exists()
    KernelChooser(path, overrides={}, machine="m", timing="measure").choose(
        "dense_linear/x", {"plain": stub(2.0, calls), "onednn": stub(1.0, calls)}, "plain")
    c = KernelChooser(path, overrides={}, machine="m", timing="prior")  # a measured choice on disk is used
    assert c.choose("dense_linear/x", {"plain": stub(2.0, calls), "onednn": stub(1.0, calls)}, "plain") == "onednn"
    assert c.choices["dense_linear/x"].source == "cache" and len(calls) == 2
    monkeypatch.setenv("MIXSERVE_KERNEL_TIMING", "sometimes")
    with pytest.raises(ValueError, match="measure or prior.*MIXSERVE_KERNEL_TIMING"):
        KernelChooser(path, overrides={}, machine="m")
    monkeypatch.setenv("MIXSERVE_KERNEL_TIMING", "prior")
    assert KernelChooser(path, overrides={}, machine="m").timing == "prior"


def test_a_second_process_timing_at_once_runs_the_prior_and_caches_nothing(tmp_path):
    import fcntl

    path, calls = tmp_path / "c.json", []
    with open(tmp_path / "c.json.lock", "a") as other:  # another process is timing
        fcntl.flock(other, fcntl.LOCK_EX)
        c = KernelChooser(path, overrides={}, machine="m", timing="measure")
        assert c.choose("k", {"a": stub(2.0, calls), "b": stub(1.0, calls)}, "a") == "a"
        assert calls == [] and c.choices["k"].source.startswith("prior") and not path.exists()
    c = KernelChooser(path, overrides={}, machine="m", timing="measure")  # the lock is free again
    assert c.choose("k", {"a": stub(2.0, calls), "b": stub(1.0, calls)}, "a") == "b" and len(calls) == 2


def test_a_start_times_kernels_within_its_budget_and_leaves_the_rest_uncached(tmp_path, caplog, monkeypatch):
    # issue 32: a first start on a new machine timed kernels for minutes; now it stops at its budget
    import time as _time

    from mixserve.layers.kernel_choice import KernelChooser

    path = tmp_path / "choices.json"

    def slow():
        _time.sleep(0.15)
        return 1.0
    cands = {"plain": slow, "onednn": lambda: 0.5}
    c = KernelChooser(path, overrides={}, machine="m", timing="measure", budget_s=0.2)
    assert c.choose("dense_linear/a", cands, "plain") == "onednn"  # 0.15 s of 0.2
    assert c.choose("dense_linear/b", cands, "plain") == "onednn"  # started within it: 0.3 s spent
    with caplog.at_level(logging.WARNING, "mixserve"):
        assert c.choose("dense_linear/c", cands, "plain") == "plain"
        assert c.choose("dense_linear/d", cands, "plain") == "plain"
    assert caplog.text.count("timing budget") == 1 and "mixserve prepare" in caplog.text
    assert c.choices["dense_linear/c"].source == "prior (timing budget spent)" and c.over_budget == ["dense_linear/c",
                                                                                                  "dense_linear/d"]
    # the decode graph's timing (a compile of unknown length) is outside the budget
    assert c.choose("decode_graph/x", {"eager": lambda: 2.0, "compiled": lambda: 1.0}, "eager") == "compiled"
    assert set(json.loads(path.read_text())["machines"]["m"]) == {"dense_linear/a", "dense_linear/b", "decode_graph/x"}
    # the next start times what this one left, and reads the rest
    c = KernelChooser(path, overrides={}, machine="m", timing="measure", budget_s=0.2)
    assert c.choose("dense_linear/a", cands, "plain") == "onednn" and c.choices["dense_linear/a"].source == "cache"
    assert c.choose("dense_linear/c", cands, "plain") == "onednn" and c.choices["dense_linear/c"].source == "measured"
    assert math.isinf(KernelChooser(path, machine="m", budget_s=math.inf).budget_s)
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="budget"):
            KernelChooser(path, machine="m", budget_s=bad)
    monkeypatch.setenv("MIXSERVE_KERNEL_BUDGET", "twenty")
    with pytest.raises(ValueError, match="MIXSERVE_KERNEL_BUDGET"):
        KernelChooser(path, machine="m")
    monkeypatch.setenv("MIXSERVE_KERNEL_BUDGET", "5")
    assert KernelChooser(path, machine="m").budget_s == 5.0


def test_a_forced_avx2_caps_both_gemm_libraries(tmp_path):
    """MIXSERVE_ISA=avx2 stands for an AVX2-only CPU in `--batch-invariant off`'s GEMMs too: float32
    F.linear is MKL's sgemm, which read ONEDNN_MAX_CPU_ISA not at all and ran AVX-512 (MKL_VERBOSE's
    first line names the instructions it dispatched to)."""
    import os
    import subprocess
    import sys

    code = ("import torch\nfrom mixserve.layers.kernel_choice import cap_isa\nassert cap_isa() == 'avx2'\n"
            "import os\nprint('ONEDNN', os.environ.get('ONEDNN_MAX_CPU_ISA'))\n"
            "print('MKL', os.environ.get('MKL_ENABLE_INSTRUCTIONS'))\n"
            "torch.nn.functional.linear(torch.randn(8, 64), torch.randn(64, 64))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA")}
    env.update(MIXSERVE_ISA="avx2", MKL_VERBOSE="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "ONEDNN AVX2" in out.stdout and "MKL AVX2" in out.stdout
    header = [ln for ln in out.stdout.splitlines() if ln.startswith("MKL_VERBOSE oneMKL")]
    # a torch built with MKL, on an Intel CPU: the line names the instructions MKL dispatched to ("...
    # (Intel(R) AVX2) enabled processors"). On an AMD CPU it names none ("Intel(R) Architecture
    # processors", MKL's path for other vendors, seen on a Zen 4 EPYC 2026-12-07): the cap above is then
    # what there is to check
    if header and "Intel(R) Architecture processors" not in header[0]:
        assert "AVX-512" not in header[0] and "AVX2" in header[0], header[0]
