"""Decoder configuration for the Llama / Qwen2 family, read from HF config.json or GGUF metadata."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class ModelConfig:
    """Shape and hyper-parameters of a Llama-family decoder.

    Sizes are in elements (not bytes); `head_dim` defaults to hidden_size // num_heads.
    `eos_token_ids` holds every id that ends a sequence (the config's EOS plus the ids the
    generation config lists; for Qwen2.5 both `<|im_end|>` and `<|endoftext|>`).
    """

    arch: str  # "llama" or "qwen2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V for one token across all layers."""
        return 2 * self.num_layers * self.kv_size * dtype_bytes

    @classmethod
    def from_hf(cls, cfg: dict, generation_config: dict | None = None) -> "ModelConfig":
        """Build from a HF `config.json` dict (model_type llama or qwen2).

        Raises:
            ValueError: unsupported model_type or rope scaling.
        """
        model_type = cfg.get("model_type")
        if model_type not in ("llama", "qwen2", "mistral"):
            raise ValueError(f"unsupported model_type {model_type!r}: mixserve runs llama/qwen2 decoders")
        scaling = cfg.get("rope_scaling")
        if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
            raise ValueError(f"unsupported rope_scaling {scaling!r}")
        rope_params = cfg.get("rope_parameters") or {}
        n_heads = cfg["num_attention_heads"]
        eos = _as_list(cfg.get("eos_token_id"))
        if generation_config:
            eos += [e for e in _as_list(generation_config.get("eos_token_id")) if e not in eos]
        return cls(
            arch="qwen2" if model_type == "qwen2" else "llama",
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=n_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or n_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(cfg.get("rope_theta") or rope_params.get("rope_theta") or 10000.0),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            eos_token_ids=eos,
            bos_token_id=cfg.get("bos_token_id"),
        )

    def to_hf(self) -> dict:
        """The HF config.json dict for this config (used for the dequantized cache folder)."""
        model_type = self.arch
        return {
            "architectures": ["Qwen2ForCausalLM" if model_type == "qwen2" else "LlamaForCausalLM"],
            "model_type": model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "hidden_act": "silu",
            "eos_token_id": self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else self.eos_token_ids,
            "bos_token_id": self.bos_token_id,
            "torch_dtype": "float32",
        }

    @classmethod
    def from_folder(cls, folder: str | Path) -> "ModelConfig":
        folder = Path(folder)
        cfg = json.loads((folder / "config.json").read_text())
        gen_path = folder / "generation_config.json"
        gen = json.loads(gen_path.read_text()) if gen_path.exists() else None
        return cls.from_hf(cfg, gen)

    def as_dict(self) -> dict:
        return asdict(self)


def _as_list(x) -> list[int]:
    if x is None:
        return []
    return list(x) if isinstance(x, (list, tuple)) else [x]
