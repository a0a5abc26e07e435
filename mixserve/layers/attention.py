"""Paged attention over a block-structured KV cache (Kwon et al., SOSP 2023, §4.1).

Every layer's K and V live in tensors of shape [num_blocks, block_size, num_kv_heads, head_dim].
A step writes the new tokens' K/V at `slot_mapping` (slot = block * block_size + offset) and reads
each sequence's context back through its block table. On 2 CPU cores a Python loop of
per-sequence calls costs more than the small models' matmuls, so decode rows (one query token)
are attended in one batched call over a gathered, padded context; prefill chunks, which are
compute-heavy anyway, go one sequence at a time.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PrefillSpan:
    """One sequence's query tokens in the flat batch.

    start, end: row range in the flat token batch (end - start query tokens).
    gather: LongTensor [ctx_len] of cache slots holding the sequence's whole context
        (already computed tokens plus this chunk), or None when the chunk is the whole context
        (then K/V are used straight from the projection, no gather).
    mask: bool [q_len, ctx_len] (True = attend) when the chunk does not start at position 0.
    """

    start: int
    end: int
    gather: torch.Tensor | None
    mask: torch.Tensor | None


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step, built once by the model runner and shared by
    all layers.

    slot_mapping: LongTensor [T], cache slot for each token of the flat batch.
    num_decode: the first `num_decode` rows of the batch are decode rows (one query each).
    decode_gather: LongTensor [num_decode, max_ctx] slots of each decode row's context, padded.
    decode_mask: bool [num_decode, 1, 1, max_ctx], True for real (non-padding) positions.
    prefills: spans for the remaining rows.
    """

    slot_mapping: torch.Tensor
    num_decode: int = 0
    decode_gather: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None
    prefills: list[PrefillSpan] = field(default_factory=list)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Write k/v into the paged cache, then attend.

    Args:
        q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim] (same dtype as the cache).
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], updated in place.
        meta: the step's AttentionMetadata.
        scale: softmax scale, usually head_dim ** -0.5.
    Returns:
        [T, num_heads, head_dim].
    """
    num_kv = k.shape[1]
    k_flat = k_cache.view(-1, num_kv, k_cache.shape[-1])
    v_flat = v_cache.view(-1, num_kv, v_cache.shape[-1])
    k_flat.index_copy_(0, meta.slot_mapping, k)
    v_flat.index_copy_(0, meta.slot_mapping, v)

    out = torch.empty_like(q)
    nd = meta.num_decode
    if nd:
        # [B, L, kvh, d] -> [B, kvh, L, d]
        kd = k_flat[meta.decode_gather].transpose(1, 2)
        vd = v_flat[meta.decode_gather].transpose(1, 2)
        qd = q[:nd].unsqueeze(2)  # [B, H, 1, d]
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, scale=scale, enable_gqa=True)
        out[:nd] = od.squeeze(2)
    for span in meta.prefills:
        qs = q[span.start:span.end].transpose(0, 1).unsqueeze(0)  # [1, H, q, d]
        if span.gather is None:
            ks = k[span.start:span.end]
            vs = v[span.start:span.end]
        else:
            ks = k_flat[span.gather]
            vs = v_flat[span.gather]
        ks = ks.transpose(0, 1).unsqueeze(0)
        vs = vs.transpose(0, 1).unsqueeze(0)
        os_ = F.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=span.mask, is_causal=span.mask is None, scale=scale, enable_gqa=True
        )
        out[span.start:span.end] = os_.squeeze(0).transpose(0, 1)
    return out
