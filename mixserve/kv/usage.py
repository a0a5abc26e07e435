"""How much of the reserved KV cache holds K/V at one instant: the waste PagedAttention removes
(Kwon et al., SOSP 2023, §3 and Fig. 2: slots reserved for future tokens, internal fragmentation)."""
from __future__ import annotations

from dataclasses import dataclass

from mixserve.kv.block_manager import BlockManager
from mixserve.sequence import Sequence


@dataclass(frozen=True)
class KVUsage:
    """KV cache slots (one slot = one token's K and V in every layer) at one instant.

    reserved_slots: blocks held by sequences x block_size.
    written_slots: slots that hold a token's K/V = the sum of the running sequences'
        num_computed_tokens (capped at reserved_slots: sequences sharing prompt blocks, n > 1,
        would count the shared slots once per sequence).
    waste: (reserved - written) / reserved, in [0, 1]; 0 when nothing is reserved. It counts the
        reserved slots not (yet) written, which for a contiguous region includes every slot up
        to its reservation, plus the unused tail of each sequence's last block (all there is for
        paged allocation).
    """

    reserved_slots: int
    written_slots: int

    @property
    def waste(self) -> float:
        if self.reserved_slots == 0:
            return 0.0
        return (self.reserved_slots - self.written_slots) / self.reserved_slots


def kv_usage(block_manager: BlockManager, running: list[Sequence]) -> KVUsage:
    """KVUsage of the cache now. `running`: the scheduler's running sequences (waiting ones hold
    no blocks)."""
    reserved = block_manager.num_used_blocks * block_manager.block_size
    written = sum(s.num_computed_tokens for s in running)
    return KVUsage(reserved, min(written, reserved))
