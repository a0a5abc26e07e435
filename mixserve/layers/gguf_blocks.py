"""GGUF block formats read as integers and scale fields (not dequantized), for the native kernels.

Block layouts as in ggml's `ggml-common.h` (block_q4_0 ... block_q6_K), the same the `gguf`
package's `gguf.quants` dequantizes. Each parser takes one tensor's blocks, uint8
[rows, blocks per row, bytes per block], and returns `Fields`: unsigned integers q and the affine
map of each group of `group` input channels, w = s_g * q + m_g, with s_g = d * sc_g and m_g one
of -zero * s_g, dm_g, dm * mn_g (layers/gguf_kernels.py explains the forms).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Fields:
    """One tensor's integers and scales, rows x K input channels.

    q: uint8 [rows, K] unsigned integers; d: float16 [rows, K / superblock]; sc: int8
    [rows, K / group] or None (s_g = d); dm: float16 like d or None; mn: uint8 like sc or None;
    zero: the symmetric types' integer offset (m_g = -zero * s_g when dm is None); bits: q's width.
    """

    q: np.ndarray
    d: np.ndarray
    sc: np.ndarray | None
    dm: np.ndarray | None
    mn: np.ndarray | None
    group: int
    superblock: int
    zero: int
    bits: int


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16)[..., 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., n] bytes -> [..., 2n]: the low nibbles, then the high nibbles (ggml's order in a block)."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def parse_q4_0(b):
    rows, nb, _ = b.shape
    return Fields(_nibbles(b[..., 2:18]).reshape(rows, nb * 32), _f16(b[..., 0:2]), None, None, None, 32, 32, 8, 4)


def parse_q4_1(b):
    rows, nb, _ = b.shape
    return Fields(_nibbles(b[..., 4:20]).reshape(rows, nb * 32), _f16(b[..., 0:2]), None, _f16(b[..., 2:4]), None,
                  32, 32, 0, 4)


def parse_q5_0(b):
    rows, nb, _ = b.shape
    # qh: a little-endian uint32 per block, bit j = channel j's bit 4 (numpy's broadcast shift by an
    # array of counts took 19 s on the 0.5B's embedding; unpackbits takes a fraction of one)
    hb = np.unpackbits(b[..., 2:6], axis=-1, bitorder="little")
    q = _nibbles(b[..., 6:22]) | (hb << 4)
    return Fields(q.reshape(rows, nb * 32), _f16(b[..., 0:2]), None, None, None, 32, 32, 16, 5)


def parse_q8_0(b):
    rows, nb, _ = b.shape
    q = (b[..., 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return Fields(q.reshape(rows, nb * 32), _f16(b[..., 0:2]), None, None, None, 32, 32, 128, 8)


def _k4_scale_min(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 scale bytes -> 8 six-bit scales and 8 six-bit mins (ggml's get_scale_min_k4)."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def parse_q4_k(b):
    rows, nb, _ = b.shape
    sc, mn = _k4_scale_min(b[..., 4:16])
    q = _nibbles(b[..., 16:144].reshape(rows, nb, 4, 32))  # 4 x 64 channels
    dm = -_f16(b[..., 2:4])  # m_g = -dmin * mn_g: the sign flip is exact
    return Fields(q.reshape(rows, nb * 256), _f16(b[..., 0:2]), sc.reshape(rows, nb * 8).astype(np.int8),
                  dm, mn.reshape(rows, nb * 8), 32, 256, 0, 4)


def parse_q6_k(b):
    rows, nb, _ = b.shape
    ql = b[..., 0:128].reshape(rows, nb, 2, 64)
    ql = np.stack([ql & 15, ql >> 4], axis=3).reshape(rows, nb, 8, 32)  # [half, nibble, 64]
    qh = b[..., 128:192].reshape(rows, nb, 2, 32)
    qh = np.stack([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=3).reshape(rows, nb, 8, 32)  # [half, shift, 32]
    q = ql | (qh << 4)
    sc = b[..., 192:208].view(np.int8)
    return Fields(q.reshape(rows, nb * 256), _f16(b[..., 208:210]), sc.reshape(rows, nb * 16), None, None,
                  16, 256, 32, 6)


# (channels, bytes) per block, as gguf.GGML_QUANT_SIZES
BLOCK_SIZES = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q8_0": (32, 34), "Q4_K": (256, 144),
               "Q6_K": (256, 210)}
PARSERS = {"Q4_0": parse_q4_0, "Q4_1": parse_q4_1, "Q5_0": parse_q5_0, "Q8_0": parse_q8_0,
           "Q4_K": parse_q4_k, "Q6_K": parse_q6_k}


def parse(qtype: str, blocks: np.ndarray, k: int) -> Fields:
    """One tensor's Fields from its blocks, uint8 [rows, row bytes] of type `qtype` (a key of
    PARSERS), k input channels a row. Raises ValueError for a row size that does not hold k
    channels."""
    n = blocks.shape[0]
    bs, ts = BLOCK_SIZES[qtype]
    if k % bs or blocks.shape[1] != k // bs * ts:
        raise ValueError(f"GGUF {qtype}: {blocks.shape[1]} bytes per row do not hold {k} channels")
    return PARSERS[qtype](np.ascontiguousarray(blocks).reshape(n, k // bs, ts))


def dequantize(qtype: str, blocks: np.ndarray, k: int):
    """A tensor's effective weights from its blocks: float32 torch [rows, k], equal bit for bit to
    `gguf.quants.dequantize` (every s_g * q is exact in float32, so one rounding remains, the
    add of m_g, as in gguf's float32 arithmetic), in PyTorch's vectorised, threaded elementwise
    ops rather than numpy's: the 0.5B's 170 such tensors 6.1-9.4 s -> 3.8-4.5 s on 2 AVX2 cores
    (benchmarks/gguf_read.py, issue 32).

    blocks: uint8 [rows, row bytes] of type `qtype` (a key of PARSERS); no rows give [0, k]. Raises
    ValueError for another type or a row size that does not hold k channels. Source: ggml-common.h
    block layouts.
    """
    import torch

    if qtype not in PARSERS:
        raise ValueError(f"GGUF type {qtype}: no parser (have {', '.join(PARSERS)})")
    f = parse(qtype, blocks, k)
    n = blocks.shape[0]
    if n == 0:
        return torch.empty(0, k)
    per_super = f.superblock // f.group
    # float16 -> float32 in numpy, which keeps a NaN's sign and payload as gguf.quants does (torch
    # makes every NaN 0x7fffffff)
    d = torch.from_numpy(f.d.astype(np.float32))  # [n, k / superblock]
    s = d.repeat_interleave(per_super, dim=1) if per_super > 1 else d
    if f.sc is not None:
        s = s * torch.from_numpy(np.ascontiguousarray(f.sc)).float()  # exact: 11 x 8 bits
    q = torch.from_numpy(np.ascontiguousarray(f.q)).view(n, -1, f.group)
    if f.dm is None:  # symmetric: w = s * (q - zero)
        w = (q.to(torch.int16) - f.zero).float()
        w *= s.unsqueeze(-1)
        return w.view(n, k)
    m = torch.from_numpy(f.dm.astype(np.float32))
    if f.mn is not None:
        m = m.repeat_interleave(per_super, dim=1) * torch.from_numpy(np.ascontiguousarray(f.mn)).float()
    w = q.float()
    w *= s.unsqueeze(-1)
    w += m.unsqueeze(-1)
    return w.view(n, k)
