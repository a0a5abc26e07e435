"""Automatic prefix caching: the caching block manager (unit and hypothesis state machine) and
greedy equality of the engine with caching on against the float32 reference (HF transformers,
near-tie rule), the same reference caching off must match, in every case the issue lists."""
from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mixserve import SamplingParams
from mixserve.kv.block_manager import BlockManager, block_hash
from tests.reference import compare_greedy, hf_greedy
from tests.unit.test_engine_tiny import VOCAB, _drain, make_tiny

BS = 4


# -- block manager -------------------------------------------------------------------------------
def _compute(bm: BlockManager, sid: int, toks: list[int], salt=None) -> int:
    """Admit `toks` as the engine does: cached prefix, then compute the rest and commit."""
    cached = bm.find_cached(toks, salt)
    assert bm.can_admit(cached, len(toks))
    n = bm.acquire(sid, cached, salt, count_query=len(toks))
    bm.append_slots(sid, n, len(toks))
    bm.commit(sid, toks, len(toks))
    return n


def test_reuse_after_free_and_at_least_one_token_computed():
    bm = BlockManager(16, BS, enable_caching=True)
    a = list(range(10))
    assert _compute(bm, 0, a) == 0
    bm.free(0)
    assert bm.num_free_blocks == 16 and len(bm.evictable) == 2  # two full blocks kept
    assert _compute(bm, 1, a) == 8  # the partial third block is computed
    bm.free(1)
    full = list(range(12))  # three full blocks: the last one holds the last token
    assert _compute(bm, 2, full) == 8
    assert bm.prefix_queries == 32 and bm.prefix_hits == 16


def test_equal_blocks_under_different_parents_do_not_share():
    bm = BlockManager(16, BS, enable_caching=True)
    _compute(bm, 0, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert bm.find_cached([9, 9, 9, 9, 5, 6, 7, 8, 9]) == []  # block 2 equal, block 1 not
    assert len(bm.find_cached([1, 2, 3, 4, 9, 9, 9, 9, 9])) == 1
    assert block_hash(None, [5, 6, 7, 8]) != block_hash(block_hash(None, [1, 2, 3, 4]), [5, 6, 7, 8])


def test_salt_separates_and_caching_off_finds_nothing():
    bm = BlockManager(16, BS, enable_caching=True)
    toks = list(range(9))
    _compute(bm, 0, toks, salt="a")
    assert len(bm.find_cached(toks, "a")) == 2
    assert bm.find_cached(toks, "b") == [] and bm.find_cached(toks) == []
    off = BlockManager(16, BS)
    _compute(off, 0, toks)
    off.free(0)
    assert off.find_cached(toks) == [] and off.num_cached_blocks == 0 and len(off.free_blocks) == 16


def test_lru_eviction_never_takes_a_held_block():
    bm = BlockManager(5, BS, enable_caching=True)
    _compute(bm, 0, list(range(9)))  # 3 blocks, 2 cached
    _compute(bm, 1, [50 + i for i in range(5)])  # 2 blocks: 1 cached; the cache is full
    bm.free(1)
    held = set(bm.block_table(0))
    _compute(bm, 2, [90 + i for i in range(8)])  # needs 2: the free one, then evicts seq 1's
    assert not held & set(bm.block_table(2)) and bm.num_evictions == 1
    assert bm.find_cached([50 + i for i in range(5)]) == []
    assert len(bm.find_cached(list(range(9)))) == 2  # held blocks stay cached


def test_reset_only_when_idle():
    bm = BlockManager(8, BS, enable_caching=True)
    _compute(bm, 0, list(range(9)))
    assert not bm.reset_prefix_cache()
    bm.free(0)
    assert bm.reset_prefix_cache() and bm.num_cached_blocks == 0 and len(bm.free_blocks) == 8


class CachingMachine(RuleBasedStateMachine):
    """Random admit / append / fork / truncate / free against a shadow cache that stores, per
    slot, the whole prefix (salt, tokens up to that position) whose K/V it holds: a block handed
    to a sequence by the cache must hold exactly that sequence's prefix, so sharing across
    different parents, or a block reused while still visible, breaks the shadow check."""

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(12, BS, enable_caching=True)
        self.seqs: dict[int, tuple[list[int], str | None]] = {}  # written tokens, salt
        self.cache: dict[int, tuple] = {}
        self.next_id = 0

    def _write(self, sid, start, end, copies):
        for src, dst in copies:
            for o in range(BS):
                if src * BS + o in self.cache:
                    self.cache[dst * BS + o] = self.cache[src * BS + o]
        toks, salt = self.seqs[sid]
        for p, slot in zip(range(start, end), self.bm.slots(sid, start, end)):
            self.cache[slot] = (salt, tuple(toks[:p + 1]))

    @rule(base=st.sampled_from([None, 0, 1]), extra=st.lists(st.integers(0, 2), min_size=1, max_size=10),
          cut=st.integers(0, 12), salt=st.sampled_from([None, "k"]))
    def admit(self, base, extra, cut, salt):
        # prompts from a 3-token alphabet, often a prefix of a live one: hashes collide a lot
        live = sorted(self.seqs)
        stem = list(self.seqs[live[base % len(live)]][0][:cut]) if live and base is not None else []
        toks = stem + extra
        cached = self.bm.find_cached(toks, salt)
        if not self.bm.can_admit(cached, len(toks)):
            return
        sid = self.next_id
        self.next_id += 1
        self.seqs[sid] = (toks, salt)
        n = self.bm.acquire(sid, cached, salt)
        assert n < len(toks)
        for p, slot in zip(range(n), self.bm.slots(sid, 0, n) if n else []):
            assert self.cache.get(slot) == (salt, tuple(toks[:p + 1])), "a cached block holds another prefix"
        copies = self.bm.append_slots(sid, n, len(toks))
        self._write(sid, n, len(toks), copies)
        self.bm.commit(sid, toks, len(toks))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), k=st.integers(1, 6))
    def append(self, data, k):
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        toks, salt = self.seqs[sid]
        start = len(toks)
        if not self.bm.can_append(sid, start, start + k):
            return
        toks.extend(data.draw(st.lists(st.integers(0, 2), min_size=k, max_size=k)))
        copies = self.bm.append_slots(sid, start, start + k)
        self._write(sid, start, start + k, copies)
        self.bm.commit(sid, toks, len(toks))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def fork(self, data):
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        child = self.next_id
        self.next_id += 1
        self.bm.fork(sid, child)
        self.seqs[child] = (list(self.seqs[sid][0]), self.seqs[sid][1])

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), keep=st.integers(1, 12))
    def truncate(self, data, keep):
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        toks = self.seqs[sid][0]
        keep = min(keep, len(toks))
        self.bm.truncate(sid, keep)
        del toks[keep:]

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data):
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        self.bm.free(sid)
        del self.seqs[sid]

    @invariant()
    def accounting(self):
        bm = self.bm
        held = Counter(b for t in bm.tables.values() for b in t)
        free, idle = set(bm.free_blocks), set(bm.evictable)
        assert len(free) == len(bm.free_blocks) and not free & idle and not (free | idle) & set(held)
        assert len(free) + len(idle) + len(held) == bm.num_blocks == bm.num_free_blocks + bm.num_used_blocks
        for b in range(bm.num_blocks):
            assert bm.ref_counts[b] == held.get(b, 0)
        assert all(bm.hash_of[b] is not None for b in idle) and all(bm.hash_of[b] is None for b in free)
        assert {h: b for b, h in enumerate(bm.hash_of) if h is not None} == bm.cached

    @invariant()
    def visible_content(self):
        for sid, (toks, salt) in self.seqs.items():
            for p, slot in zip(range(len(toks)), self.bm.slots(sid, 0, len(toks))):
                assert self.cache.get(slot) == (salt, tuple(toks[:p + 1])), (sid, p)


TestCachingMachine = CachingMachine.TestCase
TestCachingMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                       suppress_health_check=[HealthCheck.too_slow])


# -- engine: caching on equals the reference -------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("pc"), "qwen2", tie=False)


def _rand(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


G = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def _engine(folder, caching=True, **kw):
    from mixserve.engine.args import EngineArgs
    from mixserve.engine.llm_engine import LLMEngine

    args = dict(model=folder, dtype="float32", kv_cache_memory="8MiB", block_size=BS, progress=False,
                enable_prefix_caching=caching)
    args.update(kw)
    return LLMEngine(EngineArgs(**args))


def _run(eng, reqs):
    """Add (id, prompt, params[, share]) requests, drain, return final outputs by id."""
    for r in reqs:
        eng.add_request(r[1], r[2] if len(r) > 2 else G, request_id=r[0],
                        share_prompt_with=r[3] if len(r) > 3 else None)
    return _drain(eng)


def _check(hf, prompt, out, n=10):
    ref, logits = hf_greedy(hf, prompt, n)
    c = compare_greedy(out.token_ids, ref, logits)
    assert c.ok, f"diverged at {c.position} (gap {c.gap})"


def test_hits_in_every_sharing_shape_equal_the_reference(tiny):
    folder, hf = tiny
    base = _rand(30, 1)
    cases = {  # prompt, cached tokens expected after `base` ran
        "same": (base, 28),
        "none": (_rand(25, 2), 0),
        "one": (base[:4] + _rand(13, 3), 4),
        "many": (base[:24] + _rand(9, 4), 24),
        "partial": (base[:26] + _rand(9, 5), 24),  # 6 full blocks + half of the 7th
        "full": (base[:28], 24),  # every block cached: the last one is computed for its logits
    }
    for caching in (True, False):
        eng = _engine(folder, caching)
        first = _run(eng, [("base", base)])["base"]
        _check(hf, base, first)
        outs = {}
        for name, (p, _) in cases.items():  # one at a time: each finds what the earlier ones left
            outs[name] = _run(eng, [(name, p)])[name]
        for name, (p, want) in cases.items():
            _check(hf, p, outs[name])
            assert outs[name].metrics["cached_tokens"] == (want if caching else 0), name
        if not caching:
            assert eng.block_manager.prefix_hits == 0 and eng.block_manager.num_cached_blocks == 0
        assert eng.block_manager.num_free_blocks == eng.num_blocks


def test_cached_tokens_per_request(tiny):
    from mixserve.llm import LLM

    folder, _ = tiny
    llm = LLM(folder, dtype="float32", kv_cache_memory="8MiB", block_size=BS, progress=False)
    base = _rand(30, 1)
    llm.generate([base], G)
    outs = llm.generate([base, base[:4] + _rand(13, 3), base[:26] + _rand(9, 5), _rand(25, 2)], G)
    assert [o.metrics["cached_tokens"] for o in outs] == [28, 4, 24, 0]
    assert llm.engine.block_manager.prefix_queries == 30 + 30 + 17 + 35 + 25


def test_continuation_reuses_generated_blocks(tiny):
    folder, hf = tiny
    for caching in (True, False):
        eng = _engine(folder, caching)
        p1 = _rand(13, 7)
        o1 = _run(eng, [("t1", p1, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))])["t1"]
        p2 = p1 + o1.token_ids + _rand(6, 8)  # the next turn: the model's own reply in the prompt
        o2 = _run(eng, [("t2", p2)])["t2"]
        _check(hf, p2, o2)
        # 13 + 16 = 29 tokens of which 28 have K/V (the last output token was never fed back)
        assert o2.metrics["cached_tokens"] == (28 if caching else 0)


def test_evicted_prefix_is_recomputed(tiny):
    from mixserve.models.config import ModelConfig

    folder, hf = tiny
    per_block = BS * ModelConfig.from_folder(folder).kv_bytes_per_token(4)
    eng = _engine(folder, kv_cache_memory=24 * per_block)
    p = _rand(30, 9)
    _run(eng, [("a", p)])
    for i in range(4):  # fill the cache with other prompts: p's blocks are evicted
        _run(eng, [(f"x{i}", _rand(60, 20 + i))])
    assert eng.block_manager.num_evictions > 0 and not eng.block_manager.find_cached(p)
    o = _run(eng, [("again", p)])["again"]
    assert o.metrics["cached_tokens"] == 0
    _check(hf, p, o)


def test_preemption_while_a_prefix_is_shared(tiny):
    from mixserve.models.config import ModelConfig

    folder, hf = tiny
    per_block = BS * ModelConfig.from_folder(folder).kv_bytes_per_token(4)
    eng = _engine(folder, kv_cache_memory=40 * per_block, max_num_batched_tokens=64)
    shared = _rand(40, 11)
    _run(eng, [("warm", shared, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))])
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ps = {f"r{i}": shared + _rand(5 + i, 30 + i) for i in range(5)}
    outs = _run(eng, [(r, p, long) for r, p in ps.items()])
    assert eng.scheduler.num_preemptions > 0
    assert all(o.metrics["cached_tokens"] == 40 for o in outs.values())
    assert eng.block_manager.recompute_hits > 0  # a preempted request found blocks again
    for r, p in ps.items():
        _check(hf, p, outs[r], 40)
    assert eng.block_manager.num_free_blocks == eng.num_blocks


def test_parallel_samples_through_the_cache(tiny):
    folder, hf = tiny
    p = _rand(23, 12)
    eng = _engine(folder)
    outs = _run(eng, [("a", p), ("b", p, G, "a"), ("c", p, G, "a")])
    for r in "abc":
        _check(hf, p, outs[r])
    assert [outs[r].metrics["cached_tokens"] for r in "abc"] == [0, 20, 20]


def test_speculative_decoding_with_a_draft_model(tiny):
    folder, hf = tiny
    eng = _engine(folder, draft_model=folder, num_speculative_tokens=3, speculation="fixed")
    base = _rand(26, 13)
    ps = {"a": base, "b": base[:20] + _rand(8, 14), "c": base}
    outs = {}
    for r, p in ps.items():
        outs.update(_run(eng, [(r, p, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))]))
    for r, p in ps.items():
        _check(hf, p, outs[r], 12)
    assert outs["b"].metrics["cached_tokens"] == 20 and outs["c"].metrics["cached_tokens"] == 24
    dbm = eng.proposer.bm
    assert dbm.enable_caching and dbm.num_cached_blocks > 0
    assert sum(o.metrics["spec_accepted"] for o in outs.values()) > 0
    assert dbm.num_free_blocks == dbm.num_blocks and eng.block_manager.num_free_blocks == eng.num_blocks


def test_prompt_logprobs_and_abort_compose(tiny):
    folder, _ = tiny
    eng = _engine(folder)
    p = _rand(30, 15)
    _run(eng, [("a", p)])
    scored = _run(eng, [("s", p, SamplingParams(max_tokens=0, prompt_logprobs=1))])["s"]
    assert scored.metrics["cached_tokens"] == 0 and len(scored.prompt_logprobs) == 29  # scoring computes it all
    eng.add_request(p, G, request_id="x")
    eng.step()
    assert eng.abort("x")
    assert eng.block_manager.num_free_blocks == eng.num_blocks and eng.block_manager.find_cached(p)


def test_contiguous_allocator_never_caches(tiny):
    folder, _ = tiny
    eng = _engine(folder, kv_allocator="contiguous", reserve="max-tokens")
    p = _rand(30, 16)
    outs = _run(eng, [("a", p)])
    outs.update(_run(eng, [("b", p)]))
    assert outs["b"].metrics["cached_tokens"] == 0 and "prefix caching off" in eng.describe()


@pytest.mark.parametrize("draft", ["model", "ngram"])
def test_parallel_sample_released_when_the_prefill_ends_on_a_verified_row(tiny, draft):
    """A leader's prefill whose last chunk is one token runs as a speculative (decode) row: its
    followers must be released then, not stranded (found by the break-it round)."""
    folder, hf = tiny
    eng = _engine(folder, max_num_batched_tokens=4, draft_model=folder if draft == "model" else "ngram",
                  speculation="fixed", num_speculative_tokens=2)
    p = _rand(5, 17)  # a chunk of 4, then 1 token
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = _run(eng, [("lead", p, sp), ("f", p, sp, "lead")])
    assert set(outs) == {"lead", "f"} and outs["f"].token_ids == outs["lead"].token_ids
    _check(hf, p, outs["f"], 6)
    assert not eng.has_unfinished() and eng.num_waiting == 0


def test_a_block_cut_back_while_shared_is_unregistered_when_written_in_place():
    """The CI run of 2026-12-07 (hypothesis, CachingMachine): a sequence cut back (`truncate`) into a
    block it shared kept that block's registration (the write would copy it); its sharers then went,
    so the next append wrote in place, and a later prompt was handed a block naming [0]*7 + [1] that
    held [0]*8. `append_slots` now drops the registration of a block it writes in place."""

    class Draws:
        def __init__(self, *v):
            self.v = list(v)

        def draw(self, _):
            return self.v.pop(0)

    m = CachingMachine()
    steps = [lambda: m.admit(base=None, cut=0, extra=[0, 0, 0, 0, 0, 0, 0, 1], salt="k"),
             *[lambda: m.fork(Draws(0))] * 3, lambda: m.free(Draws(0)), lambda: m.free(Draws(1)),
             lambda: m.append(Draws(2, [0]), k=1), lambda: m.admit(base=None, cut=0, extra=[0], salt=None),
             lambda: m.truncate(Draws(3), keep=7), *[lambda: m.append(Draws(2, [0]), k=1)] * 3,
             lambda: m.free(Draws(2)), lambda: m.free(Draws(4)), lambda: m.append(Draws(3, [0]), k=1),
             lambda: m.admit(base=0, cut=7, extra=[1, 0], salt="k")]
    for step in steps:
        step()
        m.accounting()
        m.visible_content()
    assert sorted(m.seqs) == [3, 5]  # the last prompt was admitted, checked against its prefix
