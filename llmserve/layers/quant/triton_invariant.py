"""A float weight multiplied by llmserve's batch-invariant Triton matmul: the deterministic mode's matmul on CUDA
(kernels/triton_batch_invariant.py). Same weight tensor as FloatWeight (tied embeddings stay shared); only the
kernel differs."""

from __future__ import annotations

from llmserve.kernels.triton_batch_invariant import batch_invariant_linear
from llmserve.layers.quant import WeightMethod


class TritonInvariantWeight(WeightMethod):
    name = "float/batch-invariant-triton"

    def apply(self, layer, x):
        return batch_invariant_linear(x, layer.weight, layer.bias)
