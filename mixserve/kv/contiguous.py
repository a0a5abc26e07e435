"""Contiguous KV reservation: the pre-PagedAttention baseline (Kwon et al., SOSP 2023, §3, Fig. 2-3).

Engines before vLLM (FasterTransformer, Orca) stored each request's K/V in one contiguous region
sized, at admission, for the longest the request could become: the model's context length
(`reserve="max-model-len"`), or, when the output budget is known, prompt + max_tokens
(`reserve="max-tokens"`). The region never grows, so nothing is ever preempted for room; what it
costs is memory reserved but not (yet, or ever) written, and external fragmentation: a region
needs a run of adjacent free blocks, which may not exist even when enough blocks are free.

Here a region is a run of consecutive physical block ids in the same cache the paged manager uses,
so the model runner, block tables and slot mapping are unchanged; only allocation differs.
"""
from __future__ import annotations

from mixserve.kv.block_manager import BlockManager, NoFreeBlocksError

RESERVE_MODES = ("max-model-len", "max-tokens")


class ContiguousBlockManager(BlockManager):
    """Allocates each sequence's whole region, first fit, at its first `append_slots`.

    Args:
        num_blocks: physical blocks in the cache. block_size: tokens per block.
        reserve: "max-model-len" (region = max_model_len tokens for every sequence) or
            "max-tokens" (prompt + max_tokens, as declared with `reserve_for`).
        max_model_len: the context limit in tokens.
    Raises:
        ValueError: a bad reserve mode, or a max-model-len region larger than the whole cache.
    """

    def __init__(self, num_blocks: int, block_size: int, reserve: str, max_model_len: int):
        super().__init__(num_blocks, block_size)
        if reserve not in RESERVE_MODES:
            raise ValueError(f"reserve: must be one of {', '.join(RESERVE_MODES)} (got {reserve!r})")
        if reserve == "max-model-len" and self.blocks_for(max_model_len) > num_blocks:
            raise ValueError(f"kv_cache_memory: {num_blocks * block_size} tokens of cache cannot hold one "
                             f"max-model-len region ({max_model_len} tokens); raise --kv-cache-memory or lower "
                             f"--max-model-len")
        self.reserve = reserve
        self.max_model_len = max_model_len
        # 1 = free; a region is found with bytearray.find of a run of ones (first fit, C speed)
        self._free = bytearray(b"\x01" * num_blocks)
        self._num_free = num_blocks
        self._max_len: dict[int, int] = {}
        self.free_blocks.clear()  # the paged free list is not used here

    @property
    def num_free_blocks(self) -> int:
        return self._num_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self._num_free

    def reserve_for(self, seq_id: int, max_seq_len: int) -> None:
        """Remember the sequence's prompt + max_tokens (tokens): its region in max-tokens mode."""
        self._max_len[seq_id] = max_seq_len

    def region_blocks(self, seq_id: int) -> int:
        """Blocks of the region a sequence gets (or has)."""
        if seq_id in self.tables:
            return len(self.tables[seq_id])
        if self.reserve == "max-model-len":
            return self.blocks_for(self.max_model_len)
        if seq_id not in self._max_len:
            raise KeyError(f"sequence {seq_id}: reserve_for was not called before its first append")
        return self.blocks_for(self._max_len[seq_id])

    def num_blocks_needed(self, seq_id: int, start: int, end: int) -> int:
        if seq_id in self.tables:
            return 0
        return self.region_blocks(seq_id)

    def can_append(self, seq_id: int, start: int, end: int) -> bool:
        """True when [start, end) fits: inside an existing region always; a new sequence only
        when a run of region_blocks adjacent free blocks exists.

        Raises RuntimeError if `end` lies past the sequence's region (the region never grows)."""
        need = self.region_blocks(seq_id)
        if self.blocks_for(end) > need:
            raise RuntimeError(f"sequence {seq_id}: {end} tokens overrun its contiguous region of "
                               f"{need * self.block_size} tokens")
        if seq_id in self.tables:
            return True
        return need <= self._num_free and self._free.find(b"\x01" * need) >= 0

    def append_slots(self, seq_id: int, start: int, end: int) -> list[tuple[int, int]]:
        """Allocate a new sequence's whole region (first fit); nothing to do inside a region.
        Never copies (no blocks are shared). Raises NoFreeBlocksError when no run is free."""
        if not self.can_append(seq_id, start, end):
            raise NoFreeBlocksError(f"no run of {self.region_blocks(seq_id)} free blocks")
        if seq_id not in self.tables:
            need = self.region_blocks(seq_id)
            first = self._free.find(b"\x01" * need)
            self._free[first:first + need] = b"\x00" * need
            self._num_free -= need
            for b in range(first, first + need):
                self.ref_counts[b] = 1
            self.tables[seq_id] = list(range(first, first + need))
            self.peak_used = max(self.peak_used, self.num_used_blocks)
        return []

    def fork(self, parent_id: int, child_id: int) -> None:
        raise NotImplementedError("contiguous reservation does not share blocks between sequences")

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Nothing is released: the region stays reserved until the sequence ends."""

    def free(self, seq_id: int) -> None:
        self._max_len.pop(seq_id, None)
        table = self.tables.pop(seq_id, None)
        if table:
            for b in table:
                self.ref_counts[b] = 0
            self._free[table[0]:table[-1] + 1] = b"\x01" * len(table)
            self._num_free += len(table)
