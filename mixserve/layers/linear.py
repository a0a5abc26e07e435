"""Linear layers: dense (plain F.linear or oneDNN-prepacked, chosen by measurement) and weight-only int4."""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from mixserve.layers import bf16_gemv, gguf_linear, graph_ops, int4_vnni, invariant_linear
from mixserve.layers.int4_dequant import _unpack_int4pack_cpu, dequantize_int4pack, scratch
from mixserve.layers.kernel_choice import (FLOAT_HEAD_ROWS, geomean, rotating_copies, switch_candidates,
                                           time_calls)


# read once: the query is not traceable, and a decode graph would break at it
_MKLDNN = torch.backends.mkldnn.is_available()


def _can_prepack(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and _MKLDNN
            and weight.dtype in (torch.float32, torch.bfloat16))


class DenseLinear(nn.Module):
    """y = x @ W^T + b, W [out_features, in_features] in the compute dtype.

    Kernels, chosen per machine by measurement (layers/kernel_choice.py, `set_impl`): "plain"
    (F.linear, PyTorch's eager path, the default), "onednn" (the weight reordered once into
    oneDNN's blocked layout, as Inductor does for frozen CPU linears; on a Zen 5 it was 1.37x
    F.linear at 1 row, on the AVX-512/AMX Xeon 0.87x) or "gemv" (bf16 only, where AVX512-BF16
    exists: layers/bf16_gemv.py for up to bf16_gemv.MAX_ROWS rows, F.linear above); or
    "invariant" (layers/invariant_linear.py: each row computed alike at any row count, float32
    accumulation rounded once; the batch-invariant mode's, layers/batch_invariance.py). Only one
    copy of the weight is resident.

    float_out (set on an LM head): the result is float32 whatever the weight's dtype, the product
    of the bf16 operands with float32 accumulation left unrounded (`forward_float`).

    Args: weight [out, in] float32/bfloat16; bias [out] or None.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.bias = bias.contiguous() if bias is not None else None
        self.packed = None
        self.inv_packed = None  # "invariant": the weight in invariant_linear's panel layout
        self.weight = weight
        self.impl = "plain"
        self.float_out = False
        self.float_gemv_rows = 0  # float_out: rows below which the gemv kernel gives the result
        # the plain weight is held elsewhere anyway (a tied LM head's embedding): kept beside a
        # prepacked copy, it costs no memory and lets the gemv kernel serve few rows
        self.keep_plain = False

    def set_impl(self, impl: str, packed: torch.Tensor | None = None) -> bool:
        """Switch kernel: "plain", "onednn", "gemv" or "invariant"; a kernel that cannot take this
        weight (oneDNN off, not bf16, no AVX512-BF16, no AVX2) leaves it on "plain". packed: for
        "invariant", the weight already in its panel layout (a memory-mapped copy from an earlier
        start, models/packed_weights.py), taken where its shape, dtype and sampled panels match
        this weight, else packed anew. Returns whether `packed` was taken. Raises ValueError for
        another name."""
        if impl not in ("plain", "onednn", "gemv", "invariant"):
            raise ValueError(f"dense linear: unknown kernel {impl!r} (plain, onednn, gemv or invariant)")
        if impl == self.impl:
            return False
        if self.packed is not None:
            self.weight = self.weight if self.weight is not None else self.packed.to_dense()
            self.packed = None
        if self.inv_packed is not None:
            self.weight = self.dense_weight()
            self.inv_packed = None
        self.impl = "plain"
        taken = False
        if impl == "invariant" and self.weight.dtype in (torch.float32, torch.bfloat16) \
                and self.weight.device.type == "cpu" and invariant_linear.available():
            taken = packed is not None and invariant_linear.matches(packed, self.weight)
            self.inv_packed = packed if taken else invariant_linear.pack(self.weight)
            self.impl = "invariant"
            self.weight = self.weight.contiguous() if self.keep_plain else None
            if self.bias is not None:
                self._bias_f32 = self.bias.float().contiguous()
        elif impl == "gemv" and self.weight.dtype == torch.bfloat16 and self.weight.device.type == "cpu" \
                and bf16_gemv.available():
            self.weight, self.impl = self.weight.contiguous(), "gemv"
        elif impl == "onednn" and _can_prepack(self.weight):
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.contiguous(), batch_size=1)
                graph_ops.available()  # registers the op a captured decode graph calls it through
                self.weight = self.weight.contiguous() if self.keep_plain else None
                self.impl = "onednn"
            except RuntimeError:
                self.packed = None
        return taken

    def dense_weight(self) -> torch.Tensor:
        """The weight as a plain [out, in] tensor."""
        if self.weight is not None:
            return self.weight
        if self.inv_packed is not None:
            return invariant_linear.unpack(self.inv_packed, self.out_features)
        return self.packed.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.float_out:
            return self.forward_float(x)
        return self._forward(x)

    def forward_float(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> float32 [..., out]: x @ W^T + b accumulated in float32 and not rounded to
        the weight's dtype (a bf16 logit is a multiple of 0.125 at typical sizes). bf16 weights:
        below `float_gemv_rows` rows the gemv kernel's float32 output (layers/bf16_gemv.py); from
        there two oneDNN passes, y = bf16(xW + b) + bf16(xW + b - bf16(xW + b)), the second one
        adding the first's negation to its float32 accumulator before rounding, so the sum keeps
        about 16 significant bits (error ~1e-4 on a logit of 20). Which is cheaper at which rows
        is measured (`float_dense_head_candidates`). Without oneDNN: a float32 copy of W per call.
        The "invariant" kernel returns its float32 accumulator as is."""
        if self.impl == "invariant":
            return invariant_linear.linear(x, self.inv_packed, self.out_features,
                                           self._bias_f32 if self.bias is not None else None)
        if self.dense_weight_dtype() == torch.float32:
            return self._forward(x).float()
        x2 = x.reshape(-1, self.in_features)
        if x2.is_cuda:
            y = cuda_float_linear(x2, self.weight, self.bias)
        elif x2.shape[0] < self.float_gemv_rows and self.weight is not None:
            y = bf16_gemv.gemv(x2, self.weight, self.bias, torch.float32)
        elif _MKLDNN and x2.dtype == torch.bfloat16:
            hi = self._forward(x2)
            w = self.packed if self.packed is not None else self.weight
            y = hi.float() + graph_ops.onednn_linear_add(x2, hi.neg(), w, self.bias).float()
        else:
            b = self.bias.float() if self.bias is not None else None
            y = F.linear(x2.float(), self.dense_weight().float(), b)
        return y.view(*x.shape[:-1], self.out_features)

    def dense_weight_dtype(self) -> torch.dtype:
        """The weight's dtype, whichever form (plain or prepacked) holds it."""
        if self.weight is not None:
            return self.weight.dtype
        return (self.inv_packed if self.inv_packed is not None else self.packed).dtype

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.impl == "invariant":
            y = invariant_linear.linear(x, self.inv_packed, self.out_features,
                                        self._bias_f32 if self.bias is not None else None)
            return y.to(x.dtype)
        if self.packed is not None:
            if torch.compiler.is_compiling():  # Inductor cannot lower oneDNN's op on our own packed weight
                return graph_ops.onednn_linear(x, self.packed, self.bias, self.out_features)
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        if self.impl == "gemv" and x.dim() == 2 and x.shape[0] <= bf16_gemv.MAX_ROWS and x.dtype == torch.bfloat16:
            return bf16_gemv.gemv(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def cuda_float_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """float32 x @ w^T + b on CUDA from bf16 x [M, in] and w [out, in], accumulated in float32 and
    never rounded to bf16 (float logits: shared/cases/bf16-logit-granularity.md). cuBLAS's bf16
    GEMM accumulates in float32; its epilogue adds C in float32 before the one rounding, so
    hi = bf16(xW), lo = bf16(xW - hi) (addmm with C = -hi) and hi + lo keep ~16 significant bits
    at two reads of w, not the float32 copy of w per call that F.linear(x.float(), w.float())
    would write. float32 operands: one plain GEMM. Returns float32 [M, out]."""
    if w.dtype == torch.float32:
        return F.linear(x.float(), w, bias)
    x = x.to(w.dtype)
    hi = F.linear(x, w)
    y = hi.float() + torch.addmm(hi.neg(), x, w.t()).float()
    return y + bias.float() if bias is not None else y


DENSE_ROWS = (1, 4, 16, 128)


def dense_candidates(out_features: int, in_features: int, dtype: torch.dtype) -> dict:
    """Timers for kernel_choice: seconds per call of each dense kernel on this shape, the
    geometric mean over DENSE_ROWS rows (decode to prefill), weights rotating past the cache."""
    nbytes = out_features * in_features * torch.finfo(dtype).bits // 8

    def timer(impl):
        def run():
            base = torch.randn(out_features, in_features).to(dtype)

            def make():
                m = DenseLinear(base.clone())
                m.set_impl(impl)
                return m
            mods = rotating_copies(make, nbytes)
            return geomean(time_calls(mods, lambda m, x=torch.randn(r, in_features).to(dtype): m(x))
                           for r in DENSE_ROWS)
        return run

    cands = {"plain": timer("plain")}
    if _can_prepack(torch.empty(0, dtype=dtype)):
        cands["onednn"] = timer("onednn")
    if dtype == torch.bfloat16 and bf16_gemv.available():
        cands["gemv"] = timer("gemv")
    return cands


# revision of the many-row path's dequantization (gemm_weight): part of the int4_dense_rows key, so
# a switch point timed with an older, slower dequantization is measured again
DEQUANT_REV = 3
# Row counts at which the int4 kernel and dequantize + dense GEMM are timed to place the switch
INT4_ROWS = (1, 4, 16, 32, 64, 128, 512)
# largest weight (elements) dequantized into the reused scratch buffer: a 1.5B's fused gate/up
# (27.5M) fits; larger ones get a fresh tensor per call
SCRATCH_MAX_ELEMENTS = 32 << 20


def int4_supported(out_features: int, in_features: int, group_size: int) -> str | None:
    """None when PyTorch's CPU int4 kernel takes this shape, else why not."""
    if out_features % 16:
        return f"out_features {out_features} is not a multiple of 16 (int4 kernel)"
    if in_features % group_size or group_size % 32:
        return f"in_features {in_features} / group size {group_size} do not fit the int4 kernel"
    return None


class Int4Linear(nn.Module):
    """Weight-only int4 linear, y = x @ W^T + b with W = (q - zero) * scale group-wise along `in`.

    Few rows (decode): PyTorch's CPU int4 kernel `aten._weight_int4pack_mm_for_cpu`, which reads
    half a byte per weight. Its dequantization is w = (q - 8) * scale + zero', so AWQ's integer
    zero point z becomes zero' = (8 - z) * scale. Or, where `set_kernel("vnni")` is chosen by
    timing (`int4_kernel_candidates`), int8 activations x int4 weights in our own layout
    (layers/int4_vnni.py). From `dense_rows` rows (prefill, large batches;
    None: never, the default) the weight is dequantized for the call and the ordinary dense GEMM
    runs, where that beats the int4 kernel: where it does is measured per machine
    (`int4_candidates`, layers/kernel_choice.py). Only the packed integers stay resident (0.5 byte
    per weight plus scales).
    On CUDA (`to_device`) the weight is repacked for PyTorch's CUDA int4 kernel
    `aten._weight_int4pack_mm` (bf16 activations; the same (q - 8) * scale + zero' form), with the
    nibbles also kept as uint8 [out, in / 2] for the dense path's dequantization (float32 models,
    `dense_rows` and up).

    float_out (set on an LM head): the result is float32, within ~1e-3 of the float32 product of
    the activations with `float_weight()` (`forward_float`).

    Args:
        q: int32 [out, in] in [0, 15]; scales: [out, in / group_size] (float16 from checkpoints);
        zeros: int32 [out, in / group_size]; group_size: input channels per group;
        bias: [out] or None; dtype: compute dtype (float32 or bfloat16).
    Raises:
        ValueError: a shape the int4 kernel cannot take (see int4_supported).
    """

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                 bias: torch.Tensor | None, dtype: torch.dtype, dense_rows: int | None = None):
        super().__init__()
        self.out_features, self.in_features = q.shape
        why = int4_supported(self.out_features, self.in_features, group_size)
        if why:
            raise ValueError(why)
        want = (self.out_features, self.in_features // group_size)
        for name, t in (("scales", scales), ("zeros", zeros)):
            if tuple(t.shape) != want:
                raise ValueError(f"{name}: shape {tuple(t.shape)} does not match weight {tuple(q.shape)} at group "
                                 f"size {group_size} (expected {want})")
        if q.numel() and (q.min() < 0 or q.max() > 15):
            raise ValueError("q: int4 values must lie in [0, 15]")
        self.group_size = group_size
        self.dtype = dtype
        self.dense_rows = dense_rows
        self.bias = bias.to(dtype).contiguous() if bias is not None else None
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
        s = scales.float()
        zero = (8 - zeros.float()) * s
        # [in/g, out, 2] as the kernel wants; [out, in/g] copies for the dense path
        self.scales_and_zeros = torch.stack([s.t(), zero.t()], -1).to(dtype).contiguous()
        self.scale_rows = s.to(dtype)
        self.zero_rows = zero.to(dtype)
        self.kernel = "torch"  # or "vnni" (set_kernel): layers/int4_vnni.py, its own weight layout
        self.vq = self.vs = self.vm = None
        self.float_out = False
        self.float_dense_rows: int | None = None  # float_out: rows from which float32 dequant + GEMM run
        self.invariant = False  # batch-invariant mode: the float32 head's GEMM is invariant_linear's

    def set_kernel(self, kernel: str) -> None:
        """Few-row kernel: "torch" (PyTorch's int4 kernel, the default) or "vnni" (int8 activations
        x int4 weights, layers/int4_vnni.py, where it builds and takes the shape). The weight is
        repacked into the kernel's layout and the other layout dropped: one copy stays resident.
        Raises ValueError for another name."""
        if kernel not in ("torch", "vnni"):
            raise ValueError(f"int4 linear: unknown kernel {kernel!r} (torch or vnni)")
        if kernel == self.kernel:
            return
        n, k = self.out_features, self.in_features
        if kernel == "vnni":
            if not (int4_vnni.available() and int4_vnni.supported(k, self.group_size)):
                return
            s = self.scale_rows.float()
            self.vq = int4_vnni.pack(_unpack_int4pack_cpu(self.packed, n, k))
            self.vs, self.vm = s.half(), (self.zero_rows.float() - 8 * s).half()
            self.packed = self.scales_and_zeros = None
        else:
            q = int4_vnni.unpack(self.vq).to(torch.int32)
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)
            self.scales_and_zeros = torch.stack([self.scale_rows.t(), self.zero_rows.t()], -1).contiguous()
            self.vq = self.vs = self.vm = None
        self.kernel = kernel

    def int_weight(self) -> torch.Tensor:
        """The integers q [out, in] (uint8, 0..15) from whichever layout holds them."""
        n, k = self.out_features, self.in_features
        if self.kernel == "vnni":
            return int4_vnni.unpack(self.vq)
        if self.kernel == "cuda":
            return torch.stack([self.nibbles >> 4, self.nibbles & 15], -1).view(n, k)
        return _unpack_int4pack_cpu(self.packed, n, k)

    def to_device(self, device: torch.device) -> None:
        """Move to `device` (device.move_module). CUDA: the integers repacked for
        `aten._weight_int4pack_mm` (uint8 [out, in / 2], even input channel in the high nibble, then
        `_convert_weight_to_int4pack` with the most inner k-tiles the shape allows), scales and
        zero points as its [in / g, out, 2] bf16 table. Raises ValueError for another device type,
        or a shape the CUDA kernel cannot take (in % 32, out % 8)."""
        device = torch.device(device)
        if device.type == "cpu":
            return
        if device.type != "cuda":
            raise ValueError(f"int4 linear: no int4 layout for device {device}")
        n, k = self.out_features, self.in_features
        if n % 8 or k % 32 or self.group_size not in (32, 64, 128, 256):
            raise ValueError(f"int4 linear: the CUDA int4 kernel needs out % 8 == 0, in % 32 == 0 and a group size of "
                             f"32, 64, 128 or 256 (got {n}x{k}, group {self.group_size})")
        q = self.int_weight().to(torch.int32)
        self.nibbles = ((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8).to(device)
        inner = next(t for t in (8, 4, 2) if k % (t * 16) == 0)
        self.packed = torch.ops.aten._convert_weight_to_int4pack(self.nibbles, inner)
        self.scale_rows = self.scale_rows.to(device)
        self.zero_rows = self.zero_rows.to(device)
        self.scales_and_zeros = torch.stack([self.scale_rows.t(), self.zero_rows.t()], -1).to(torch.bfloat16) \
            .contiguous()
        self.bias = self.bias.to(device) if self.bias is not None else None
        self.vq = self.vs = self.vm = None
        self.kernel = "cuda"

    def _dequantize_nibbles(self, dtype: torch.dtype) -> torch.Tensor:
        """CUDA layout: (q - 8) * scale + zero' in `dtype`, [out, in], in plain PyTorch."""
        q = self.int_weight().view(self.out_features, -1, self.group_size).to(dtype)
        w = torch.addcmul(self.zero_rows.to(dtype).unsqueeze(-1), q - 8, self.scale_rows.to(dtype).unsqueeze(-1))
        return w.view(self.out_features, self.in_features)

    def weight_bytes(self) -> int:
        """Bytes a call reads below `dense_rows`: the kernel's layout (and, off CUDA, the scales)."""
        if self.kernel == "cuda":  # the nibbles are only read by the dequantize + GEMM path
            return sum(t.numel() * t.element_size() for t in (self.packed, self.scales_and_zeros))
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales_and_zeros, self.scale_rows,
                                                           self.zero_rows, self.vq, self.vs, self.vm,
                                                           getattr(self, "nibbles", None))
                   if t is not None)

    def dense_weight(self, reuse: bool = False) -> torch.Tensor:
        """The dequantized weight [out, in] in the compute dtype. reuse=True writes it into the
        thread's scratch buffer (int4_dequant.scratch), valid only until the next such call."""
        n = self.out_features * self.in_features
        # an LM head (a quarter billion weights) would pin its size in scratch for good
        out = scratch(n, self.dtype) if reuse and n <= SCRATCH_MAX_ELEMENTS else None
        if self.kernel == "cuda":
            return self._dequantize_nibbles(self.dtype)
        if self.kernel == "vnni":
            out = out if out is not None else torch.empty(n, dtype=self.dtype)
            return int4_vnni.dequantize(self.vq, self.vs, self.vm, self.group_size, out)
        w = dequantize_int4pack(self.packed, self.scale_rows, self.zero_rows, self.out_features, self.in_features,
                                self.group_size, out)
        if w is not None:
            return w
        return self._dequantize_torch_layout(self.dtype)

    def _dequantize_torch_layout(self, dtype: torch.dtype) -> torch.Tensor:
        """PyTorch's int4 layout dequantized in plain PyTorch, computed in `dtype`: [out, in]."""
        q = _unpack_int4pack_cpu(self.packed, self.out_features, self.in_features)
        q = q.view(self.out_features, -1, self.group_size).to(dtype)
        w = torch.addcmul(self.zero_rows.to(dtype).unsqueeze(-1), q - 8, self.scale_rows.to(dtype).unsqueeze(-1))
        return w.view(self.out_features, self.in_features)

    def float_weight(self) -> torch.Tensor:
        """The weight [out, in] dequantized in float32 from this layout's own scales (the vnni
        layout keeps them in float16, PyTorch's in the compute dtype): the operand float32 logits
        are checked against."""
        n = self.out_features * self.in_features
        if self.kernel == "cuda":
            return self._dequantize_nibbles(torch.float32)
        if self.kernel == "vnni":
            return int4_vnni.dequantize(self.vq, self.vs, self.vm, self.group_size, torch.empty(n))
        return self._dequantize_torch_layout(torch.float32)

    def forward_float(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> float32 [..., out], x @ float_weight()^T + b to ~1e-3. vnni layout:
        below `float_dense_rows` rows the kernel with three-level int8 activations
        (int4_vnni_matmul(levels=3)); from there the weight dequantized to float32 slice by
        slice and PyTorch's float32 GEMM (int4_vnni.linear_f32); where to switch is measured
        (`float_int4_head_candidates`). PyTorch's layout (no VNNI): a float32 dequantization per call."""
        x2 = x.reshape(-1, self.in_features).float()
        if self.kernel == "vnni" and (self.float_dense_rows is None or x2.shape[0] < self.float_dense_rows):
            y = int4_vnni.int4_vnni_matmul(x2, self.vq, self.vs, self.vm, self.group_size, levels=3)
        elif self.kernel == "vnni":
            y = int4_vnni.linear_f32(x2, self.vq, self.vs, self.vm, self.group_size)
        elif self.invariant and x2.device.type == "cpu":
            y = invariant_linear.linear(x2, invariant_linear.pack(self.float_weight()), self.out_features)
        else:
            y = F.linear(x2, self.float_weight())
        if self.bias is not None:
            y = y + self.bias.float()
        return y.view(*x.shape[:-1], self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.float_out:
            return self.forward_float(x)
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        x = x.to(self.dtype)
        if rows == 0:
            return x.new_zeros(*x.shape[:-1], self.out_features)
        if x.device.type == "cpu" and (self.dense_rows is None or rows < self.dense_rows):
            if self.kernel == "vnni":
                y = int4_vnni.int4_vnni_matmul(x.reshape(rows, -1), self.vq, self.vs, self.vm, self.group_size)
                y = y.to(self.dtype).view(*x.shape[:-1], self.out_features)
                return y + self.bias if self.bias is not None else y
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(rows, -1).contiguous(), self.packed,
                                                           self.group_size, self.scales_and_zeros)
            y = y.view(*x.shape[:-1], self.out_features)
            return y + self.bias if self.bias is not None else y
        if self.kernel == "cuda" and x.dtype == torch.bfloat16 and (self.dense_rows is None or rows < self.dense_rows):
            y = torch.ops.aten._weight_int4pack_mm(x.reshape(rows, -1).contiguous(), self.packed, self.group_size,
                                                   self.scales_and_zeros)
            y = y.view(*x.shape[:-1], self.out_features)
            return y + self.bias if self.bias is not None else y
        return F.linear(x, self.gemm_weight(), self.bias)

    def gemm_weight(self) -> torch.Tensor:
        """The dequantized weight as an [out, in] operand for the many-row GEMM, in the thread's
        scratch buffer (valid until the next such call). From PyTorch's layout it is written as
        W^T (contiguous [in, out], returned as its transposed view): that layout's 64-row blocks
        hold each input channel's outputs side by side, so the transposed form is written with
        vector stores at over twice the rate, and the GEMM reads either form at one speed. Both
        layouts' kernels write with non-temporal stores (layers/int4_dequant.py)."""
        n = self.out_features * self.in_features
        if self.kernel == "cuda":
            return self._dequantize_nibbles(self.dtype)
        if self.kernel == "torch" and n <= SCRATCH_MAX_ELEMENTS:
            wt = dequantize_int4pack(self.packed, self.scale_rows, self.zero_rows, self.out_features,
                                     self.in_features, self.group_size, scratch(n, self.dtype), transposed=True)
            if wt is not None:
                return wt.t()
        return self.dense_weight(reuse=True)


_INT4_TENSORS = ("packed", "scales_and_zeros", "scale_rows", "zero_rows", "vq", "vs", "vm")


def _int4_copies(out_features: int, in_features: int, group_size: int, dtype: torch.dtype, kernel: str) -> list:
    """Random Int4Linear modules of this shape on `kernel`, rotating past the last-level cache."""
    base = Int4Linear(torch.randint(0, 16, (out_features, in_features), dtype=torch.int32),
                      torch.rand(out_features, in_features // group_size) * 0.01 + 0.001,
                      torch.randint(0, 16, (out_features, in_features // group_size), dtype=torch.int32),
                      group_size, None, dtype)
    base.set_kernel(kernel)

    def make():
        m = copy.copy(base)  # the module's tensors cloned, not the quantization redone
        m._parameters, m._buffers, m._modules = {}, {}, {}
        for name in _INT4_TENSORS:
            t = getattr(base, name)
            setattr(m, name, None if t is None else t.clone())
        return m
    return rotating_copies(make, out_features * in_features // 2)


INT4_KERNEL_ROWS = (1, 4)


def int4_kernel_candidates(out_features: int, in_features: int, group_size: int, dtype: torch.dtype) -> dict:
    """Timers for kernel_choice's `int4_kernel` choice: seconds per call of "torch" (PyTorch's int4
    kernel) and, where it builds and takes the shape, "vnni" (layers/int4_vnni.py), the geometric
    mean over INT4_KERNEL_ROWS rows (decode), weights rotating past the cache."""
    def timer(kernel):
        def run():
            mods = _int4_copies(out_features, in_features, group_size, dtype, kernel)
            return geomean(time_calls(mods, lambda m, x=torch.randn(r, in_features).to(dtype): m(x))
                           for r in INT4_KERNEL_ROWS)
        return run

    cands = {"torch": timer("torch")}
    if int4_vnni.available() and int4_vnni.supported(in_features, group_size):
        cands["vnni"] = timer("vnni")
    return cands


def int4_candidates(out_features: int, in_features: int, group_size: int, dtype: torch.dtype,
                    kernel: str = "torch") -> dict:
    """Timers for kernel_choice's `int4_dense_rows` choice (switch_candidates over INT4_ROWS):
    the few-row int4 `kernel` against dequantize + dense GEMM, weights rotating past the cache."""
    mods: list = []

    def time_at(r, many):
        mods[:] = mods or _int4_copies(out_features, in_features, group_size, dtype, kernel)
        x = torch.randn(r, in_features).to(dtype)
        for m in mods:
            m.dense_rows = 0 if many else None
        return time_calls(mods, lambda m: m(x))
    return switch_candidates(INT4_ROWS, time_at)



def cuda_int4_candidates(lin: "Int4Linear") -> dict:
    """Timers for the CUDA `int4_dense_rows` choice of a placed Int4Linear (kernel "cuda"): PyTorch's
    CUDA int4 kernel against dequantize + cuBLAS GEMM over INT4_ROWS (switch_candidates), each the
    mean of 10 calls after 2 untimed ones, timed to the end of the GPU's work. The layer's own
    weights are timed (a GPU's L2 holds a layer: both paths are equally cache-warm)."""
    import time

    dev = lin.packed.device

    def time_at(r, many):
        x = torch.randn(r, lin.in_features, device=dev).to(lin.dtype)
        old = lin.dense_rows
        lin.dense_rows = 0 if many else None
        try:
            with torch.inference_mode():
                for _ in range(2):
                    lin(x)
                torch.cuda.synchronize(dev)
                t0 = time.perf_counter()
                for _ in range(10):
                    lin(x)
                torch.cuda.synchronize(dev)
            return (time.perf_counter() - t0) / 10
        finally:
            lin.dense_rows = old
    return switch_candidates(INT4_ROWS, time_at)


def float_dense_head_candidates(out_features: int, in_features: int, keep_plain: bool = False) -> dict:
    """Timers for a bf16 DenseLinear LM head's float32 path (`forward_float`): "onednn" and
    "plain" (two passes on the prepacked or plain weight at every row count), "gemv<R>" (the
    gemv kernel's float32 output below R rows, plain two passes from there) and, where the plain
    weight is kept anyway (`keep_plain`, a tied head), "onednn-gemv<R>" (gemv below R rows,
    prepacked two passes from there); each the geometric mean over FLOAT_HEAD_ROWS of seconds
    per call, weights rotating past the cache."""
    timed: dict[str, dict[int, float]] = {}

    def measure():
        if timed:
            return timed
        base = torch.randn(out_features, in_features).to(torch.bfloat16)
        # the gemv variant only where its kernel exists (AVX512-BF16): elsewhere it is no candidate
        for variant in ("onednn", "plain") + (("gemv",) if bf16_gemv.available() else ()):
            def make():
                m = DenseLinear(base.clone())
                m.set_impl("onednn" if variant == "onednn" else "plain")
                m.float_out, m.float_gemv_rows = True, (1 << 30) if variant == "gemv" else 0
                return m
            mods = rotating_copies(make, out_features * in_features * 2, max_copies=4)
            timed[variant] = {r: time_calls(mods, lambda m, x=torch.randn(r, in_features).to(torch.bfloat16): m(x))
                              for r in FLOAT_HEAD_ROWS}
        return timed

    cands = {v: (lambda v=v: geomean(measure()[v].values())) for v in ("onednn", "plain")}
    if not _can_prepack(torch.empty(0, dtype=torch.bfloat16)):
        del cands["onednn"]
    if bf16_gemv.available():
        for above in ("plain", "onednn") if keep_plain and "onednn" in cands else ("plain",):
            for R in FLOAT_HEAD_ROWS[1:]:
                name = f"gemv{R}" if above == "plain" else f"onednn-gemv{R}"
                cands[name] = lambda R=R, above=above: geomean(measure()["gemv" if r < R else above][r]
                                                               for r in FLOAT_HEAD_ROWS)
    return cands


def float_int4_head_candidates(lin: "Int4Linear") -> dict:
    """Timers for an int4 (vnni layout) LM head's switch between its few-row and many-row float32
    paths (switch_candidates over FLOAT_HEAD_ROWS): the three-level int8 kernel against a float32
    dequantization and GEMM, on random weights of `lin`'s shape rotating past the cache."""
    mods: list = []

    def time_at(r, many):
        if not mods:
            mods[:] = _int4_copies(lin.out_features, lin.in_features, lin.group_size, lin.dtype, "vnni")
            for m in mods:
                m.float_out = True
        x = torch.randn(r, lin.in_features).to(torch.bfloat16)
        for m in mods:
            m.float_dense_rows = 0 if many else None
        return time_calls(mods, lambda m: m(x))
    return switch_candidates(FLOAT_HEAD_ROWS, time_at)


def choose_linear_kernel(lin: nn.Module, chooser, dtype: torch.dtype, invariant: bool = False) -> None:
    """Set `lin` (DenseLinear, Int4Linear or GGUFLinear) to the kernel `chooser` (kernel_choice.KernelChooser)
    picks for its shape and `dtype`; the one place that names these choices' keys, so the engine
    and `hw probe` time and run the same kernels. Other modules are left alone. On CUDA (a layer
    already placed there) a dense linear is cuBLAS's and an int4 one gets its measured switch to
    dequantize + GEMM (key int4_dense_rows/cuda/<GPU>/...). invariant (batch-invariant mode,
    layers/batch_invariance.py): only the choices that leave a row's numerics alone at every row
    count are timed (a GGUF weight's prefetch, an int4 layer's few-row kernel); dense kernels and
    row switches are that mode's."""
    dt = str(dtype).removeprefix("torch.")
    if isinstance(lin, Int4Linear) and lin.kernel == "cuda":
        if lin.dtype == torch.bfloat16:  # float32 models run dequantize + GEMM at every row count
            gpu = torch.cuda.get_device_name(lin.packed.device).replace(" ", "-")
            key = f"int4_dense_rows/cuda/{gpu}/{dt}/{lin.out_features}x{lin.in_features}g{lin.group_size}"
            pick = chooser.choose(key, cuda_int4_candidates(lin), "never")
            lin.dense_rows = None if pick == "never" else int(pick)
        return
    if isinstance(lin, DenseLinear) and lin.weight is not None and lin.weight.is_cuda:
        return  # cuBLAS: nothing to choose
    if invariant and isinstance(lin, DenseLinear):
        return
    if isinstance(lin, gguf_linear.GGUFLinear):
        gguf_linear.choose(lin, chooser, switches=not invariant)
    elif isinstance(lin, DenseLinear) and lin.float_out and dtype == torch.bfloat16:
        n, k = lin.out_features, lin.in_features
        tied = "/tied" if lin.keep_plain else ""
        pick = chooser.choose(f"float_head/{dt}/{n}x{k}{tied}", float_dense_head_candidates(n, k, lin.keep_plain),
                              "plain")
        lin.set_impl("onednn" if pick.startswith("onednn") else "plain")
        # a pick cached on a machine with the gemv kernel is not one here
        lin.float_gemv_rows = int(pick.rsplit("gemv", 1)[1]) if "gemv" in pick and bf16_gemv.available() else 0
    elif isinstance(lin, DenseLinear):
        key = f"dense_linear/{dt}/{lin.out_features}x{lin.in_features}"
        lin.set_impl(chooser.choose(key, dense_candidates(lin.out_features, lin.in_features, dtype), "plain"))
    elif isinstance(lin, Int4Linear):
        shape = f"{lin.out_features}x{lin.in_features}g{lin.group_size}"
        n, k, g = lin.out_features, lin.in_features, lin.group_size
        if lin.float_out:
            # an LM head: the torch kernel has no float32-output path worth having (a scalar loop,
            # ~20x slower); the vnni layout has one (multi-level int8 activations) where it builds
            lin.set_kernel("vnni")
        else:
            lin.set_kernel(chooser.choose(f"int4_kernel/{dt}/{shape}", int4_kernel_candidates(n, k, g, dtype), "torch"))
        if invariant:
            return
        if lin.float_out:  # forward_float has its own switch; dense_rows is never read
            if lin.kernel == "vnni":
                pick = chooser.choose(f"float_head_rows/{dt}/{shape}/vnni/l3", float_int4_head_candidates(lin),
                                      "never")
                lin.float_dense_rows = None if pick == "never" else int(pick)
            return
        # where the many-row switch pays depends on the few-row kernel it switches from
        layout = "" if lin.kernel == "torch" else f"/{lin.kernel}"
        key = f"int4_dense_rows/{dt}/{shape}{layout}/deq{DEQUANT_REV}"
        pick = chooser.choose(key, int4_candidates(n, k, g, dtype, lin.kernel), "never")
        lin.dense_rows = None if pick == "never" else int(pick)
