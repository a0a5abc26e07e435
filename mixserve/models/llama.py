"""Llama / Qwen2 decoder over a flat, unpadded token batch and a paged KV cache.

Architecture as in Touvron et al. 2023 (Llama) and the Qwen2 report (Yang et al. 2024): pre-norm
RMSNorm, RoPE, grouped-query attention (Ainslie et al. 2023) with optional q/k/v bias, SwiGLU MLP
(Shazeer 2020), tied or separate LM head. Q/K/V and gate/up projections are fused into one matmul
each: on CPU one larger GEMM beats three small ones.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mixserve.layers import batch_invariance
from mixserve.layers.attention import (AttentionMetadata, choose_decode_kernel, gathered_decode_attention,
                                       paged_attention)
from mixserve.layers.gguf_linear import GGUFEmbedding, GGUFLinear, GGUFWeight
from mixserve.layers.kernel_choice import KernelChooser
from mixserve.layers.linear import DenseLinear, Int4Linear, choose_linear_kernel
from mixserve.layers.paged_decode import paged_decode_attention
from mixserve.device import move_module
from mixserve.layers.rmsnorm import RMSNorm, silu_mul
from mixserve.layers.rotary import RotaryEmbedding
from mixserve.models.config import ModelConfig
from mixserve.quant.loading import QuantSpec, make_linear


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor], prefix: str, dtype: torch.dtype,
                 quant: QuantSpec | None = None):
        super().__init__()
        self.cfg = cfg
        g = lambda n: w[prefix + n].to(dtype)  # noqa: E731
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.input_layernorm.weight.data = g("input_layernorm.weight")
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm.weight.data = g("post_attention_layernorm.weight")
        lin = lambda *names: make_linear(w, [prefix + n for n in names], dtype, quant)  # noqa: E731
        self.qkv_proj = lin("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
        self.o_proj = lin("self_attn.o_proj")
        self.gate_up_proj = lin("mlp.gate_proj", "mlp.up_proj")
        self.down_proj = lin("mlp.down_proj")
        self.scale = cfg.head_dim ** -0.5
        self.decode_attention = "sdpa"  # LlamaForCausalLM.choose_kernels may pick another
        self.opaque_mlp = False  # batch-invariant mode: SwiGLU's product as one op (rmsnorm.silu_mul_op)
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def forward(self, x, rope_tables: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata | tuple[torch.Tensor, torch.Tensor, torch.Tensor], rope: RotaryEmbedding):
        """meta: the step's AttentionMetadata, or for a decode-only step (LlamaForCausalLM.decode)
        (slot_mapping, block_tables, context_lens) for the paged kernel."""
        cfg = self.cfg
        T = x.shape[0]
        h = self.input_layernorm(x)
        qkv = self.qkv_proj(h)
        # q and k heads rotated in one pass over their slice of the fused projection. The heads
        # are a view of the whole (contiguous) projection, then sliced: a view of a slice makes
        # Inductor's lowering ask whether the row count is 1, specialising the compiled decode
        # graph to one row count (engine/decode_graph.py)
        heads = qkv.view(T, -1, cfg.head_dim)
        qk = rope.rotate(heads[:, :cfg.num_heads + cfg.num_kv_heads], *rope_tables)
        q, k = qk.split([cfg.num_heads, cfg.num_kv_heads], dim=1)
        v = heads[:, cfg.num_heads + cfg.num_kv_heads:]
        if isinstance(meta, AttentionMetadata):
            a = paged_attention(q, k, v, self.k_cache, self.v_cache, meta, self.scale, self.decode_attention)
        elif self.k_cache.is_cuda:  # a CUDA graph's fixed-width step (engine/cuda_graph.py)
            a = gathered_decode_attention(q, k, v, self.k_cache, self.v_cache, *meta, self.scale)
        else:
            # copies, not .contiguous(): whether a view is contiguous depends on a row count of 1,
            # which would specialise the compiled graph to one row (engine/decode_graph.py)
            a = paged_decode_attention(q, k.clone(memory_format=torch.contiguous_format),
                                       v.clone(memory_format=torch.contiguous_format), self.k_cache, self.v_cache,
                                       *meta, self.scale)
        x = x + self.o_proj(a.reshape(T, cfg.q_size))
        h = self.post_attention_layernorm(x)
        gate, up = self.gate_up_proj(h).chunk(2, dim=-1)
        act = silu_mul(gate, up, self.opaque_mlp)  # one op, the same in eager steps and opaque graphs
        return x + self.down_proj(act)


class LlamaForCausalLM(nn.Module):
    """The decoder plus LM head.

    Args:
        cfg: model shape.
        weights: HF-named tensors ([out, in] linears), any float dtype, cast to `dtype`; or
            GGUFWeight for GGUF tensors kept as stored (models/weights.read_gguf_native).
        dtype: compute dtype (torch.bfloat16 or torch.float32).
        max_positions: RoPE table length in tokens (the engine's max_model_len).
        quant: int4 weights (an AWQ checkpoint's, or round-to-nearest at load); None: dense.
    Raises:
        KeyError: a weight is missing.
    """

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype, max_positions: int,
                 quant: QuantSpec | None = None):
        super().__init__()
        self.cfg = cfg
        self.dtype = dtype
        embed = weights["model.embed_tokens.weight"]
        native = isinstance(embed, GGUFWeight)  # a GGUF loaded with its quantized tensors as stored
        self.embed_tokens = (GGUFEmbedding(embed, dtype) if native
                             else nn.Embedding.from_pretrained(embed.to(dtype), freeze=True))
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, weights, f"model.layers.{i}.", dtype, quant) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.norm.weight.data = weights["model.norm.weight"].to(dtype)
        self.quant = quant
        # the LM head stays in the compute dtype unless asked (rtn) or stored int4 (awq)
        head_q = quant is not None and (quant.lm_head or "lm_head.qweight" in weights)
        rtn = quant.lm_head_group_size if quant is not None and quant.lm_head else None
        if native and cfg.tie_word_embeddings:  # the embedding's blocks serve the head too: one copy
            self.lm_head = GGUFLinear([embed], None, dtype)
        elif "lm_head.qweight" in weights or (not cfg.tie_word_embeddings and "lm_head.weight" in weights):
            self.lm_head = make_linear(weights, ["lm_head"], dtype, quant, allow_quant=head_q, rtn_group=rtn)
        elif head_q:
            self.lm_head = make_linear({"lm_head.weight": weights["model.embed_tokens.weight"]}, ["lm_head"], dtype,
                                       quant, rtn_group=rtn)
        else:
            self.lm_head = DenseLinear(self.embed_tokens.weight)
            self.lm_head.keep_plain = True  # the embedding holds the plain weight anyway
        # logits leave the model in float32, accumulated so and never rounded to bf16 (a bf16 logit
        # is a multiple of 0.125 at typical sizes: near-ties and logprobs would be that coarse)
        self.lm_head.float_out = True
        if isinstance(self.lm_head, Int4Linear):
            self.lm_head.set_kernel("vnni")  # the layout with a float32-output path (where it builds)
        self.rope = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, dtype)
        self.batch_invariant = False  # layers/batch_invariance.apply sets it (read by the model runner)

    def choose_kernels(self, chooser: KernelChooser, batch_invariant: bool = False,
                       packed: dict | None = None) -> int:
        """Set every linear's and the decode attention's kernel to the chooser's pick for this
        model's shapes and dtype (measured once per machine, layers/kernel_choice.py). Until this
        is called the model runs PyTorch's eager kernels. batch_invariant: only the choices that
        keep a row's numerics the same at every row count are timed, then every layer is put on
        its batch-invariant path (layers/batch_invariance.py; RuntimeError where a kernel of it
        did not build), taking the dense weights already packed in `packed` where they match
        (models/packed_weights.py). Returns how many dense linears were packed anew."""
        if not batch_invariant:
            batch_invariance.clear(self)
        for m in self.modules():
            choose_linear_kernel(m, chooser, self.dtype, invariant=batch_invariant)
        if batch_invariant:
            return batch_invariance.apply(self, packed)
        c = self.cfg
        pick = choose_decode_kernel(chooser, c.num_heads, c.num_kv_heads, c.head_dim, self.dtype)
        for layer in self.layers:
            layer.decode_attention = pick
        return 0

    def place(self, device: torch.device, chooser=None) -> None:
        """Move the model to a non-CPU device (device.move_module): dense linears run PyTorch's
        kernels there (cuBLAS; float logits via linear.cuda_float_linear), int4 ones its CUDA int4
        kernel, decode attention gathers + SDPA. An int4 LM head becomes its dense dequantization
        in the compute dtype: the CUDA int4 kernel returns bf16, and logits must stay float32.
        With `chooser` (layers/kernel_choice.KernelChooser) each int4 linear's switch to
        dequantize + GEMM is measured there (linear.choose_linear_kernel); without, the int4 kernel
        runs at every row count.
        Raises ValueError for GGUF-native layers (CPU kernels: load with gguf_weights dequantize)."""
        if any(isinstance(m, (GGUFLinear, GGUFEmbedding)) for m in self.modules()):
            raise ValueError(f"device {device}: GGUF-native layers run on the CPU only; load the model with "
                             "--gguf-weights dequantize")
        if isinstance(self.lm_head, Int4Linear):
            head = DenseLinear(self.lm_head.dense_weight().to(self.dtype),
                               self.lm_head.bias.to(self.dtype) if self.lm_head.bias is not None else None)
            head.float_out = True
            self.lm_head = head
        move_module(self, device)
        # cuBLAS may otherwise reduce split-K partial sums in bf16, and the float32 logits'
        # second pass (linear.cuda_float_linear) needs float32 accumulation throughout
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        for layer in self.layers:
            layer.decode_attention = "sdpa"
        if chooser is not None:
            for m in self.modules():
                if isinstance(m, Int4Linear) and not m.float_out:
                    choose_linear_kernel(m, chooser, self.dtype)

    def bind_kv_cache(self, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor]) -> None:
        """Give each layer its K/V cache tensors [num_blocks, block_size, num_kv_heads, head_dim]."""
        for layer, kc, vc in zip(self.layers, k_caches, v_caches):
            layer.k_cache, layer.v_cache = kc, vc

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                logits_indices: torch.Tensor, score_indices: torch.Tensor | None = None):
        """input_ids, positions: int64 [T]; logits_indices: int64 [N] rows of the batch whose
        next-token logits are wanted. Returns float32 logits [N, vocab_size]; with
        score_indices (int64 [M], rows whose next-token distribution is scored, prompt
        logprobs), (those logits, the final-norm hidden states [M, hidden] of the scored rows),
        for the caller to put through `compute_logits` a slice at a time."""
        x = self.embed_tokens(input_ids)
        tables = self.rope.tables(positions)  # one lookup per step, not per layer
        for layer in self.layers:
            x = layer(x, tables, meta, self.rope)
        logits = self.lm_head(self.norm(x[logits_indices])).float()
        if score_indices is None:
            return logits
        return logits, self.norm(x[score_indices])

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final-norm hidden states [M, hidden] -> float32 logits [M, vocab_size]."""
        return self.lm_head(hidden).float()

    def decode(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
               block_tables: torch.Tensor, context_lens: torch.Tensor,
               logit_rows: torch.Tensor | None = None) -> torch.Tensor:
        """A step of query rows, each with its own position, slot, block table and context: the
        form the decode graph captures (engine/decode_graph.py), with attention through the paged
        kernel (layers/paged_decode.py), which writes every row's k/v before any row attends. A
        decode row is one; a speculative verification's k + 1 positions of one sequence are k + 1
        rows whose contexts end at their own positions. input_ids, positions, slot_mapping,
        context_lens: int64 [B]; block_tables: int64 [B, max_blocks]; logit_rows: int64 [L], the
        rows whose logits are wanted (None: all). Returns float32 logits [L or B, vocab_size].
        Undecorated (the caller runs it under inference_mode): the graph's compiled code is kept
        per code object of this very function, which a decorator's wrapper would share between
        all graphs."""
        x = self.embed_tokens(input_ids)
        tables = self.rope.tables(positions)
        meta = (slot_mapping, block_tables, context_lens)
        for layer in self.layers:
            x = layer(x, tables, meta, self.rope)
        if logit_rows is not None:
            x = x.index_select(0, logit_rows)
        return self.lm_head(self.norm(x)).float()
