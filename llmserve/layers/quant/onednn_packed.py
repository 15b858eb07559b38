"""CPU, bf16: the weight kept in oneDNN's blocked layout instead of (out, in), which makes its matmuls faster (AMX
tiles where the CPU has them) with identical results."""

from __future__ import annotations

import torch

from llmserve import kernels
from llmserve.layers.quant import WeightMethod


@torch.library.custom_op("llmserve::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's matmul with a prepacked weight, as an opaque op for torch.compile: inductor's own lowering of
    it expects weights frozen into the graph, which a model whose weights are module attributes is not. The graph
    calls back into Python for it; where llmserve's native kernels are built, their C++ copy of it is used instead."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


packed_linear.register_fake(kernels.packed_linear_shape)


class OneDNNPackedWeight(WeightMethod):
    name = "onednn_packed"

    def __init__(self, packed: torch.Tensor):
        self.packed = packed

    @staticmethod
    def pack(weight: torch.Tensor) -> "OneDNNPackedWeight | None":
        """None where this weight cannot be packed (not bf16, or a torch without the op)."""
        if weight.numel() == 0 or weight.dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
            return None
        try:
            return OneDNNPackedWeight(torch.ops.mkldnn._reorder_linear_weight(weight.detach()))
        except (RuntimeError, AttributeError):
            return None

    def apply(self, layer, x):
        if torch.compiler.is_compiling():  # traced once: the graph then calls the op from C++ where it can
            op = torch.ops.llmserve_kernels.packed_linear if kernels.loaded() else packed_linear
            return op(x, self.packed, layer.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, layer.bias, "none", [], "")  # no custom-op overhead
