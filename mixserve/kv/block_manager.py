"""Paged KV-cache block manager (Kwon et al., SOSP 2023, §4.2–4.4).

The cache is `num_blocks` physical blocks of `block_size` token slots. Each sequence owns a block
table (logical block i -> physical block); blocks are handed out on demand as the sequence grows
and returned at once when it finishes, is aborted or is preempted. Reference counts let forked
sequences (parallel samples, n > 1) share blocks; writing into a shared block copies it first
(copy-on-write, §4.4) and the copy is reported so the model runner can move the K/V.
Slot of token position p: block_table[p // block_size] * block_size + p % block_size.

Automatic prefix caching (§4.4's sharing across requests, as vLLM's APC): a full block, once its
K/V is written (`commit`), is registered under a hash chained over its parent block's hash, its
token ids and the request's cache salt, so equal hashes mean equal prefixes. A new (or preempted)
sequence takes the longest run of registered blocks of its tokens (`find_cached` / `acquire`).
A freed block that carries a hash is not wiped: it waits, least recently used first, in
`evictable` and is reused by content until its memory is needed, when `_take` evicts it.
Blocks still held by a sequence are never evicted.
"""
from __future__ import annotations

import hashlib
import random
from array import array
from collections import OrderedDict, deque

_ROOT = b"mixserve-prefix-v1"


def block_hash(parent: bytes | None, token_ids, salt: str | None = None) -> bytes:
    """SHA-256 (FIPS 180-4) of one full block: the parent block's hash (None for the first
    block, whose hash covers `salt` instead), then the block's token ids as little-endian int64.
    Chaining makes a block's hash name its whole prefix; the salt separates tenants (a request's
    `cache_salt`), so equal prompts under different salts never share blocks."""
    h = hashlib.sha256()
    if parent is None:
        h.update(_ROOT)
        h.update((salt or "").encode("utf-8", "surrogatepass"))
        h.update(b"\0")
    else:
        h.update(parent)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


class NoFreeBlocksError(RuntimeError):
    """Raised by `append_slots` when the free list cannot cover the request."""


class BlockManager:
    """Free list, reference counts and per-sequence block tables.

    Args:
        num_blocks: physical blocks in the cache.
        block_size: tokens per block.
        shuffle_seed: if given, free blocks are handed out in a random order (tests use this to
            prove that nothing depends on blocks being contiguous).
        enable_caching: automatic prefix caching (module docstring); off, `find_cached` finds
            nothing and `commit` registers nothing.

    Counters (tokens, cumulative): `prefix_queries` prompt tokens looked up at a request's first
    admission and `prefix_hits` those served from the cache (vLLM's prefix_cache_queries/hits);
    `recompute_hits` tokens a preempted sequence found again at its re-admission.
    """

    def __init__(self, num_blocks: int, block_size: int, shuffle_seed: int | None = None,
                 enable_caching: bool = False):
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
        self._salts: dict[int, str | None] = {}
        self.enable_caching = enable_caching
        self.hash_of: list[bytes | None] = [None] * num_blocks  # registered hash per block
        self.cached: dict[bytes, int] = {}  # hash -> block holding that content
        self.evictable: OrderedDict[int, None] = OrderedDict()  # ref 0, hashed: LRU first
        self._hashes: dict[int, list[bytes]] = {}  # seq_id -> hashes of its full blocks so far
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.recompute_hits = 0  # tokens found again by recomputes (preempted sequences)
        self.num_evictions = 0

    # -- queries ---------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks a new allocation can take: never used, or cached but held by no sequence."""
        return len(self.free_blocks) + len(self.evictable)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by at least one sequence."""
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache (held or evictable)."""
        return len(self.cached)

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
        return self.num_blocks_needed(seq_id, start, end) <= self.num_free_blocks

    # -- prefix caching --------------------------------------------------------------------------
    def find_cached(self, token_ids, salt: str | None = None) -> list[int]:
        """Physical blocks holding the longest cached run of full blocks of `token_ids`; never
        the block of the last token, so at least one token is computed (its logits are needed).
        Changes nothing. [] when caching is off."""
        if not self.enable_caching or not self.cached:
            return []
        bs = self.block_size
        n = (len(token_ids) - 1) // bs
        out, parent = [], None
        for i in range(n):
            parent = block_hash(parent, token_ids[i * bs:(i + 1) * bs], salt)
            b = self.cached.get(parent)
            if b is None:
                break
            out.append(b)
        return out

    def can_admit(self, cached_blocks: list[int], end: int) -> bool:
        """Whether a sequence with no table can take `cached_blocks` (from find_cached) and grow
        to `end` tokens: the evictable ones among them stop counting as free."""
        idle = sum(1 for b in cached_blocks if self.ref_counts[b] == 0)
        return self.blocks_for(end) - len(cached_blocks) <= self.num_free_blocks - idle

    def acquire(self, seq_id: int, cached_blocks: list[int], salt: str | None = None, count_query: int = 0) -> int:
        """Start `seq_id`'s table with `cached_blocks` (find_cached's answer under `salt`,
        reference counts + 1; evictable ones leave the eviction queue) and remember its salt for
        `commit`. `count_query`: prompt tokens to add to the query counter (a first admission; 0
        for a recompute). Returns the tokens now cached. Raises ValueError if the sequence
        already has blocks."""
        if self.tables.get(seq_id):
            raise ValueError(f"sequence {seq_id} already has blocks")
        if count_query:
            self.prefix_queries += count_query
            self.prefix_hits += min(len(cached_blocks) * self.block_size, count_query)
        else:
            self.recompute_hits += len(cached_blocks) * self.block_size
        if not cached_blocks:  # no table yet: an allocator may size it at the first append
            self._salts[seq_id] = salt
            return 0
        for b in cached_blocks:
            if self.ref_counts[b] == 0:
                del self.evictable[b]
            self.ref_counts[b] += 1
        self.tables[seq_id] = list(cached_blocks)
        self._hashes[seq_id] = [self.hash_of[b] for b in cached_blocks]
        self._salts[seq_id] = salt
        n = len(cached_blocks) * self.block_size
        self.peak_used = max(self.peak_used, self.num_used_blocks)
        return n

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block no sequence holds (they become plain free blocks) and the
        hashes of held ones. Returns False, changing nothing, while any block is in use: the
        held blocks' sequences would still register their later blocks under a chain that the
        cache no longer knows (vLLM's reset_prefix_cache has the same precondition)."""
        if self.num_used_blocks:
            return False
        for b in self.evictable:
            self.free_blocks.append(b)
        self.evictable.clear()
        self.cached.clear()
        self.hash_of = [None] * self.num_blocks
        return True

    def commit(self, seq_id: int, token_ids, num_computed: int) -> None:
        """Register the full blocks of `seq_id` whose K/V is now written (positions below
        `num_computed`, of `token_ids`) in the prefix cache, under the salt given at `acquire`.
        A block whose content another block already holds stays unregistered (it is freed as
        plain memory)."""
        if not self.enable_caching:
            return
        table = self.tables.get(seq_id)
        if not table:
            return
        n = min(num_computed // self.block_size, len(table))
        have = self._hashes.setdefault(seq_id, [])
        if len(have) >= n:
            return
        salt, bs = self._salts.get(seq_id), self.block_size
        for i in range(len(have), n):  # the chain goes on from the hashes it already has
            h = block_hash(have[-1] if have else None, token_ids[i * bs:(i + 1) * bs], salt)
            have.append(h)
            b = table[i]
            if self.hash_of[b] is None and h not in self.cached:
                self.hash_of[b] = h
                self.cached[h] = b

    # -- mutations -------------------------------------------------------------------------------
    def reserve_for(self, seq_id: int, max_seq_len: int) -> None:
        """Declare that a queued sequence will hold at most `max_seq_len` tokens (prompt +
        max_tokens). Paged allocation ignores it: blocks are taken as the sequence grows (§4.2).
        The contiguous baseline (kv/contiguous.py) sizes its region from it."""

    def _take(self) -> int:
        if self.free_blocks:
            if self._rng is not None:
                i = self._rng.randrange(len(self.free_blocks))
                self.free_blocks.rotate(-i)
            b = self.free_blocks.popleft()
        else:  # evict the least recently used cached block no sequence holds
            b, _ = self.evictable.popitem(last=False)
            del self.cached[self.hash_of[b]]
            self.hash_of[b] = None
            self.num_evictions += 1
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
        if need > self.num_free_blocks:
            raise NoFreeBlocksError(f"need {need} blocks, {self.num_free_blocks} free")
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
            elif self.hash_of[b] is not None:
                # written in place while registered: a block cut back by `truncate` while shared, whose
                # sharers have gone since, would keep naming the prefix it is about to stop holding
                if self.cached.get(self.hash_of[b]) == b:
                    del self.cached[self.hash_of[b]]
                self.hash_of[b] = None
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
        self._hashes[child_id] = list(self._hashes.get(parent_id, ()))
        self._salts[child_id] = self._salts.get(parent_id)

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Release the blocks past the first `num_tokens` tokens (speculative rollback)."""
        table = self.tables.get(seq_id)
        if not table:
            return
        keep = self.blocks_for(num_tokens)
        for b in reversed(table[keep:]):
            self._release(b)
        del table[keep:]
        if num_tokens % self.block_size and len(table) == keep:
            # the kept last block is partial now and will be written again: its registration
            # would name content it no longer holds (shared, the write copies it first)
            b = table[keep - 1]
            if self.ref_counts[b] == 1 and self.hash_of[b] is not None:
                del self.cached[self.hash_of[b]]
                self.hash_of[b] = None
        hashes = self._hashes.get(seq_id)
        if hashes is not None:
            del hashes[num_tokens // self.block_size:]

    def free(self, seq_id: int) -> None:
        """Return a sequence's blocks (those no other sequence shares) to the free list.
        Freeing an unknown sequence is a no-op. Cached blocks become evictable, the tail first:
        a prefix outlives the suffixes that branch from it."""
        self._hashes.pop(seq_id, None)
        self._salts.pop(seq_id, None)
        for b in reversed(self.tables.pop(seq_id, [])):
            self._release(b)

    def _release(self, b: int) -> None:
        self.ref_counts[b] -= 1
        assert self.ref_counts[b] >= 0
        if self.ref_counts[b] == 0:
            if self.hash_of[b] is not None:
                self.evictable[b] = None
            else:
                self.free_blocks.append(b)
