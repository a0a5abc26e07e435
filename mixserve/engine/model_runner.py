"""Turns a SchedulerOutput into one flat, unpadded batch and runs the model over the paged cache.

Batch layout (design sketch): decode rows first (one token each), then prefill chunks; all
tokens concatenated; `slot_mapping` says where each token's K/V go; block tables say where each
sequence's context is. Only the rows that sample get logits.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from mixserve.engine.scheduler import ScheduledSeq, SchedulerOutput
from mixserve.kv.block_manager import BlockManager
from mixserve.layers.attention import AttentionMetadata, PrefillSpan
from mixserve.models.config import ModelConfig


def allocate_kv_cache(cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device="cpu"):
    """Per-layer K and V caches, each [num_blocks, block_size, num_kv_heads, head_dim], zeroed
    (padding positions of the batched decode read them; zeros keep them finite)."""
    shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    ks = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
    vs = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
    return ks, vs


@dataclass
class PreparedBatch:
    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # int64 [N]
    sampled: list[ScheduledSeq]  # the N scheduled entries that get a new token, in row order


class ModelRunner:
    """Owns the model and its KV cache; `run` executes one scheduled step.

    Args:
        model: a module with `bind_kv_cache` and forward(input_ids, positions, meta, logits_indices).
        cfg: model config; block_manager: the allocator whose tables address the cache.
        num_blocks, block_size: cache geometry; dtype: cache dtype.
    """

    def __init__(self, model, cfg: ModelConfig, block_manager: BlockManager, num_blocks: int,
                 block_size: int, dtype: torch.dtype):
        self.model = model
        self.cfg = cfg
        self.bm = block_manager
        self.block_size = block_size
        self.k_caches, self.v_caches = allocate_kv_cache(cfg, num_blocks, block_size, dtype)
        model.bind_kv_cache(self.k_caches, self.v_caches)
        self.num_forwards = 0

    def _slot_tensor(self, seq_id: int, start: int, end: int) -> torch.Tensor:
        bs = self.block_size
        table = torch.tensor(self.bm.block_table(seq_id), dtype=torch.long)
        pos = torch.arange(start, end)
        return table[pos // bs] * bs + pos % bs

    def prepare(self, sched: list[ScheduledSeq]) -> PreparedBatch:
        bs = self.block_size
        decode = [s for s in sched if s.num_new_tokens == 1]
        prefill = [s for s in sched if s.num_new_tokens > 1]
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        meta = AttentionMetadata(slot_mapping=torch.empty(0))
        sampled: list[ScheduledSeq] = []
        logit_rows: list[int] = []
        if decode:
            ctx = []
            tables = []
            for s in decode:
                p = s.start
                table = self.bm.block_table(s.seq.seq_id)
                ids.append(s.seq.token_ids[p])
                pos.append(p)
                slots.append(table[p // bs] * bs + p % bs)
                ctx.append(p + 1)
                tables.append(table)
            max_blocks = max(len(t) for t in tables)
            bt = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.long)
            ctx_t = torch.tensor(ctx)
            ar = torch.arange(max_blocks * bs)
            meta.num_decode = len(decode)
            meta.decode_block_tables = bt
            meta.decode_bias = torch.zeros(len(decode), max_blocks * bs).masked_fill_(
                ar[None, :] >= ctx_t[:, None], float("-inf"))
            for i, s in enumerate(decode):
                if s.samples:
                    sampled.append(s)
                    logit_rows.append(i)
        slot_parts = [torch.tensor(slots, dtype=torch.long)]
        for s in prefill:
            row0 = len(ids)
            ids.extend(s.seq.token_ids[s.start:s.end])
            pos.extend(range(s.start, s.end))
            slot_parts.append(self._slot_tensor(s.seq.seq_id, s.start, s.end))
            if s.start == 0:
                span = PrefillSpan(row0, len(ids), None, None)
            else:
                q_pos = torch.arange(s.start, s.end)
                mask = torch.arange(s.end)[None, :] <= q_pos[:, None]
                span = PrefillSpan(row0, len(ids), self._slot_tensor(s.seq.seq_id, 0, s.end), mask)
            meta.prefills.append(span)
            if s.samples:
                sampled.append(s)
                logit_rows.append(len(ids) - 1)
        meta.slot_mapping = torch.cat(slot_parts)
        return PreparedBatch(
            input_ids=torch.tensor(ids, dtype=torch.long),
            positions=torch.tensor(pos, dtype=torch.long),
            meta=meta,
            logits_indices=torch.tensor(logit_rows, dtype=torch.long),
            sampled=sampled,
        )

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate K/V of src blocks into dst blocks in every layer."""
        if not copies:
            return
        src = torch.tensor([c[0] for c in copies])
        dst = torch.tensor([c[1] for c in copies])
        for kc, vc in zip(self.k_caches, self.v_caches):
            kc[dst] = kc[src]
            vc[dst] = vc[src]

    def run(self, out: SchedulerOutput) -> tuple[torch.Tensor, list[ScheduledSeq]]:
        """Run one step. Returns (float32 logits [N, vocab] for the sampling rows, those rows)."""
        self.copy_blocks(out.copies)
        batch = self.prepare(out.scheduled)
        logits = self.model(batch.input_ids, batch.positions, batch.meta, batch.logits_indices)
        self.num_forwards += 1
        return logits, batch.sampled
