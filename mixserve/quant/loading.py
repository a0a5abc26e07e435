"""Building a model's linears from dense, AWQ-checkpoint or round-to-nearest-on-load weights."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from mixserve.layers.gguf_linear import GGUFLinear, GGUFWeight
from mixserve.layers.linear import DenseLinear, Int4Linear, int4_supported
from mixserve.quant.groupwise import quantize_groupwise
from mixserve.quant.pack import dequantize_awq, unpack_awq


@dataclass
class QuantSpec:
    """How linears are stored.

    method: "awq" (integers from an AutoAWQ GEMM checkpoint: `<name>.qweight/.qzeros/.scales`)
        or "rtn" (round-to-nearest at load from dense `<name>.weight`).
    group_size: input channels per scale/zero pair. lm_head: also quantize the LM head (rtn at
    load, group lm_head_group_size, when the checkpoint stores it dense).
    dense: filled at load with "name: reason" for every linear left in the compute dtype.
    """

    method: str
    group_size: int = 128
    lm_head: bool = False
    lm_head_group_size: int = 128
    dense: list[str] = field(default_factory=list)

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "QuantSpec | None":
        """The spec for an HF config.json's `quantization_config`, None when there is none.

        Raises ValueError for a quantization mixserve cannot run (only AWQ GEMM, 4 bits, zero point).
        """
        qc = cfg.get("quantization_config")
        if not qc:
            return None
        method = str(qc.get("quant_method", "")).lower()
        if method != "awq":
            raise ValueError(f"quantization_config: quant_method {method!r} is not supported (only awq)")
        if qc.get("bits", qc.get("w_bit")) != 4 or not qc.get("zero_point", True):
            raise ValueError("quantization_config: only 4-bit AWQ with zero points is supported")
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"quantization_config: AWQ version {version!r} is not supported (only gemm)")
        g = qc.get("group_size", qc.get("q_group_size", 128))
        if not isinstance(g, int) or isinstance(g, bool) or g < 32 or g % 32:
            raise ValueError(f"quantization_config: group_size must be a positive multiple of 32 (got {g!r})")
        return cls("awq", g)


def _awq_parts(w: dict, name: str, group_size: int):
    for leaf in ("qweight", "qzeros", "scales"):
        if f"{name}.{leaf}" not in w:
            raise ValueError(f"checkpoint: missing tensor {name}.{leaf}")
    q = unpack_awq(w[name + ".qweight"]).t()
    z = unpack_awq(w[name + ".qzeros"]).t()
    s = w[name + ".scales"].t()
    if s.shape != z.shape or q.shape[1] != s.shape[1] * group_size or q.shape[0] != s.shape[0]:
        raise ValueError(f"checkpoint: {name} has qweight {tuple(q.t().shape)} int4 values, scales "
                         f"{tuple(s.t().shape)}, qzeros {tuple(z.t().shape)} unpacked: these do not fit group size "
                         f"{group_size} (config.json quantization_config)")
    return q, s, z


def _gguf_linear(w: dict, names: list[str], bias, dtype: torch.dtype) -> nn.Module:
    """A GGUFLinear over native GGUF parts, runs of one type concatenated into one part."""
    runs: list[list[GGUFWeight]] = []
    for n in names:
        t = w[n + ".weight"]
        if runs and runs[-1][0].qtype == t.qtype:
            runs[-1].append(t)
        else:
            runs.append([t])
    return GGUFLinear([GGUFWeight.concat(r) if len(r) > 1 else r[0] for r in runs], bias, dtype)


def make_linear(w: dict[str, torch.Tensor], names: list[str], dtype: torch.dtype, quant: QuantSpec | None,
                allow_quant: bool = True, rtn_group: int | None = None) -> nn.Module:
    """One linear over the row-wise concatenation of `names` (e.g. q/k/v projections).

    w: HF-named tensors; each name has `.weight` [out, in] (or a GGUFWeight: a native GGUF load,
    giving a GGUFLinear) or, in AWQ checkpoints, `.qweight`, `.qzeros`, `.scales` (pack.py), and an
    optional `.bias`. Returns Int4Linear when every part is int4 and the shape suits the int4
    kernel, else DenseLinear (noting why in quant.dense).
    rtn_group: round dense-stored weights to int4 at this group size whatever quant.method is
    (the LM head of an AWQ model on request).
    Raises ValueError when a weight is missing.
    """
    bias = None
    if all(n + ".bias" in w for n in names):
        bias = torch.cat([w[n + ".bias"].to(dtype) for n in names])
    native = [isinstance(w.get(n + ".weight"), GGUFWeight) for n in names]
    if all(native):
        return _gguf_linear(w, names, bias, dtype)
    if any(native):  # a part of a type without a kernel beside native ones: the fused linear runs dense
        w = {**w, **{n + ".weight": w[n + ".weight"].dequantize() for n, is_q in zip(names, native) if is_q}}
    is_awq = [n + ".qweight" in w for n in names]
    if any(is_awq) and quant is None:
        raise ValueError(f"checkpoint: {names[0]} holds int4 tensors (qweight) but config.json has no "
                         "quantization_config")
    for n, awq in zip(names, is_awq):
        if not awq and n + ".weight" not in w:
            raise ValueError(f"checkpoint: missing tensor {n}.weight")
    label = "+".join(n.rsplit(".", 1)[-1] for n in names)
    if quant is not None and allow_quant and all(is_awq):
        g = quant.group_size
        parts = [_awq_parts(w, n, g) for n in names]
        q, s, z = (torch.cat([p[i] for p in parts]) for i in range(3))
        why = int4_supported(q.shape[0], q.shape[1], g)
        if why is None:
            return Int4Linear(q, s, z, g, bias, dtype)
        quant.dense.append(f"{names[0].rsplit('.', 2)[0]}.{label}: {why}")
    dense = []
    for n, awq in zip(names, is_awq):
        if awq:
            dense.append(dequantize_awq(w[n + ".qweight"], w[n + ".qzeros"], w[n + ".scales"],
                                        quant.group_size if quant else 128, dtype))
        else:
            dense.append(w[n + ".weight"].to(dtype))
    weight = torch.cat(dense) if len(dense) > 1 else dense[0]
    if quant is not None and allow_quant and (quant.method == "rtn" or rtn_group):
        g = rtn_group or quant.group_size
        why = int4_supported(weight.shape[0], weight.shape[1], g)
        if why is None:
            try:
                q, s, z = quantize_groupwise(weight.float(), g)
            except ValueError as e:
                raise ValueError(f"{names[0].rsplit('.', 1)[0]}: cannot round to int4: {e}") from None
            return Int4Linear(q, s, z, g, bias, dtype)
        quant.dense.append(f"{names[0].rsplit('.', 2)[0]}.{label}: {why}")
    elif quant is not None and quant.method == "awq" and allow_quant and not all(is_awq):
        quant.dense.append(f"{names[0].rsplit('.', 2)[0]}.{label}: stored dense in the checkpoint")
    return DenseLinear(weight, bias)
