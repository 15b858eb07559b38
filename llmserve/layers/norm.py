import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps
        # Set by the platform at load time where a fused kernel serves this device and dtype (one call instead of ~7):
        # fused_op(x, weight, eps) -> normed; fused_add_op(x, residual, weight, eps) -> (normed, x + residual).
        self.fused_op = None
        self.fused_add_op = None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); with a residual, (norm(x + residual), x + residual): the decoder's residual add and the next
        norm, which a fused kernel does in one pass. (One body for both: no extra call per layer on the CPU.)"""
        if residual is not None:
            if self.fused_add_op is not None and x.dtype is self.weight.dtype and not torch.compiler.is_compiling():
                return self.fused_add_op(x, residual, self.weight, self.eps)
            x = residual = x + residual
        # identity test: `dtype in (...)` costs ~6 us, more than the kernel; compiled graphs fuse the ops anyway
        if self.fused_op is not None and x.dtype is self.weight.dtype and not torch.compiler.is_compiling():
            out = self.fused_op(x, self.weight, self.eps)
        else:
            # Normalise in float32 as the reference implementations do; bf16 variance loses digits.
            # The weight multiplies after the round to x's dtype, as Hugging Face's LlamaRMSNorm does.
            out = self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)
        return out if residual is None else (out, residual)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: the weight is stored as an offset from 1 and multiplies in float32, before the round to x's
    dtype (Llama's multiplies after it), as transformers' Gemma3RMSNorm does."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (F.rms_norm(x.float(), self.weight.shape, eps=self.eps) * (1.0 + self.weight.float())).to(x.dtype)
