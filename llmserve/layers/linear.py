"""Linear layers. Merged projections (QKV, gate/up) load their parts by shard index so that a later
tensor-parallel version can split the same output dimension across processes."""

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False, shard_sizes: list[int] | None = None):
        super().__init__()
        self.shard_sizes = shard_sizes or [out_features]
        assert sum(self.shard_sizes) == out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None

    def load(self, param: str, tensor: torch.Tensor, shard: int = 0) -> None:
        target = self.weight if param == "weight" else self.bias
        start = sum(self.shard_sizes[:shard])
        part = target.data.narrow(0, start, self.shard_sizes[shard])
        if part.shape != tensor.shape:
            raise ValueError(f"shape mismatch: expected {tuple(part.shape)}, got {tuple(tensor.shape)}")
        part.copy_(tensor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)
