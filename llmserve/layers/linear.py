"""Linear layers. Merged projections (QKV, gate/up) load their parts by shard index so that a later
tensor-parallel version can split the same output dimension across processes."""

import torch
import torch.nn.functional as F
from torch import nn

from llmserve import kernels
from llmserve.layers.quant import LowBitWeight


@torch.library.custom_op("llmserve::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's matmul with a prepacked weight, as an opaque op for torch.compile: inductor's own lowering of
    it expects weights frozen into the graph, which a model whose weights are module attributes is not. The graph
    calls back into Python for it; where llmserve's native kernels are built, their C++ copy of it is used instead."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


packed_linear.register_fake(kernels.packed_linear_shape)


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False, shard_sizes: list[int] | None = None,
                 int8_activations: bool = True):
        super().__init__()
        # Whether decode_quantization w4a8 may round this layer's inputs to int8 (the model says where that costs).
        self.int8_activations = int8_activations
        self.shard_sizes = shard_sizes or [out_features]
        assert sum(self.shard_sizes) == out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None
        # Optional low-bit copy used by steps of at most `lowbit_max_rows` rows (None: every step).
        self.lowbit: LowBitWeight | None = None
        self.lowbit_max_rows: int | None = 0

    def load(self, param: str, tensor: torch.Tensor, shard: int = 0) -> None:
        target = self.weight if param == "weight" else self.bias
        start = sum(self.shard_sizes[:shard])
        part = target.data.narrow(0, start, self.shard_sizes[shard])
        if part.shape != tensor.shape:
            raise ValueError(f"shape mismatch: expected {tuple(part.shape)}, got {tuple(tensor.shape)}")
        part.copy_(tensor)

    def prepack(self) -> bool:
        """On CPU in bf16: keep the weight in oneDNN's blocked layout instead of (out, in), which makes its
        matmuls faster (AMX tiles where the CPU has them) with identical results. The plain weight is dropped.
        Returns whether it packed."""
        w = self.weight
        if (w.numel() == 0 or w.device.type != "cpu" or w.dtype != torch.bfloat16
                or not torch.backends.mkldnn.is_available()):  # empty: the low-bit copy serves every step
            return False
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(w.detach())
        except (RuntimeError, AttributeError):  # a torch without this op: keep F.linear
            return False
        self._packed = packed
        self.weight = nn.Parameter(torch.empty(0, dtype=w.dtype), requires_grad=False)
        return True

    def attach_lowbit(self, weight: LowBitWeight, max_rows: int | None) -> None:
        self.lowbit, self.lowbit_max_rows = weight, max_rows
        if max_rows is None:  # the float weight would never be read again (a tied embedding keeps its own reference)
            self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lowbit is not None and (self.lowbit_max_rows is None or x.shape[0] <= self.lowbit_max_rows):
            out = self.lowbit.matmul(x)
            return out if self.bias is None else out + self.bias
        packed = getattr(self, "_packed", None)
        if packed is not None:
            if torch.compiler.is_compiling():  # traced once: the graph then calls the op from C++ where it can
                op = torch.ops.llmserve_kernels.packed_linear if kernels.loaded() else packed_linear
                return op(x, packed, self.bias)
            return torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")  # no custom-op overhead
        return F.linear(x, self.weight, self.bias)
