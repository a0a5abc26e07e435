"""Rotary position embedding (Su et al. 2021, RoFormer), rotate-half (GPT-NeoX / HF) layout."""
from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables for positions [0, max_positions).

    Args:
        head_dim: rotary dimension (the whole head here).
        max_positions: table length in tokens.
        theta: base frequency (the model's rope_theta / GGUF `rope.freq_base`).
    tables(positions [T] int64) -> (cos, sin) [T, 1, d], looked up once per forward pass;
    apply(q [T, H, d], k [T, Hkv, d], cos, sin) -> rotated (q, k), same dtypes, in each layer.
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float, dtype: torch.dtype):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos().to(dtype), persistent=False)
        self.register_buffer("sin", emb.sin().to(dtype), persistent=False)

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def apply(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        return q * cos + self._rotate_half(q) * sin, k * cos + self._rotate_half(k) * sin

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        return self.apply(q, k, *self.tables(positions))
