"""Linear layers with Megatron-style tensor-parallel splits, each multiplying through a weight method (layers/quant)
that the platform chooses at load time.

- ColumnParallelLinear splits the output features across ranks; MergedColumnParallelLinear (gate/up) and
  QKVParallelLinear load their parts by shard index, each part split on its own, so rank r holds its slice of each
  (QKV by whole heads, which need not split evenly: parallel_state.head_ranges).
- RowParallelLinear splits the input features (by the same ranges as the layer that feeds it) and sums the ranks'
  partial outputs (all-reduce); only rank 0 holds the bias (the others zeros), so the sum adds it once.
- ReplicatedLinear keeps the whole weight on every rank.
With a tensor-parallel size of 1 (distributed/parallel_state.py) every split is the whole and the all-reduce is the
identity.
"""

from __future__ import annotations

import torch
from torch import nn

from llmserve.distributed.parallel_state import all_reduce, even_range, head_ranges, tp_rank, tp_size
from llmserve.layers.lora import LoRALayerWeights
from llmserve.layers.quant import GROUP, FloatWeight, WeightMethod

# A pre-quantized checkpoint's 4-bit grid, per GROUP input columns (loader/quantized.py, loader/gguf.py): what the
# int4 kernel needs to hold the checkpoint's own codes instead of new ones from the float weight; and, where the
# checkpoint has them apart (GGUF's 4-bit types), the codes themselves (uint8 [out, in], 0..15), taken as they are
# rather than found again from the float weight.
INT4_GRID_PARAMS = ("weight_int4_scale", "weight_int4_offset")
INT4_CODES_PARAM = "weight_int4_codes"
INT4_PARAMS = (*INT4_GRID_PARAMS, INT4_CODES_PARAM)


class LinearBase(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False, shard_sizes: list[int] | None = None,
                 int8_activations: bool = True, low_bit: bool = True):
        """in_features/out_features/shard_sizes are this rank's. low_bit=False: never given low-bit codes (a MoE
        router, whose scores pick experts: rounding would flip near-ties)."""
        super().__init__()
        self.low_bit = low_bit
        # Whether decode_quantization w4a8 may round this layer's inputs to int8 (the model says where that costs).
        self.int8_activations = int8_activations
        self.shard_sizes = shard_sizes or [out_features]
        assert sum(self.shard_sizes) == out_features
        self.in_features, self.out_features = in_features, out_features
        # Allocated when the checkpoint's first part of it arrives (materialize): a layer loaded after the previous
        # ones were quantized then reuses the memory their float32 weights freed, and loading peaks near the
        # served size rather than at the float32 model.
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device="meta"), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None
        self.method: WeightMethod = FloatWeight()
        self.lora: LoRALayerWeights | None = None  # adapter slots (layers/lora.py), when LoRA is enabled
        # the checkpoint's int4 grid and codes (INT4_PARAMS) while the layer loads, and which parts brought each
        self._int4: dict[str, torch.Tensor] = {}
        self._int4_parts: dict[str, set[int]] = {}

    def load(self, param: str, tensor: torch.Tensor, shard: int = 0) -> None:
        """Copy a checkpoint tensor (the whole, unsplit part `shard`) into this rank's slice."""
        if param in INT4_PARAMS:
            self._load_int4(param, tensor, shard)
            return
        if param == "weight":
            self.materialize()
        target = self.weight if param == "weight" else self.bias
        start = sum(self.shard_sizes[:shard])
        part = target.data.narrow(0, start, self.shard_sizes[shard])
        tensor = self.rank_slice(param, tensor, shard)
        if part.shape != tensor.shape:
            raise ValueError(f"shape mismatch: expected {tuple(part.shape)}, got {tuple(tensor.shape)}")
        part.copy_(tensor)

    def rank_slice(self, param: str, tensor: torch.Tensor, shard: int) -> torch.Tensor:
        return tensor

    def materialize(self) -> None:
        """The float32 weight in memory (uninitialized), if it is not yet."""
        if self.weight.is_meta:
            self.weight = nn.Parameter(torch.empty(self.weight.shape), requires_grad=False)

    def parts(self) -> set[tuple[str, int]]:
        """The (param, shard) a checkpoint fills: each part's weight, and its bias where the layer has one."""
        shards = range(len(self.shard_sizes))
        return {("weight", i) for i in shards} | ({("bias", i) for i in shards} if self.bias is not None else set())

    def _load_int4(self, param: str, tensor: torch.Tensor, shard: int) -> None:
        tensor = self.rank_slice(param, tensor, shard)
        if self.in_features % GROUP or tensor is None:
            return
        if param not in self._int4:
            columns = self.in_features if param == INT4_CODES_PARAM else self.in_features // GROUP
            self._int4[param] = torch.empty(self.out_features, columns, dtype=tensor.dtype)
        part = self._int4[param].narrow(0, sum(self.shard_sizes[:shard]), self.shard_sizes[shard])
        if part.shape == tensor.shape:
            part.copy_(tensor)
            self._int4_parts.setdefault(param, set()).add(shard)

    def _int4_complete(self, param: str) -> bool:
        """Whether every part of this layer brought `param` (a part without it: the layer has none)."""
        return self._int4_parts.get(param) == set(range(len(self.shard_sizes)))

    def int4_grid(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The checkpoint's scale and offset per GROUP input columns [out, in / GROUP], when every part of this
        layer brought them (else None: int4 codes are made from the float weight)."""
        if not all(map(self._int4_complete, INT4_GRID_PARAMS)):
            return None
        return self._int4[INT4_GRID_PARAMS[0]], self._int4[INT4_GRID_PARAMS[1]]

    def int4_codes(self) -> torch.Tensor | None:
        """The checkpoint's own 4-bit codes [out, in] on int4_grid(), when every part brought both."""
        if self.int4_grid() is None or not self._int4_complete(INT4_CODES_PARAM):
            return None
        return self._int4[INT4_CODES_PARAM]

    def drop_int4_grid(self) -> None:
        """The layer has its weight method: the checkpoint's grid and codes are no longer read."""
        self._int4, self._int4_parts = {}, {}

    def drop_float_weight(self) -> None:
        """The weight method no longer reads the float weight (a tied embedding keeps its own reference)."""
        self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.method.apply(self, x)
        return out if self.lora is None else self.lora.apply(x, out)


class ReplicatedLinear(LinearBase):
    """The whole weight on every rank."""


class ColumnParallelLinear(LinearBase):
    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False, int8_activations: bool = True,
                 output_ranges: list[range] | None = None):
        """output_ranges: this rank's rows of each part (default: an even split of each)."""
        self.output_ranges = output_ranges or [even_range(n, "output features") for n in output_sizes]
        super().__init__(in_features, sum(map(len, self.output_ranges)), bias, [len(r) for r in self.output_ranges],
                         int8_activations)

    def rank_slice(self, param, tensor, shard):
        rows = self.output_ranges[shard]
        return tensor[rows.start:rows.stop] if tp_size() > 1 else tensor


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several projections of the same input side by side (gate and up), each split across ranks."""


class QKVParallelLinear(ColumnParallelLinear):
    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False,
                 int8_activations: bool = True):
        q_heads, kv_heads = head_ranges(num_heads, num_kv_heads)
        kv = range(kv_heads.start * head_dim, kv_heads.stop * head_dim)
        super().__init__(hidden_size, [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], bias,
                         int8_activations, [range(q_heads.start * head_dim, q_heads.stop * head_dim), kv, kv])


class RowParallelLinear(LinearBase):
    def __init__(self, in_features: int, out_features: int, bias: bool = False, int8_activations: bool = True,
                 input_range: range | None = None):
        """input_range: this rank's input features (default: an even split)."""
        self.input_range = input_range or even_range(in_features, "input features")
        super().__init__(len(self.input_range), out_features, bias, None, int8_activations)
        self.reduce_results = tp_size() > 1  # fixed at build time: one rank's forward stays a plain call

    def rank_slice(self, param, tensor, shard):
        if tp_size() == 1:
            return tensor
        if param == "bias":
            return tensor if tp_rank() == 0 else torch.zeros_like(tensor)
        if param in INT4_PARAMS:  # the grid's columns are per GROUP inputs: a rank's range must start and end on one
            start, stop = self.input_range.start, self.input_range.stop
            if start % GROUP or stop % GROUP:
                return None
            return tensor[:, start:stop] if param == INT4_CODES_PARAM else tensor[:, start // GROUP:stop // GROUP]
        return tensor[:, self.input_range.start:self.input_range.stop]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.method.apply(self, x)
        if self.lora is not None:  # this rank's part of the low-rank term, summed by the all-reduce with the base
            out = self.lora.apply(x, out)
        return all_reduce(out) if self.reduce_results else out
