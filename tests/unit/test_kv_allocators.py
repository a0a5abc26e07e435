"""Paged vs contiguous KV allocation on one engine: admission, fragmentation, waste accounting,
and `bench --compare-allocators`, on a tiny random model made in the test."""
import random
from types import SimpleNamespace

import pytest

from mixserve.bench.allocators import compare_allocators, format_comparison
from mixserve.data.datasets import BenchRequest
from mixserve.engine.args import EngineArgs
from mixserve.engine.llm_engine import LLMEngine
from mixserve.models.loader import load_model
from mixserve.kv.block_manager import BlockManager, NoFreeBlocksError
from mixserve.kv.contiguous import ContiguousBlockManager
from mixserve.kv.usage import KVUsage, kv_usage
from tests.unit.test_engine_tiny import VOCAB, make_tiny

# tiny model: 2 layers x (K, V) x 2 KV heads x head_dim 16 x 4 bytes (fp32) = 512 bytes a token,
# so 16 blocks of 4 tokens = 32768 bytes
BLOCK = 4
KV_16_BLOCKS = 16 * BLOCK * 512


def test_contiguous_region_is_first_fit_and_never_grows():
    bm = ContiguousBlockManager(8, BLOCK, "max-tokens", max_model_len=32)
    for sid, n in ((1, 8), (2, 5), (3, 8)):
        bm.reserve_for(sid, n)
    assert bm.append_slots(1, 0, 3) == [] and bm.block_table(1) == [0, 1]
    bm.append_slots(2, 0, 5)
    bm.append_slots(3, 0, 1)
    assert bm.block_table(2) == [2, 3] and bm.block_table(3) == [4, 5]
    assert bm.num_free_blocks == 2 and bm.peak_used == 6
    assert bm.can_append(1, 3, 8)  # inside the region: no new block
    with pytest.raises(RuntimeError, match="overrun its contiguous region"):
        bm.can_append(1, 8, 9)
    bm.free(2)
    bm.reserve_for(4, 12)  # 3 blocks: 4 are free (2, 3, 6, 7) but no 3 of them adjacent
    assert bm.num_free_blocks == 4 and not bm.can_append(4, 0, 12)
    with pytest.raises(NoFreeBlocksError):
        bm.append_slots(4, 0, 12)
    bm.free(3)
    assert bm.can_append(4, 0, 6)
    bm.append_slots(4, 0, 6)
    assert bm.block_table(4) == [2, 3, 4]  # the whole region at once, first fit
    assert bm.slots(4, 4, 6) == [12, 13]
    bm.truncate(4, 1)  # speculative rollback keeps the region
    assert bm.block_table(4) == [2, 3, 4]
    bm.free(1)
    bm.free(4)
    bm.free(99)
    assert bm.num_free_blocks == 8 and not bm.tables and not any(bm.ref_counts)


def test_contiguous_max_model_len_region_and_refusals():
    bm = ContiguousBlockManager(8, BLOCK, "max-model-len", max_model_len=17)
    bm.reserve_for(1, 3)  # ignored: every region is max_model_len
    bm.append_slots(1, 0, 3)
    assert bm.block_table(1) == [0, 1, 2, 3, 4]
    assert not bm.can_append(2, 0, 1)  # 3 free, a region is 5
    with pytest.raises(ValueError, match="kv_cache_memory: 32 tokens of cache cannot hold one max-model-len region"):
        ContiguousBlockManager(8, BLOCK, "max-model-len", max_model_len=33)
    with pytest.raises(ValueError, match="reserve: must be one of"):
        ContiguousBlockManager(8, BLOCK, "all", max_model_len=8)
    with pytest.raises(NotImplementedError):
        bm.fork(1, 2)


def test_kv_usage_hand_worked():
    seq = SimpleNamespace(num_computed_tokens=6)
    paged = BlockManager(16, BLOCK)
    paged.append_slots(0, 0, 6)  # 2 blocks = 8 slots, 6 written: the tail of the last block
    u = kv_usage(paged, [seq])
    assert (u.reserved_slots, u.written_slots, u.waste) == (8, 6, 0.25)
    cont = ContiguousBlockManager(16, BLOCK, "max-model-len", max_model_len=32)
    cont.append_slots(0, 0, 6)  # a region of 8 blocks = 32 slots
    assert kv_usage(cont, [seq]).waste == 26 / 32
    assert KVUsage(0, 0).waste == 0.0
    assert kv_usage(paged, [seq, seq, seq]).written_slots == 8  # capped at what is reserved


@pytest.fixture(scope="module")
def tiny_loaded(tmp_path_factory):
    folder, _ = make_tiny(tmp_path_factory.mktemp("alloc"), "qwen2", tie=False)
    import torch

    return folder, load_model(folder, torch.float32, 32, progress=False)


def _args(folder, **kw):
    return EngineArgs(model=folder, dtype="float32", block_size=BLOCK, kv_cache_memory=KV_16_BLOCKS,
                      max_model_len=32, progress=False, **kw)


def test_engine_refuses_bad_allocator_settings(tiny_loaded):
    folder, loaded = tiny_loaded
    with pytest.raises(ValueError, match="kv_allocator: must be paged or contiguous"):
        LLMEngine(_args(folder, kv_allocator="buddy"), loaded)
    with pytest.raises(ValueError, match="reserve: must be"):
        LLMEngine(_args(folder, kv_allocator="contiguous", reserve="max"), loaded)
    with pytest.raises(ValueError, match="kv_allocator: contiguous does not support a draft model"):
        LLMEngine(_args(folder, kv_allocator="contiguous", draft_model=folder), loaded)
    with pytest.raises(ValueError, match="kv_cache_memory: 64 tokens of cache cannot hold"):
        LLMEngine(EngineArgs(model=folder, dtype="float32", block_size=BLOCK, kv_cache_memory=KV_16_BLOCKS,
                             max_model_len=65, progress=False, kv_allocator="contiguous"), loaded)


def test_compare_allocators_hand_worked(tiny_loaded):
    """6 requests of 6 prompt + 6 output tokens (12 tokens = 3 blocks each; 11 are ever written),
    16 blocks of 4 tokens, max_model_len 32 (8 blocks):
    - paged admits all 6 at step 1 (2 blocks each = 12); at step 4 every sequence crosses into
      its third block, 4 are free, so the 5th preempts the 6th: peak 6, 1 preemption. Waste
      after step 1: 6 x 8 slots reserved, 6 x 6 written -> 25%.
    - contiguous, max-tokens: regions of 3 blocks, 5 fit (15 blocks): peak 5; waste after step 1:
      5 x 12 reserved, 5 x 6 written -> 50%.
    - contiguous, max-model-len: regions of 8 blocks, 2 fit: peak 2; waste 1 - 12/64 = 81.25%.
    """
    folder, loaded = tiny_loaded
    rng = random.Random(0)
    reqs = [BenchRequest([rng.randrange(VOCAB) for _ in range(6)], 6, 6, "t") for _ in range(6)]
    res = compare_allocators(_args(folder), reqs, loaded=loaded, progress=False)
    got = {(r["kv_allocator"], r["reserve"]): r for r in res["runs"]}
    assert list(got) == [("paged", None), ("contiguous", "max-model-len"), ("contiguous", "max-tokens")]
    paged, cmax, ctok = got[("paged", None)], got[("contiguous", "max-model-len")], got[("contiguous", "max-tokens")]
    assert (paged["peak_running_seqs"], ctok["peak_running_seqs"], cmax["peak_running_seqs"]) == (6, 5, 2)
    assert (paged["preemptions"], ctok["preemptions"], cmax["preemptions"]) == (1, 0, 0)
    assert paged["kv_waste_pct_at_peak"] == pytest.approx(25.0)
    assert ctok["kv_waste_pct_at_peak"] == pytest.approx(50.0)
    assert cmax["kv_waste_pct_at_peak"] == pytest.approx(81.25)
    for r in res["runs"]:
        assert 0 <= r["kv_waste_pct_time_avg"] <= 100
        assert r["same_outputs_as_paged"] == 6  # greedy: identical outputs whatever the allocator
        assert r["report"]["output_tokens"] == 36 and r["report"]["num_requests"] == 6
    assert res["num_blocks"] == 16
    text = format_comparison(res)
    assert "max-model-len" in text and "6/6" in text


@pytest.mark.parametrize("reserve", ["max-model-len", "max-tokens"])
def test_contiguous_engine_frees_everything_and_matches_paged(tiny_loaded, reserve):
    from mixserve import SamplingParams

    folder, loaded = tiny_loaded
    rng = random.Random(1)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(2, 14))] for _ in range(7)]
    budgets = [rng.randint(1, 16) for _ in prompts]
    outs = {}
    for alloc in ("paged", "contiguous"):
        eng = LLMEngine(_args(folder, kv_allocator=alloc, reserve=reserve), loaded)
        ids = [eng.add_request(p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
               for p, n in zip(prompts, budgets)]
        done = {}
        while eng.has_unfinished():
            for o in eng.step():
                if o.finished:
                    done[o.request_id] = o.token_ids
            if alloc == "contiguous":
                assert eng.scheduler.num_preemptions == 0
        bm = eng.block_manager
        assert bm.num_free_blocks == bm.num_blocks and not bm.tables and not any(bm.ref_counts)
        outs[alloc] = [done[i] for i in ids]
        eng.add_request(prompts[0], SamplingParams(max_tokens=2))  # an aborted waiting request frees too
        eng.abort("7")
        assert bm.num_free_blocks == bm.num_blocks
    assert outs["paged"] == outs["contiguous"]


@pytest.mark.parametrize("alloc", ["paged", "contiguous"])
def test_parallel_samples_under_kv_pressure_never_stall(tiny_loaded, alloc):
    """n = 2 per prompt (samples share the prompt's blocks when paged) in a cache of 16 blocks.
    Once: released samples waited, holding shared blocks, behind sequences preempted later; with
    nothing running the head never fit and the engine stepped forever without progress."""
    from mixserve import SamplingParams

    folder, loaded = tiny_loaded
    rng = random.Random(3)
    prompts = [([rng.randrange(VOCAB) for _ in range(rng.randint(2, 14))] * 2)[:20] for _ in range(5)]
    outs = {}
    for share in (True, False):
        eng = LLMEngine(_args(folder, kv_allocator=alloc), loaded)
        ids = []
        for i, p in enumerate(prompts):
            lead = None
            for _ in range(2):
                sp = SamplingParams(temperature=0, max_tokens=32 - len(p) - i % 3, ignore_eos=True)
                ids.append(eng.add_request(p, sp, share_prompt_with=lead if share else None))
                lead = lead or ids[-1]
        done = {}
        for _ in range(500):
            if not eng.has_unfinished():
                break
            for o in eng.step():
                if o.finished:
                    done[o.request_id] = o.token_ids
        assert not eng.has_unfinished(), "the engine stalled"
        bm = eng.block_manager
        assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)
        outs[share] = [done[i] for i in ids]
    assert outs[True] == outs[False]
