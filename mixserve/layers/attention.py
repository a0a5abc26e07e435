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

from mixserve.layers.paged_decode import available as paged_available, paged_decode, paged_rows


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
    decode_groups: decode rows in groups of similar context length, each attended in one call.
    prefills: spans for the remaining rows.
    rows: batch-invariant mode (layers/batch_invariance.py): (tables int64 [S, W], row_table int64
        [T], context_lens int64 [T]) for every row of the batch, decode and prefill alike: row t
        attends to positions 0..context_lens[t]-1 of its sequence's table tables[row_table[t]], by
        the paged kernel (`paged_decode.paged_rows`); decode_groups and prefills are then empty.
    """

    slot_mapping: torch.Tensor
    num_decode: int = 0
    decode_groups: list["DecodeGroup"] = field(default_factory=list)
    prefills: list[PrefillSpan] = field(default_factory=list)
    rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


@dataclass
class DecodeGroup:
    """Rows [start, end) of the batch, all decode rows, padded to a common context.

    block_tables: LongTensor [rows, max_blocks], each row's block table padded with block 0
        (whole blocks are gathered: 1/block_size as many indices as slots).
    context_lens: int64 [rows], each row's context in tokens (the "paged" kernel reads only these).
    The padding bias of the gathering kernels ("sdpa", "bmm") is derived from these on first use
    (`padding_bias`), so a step on the paged kernel never builds it.
    Rows are grouped by context length so that a short context is not padded to the longest one
    in a large batch.
    """

    start: int
    end: int
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    _masks: dict = field(default_factory=dict, repr=False)

    def padding_bias(self, block_size: int) -> torch.Tensor:
        """float32 [rows, max_blocks * block_size]: 0 for real context positions, -inf for padding
        and the unwritten tail of the last block; made once per step (every layer shares it)."""
        b = self._masks.get("bias")
        if b is None:
            dev = self.block_tables.device
            ar = torch.arange(self.block_tables.shape[1] * block_size, device=dev)
            b = torch.zeros(self.block_tables.shape[0], len(ar), device=dev)
            b = self._masks["bias"] = b.masked_fill_(ar[None, :] >= self.context_lens[:, None], float("-inf"))
        return b

    def sdpa_mask(self, dtype: torch.dtype, block_size: int) -> torch.Tensor:
        """padding_bias as SDPA's additive mask [rows, 1, 1, L] in `dtype`, made once per step."""
        m = self._masks.get(dtype)
        if m is None:
            m = self._masks[dtype] = self.padding_bias(block_size)[:, None, None, :].to(dtype)
        return m


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    decode: str = "sdpa",
) -> torch.Tensor:
    """Write k/v into the paged cache, then attend.

    Args:
        q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim] (same dtype as the cache).
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], updated in place.
        meta: the step's AttentionMetadata.
        scale: softmax scale, usually head_dim ** -0.5.
        decode: decode-row kernel, "sdpa" (PyTorch's fused kernel over the gathered context, the
            eager default), "bmm" (`_decode_attention`, batched matmuls over it) or "paged"
            (layers/paged_decode.py, reading the cache through the block table in place); chosen
            per machine by `decode_candidates`.
    Returns:
        [T, num_heads, head_dim].
    """
    num_kv = k.shape[1]
    k_flat = k_cache.view(-1, num_kv, k_cache.shape[-1])
    v_flat = v_cache.view(-1, num_kv, v_cache.shape[-1])
    k_flat.index_copy_(0, meta.slot_mapping, k)
    v_flat.index_copy_(0, meta.slot_mapping, v)
    if meta.rows is not None:  # one kernel for every row: what a row gets does not depend on the batch
        return paged_rows(q, k_cache, v_cache, *meta.rows, scale)

    out = torch.empty_like(q)
    nd = meta.num_decode
    if nd:
        for g in meta.decode_groups:
            if decode == "paged":
                out[g.start:g.end] = paged_decode(q[g.start:g.end], k_cache, v_cache, g.block_tables,
                                                  g.context_lens, scale)
                continue
            bs = k_cache.shape[1]
            kd = k_cache[g.block_tables].flatten(1, 2)  # [rows, max_blocks * block_size, kvh, d]
            vd = v_cache[g.block_tables].flatten(1, 2)
            if decode == "bmm":
                out[g.start:g.end] = _decode_attention(q[g.start:g.end], kd, vd, g.padding_bias(bs), scale)
            else:
                out[g.start:g.end] = _decode_sdpa(q[g.start:g.end], kd, vd, g.sdpa_mask(q.dtype, bs), scale)
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


def gathered_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                              v_cache: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                              context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """A decode-only step's attention for one layer at fixed shapes, as a CUDA graph captures it
    (engine/cuda_graph.py): k, v [B, kv_heads, d] written at slot_mapping (int64 [B]) with one
    index_copy_ each, then every row's blocks gathered through its block table (int64 [B, W], all
    W blocks: padding entries name any block, the mask hides them) and attended with SDPA under a
    mask built on the device from context_lens (int64 [B]). q [B, H, d]. Returns [B, H, d].
    Plain PyTorch, so it runs (and is tested) on the CPU too. Where flash-attn's paged kernel can
    read the cache in place (`flash_paged_usable`), it does instead of the gather."""
    num_kv, d = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv, d).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv, d).index_copy_(0, slot_mapping, v)
    if flash_paged_usable(k_cache):
        from flash_attn import flash_attn_with_kvcache

        # its paged layout is ours ([blocks, block_size, kv_heads, d]); the new K/V is already in
        o = flash_attn_with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=context_lens.to(torch.int32),
                                    block_table=block_tables.to(torch.int32), softmax_scale=scale, causal=True)
        return o.squeeze(1)
    kd = k_cache[block_tables].flatten(1, 2)  # [B, W * block_size, kv_heads, d]
    vd = v_cache[block_tables].flatten(1, 2)
    visible = torch.arange(kd.shape[1], device=q.device)[None, :] < context_lens[:, None]
    o = F.scaled_dot_product_attention(q.unsqueeze(2), kd.transpose(1, 2), vd.transpose(1, 2),
                                       attn_mask=visible[:, None, None, :], scale=scale, enable_gqa=True)
    return o.squeeze(2)


_FLASH: list[bool] = []


def flash_paged_usable(k_cache: torch.Tensor) -> bool:
    """True where flash-attn (>= 2.5, `flash_attn_with_kvcache` with `block_table`) is installed and
    can read this cache: CUDA, fp16/bf16, and a block size that is a multiple of 256 (its paged
    layout's constraint; mixserve's default block size, 16, is not, so `--block-size 256` opts in)."""
    if not (k_cache.is_cuda and k_cache.dtype in (torch.float16, torch.bfloat16) and k_cache.shape[1] % 256 == 0):
        return False
    if not _FLASH:
        try:
            from flash_attn import flash_attn_with_kvcache  # noqa: F401

            _FLASH.append(True)
        except Exception:  # noqa: BLE001 -- absent or built for another torch: the PyTorch path
            _FLASH.append(False)
    return _FLASH[0]


def _decode_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float):
    """`_decode_attention` through PyTorch's fused SDPA (GQA-aware); mask: additive
    [B, 1, 1, L] in q's dtype (DecodeGroup.sdpa_mask)."""
    o = F.scaled_dot_product_attention(q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2),
                                       attn_mask=mask, scale=scale, enable_gqa=True)
    return o.squeeze(2)


def _decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float):
    """One query per row over a padded context, grouped-query aware.

    q [B, H, d]; k, v [B, L, Hkv, d]; bias float32 [B, L] (0 or -inf). Returns [B, H, d].
    Plain batched matmuls: on a Zen 5, PyTorch's fused SDPA kernel ran a single-token query
    about 7x slower than this (benchmarks/kernel_choices.py: 4.44 ms vs 0.61 ms for B=16, L=320, bf16,
    2 threads); on the AVX-512/AMX Xeon this was 0.7x of SDPA, hence a measured choice.
    Query heads are grouped per KV head so K/V are never repeated.
    """
    B, H, d = q.shape
    kvh = k.shape[2]
    qg = q.view(B, kvh, H // kvh, d)
    s = torch.matmul(qg, k.permute(0, 2, 3, 1)).float() * scale  # [B, kvh, g, L]
    p = torch.softmax(s + bias[:, None, None, :], dim=-1).to(q.dtype)
    return torch.matmul(p, v.transpose(1, 2)).reshape(B, H, d)


def decode_candidates(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                      context: int = 512, block_size: int = 16) -> dict:
    """Timers for kernel_choice's `decode_attention` choice: seconds per call of "sdpa", "bmm" and
    (where it builds) "paged", the geometric mean over 1 and 16 rows of up to `context` tokens
    (the shorter rows padded, as a group's are), each timed from the paged cache: the gather of
    the blocks is part of what "sdpa" and "bmm" cost."""
    from mixserve.layers.kernel_choice import geomean, time_calls

    blocks = context // block_size
    shapes = []
    for rows in (1, 16):
        nb = rows * blocks + 1
        kc = torch.randn(nb, block_size, num_kv_heads, head_dim).to(dtype)
        vc = torch.randn(nb, block_size, num_kv_heads, head_dim).to(dtype)
        tables = torch.randperm(nb - 1)[:rows * blocks].view(rows, blocks) + 1  # scattered blocks
        lens = torch.full((rows,), context)
        lens[rows // 2:] = context - context // 8  # padding, as a group's shorter rows have
        bias = torch.zeros(rows, context).masked_fill_(torch.arange(context)[None, :] >= lens[:, None],
                                                       float("-inf"))
        q = torch.randn(rows, num_heads, head_dim).to(dtype)
        shapes.append((q, kc, vc, tables, lens, bias))
    scale = head_dim ** -0.5

    def gathered(fn, as_mask):
        def call(a):
            q, kc, vc, tables, lens, bias = a
            m = bias[:, None, None, :].to(dtype) if as_mask else bias
            return fn(q, kc[tables].flatten(1, 2), vc[tables].flatten(1, 2), m, scale)
        return lambda: geomean(time_calls([a], call) for a in shapes)

    cands = {"sdpa": gathered(_decode_sdpa, True), "bmm": gathered(_decode_attention, False)}
    if dtype in (torch.float32, torch.bfloat16) and paged_available():
        cands["paged"] = lambda: geomean(time_calls([a], lambda a: paged_decode(*a[:5], scale)) for a in shapes)
    return cands


def choose_decode_kernel(chooser, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> str:
    """The decode attention kernel ("sdpa", "bmm" or "paged") `chooser` picks for this head layout."""
    key = f"decode_attention/{str(dtype).removeprefix('torch.')}/{num_heads}x{num_kv_heads}x{head_dim}"
    return chooser.choose(key, decode_candidates(num_heads, num_kv_heads, head_dim, dtype), "sdpa")
