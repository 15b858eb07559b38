"""Weight methods: how a linear layer multiplies, chosen once at load time by the platform.

- FloatWeight: F.linear on the float weight (every device).
- OneDNNPackedWeight (onednn_packed.py): the weight in oneDNN's blocked layout (CPU, bf16).
- LowBitMethod: low-bit codes (lowbit_weights.py: llmserve's CPU kernel, or torch's weight-only int4/int8 kernels)
  for steps of at most `max_rows` rows, another method above that.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmserve.layers.quant.lowbit_weights import (GROUP, INT4_GROUP, LOWBIT_KINDS, GroupWeight, Int4Weight, Int8Weight,
                                                  LowBitWeight, lowbit_supported, quantize_weight)

__all__ = ["WeightMethod", "FloatWeight", "LowBitMethod", "GroupWeight", "Int4Weight", "Int8Weight", "LowBitWeight",
           "lowbit_supported", "quantize_weight", "GROUP", "INT4_GROUP", "LOWBIT_KINDS"]


class WeightMethod:
    name = "base"

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def describe(self) -> str:
        return self.name


class FloatWeight(WeightMethod):
    name = "float"

    def apply(self, layer, x):
        return F.linear(x, layer.weight, layer.bias)


class LowBitMethod(WeightMethod):
    """Low-bit codes for steps of at most max_rows rows (None: every step, and the float weight is dropped)."""

    name = "lowbit"

    def __init__(self, weight: LowBitWeight, max_rows: int | None, fallback: WeightMethod):
        self.weight, self.max_rows, self.fallback = weight, max_rows, fallback

    def describe(self) -> str:
        own = f"{self.weight.kind}/{self.weight.route or 'torch'}"
        return own if self.max_rows is None else f"{own} up to {self.max_rows} rows, else {self.fallback.describe()}"

    def apply(self, layer, x):
        if self.max_rows is None or x.shape[0] <= self.max_rows:
            out = self.weight.matmul(x)
            return out if layer.bias is None else out + layer.bias
        return self.fallback.apply(layer, x)
