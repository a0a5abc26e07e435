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
    tables(positions [T] int64) -> (cos, signed sin) [T, 1, d], looked up once per forward pass;
    rotate(x [T, heads, d] (q and k heads side by side), cos, sin) -> rotated x, in each layer;
    forward(positions, q, k) -> rotated (q, k), same dtypes.
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float, dtype: torch.dtype):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        # plain attributes, not buffers (device.move_module moves them): Dynamo keeps a buffer's
        # shapes static even when marked dynamic, and the tables' length (max_model_len) must not
        # be part of the decode graph (engine/decode_graph.py, _symbolic)
        self.cos = emb.cos().to(dtype)
        self.sin = emb.sin().to(dtype)
        # rotate_half(x) * sin == roll(x, d/2) * [-sin, sin]: one roll instead of chunk, neg, cat
        half = head_dim // 2
        self.sin_signed = torch.cat((-emb[:, :half].sin(), emb[:, half:].sin()), -1).to(dtype)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions].unsqueeze(1), self.sin_signed[positions].unsqueeze(1)

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
        # the same products and sum as x * cos + rotate_half(x) * sin, so the same rounding
        return x * cos + x.roll(x.shape[-1] // 2, -1) * sin_signed

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        cos, sin = self.tables(positions)
        return self.rotate(q, cos, sin), self.rotate(k, cos, sin)
