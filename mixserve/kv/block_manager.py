"""Paged KV-cache block manager (Kwon et al., SOSP 2023, §4.2–4.4).

The cache is `num_blocks` physical blocks of `block_size` token slots. Each sequence owns a block
table (logical block i -> physical block); blocks are handed out on demand as the sequence grows
and returned at once when it finishes, is aborted or is preempted. Reference counts let forked
sequences (parallel samples, n > 1) share blocks; writing into a shared block copies it first
(copy-on-write, §4.4) and the copy is reported so the model runner can move the K/V.
Slot of token position p: block_table[p // block_size] * block_size + p % block_size.
"""
from __future__ import annotations

import random
from collections import deque


class NoFreeBlocksError(RuntimeError):
    """Raised by `append_slots` when the free list cannot cover the request."""


class BlockManager:
    """Free list, reference counts and per-sequence block tables.

    Args:
        num_blocks: physical blocks in the cache.
        block_size: tokens per block.
        shuffle_seed: if given, free blocks are handed out in a random order (tests use this to
            prove that nothing depends on blocks being contiguous).
    """

    def __init__(self, num_blocks: int, block_size: int, shuffle_seed: int | None = None):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.tables: dict[int, list[int]] = {}
        order = list(range(num_blocks))
        self._rng = random.Random(shuffle_seed) if shuffle_seed is not None else None
        if self._rng:
            self._rng.shuffle(order)
        self.free_blocks: deque[int] = deque(order)
        self.peak_used = 0

    # -- queries ---------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    def block_table(self, seq_id: int) -> list[int]:
        return self.tables.get(seq_id, [])

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold num_tokens tokens."""
        return -(-num_tokens // self.block_size)

    def num_blocks_needed(self, seq_id: int, start: int, end: int) -> int:
        """New physical blocks that writing token positions [start, end) would take: blocks to
        extend the table to `end` tokens plus copies of shared blocks in the written range."""
        table = self.tables.get(seq_id, [])
        bs = self.block_size
        grow = max(0, self.blocks_for(end) - len(table))
        first, last = start // bs, min(len(table), self.blocks_for(end))
        cow = sum(1 for i in range(first, last) if self.ref_counts[table[i]] > 1)
        return grow + cow

    def can_append(self, seq_id: int, start: int, end: int) -> bool:
        return self.num_blocks_needed(seq_id, start, end) <= len(self.free_blocks)

    # -- mutations -------------------------------------------------------------------------------
    def reserve_for(self, seq_id: int, max_seq_len: int) -> None:
        """Declare that a queued sequence will hold at most `max_seq_len` tokens (prompt +
        max_tokens). Paged allocation ignores it: blocks are taken as the sequence grows (§4.2).
        The contiguous baseline (kv/contiguous.py) sizes its region from it."""

    def _take(self) -> int:
        if self._rng is not None:
            i = self._rng.randrange(len(self.free_blocks))
            self.free_blocks.rotate(-i)
        b = self.free_blocks.popleft()
        assert self.ref_counts[b] == 0
        self.ref_counts[b] = 1
        return b

    def append_slots(self, seq_id: int, start: int, end: int) -> list[tuple[int, int]]:
        """Make positions [start, end) of a sequence writable and return the copy-on-write copies
        needed, as (src_block, dst_block) pairs. Creates the table on first use.

        Raises:
            NoFreeBlocksError: not enough free blocks (nothing is changed then).
        """
        need = self.num_blocks_needed(seq_id, start, end)
        if need > len(self.free_blocks):
            raise NoFreeBlocksError(f"need {need} blocks, {len(self.free_blocks)} free")
        table = self.tables.setdefault(seq_id, [])
        copies = []
        bs = self.block_size
        for i in range(start // bs, min(len(table), self.blocks_for(end))):
            b = table[i]
            if self.ref_counts[b] > 1:
                nb = self._take()
                self.ref_counts[b] -= 1
                table[i] = nb
                copies.append((b, nb))
        while len(table) < self.blocks_for(end):
            table.append(self._take())
        self.peak_used = max(self.peak_used, self.num_used_blocks)
        return copies

    def slots(self, seq_id: int, start: int, end: int) -> list[int]:
        """Cache slots of token positions [start, end) (the slot mapping of those tokens)."""
        table = self.tables[seq_id]
        bs = self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def fork(self, parent_id: int, child_id: int) -> None:
        """Let `child_id` share every block of `parent_id` (reference counts + 1)."""
        if child_id in self.tables:
            raise ValueError(f"sequence {child_id} already has blocks")
        table = list(self.tables.get(parent_id, []))
        for b in table:
            self.ref_counts[b] += 1
        self.tables[child_id] = table

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Release the blocks past the first `num_tokens` tokens (speculative rollback)."""
        table = self.tables.get(seq_id)
        if not table:
            return
        keep = self.blocks_for(num_tokens)
        for b in table[keep:]:
            self._release(b)
        del table[keep:]

    def free(self, seq_id: int) -> None:
        """Return a sequence's blocks (those no other sequence shares) to the free list.
        Freeing an unknown sequence is a no-op."""
        for b in self.tables.pop(seq_id, []):
            self._release(b)

    def _release(self, b: int) -> None:
        self.ref_counts[b] -= 1
        assert self.ref_counts[b] >= 0
        if self.ref_counts[b] == 0:
            self.free_blocks.append(b)
