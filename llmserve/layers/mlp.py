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


class GeGLUMLP(SwiGLUMLP):
    """Gemma's gated MLP: gelu(gate) * up, gelu with its tanh approximation where the checkpoint says
    gelu_pytorch_tanh. (The fused act_op a platform may set is SwiGLU's: not used here.)"""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str = "gelu_pytorch_tanh"):
        super().__init__(hidden_size, intermediate_size)
        self.approximate = "tanh" if activation == "gelu_pytorch_tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate=self.approximate).mul_(up))
