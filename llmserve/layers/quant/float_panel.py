"""A float32 weight multiplied in an order that does not depend on the step's size: the deterministic mode's matmul
for float layers on CPU.

torch's float32 matmul (MKL's sgemm) picks its kernel, and with it the order each row's products are summed in, by
the number of rows, so the same token's logits differ in the last bits between a step of 1 row and one of 40. Here
the weight is kept in the layout of llmserve's AVX2 low-bit route once its blocks are expanded ([N/32 work items]
[K/2 pairs of input columns][8 vectors of 4 columns x 2 inputs]), and every step runs the same register passes over
it, one row or many (kernels/lowbit_linear_avx2.cpp, float_gemm). Same bytes as the float weight; no rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmserve.layers.quant import WeightMethod

COLUMNS_PER_ITEM = 32


def pack_float_panel(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] float32 -> [ceil(N/32), ceil(K/2), 64]: element (item, p, 8v + l) is W[32 item + 4v + l // 2, 2p + l % 2].
    N and K are padded with zeros (zero products leave every sum as it is)."""
    n, k = weight.shape
    padded = F.pad(weight.float(), (0, k % 2, 0, -n % COLUMNS_PER_ITEM))
    items, pairs = padded.shape[0] // COLUMNS_PER_ITEM, padded.shape[1] // 2
    # [item, vector, column in vector, pair, parity] -> [item, pair, vector, column, parity]
    return padded.view(items, 8, 4, pairs, 2).permute(0, 3, 1, 2, 4).contiguous().view(items, pairs, 64)


class FloatPanelWeight(WeightMethod):
    name = "float32/batch-invariant"

    def __init__(self, weight: torch.Tensor):
        self.out_features, self.in_features = weight.shape
        self.panel = pack_float_panel(weight)

    def apply(self, layer, x):
        rows = x.reshape(-1, x.shape[-1])
        if self.in_features % 2:
            rows = F.pad(rows, (0, 1))
        out = torch.ops.llmserve_kernels.float_panel_linear(rows, self.panel)
        if out.shape[1] != self.out_features:
            out = out[:, : self.out_features]
        out = out.reshape(*x.shape[:-1], self.out_features)
        return out if layer.bias is None else out + layer.bias
