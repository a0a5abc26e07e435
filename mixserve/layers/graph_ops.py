"""oneDNN's prepacked linear as a dispatcher op a captured graph can call (engine/decode_graph.py).

Inductor lowers `mkldnn._linear_pointwise` only for weights it prepacked itself while freezing a
graph, and freezing folds every weight into the compiled artifact, so that nothing is reused from
Inductor's cache by the next process (each start recompiles the graph). Our
DenseLinear prepacks its own weight (the "onednn" kernel choice); this op hands that weight to
oneDNN from C++, opaque to Inductor, so the graph is compiled without freezing, cached across
processes, and the weight stays one resident copy.
"""
from __future__ import annotations

import torch

from mixserve.layers.cpp_build import build_extension

_SRC = r"""
#include <torch/extension.h>
#include <ATen/core/dispatch/Dispatcher.h>

torch::Tensor onednn_linear(const torch::Tensor& x, const torch::Tensor& packed, const std::optional<torch::Tensor>& bias,
                            int64_t out_features) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                         c10::string_view, c10::List<std::optional<c10::Scalar>>,
                                         std::optional<c10::string_view>)>();
  return op.call(x, packed, bias, "none", c10::List<std::optional<c10::Scalar>>(), std::string_view(""));
}

// bf16(x W^T + b + other), the add applied to the float32 accumulator before it rounds, so
// other = -bf16(x W^T + b) gives the rounding residual (float32 logits, linear.py): oneDNN's add
// post-op for a prepacked weight; for a plain one without bias, addmm, whose beta term is added
// to the accumulator too (oneDNN's add post-op on a plain weight ran a third slower at 64 rows)
torch::Tensor onednn_linear_add(const torch::Tensor& x, const torch::Tensor& other, const torch::Tensor& weight,
                                const std::optional<torch::Tensor>& bias) {
  if (!weight.is_mkldnn() && !bias.has_value()) return at::addmm(other, x, weight.t());
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkldnn::_linear_pointwise", "binary")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const std::optional<at::Tensor>&, c10::string_view)>();
  return op.call(x, other, weight, bias, "add");
}

bool loaded() { return true; }

TORCH_LIBRARY_FRAGMENT(mixserve, m) {
  m.def("onednn_linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
  m.def("onednn_linear_add(Tensor x, Tensor other, Tensor weight, Tensor? bias) -> Tensor");
}
TORCH_LIBRARY_IMPL(mixserve, CPU, m) {
  m.impl("onednn_linear", &onednn_linear);
  m.impl("onednn_linear_add", &onednn_linear_add);
}
TORCH_LIBRARY_IMPL(mixserve, MkldnnCPU, m) {
  m.impl("onednn_linear", &onednn_linear);
  m.impl("onednn_linear_add", &onednn_linear_add);
}
"""

_state = {"loaded": None}


def _load() -> bool:
    if _state["loaded"] is None:
        ok = build_extension("mixserve_graph_ops_v4", _SRC, ["loaded"]) is not None
        if ok:
            torch.library.register_fake("mixserve::onednn_linear")(
                lambda x, packed, bias, n: x.new_empty(*x.shape[:-1], n))
            torch.library.register_fake("mixserve::onednn_linear_add")(
                lambda x, other, w, bias: torch.empty_like(other))
        _state["loaded"] = ok
    return _state["loaded"]


def available() -> bool:
    """True where the op builds (a C++ compiler and PyTorch's headers)."""
    return _load()


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """y = x @ W^T + b with W prepacked by `torch.ops.mkldnn._reorder_linear_weight`.

    x [..., in] in W's dtype; packed: the oneDNN (opaque) weight; bias [out] or None.
    Returns [..., out_features]. The caller has checked `available()`."""
    return torch.ops.mixserve.onednn_linear(x, packed, bias, out_features)


def onednn_linear_add(x: torch.Tensor, other: torch.Tensor, weight: torch.Tensor,
                      bias: torch.Tensor | None) -> torch.Tensor:
    """bf16(x @ W^T + b + other), the add applied to oneDNN's float32 accumulator before rounding.

    x [R, in] bf16; other [R, out] bf16; weight: [out, in] bf16, plain or prepacked. With other =
    -bf16(x @ W^T + b) the result is that rounding's residual, so other + result carries about 16
    significant bits (float32 logits, layers/linear.py). Falls back to oneDNN's own op where this
    one does not build; the caller has checked torch.backends.mkldnn.is_available(). An op of
    its own rather than addmm in the graph, so that Inductor cannot split the add off the GEMM."""
    if _load():
        return torch.ops.mixserve.onednn_linear_add(x, other, weight, bias)
    if not weight.is_mkldnn and bias is None:
        return torch.addmm(other, x, weight.t())
    return torch.ops.mkldnn._linear_pointwise.binary(x, other, weight, bias, "add")
