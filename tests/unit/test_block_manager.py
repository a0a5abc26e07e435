"""Tests for mixserve.kv.block_manager: plain unit tests plus a hypothesis state machine that
drives random create / append / fork / truncate / free sequences against a shadow model.

Model used by the state machine
-------------------------------
Every live sequence has a list of *token ids*: the tokens it has written, positions 0..n-1.
Each written token gets a globally unique id, so two sequences hold the same id at a position
only if that value was written once and then inherited through `fork`.  Next to the manager we
keep a shadow of the physical cache (slot -> token id) and update it exactly as the model runner
would: first apply the copy-on-write (src, dst) block copies returned by `append_slots`, then
write the new tokens into `slots(...)`.

Slot-exclusivity invariant (the precise form of "never double-assign a slot")
----------------------------------------------------------------------------
For every live sequence s and every written position p < len(s):

    cache[slot_s(p)] == tokens_s[p]                                                       (I1)

i.e. no write made by any sequence (or any block hand-out after a free/truncate) has clobbered
a token another live sequence can still see.  Structurally this means: if two distinct live
sequences a, b map written positions p (of a) and q (of b) to the same slot, then p == q, the
slot lies in a physical block at the same logical index in both tables whose reference count
counts both of them, and tokens_a[p] == tokens_b[p] is the *same write* -- it was written before
a fork common to both and neither of them has written that block since (a write after the fork
must have gone to a private copy).  Sharing is allowed only for such inherited positions; the
stale tail of a shared partially-filled block (positions >= len) is not "visible" and is allowed
to differ.  In addition, right after `append_slots(s, start, end)` every block covering
[start, end) is held by s alone (ref count 1), which is what makes the write safe.

Accounting invariant ("never leak a block")
-------------------------------------------
Every physical block is either on the free list exactly once with ref count 0, or held by at
least one table with ref count == number of tables holding it (never both); a table never holds
the same block twice and holds exactly blocks_for(len) blocks.
"""
from __future__ import annotations

import copy
from collections import Counter

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from mixserve.kv.block_manager import BlockManager, NoFreeBlocksError


def snapshot(bm: BlockManager):
    return (
        list(bm.ref_counts),
        copy.deepcopy(bm.tables),
        list(bm.free_blocks),
        bm.peak_used,
    )


def holders(bm: BlockManager) -> Counter:
    return Counter(b for table in bm.tables.values() for b in table)


# --- plain unit tests -------------------------------------------------------------------------

def test_slot_formula_sequential():
    bm = BlockManager(num_blocks=4, block_size=4)
    assert bm.append_slots(0, 0, 6) == []
    assert bm.block_table(0) == [0, 1]
    assert bm.slots(0, 0, 6) == [0, 1, 2, 3, 4, 5]
    bm.append_slots(1, 0, 3)
    assert bm.block_table(1) == [2]
    assert bm.slots(1, 0, 3) == [8, 9, 10]
    bm.append_slots(0, 6, 9)
    assert bm.block_table(0) == [0, 1, 3]
    assert bm.slots(0, 6, 9) == [6, 7, 12]
    assert bm.slots(0, 2, 5) == [2, 3, 4]


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_slot_formula_shuffled(block_size):
    bm = BlockManager(num_blocks=10, block_size=block_size, shuffle_seed=7)
    n = 10 * block_size - 1
    bm.append_slots(5, 0, n)
    table = bm.block_table(5)
    expected = [table[p // block_size] * block_size + p % block_size for p in range(n)]
    assert bm.slots(5, 0, n) == expected
    assert len(set(expected)) == n
    assert all(0 <= s < 10 * block_size for s in expected)


def test_shuffle_seed_order_is_permutation_not_sequential():
    n = 64
    plain = BlockManager(n, 1)
    plain.append_slots(0, 0, n)
    assert plain.block_table(0) == list(range(n))

    a = BlockManager(n, 1, shuffle_seed=1234)
    a.append_slots(0, 0, n)
    order = a.block_table(0)
    assert order != list(range(n))
    assert sorted(order) == list(range(n))
    assert a.num_free_blocks == 0

    b = BlockManager(n, 1, shuffle_seed=1234)  # same seed -> same order (reproducible)
    b.append_slots(0, 0, n)
    assert b.block_table(0) == order

    # One block at a time also gives a non-sequential permutation.
    c = BlockManager(n, 1, shuffle_seed=99)
    for i in range(n):
        c.append_slots(i, 0, 1)
    one_by_one = [c.block_table(i)[0] for i in range(n)]
    assert one_by_one != list(range(n))
    assert sorted(one_by_one) == list(range(n))

    # Blocks returned to the free list are handed out in random order too, not FIFO.
    for i in range(n):
        c.free(i)
    fifo = list(c.free_blocks)
    assert sorted(fifo) == list(range(n))
    c.append_slots(0, 0, n)
    again = c.block_table(0)
    assert sorted(again) == list(range(n))
    assert again != fifo


def test_fork_then_append_returns_copy_pair():
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.append_slots(0, 0, 6)  # blocks [0, 1], block 1 partially filled (2/4)
    bm.fork(0, 1)
    assert bm.block_table(1) == [0, 1]
    assert bm.ref_counts == [2, 2, 0, 0]
    assert bm.num_free_blocks == 2

    copies = bm.append_slots(1, 6, 7)  # child writes into the shared partial block
    assert copies == [(1, 2)]
    assert bm.block_table(1) == [0, 2]
    assert bm.block_table(0) == [0, 1]
    assert bm.ref_counts == [2, 1, 1, 0]
    assert bm.slots(1, 0, 7) == [0, 1, 2, 3, 8, 9, 10]

    # The parent is now the sole owner of block 1: no copy when it writes.
    assert bm.append_slots(0, 6, 7) == []
    assert bm.block_table(0) == [0, 1]

    bm.free(0)
    bm.free(1)
    assert bm.num_free_blocks == 4
    assert bm.ref_counts == [0, 0, 0, 0]


def test_fork_at_block_boundary_needs_no_copy():
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.append_slots(0, 0, 4)
    bm.fork(0, 1)
    assert bm.append_slots(1, 4, 5) == []  # block 0 is full and not written again
    assert bm.block_table(1)[0] == bm.block_table(0)[0]
    assert bm.ref_counts[bm.block_table(0)[0]] == 2


def test_fork_multiple_children_copies_once_each():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.append_slots(0, 0, 5)
    for child in (1, 2, 3):
        bm.fork(0, child)
    last = bm.block_table(0)[1]
    assert bm.ref_counts[last] == 4
    seen = set()
    for child in (1, 2, 3):
        copies = bm.append_slots(child, 5, 6)
        assert len(copies) == 1 and copies[0][0] == last
        seen.add(copies[0][1])
    assert len(seen) == 3 and last not in seen
    assert bm.ref_counts[last] == 1
    assert bm.append_slots(0, 5, 6) == []


def test_fork_into_existing_sequence_raises():
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.append_slots(0, 0, 3)
    bm.append_slots(1, 0, 1)
    before = snapshot(bm)
    with pytest.raises(ValueError):
        bm.fork(0, 1)
    assert snapshot(bm) == before


def test_can_append_agrees_with_append_slots():
    bm = BlockManager(num_blocks=3, block_size=4)
    bm.append_slots(0, 0, 6)  # 2 blocks, last one partially filled
    bm.fork(0, 1)
    assert bm.can_append(1, 6, 8)  # CoW needs exactly 1, 1 free
    assert bm.num_blocks_needed(1, 6, 8) == 1
    assert not bm.can_append(1, 6, 9)  # CoW 1 + grow 1 = 2 > 1 free
    assert bm.num_blocks_needed(1, 6, 9) == 2
    before = snapshot(bm)
    with pytest.raises(NoFreeBlocksError):
        bm.append_slots(1, 6, 9)
    assert snapshot(bm) == before

    bm.append_slots(2, 0, 1)  # take the last free block
    assert bm.num_free_blocks == 0
    for sid in (0, 1):  # both sharers would need a copy
        assert not bm.can_append(sid, 6, 7)
        with pytest.raises(NoFreeBlocksError):
            bm.append_slots(sid, 6, 7)
    assert bm.can_append(2, 1, 4)  # fits in its own block
    assert bm.append_slots(2, 1, 4) == []
    assert not bm.can_append(2, 4, 5)
    with pytest.raises(NoFreeBlocksError):
        bm.append_slots(2, 4, 5)
    assert not bm.can_append(99, 0, 1)  # new sequence, nothing free
    with pytest.raises(NoFreeBlocksError):
        bm.append_slots(99, 0, 1)
    assert 99 not in bm.tables

    bm.free(2)
    assert bm.can_append(1, 6, 7)
    assert len(bm.append_slots(1, 6, 7)) == 1


def test_peak_used():
    bm = BlockManager(num_blocks=8, block_size=2)
    assert bm.peak_used == 0
    bm.append_slots(0, 0, 6)  # 3 blocks
    assert bm.peak_used == 3
    bm.append_slots(1, 0, 4)  # 5 blocks
    assert bm.peak_used == 5
    bm.free(0)
    assert bm.num_used_blocks == 2
    assert bm.peak_used == 5
    bm.append_slots(2, 0, 2)
    assert bm.num_used_blocks == 3 and bm.peak_used == 5
    bm.fork(1, 3)  # sharing allocates nothing
    assert bm.num_used_blocks == 3
    bm.append_slots(3, 3, 4)  # CoW of the (full) last block counts
    assert bm.num_used_blocks == 4
    bm.append_slots(3, 4, 10)  # +3 -> 7
    assert bm.num_used_blocks == 7 and bm.peak_used == 7
    bm.truncate(3, 0)
    assert bm.peak_used == 7
    with pytest.raises(NoFreeBlocksError):
        bm.append_slots(4, 0, 100)
    assert bm.peak_used == 7


def test_truncate_and_free_release_blocks():
    bm = BlockManager(num_blocks=6, block_size=2)
    bm.append_slots(0, 0, 9)  # 5 blocks
    table = list(bm.block_table(0))
    bm.truncate(0, 3)  # keep 2 blocks
    assert bm.block_table(0) == table[:2]
    assert bm.num_free_blocks == 4
    assert all(bm.ref_counts[b] == 0 for b in table[2:])
    bm.truncate(0, 3)  # idempotent
    assert bm.num_free_blocks == 4
    bm.fork(0, 1)
    bm.truncate(1, 0)  # releases the child's references only
    assert bm.block_table(1) == []
    assert [bm.ref_counts[b] for b in table[:2]] == [1, 1]
    assert bm.num_free_blocks == 4
    bm.free(0)
    bm.free(1)
    bm.free(12345)  # unknown: no-op
    assert bm.num_free_blocks == 6
    assert sorted(bm.free_blocks) == list(range(6))


# --- stateful property test -------------------------------------------------------------------

class BlockManagerMachine(RuleBasedStateMachine):
    """Random operations against a shadow model; see the module docstring for the invariants."""

    @initialize(
        num_blocks=st.integers(1, 16),
        block_size=st.integers(1, 4),
        seed=st.none() | st.integers(0, 2**16),
    )
    def setup(self, num_blocks, block_size, seed):
        self.bm = BlockManager(num_blocks, block_size, shuffle_seed=seed)
        self.tokens: dict[int, list[int]] = {}  # live seq -> written token ids
        self.cache: dict[int, int] = {}  # shadow physical cache: slot -> token id
        self.next_token = 0
        self.next_seq = 0
        self.model_peak = 0

    # -- helpers ---------------------------------------------------------------------------------
    def _new_seq_id(self) -> int:
        sid = self.next_seq
        self.next_seq += 1
        return sid

    def _others_hold(self, sid: int, block: int) -> bool:
        return any(block in t for s, t in self.bm.tables.items() if s != sid)

    def _append(self, sid: int, k: int) -> None:
        bm, bs = self.bm, self.bm.block_size
        old_tokens = self.tokens.get(sid, [])
        start, end = len(old_tokens), len(old_tokens) + k
        old_table = list(bm.block_table(sid))
        n_blocks = bm.blocks_for(end)
        # Expected work, computed from the tables (not from ref counts): grow the table, and copy
        # every block in the written range that some other live sequence also holds.
        cow_idx = [i for i in range(start // bs, min(len(old_table), n_blocks))
                   if self._others_hold(sid, old_table[i])]
        need = max(0, n_blocks - len(old_table)) + len(cow_idx)
        free_before = bm.num_free_blocks
        assert bm.num_blocks_needed(sid, start, end) == need
        can = bm.can_append(sid, start, end)
        assert can == (need <= free_before)
        before = snapshot(bm)
        try:
            copies = bm.append_slots(sid, start, end)
        except NoFreeBlocksError:
            event("append: NoFreeBlocksError")
            assert not can
            assert snapshot(bm) == before, "NoFreeBlocksError must leave the state unchanged"
            return
        assert can
        assert free_before - bm.num_free_blocks == need
        table = bm.block_table(sid)
        assert len(table) == n_blocks
        assert sorted(copies) == sorted((old_table[i], table[i]) for i in cow_idx)
        if copies:
            event("append: copy-on-write")
        for i in range(len(old_table)):
            if i not in cow_idx:
                assert table[i] == old_table[i]
        for src, dst in copies:
            assert src != dst
            assert bm.ref_counts[src] >= 1  # still held by the other sharer(s)
        # Every block covering the written range is now exclusively this sequence's.
        for i in range(start // bs, n_blocks):
            assert bm.ref_counts[table[i]] == 1
            assert not self._others_hold(sid, table[i])
        # Apply the copies like the model runner would, then write the new tokens.
        for src, dst in copies:
            for o in range(bs):
                if src * bs + o in self.cache:
                    self.cache[dst * bs + o] = self.cache[src * bs + o]
                else:
                    self.cache.pop(dst * bs + o, None)
        new = list(range(self.next_token, self.next_token + k))
        self.next_token += k
        for slot, tok in zip(bm.slots(sid, start, end), new):
            self.cache[slot] = tok
        self.tokens[sid] = old_tokens + new
        self.model_peak = max(self.model_peak, bm.num_used_blocks)

    def _draw_live(self, data) -> int:
        return data.draw(st.sampled_from(sorted(self.tokens)), label="seq")

    # -- rules -----------------------------------------------------------------------------------
    @rule(k=st.integers(0, 10))
    def create(self, k):
        self._append(self._new_seq_id(), k)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), k=st.integers(1, 9))
    def append(self, data, k):
        self._append(self._draw_live(data), k)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data):
        parent = self._draw_live(data)
        child = self._new_seq_id()
        free_before = self.bm.num_free_blocks
        self.bm.fork(parent, child)
        assert self.bm.block_table(child) == self.bm.block_table(parent)
        assert self.bm.num_free_blocks == free_before
        self.tokens[child] = list(self.tokens[parent])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), k=st.integers(1, 5), child_writes=st.booleans())
    def fork_then_append(self, data, k, child_writes):
        """Fork, then let the child (or the parent) write: the usual n > 1 sampling pattern,
        which must copy a shared partially-filled last block before writing into it."""
        parent = self._draw_live(data)
        child = self._new_seq_id()
        self.bm.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])
        self._append(child if child_writes else parent, k)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork_into_live_raises(self, data):
        # Every live sequence has a table entry (possibly empty), so forking into it must fail.
        parent, child = self._draw_live(data), self._draw_live(data)
        before = snapshot(self.bm)
        with pytest.raises(ValueError):
            self.bm.fork(parent, child)
        assert snapshot(self.bm) == before

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def truncate(self, data):
        sid = self._draw_live(data)
        n = len(self.tokens[sid])
        m = data.draw(st.integers(0, n), label="keep_tokens")
        old_table = list(self.bm.block_table(sid))
        keep = self.bm.blocks_for(m)
        dropped_private = [b for b in old_table[keep:] if not self._others_hold(sid, b)]
        free_before = self.bm.num_free_blocks
        self.bm.truncate(sid, m)
        assert self.bm.block_table(sid) == old_table[:keep]
        assert self.bm.num_free_blocks == free_before + len(dropped_private)
        for b in dropped_private:
            assert self.bm.ref_counts[b] == 0 and b in self.bm.free_blocks
        self.tokens[sid] = self.tokens[sid][:m]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        sid = self._draw_live(data)
        table = list(self.bm.block_table(sid))
        private = [b for b in table if not self._others_hold(sid, b)]
        free_before = self.bm.num_free_blocks
        self.bm.free(sid)
        assert sid not in self.bm.tables
        assert self.bm.num_free_blocks == free_before + len(private)
        del self.tokens[sid]

    @rule()
    def free_unknown_is_noop(self):
        before = snapshot(self.bm)
        self.bm.free(10**9)
        self.bm.truncate(10**9, 0)
        assert snapshot(self.bm) == before

    @rule()
    def free_all(self):
        self._free_everything()
        self.tokens.clear()

    def _free_everything(self):
        bm = self.bm
        for sid in list(self.tokens):
            bm.free(sid)
        assert bm.tables == {}
        assert bm.num_free_blocks == bm.num_blocks
        assert bm.num_used_blocks == 0
        assert sorted(bm.free_blocks) == list(range(bm.num_blocks))
        assert all(rc == 0 for rc in bm.ref_counts)

    # -- invariants ------------------------------------------------------------------------------
    @invariant()
    def accounting(self):
        bm = self.bm
        assert set(bm.tables) == set(self.tokens)
        held = holders(bm)
        free = list(bm.free_blocks)
        assert len(free) == len(set(free)), "block on the free list twice"
        assert bm.num_free_blocks == len(free)
        assert bm.num_used_blocks == bm.num_blocks - len(free)
        for b in range(bm.num_blocks):
            if b in held:
                assert b not in free, f"block {b} is both free and held"
                assert bm.ref_counts[b] == held[b], f"block {b}: ref {bm.ref_counts[b]} != {held[b]} holders"
            else:
                assert b in free, f"block {b} leaked"
                assert bm.ref_counts[b] == 0
        for sid, table in bm.tables.items():
            assert len(table) == len(set(table))
            assert len(table) == bm.blocks_for(len(self.tokens[sid]))
        assert bm.peak_used == self.model_peak
        assert bm.peak_used >= bm.num_used_blocks

    @invariant()
    def slots_exclusive(self):
        bm, bs = self.bm, self.bm.block_size
        owners: dict[int, tuple[int, int, int]] = {}  # slot -> (seq, pos, token)
        for sid, toks in self.tokens.items():
            if not toks:
                continue
            slots = bm.slots(sid, 0, len(toks))
            assert len(set(slots)) == len(slots)
            for p, (slot, tok) in enumerate(zip(slots, toks)):
                # (I1): the value a live sequence wrote/inherited is still in its slot.
                assert self.cache.get(slot) == tok, f"seq {sid} pos {p}: slot {slot} clobbered"
                if slot in owners:
                    osid, op, otok = owners[slot]
                    # Sharing only at the same position, of the same (inherited) write,
                    # through a block whose ref count covers both sharers.
                    assert op == p and otok == tok, (sid, p, osid, op)
                    assert bm.tables[sid][p // bs] == bm.tables[osid][p // bs]
                    assert bm.ref_counts[slot // bs] >= 2
                else:
                    owners[slot] = (sid, p, tok)

    def teardown(self):
        if hasattr(self, "bm"):
            self._free_everything()


BlockManagerMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestBlockManagerStateful = BlockManagerMachine.TestCase
