"""Batch invariance: one numeric path per weight and row, whatever the batch.

A request's logits must be a function of the request alone: not of the rows beside it in a step,
of whether its prefix came from the cache, of how its prompt was chunked, of speculation, or of
the eager or compiled path (shared/cases/seeded-output-depends-on-batch.md; the problem named in
"Defeating Nondeterminism in LLM Inference", He and Thinking Machines Lab, 2025). Each source
found, and what this mode does about it:

- dense GEMMs: MKL's and oneDNN's kernels, and so the rounding of a row, change with the row
  count (on the AVX2 EPYC, F.linear float32: M = 1 | 2-3 | 4+). Every dense linear (LM head
  included, float32 logits straight from the accumulator) runs `layers/invariant_linear.py`,
  whose rows are computed by the same operations at any row count;
- row-count switches: an int4 / GGUF layer's integer kernel below a measured row count,
  bf16 dequantize + GEMM above it, and the float32 head's three-level kernel against a float32
  dequantize + GEMM. The switches are off: the few-row kernel (whose rows are computed alike in
  tiles of 1-4) runs at every row count, and a torch-layout int4 head dequantizes to float32 for
  the invariant GEMM;
- attention: decode rows went through SDPA, batched matmuls or the paged kernel by a measured
  choice, over a context padded to the longest row of the group; prefill chunks through SDPA,
  whose KV blocking depends on the chunk's length. Here every query row, decode or prefill, runs
  the paged kernel (`paged_decode.paged_rows`) over exactly its own context in block order;
- the compiled decode graph: Inductor's fused RMSNorm reduces the squares in another order than
  eager's, and in bf16 its fused elementwise code keeps float32 intermediates that eager rounds.
  (and in float32 its SwiGLU product rounds the last I mod 16 columns of a row unlike eager's scalar
  tail). Here RMSNorm and SiLU(gate) x up are opaque ops (`rmsnorm.rms_norm_op`, `silu_mul_op`,
  eager's arithmetic) in both, and the
  graph is compiled with Inductor's `emulate_precision_casts` (eager's roundings), so the 1-row
  graph, the many-row graph and the eager step give the same bits (engine/decode_graph.py).

Norms, softmax, sampling and the rest are per-row PyTorch ops whose result does not depend on the
row count (checked in tests/unit/test_batch_invariance.py). The guarantee holds for one machine
kind, one set of kernel choices and one mixserve version.
"""
from __future__ import annotations

from torch import nn

from mixserve.layers import invariant_linear
from mixserve.layers.paged_decode import available as paged_available


def unavailable() -> str | None:
    """None where this mode can run here, else why not (a kernel did not build, or none may)."""
    import os

    if os.environ.get("MIXSERVE_NO_CPP_KERNELS"):
        return "its C++ kernels are turned off (MIXSERVE_NO_CPP_KERNELS)"
    if not invariant_linear.available():
        return "the invariant GEMM (layers/invariant_linear.py, AVX2 + FMA) did not build"
    if not paged_available():
        return "the paged attention kernel (layers/paged_decode.py) did not build"
    return None


def apply(model: nn.Module, packed: dict | None = None) -> int:
    """Put every layer of `model` (a LlamaForCausalLM on the CPU, after its kernel choice) on its
    batch-invariant path: dense linears on the invariant GEMM, the int4 / GGUF row switches off,
    attention on the paged kernel for every row (model.batch_invariant = True, read by the model
    runner). packed: {module name: weight in the GEMM's panel layout} kept from an earlier start
    (models/packed_weights.py), each taken where it matches (DenseLinear.set_impl). Returns how
    many dense linears were packed anew. Raises RuntimeError where `unavailable()` says why not."""
    from mixserve.layers.linear import DenseLinear
    from mixserve.layers.rmsnorm import RMSNorm

    why = unavailable()
    if why:
        raise RuntimeError(f"batch invariance: {why}")
    fresh = 0
    for name, m in model.named_modules():
        if isinstance(m, DenseLinear) and m.impl != "invariant":
            fresh += not m.set_impl("invariant", (packed or {}).get(name))
        else:
            apply_linear(m)
        if isinstance(m, RMSNorm):
            m.opaque = True
    for layer in getattr(model, "layers", []):
        layer.decode_attention = "paged"
        layer.opaque_mlp = True
    model.batch_invariant = True
    return fresh


def clear(model: nn.Module) -> None:
    """Undo `apply`'s flags (a model reused by an engine with the mode off); the linears' kernels
    are then set again by the kernel choice."""
    from mixserve.layers.linear import Int4Linear
    from mixserve.layers.rmsnorm import RMSNorm

    for m in model.modules():
        if isinstance(m, RMSNorm):
            m.opaque = False
        elif isinstance(m, Int4Linear):
            m.invariant = False
    for layer in getattr(model, "layers", []):
        layer.opaque_mlp = False
    model.batch_invariant = False


def apply_linear(m: nn.Module) -> None:
    """One linear (DenseLinear, Int4Linear, GGUFLinear; other modules are left alone) on its
    batch-invariant path, as `apply` puts a model's (also what `hw probe` times, so the planner
    costs the kernels the engine runs). The caller has checked `unavailable()`."""
    from mixserve.layers.gguf_linear import GGUFLinear
    from mixserve.layers.linear import DenseLinear, Int4Linear

    if isinstance(m, DenseLinear):
        m.set_impl("invariant")
    elif isinstance(m, Int4Linear):
        m.dense_rows = m.float_dense_rows = None
        m.invariant = True
    elif isinstance(m, GGUFLinear):
        m.dense_rows = m.float_dense_rows = None
