"""Arithmetic cost of a Llama / Qwen2 decoder from its config: parameters, FLOPs, bytes.

Counts follow the architecture as mixserve runs it (models/llama.py): per layer a fused QKV
projection (with bias for Qwen2), the output projection, a fused gate/up projection and the down
projection (SwiGLU), two RMSNorms; a final RMSNorm; an LM head that is the embedding matrix when
tied. A matmul of an [r, in] input by an [in, out] weight is 2 * r * in * out FLOPs (one multiply
and one add per weight per row, Kaplan et al. 2020, §2.1). Attention of one query token over a
context of L tokens is 2 * L * head_dim FLOPs per query head for Q·K^T and as many for P·V
(softmax and RoPE are left out: they are O(L) per head, not O(L * head_dim)).
"""
from __future__ import annotations

from dataclasses import dataclass

from mixserve.models.config import ModelConfig

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


@dataclass(frozen=True)
class LinearShape:
    """One weight matrix of the model as the engine runs it: [out_features, in_features].

    name: "qkv", "o", "gate_up", "down" (once per layer) or "lm_head" (once, sampled rows only).
    """

    name: str
    out_features: int
    in_features: int
    per_layer: bool = True

    @property
    def numel(self) -> int:
        return self.out_features * self.in_features


def linear_shapes(cfg: ModelConfig) -> list[LinearShape]:
    """The model's matmul weights as mixserve fuses them (models/llama.py DecoderLayer)."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    return [
        LinearShape("qkv", cfg.q_size + 2 * cfg.kv_size, h),
        LinearShape("o", h, cfg.q_size),
        LinearShape("gate_up", 2 * i, h),
        LinearShape("down", h, i),
        LinearShape("lm_head", cfg.vocab_size, h, per_layer=False),
    ]


def layer_linear_params(cfg: ModelConfig) -> int:
    """Weights (elements) of one decoder layer's matmuls, biases excluded."""
    return sum(s.numel for s in linear_shapes(cfg) if s.per_layer)


def param_count(cfg: ModelConfig) -> dict:
    """Parameter count (elements) by part.

    Returns a dict: embed, per_layer (weights + biases + norms of one layer), layers (all layers),
    final_norm, lm_head (0 when tied: the embedding matrix is reused), total.
    """
    h = cfg.hidden_size
    bias = (cfg.q_size + 2 * cfg.kv_size) if cfg.attention_bias else 0
    per_layer = layer_linear_params(cfg) + bias + 2 * h
    embed = cfg.vocab_size * h
    lm_head = 0 if cfg.tie_word_embeddings else cfg.vocab_size * h
    total = embed + cfg.num_layers * per_layer + h + lm_head
    return {"embed": embed, "per_layer": per_layer, "layers": cfg.num_layers * per_layer, "final_norm": h,
            "lm_head": lm_head, "total": total}


def linear_flops_per_token(cfg: ModelConfig, with_lm_head: bool = True) -> int:
    """Matmul FLOPs for one token through every layer (and the LM head): 2 * matmul weights.

    The engine computes the LM head only for rows that sample (the last token of a prompt or a
    decode row), so a prefill token that is not last costs `with_lm_head=False`.
    """
    f = 2 * cfg.num_layers * layer_linear_params(cfg)
    return f + (2 * cfg.vocab_size * cfg.hidden_size if with_lm_head else 0)


def attention_flops(cfg: ModelConfig, context_tokens: int) -> int:
    """Q·K^T plus P·V FLOPs of one query token over `context_tokens` keys, all layers:
    4 * num_heads * head_dim * context_tokens * num_layers."""
    return 4 * cfg.num_heads * cfg.head_dim * context_tokens * cfg.num_layers


def decode_flops_per_token(cfg: ModelConfig, context_tokens: int) -> int:
    """FLOPs to generate one token whose context (itself included) is `context_tokens` long."""
    return linear_flops_per_token(cfg) + attention_flops(cfg, context_tokens)


def prefill_flops(cfg: ModelConfig, prompt_tokens: int) -> int:
    """FLOPs of a whole causal prefill of `prompt_tokens` tokens: matmuls for every token, the
    LM head once (the first output token), attention over 1 + 2 + ... + n keys."""
    n = prompt_tokens
    return (n * linear_flops_per_token(cfg, with_lm_head=False) + 2 * cfg.vocab_size * cfg.hidden_size
            + attention_flops(cfg, n * (n + 1) // 2))


def prefill_flops_per_token(cfg: ModelConfig, prompt_tokens: int) -> float:
    """prefill_flops / prompt_tokens."""
    return prefill_flops(cfg, prompt_tokens) / prompt_tokens


@dataclass(frozen=True)
class WeightFormat:
    """How matmul weights are stored.

    name: "bf16" (2 bytes a weight), "int4" (AWQ GEMM layout, Lin et al. 2023 §4: packed
    nibbles, 0.5 byte a weight, plus per group of `group_size` input channels an fp16 scale and a
    4-bit zero point, AutoAWQ's qzeros) or "gguf" (a GGUF file's quantized tensors as stored:
    `bytes_per_weight` over the layers' matmuls, `head_bytes_per_weight` for the LM head and
    `embed_bytes_per_weight` for the embedding, read from the file by `gguf_format`).
    `lm_head_int4`: the LM head is int4 too (mixserve keeps it in bf16 by default); embeddings and
    norms stay bf16 except in "gguf".
    """

    name: str = "bf16"
    group_size: int = 128
    scale_bytes: float = 2.0
    zero_bytes: float = 0.5
    lm_head_int4: bool = False
    bytes_per_weight: float = 0.0
    head_bytes_per_weight: float = 0.0
    embed_bytes_per_weight: float = 2.0
    label: str = ""

    def __post_init__(self):
        if self.name not in ("bf16", "int4", "gguf"):
            raise ValueError(f"format: must be bf16, int4 or gguf (got {self.name!r})")
        if self.group_size < 1:
            raise ValueError(f"group_size: must be >= 1 (got {self.group_size})")
        if self.name == "gguf" and not (self.bytes_per_weight > 0 and self.head_bytes_per_weight > 0):
            raise ValueError("format gguf: needs bytes_per_weight and head_bytes_per_weight (gguf_format)")

    def linear_bytes(self, numel: int, in_features: int, quantized: bool = True) -> float:
        """Bytes of one [out, in] weight with `numel` elements (gguf: quantized=False is the head)."""
        if self.name == "gguf":
            return numel * (self.bytes_per_weight if quantized else self.head_bytes_per_weight)
        if self.name == "bf16" or not quantized:
            return 2.0 * numel
        groups = numel / self.group_size
        return numel / 2 + groups * (self.scale_bytes + self.zero_bytes)


BF16 = WeightFormat("bf16")
INT4 = WeightFormat("int4", 128)


def default_format(resolved) -> WeightFormat:
    """The weight format the engine runs a resolved model (models.registry.resolve_model) in by default:
    a GGUF file's tensors as stored where the loader loads it natively without flags
    (models.loader.use_native_gguf: a variant of the kernel runs here), else bf16 (the dequantized copy,
    or an HF folder). A benchmark that compares the planner with the engine's default must plan this
    one: planned as bf16, the native 0.5B's decode was put at ~2.5x its time (benchmarks/prefix_cache.py,
    2026-12-06). Builds the GGUF kernel where the CPU may run it natively."""
    if resolved.kind != "gguf":
        return BF16
    from mixserve.models.loader import use_native_gguf

    return gguf_format(resolved.path) if use_native_gguf(None, None) else BF16


def gguf_format(path) -> WeightFormat:
    """The "gguf" WeightFormat of a GGUF file: the bytes per weight its tensors take as stored
    (block sizes per the GGUF spec, `n_bytes` of the `gguf` package's reader), over the layers' 2-D tensors,
    the LM head (`output.weight`, else the tied `token_embd.weight`) and the embedding; the label
    names the types by share of bytes (e.g. "Q4_K 68%, Q6_K 32%")."""
    from collections import Counter

    from mixserve.models.gguf_file import open_gguf

    body = [0, 0]
    types: Counter = Counter()
    head = embed = None
    for t in open_gguf(path).tensors:
        n, b = int(t.n_elements), int(t.n_bytes)
        if t.name == "token_embd.weight":
            embed = (n, b)
        elif t.name == "output.weight":
            head = (n, b)
        elif t.name.startswith("blk.") and len(t.shape) == 2:
            body[0] += n
            body[1] += b
            types[t.tensor_type.name] += b
    if embed is None or not body[0]:
        raise ValueError(f"{path}: no token_embd.weight or layer matmuls: not a decoder GGUF")
    head = head or embed
    total = sum(types.values())
    label = ", ".join(f"{k} {v / total:.0%}" for k, v in types.most_common())
    return WeightFormat("gguf", bytes_per_weight=body[1] / body[0], head_bytes_per_weight=head[1] / head[0],
                        embed_bytes_per_weight=embed[1] / embed[0], label=label)


def weight_bytes(cfg: ModelConfig, fmt: WeightFormat = BF16) -> dict:
    """Bytes held for the weights, by part: embed, layers (matmuls, biases, norms), lm_head
    (0 when tied and bf16: it is the embedding), total; decode_read is what one decode step
    reads (every layer's matmul weights and the LM head; one embedding row is negligible)."""
    shapes = linear_shapes(cfg)
    body = sum(fmt.linear_bytes(s.numel, s.in_features) for s in shapes if s.per_layer) * cfg.num_layers
    pc = param_count(cfg)
    small = (pc["per_layer"] - layer_linear_params(cfg)) * cfg.num_layers * 2 + pc["final_norm"] * 2
    head = shapes[-1]
    head_bytes = fmt.linear_bytes(head.numel, head.in_features, quantized=fmt.lm_head_int4)
    embed = fmt.embed_bytes_per_weight * pc["embed"]
    # a tied bf16 head is the embedding itself; an int4 head of a tied model is a second copy
    lm_head = 0.0 if (cfg.tie_word_embeddings and not (fmt.name == "int4" and fmt.lm_head_int4)) else head_bytes
    return {"embed": embed, "layers": body + small, "lm_head": lm_head, "total": embed + body + small + lm_head,
            "decode_read": body + small + head_bytes}


def kv_bytes_per_token(cfg: ModelConfig, dtype_bytes: int = 2) -> int:
    """K and V of one token in every layer: 2 * num_layers * num_kv_heads * head_dim * dtype_bytes."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype_bytes


def summary(cfg: ModelConfig, fmt: WeightFormat = BF16, context_tokens: int = 1024) -> dict:
    """Everything above in one dict for reports (FLOPs, bytes)."""
    return {
        "params": param_count(cfg),
        "linear_flops_per_token": linear_flops_per_token(cfg),
        "attention_flops_per_context_token": attention_flops(cfg, 1),
        "decode_flops_per_token_at_context": {"context": context_tokens,
                                              "flops": decode_flops_per_token(cfg, context_tokens)},
        "prefill_flops_per_token_at_prompt": {"prompt": context_tokens,
                                              "flops": prefill_flops_per_token(cfg, context_tokens)},
        "weight_bytes": weight_bytes(cfg, fmt),
        "format": fmt.name,
        "kv_bytes_per_token": kv_bytes_per_token(cfg),
    }
