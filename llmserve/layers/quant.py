"""Weight-only low-bit copies of a linear layer's weight, for the memory-bound small-batch decode.

A decode step with a few sequences reads every weight once and does little arithmetic with it, so its
speed is set by the bytes of weight read per token. These copies shrink those bytes (int4: a quarter of
bf16, int8: half) and feed torch's CPU weight-only kernels, which dequantize on the fly against bf16
activations. Large batches and prefill stay on the bf16 weight: those kernels are slower than oneDNN's
bf16 matmul once a step has more than a few rows.

int4 is asymmetric, one (scale, zero) pair per group of 32 input columns: `w = (q - 8) * scale + zero`,
q in 0..15. A GGUF Q4_1 block is `w = d * q + m` over the same 32 columns with its minimum at q = 0 and
maximum at q = 15, so min/max quantization recovers Q4_1's codes exactly (scale = d, zero = m + 8d);
only the rounding of scale and zero to bf16 differs from the file. int8 is symmetric per output channel.
"""

from __future__ import annotations

import torch

LOWBIT_KINDS = ("int4", "int8")
INT4_GROUP = 32
INT4_INNER_K_TILES = 2


class LowBitWeight:
    """A packed low-bit weight [out, in] and its matmul. Built once at load; read-only afterwards."""

    nbytes: int

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dequantize(self) -> torch.Tensor:
        """The weight as the kernel sees it, float32 [out, in]: for tests and error reports."""
        raise NotImplementedError


class Int4Weight(LowBitWeight):
    def __init__(self, weight: torch.Tensor, dtype: torch.dtype):
        w = weight.detach().float()
        out_f, in_f = w.shape
        groups = w.view(out_f, in_f // INT4_GROUP, INT4_GROUP)
        lo, hi = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
        scale = (hi - lo) / 15
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = ((groups - lo) / safe).round_().clamp_(0, 15).to(torch.int32).view(out_f, in_f)
        zero = lo + 8 * scale
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, INT4_INNER_K_TILES)
        # kernel layout: [in / group, out, (scale, zero)], in the activations' dtype
        self.scales_zeros = torch.stack((scale, zero), dim=-1).squeeze(2).transpose(0, 1).contiguous().to(dtype)
        self.nbytes = self.packed.numel() * self.packed.element_size() + self.scales_zeros.numel() * self.scales_zeros.element_size()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, INT4_GROUP, self.scales_zeros)

    def dequantize(self) -> torch.Tensor:
        eye = torch.eye(self.packed.shape[1] * 2, dtype=self.scales_zeros.dtype)
        return self.matmul(eye).T.float().contiguous()


class Int8Weight(LowBitWeight):
    def __init__(self, weight: torch.Tensor, dtype: torch.dtype):
        w = weight.detach().float()
        scale = w.abs().amax(dim=1).clamp_(min=1e-12) / 127
        self.q = (w / scale.unsqueeze(1)).round_().clamp_(-127, 127).to(torch.int8)
        self.scales = scale.to(dtype)
        self.nbytes = self.q.numel() + self.scales.numel() * self.scales.element_size()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, self.q, self.scales)

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self.scales.float().unsqueeze(1)


def lowbit_supported(kind: str, shape: torch.Size) -> bool:
    """Whether this torch build has the CPU kernel for a [out, in] weight of this shape (served in bf16)."""
    if kind == "int4":
        out_f, in_f = shape
        return (hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and in_f % INT4_GROUP == 0
                and in_f % (INT4_INNER_K_TILES * 16) == 0 and out_f % 8 == 0)
    return hasattr(torch.ops.aten, "_weight_int8pack_mm")


def quantize_weight(kind: str, weight: torch.Tensor, dtype: torch.dtype) -> LowBitWeight:
    """Quantize a (preferably float32, as loaded) weight; scales are kept in the activations' `dtype`."""
    if kind == "int4":
        return Int4Weight(weight, dtype)
    if kind == "int8":
        return Int8Weight(weight, dtype)
    raise ValueError(f"unknown low-bit kind {kind!r}; expected one of {', '.join(LOWBIT_KINDS)}")
