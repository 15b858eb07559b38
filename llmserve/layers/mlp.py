import torch
import torch.nn.functional as F
from torch import nn

from llmserve.layers.linear import MergedColumnParallelLinear, RowParallelLinear


class SwiGLUMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size)
        # Set by the platform where a fused silu-and-multiply kernel serves the device (one launch instead of two).
        self.act_op = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.act_op is not None and not torch.compiler.is_compiling():  # compiled graphs fuse it themselves
            return self.down_proj(self.act_op(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up))  # in place: one activation buffer fewer per layer
