"""Weight-only low-bit copies of a linear layer's weight, for the memory-bound decode.

A decode step with a few dozen sequences or fewer reads every weight once and does little arithmetic with it,
so its speed is set by the bytes of weight read per token. These copies shrink those bytes (int4: a quarter of
bf16, int8: half) and are multiplied against the activations by one of two kernels:
- llmserve's own (GroupWeight, kernels/lowbit_linear.cpp), where the native kernels build: on bf16 activations
  where the CPU has AMX or AVX512-BF16, on float32 ones where it has AVX2. As fast as oneDNN's bf16 (or MKL's
  float32) matmul or faster at every number of rows measured, so it serves every step and the float copy is dropped;
- otherwise torch's CPU weight-only kernels (Int4Weight, Int8Weight), which lose to oneDNN's bf16 matmul once a
  step has more than a few rows, so large batches and prefill stay on the bf16 weight.

GroupWeight keeps GGUF's own block formats (Q4_1 and Q8_0): from weights that came from such a file it recovers
the file's codes, scales and offsets, so it multiplies by the file's weights: rounded to bf16 as the bf16 path
holds them, or in float32 for steps of a few rows.

int4 is asymmetric, one (scale, zero) pair per group of 32 input columns: `w = (q - 8) * scale + zero`,
q in 0..15. A GGUF Q4_1 block is `w = d * q + m` over the same 32 columns with its minimum at q = 0 and
maximum at q = 15, so min/max quantization recovers Q4_1's codes exactly (scale = d, zero = m + 8d);
only the rounding of scale and zero to bf16 differs from the file. int8 is symmetric per output channel.
"""

from __future__ import annotations

import copy

import torch

from llmserve import kernels

LOWBIT_KINDS = ("int4", "int8")
GROUP = 32  # input columns per group (GGUF's block); for GroupWeight also output columns per kernel work item
INT4_GROUP = GROUP
INT4_INNER_K_TILES = 2


class LowBitWeight:
    """A packed low-bit weight [out, in] and its matmul. Built once at load; read-only afterwards."""

    nbytes: int
    kind: str  # "int4" or "int8"
    route: str | None = None  # llmserve's kernel route; None for torch's kernels

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dequantize(self) -> torch.Tensor:
        """The weight as the kernel sees it, float32 [out, in]: for tests and error reports."""
        raise NotImplementedError


class Int4Weight(LowBitWeight):
    kind = "int4"

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
    kind = "int8"

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


class GroupWeight(LowBitWeight):
    """4 bits (`w = code * scale + offset`, code 0..15, GGUF Q4_1) or 8 bits (`w = code * scale`, code -127..127,
    GGUF Q8_0) per group of 32 input columns, with float16 scales and offsets, laid out for llmserve's kernel (in the
    pair-interleaved order AMX tiles and vdpbf16ps read). `route` ("amx", "avx512_bf16"; "avx2" for float32 activations, "avx2_int8" for float32 activations
    quantized to int8 per group) picks the kernel's code
    path; by default the best one this CPU has."""

    def __init__(self, weight: torch.Tensor, bits: int, route: str | None = None,
                 grid: tuple[torch.Tensor, torch.Tensor] | None = None, codes: torch.Tensor | None = None):
        """grid (4 bits): the scale and offset per group [out, in / GROUP] that a pre-quantized checkpoint's codes
        sit on, taken instead of the groups' min/max, so that the codes are the checkpoint's own; codes: those codes
        (uint8 [out, in], 0..15), when the checkpoint brought them (GGUF's 4-bit types), taken as they are rather
        than found again from the weight (the same codes, but where a group's scale is 0)."""
        out_f, in_f = weight.shape
        if bits == 4 and grid is not None:
            scale, offset = grid[0].half(), grid[1].half()
            if codes is None:
                groups = weight.detach().float().view(out_f, in_f // GROUP, GROUP)
                codes = (groups - offset.float().unsqueeze(-1)) / _nonzero(scale).unsqueeze(-1)
                codes = codes.round_().clamp_(0, 15).to(torch.uint8)
        elif bits == 4:  # min/max: a Q4_1 block holds its minimum at code 0 and its maximum at code 15
            groups = weight.detach().float().view(out_f, in_f // GROUP, GROUP)
            lo = groups.amin(-1)
            scale, offset = ((groups.amax(-1) - lo) / 15).half(), lo.half()
            codes = (groups - offset.float().unsqueeze(-1)) / _nonzero(scale).unsqueeze(-1)
            codes = codes.round_().clamp_(0, 15).to(torch.uint8)
        elif bits == 8:  # a Q8_0 block's largest magnitude has code +-127
            groups = weight.detach().float().view(out_f, in_f // GROUP, GROUP)
            scale, offset = (groups.abs().amax(-1) / 127).half(), None
            codes = (groups / _nonzero(scale).unsqueeze(-1)).round_().clamp_(-127, 127).to(torch.int8).view(torch.uint8)
        else:
            raise ValueError(f"GroupWeight takes 4 or 8 bits, not {bits}")
        blocks, groups_n = out_f // GROUP, in_f // GROUP
        # The kernel's order: [32-column block, group, 16-column tile, input-column pair, column, pair member], the
        # pair-interleaved rows an AMX bf16 tile reads. 4 bits: tile rows 2i and 2i + 1 in 32 bytes, element j of
        # the first in byte j's low nibble, of the second in its high one.
        # (Each input-column pair moved as one int16: torch permutes 2-byte elements 7x faster than byte pairs.)
        tiles = codes.contiguous().view(torch.int16).view(blocks, 2, 16, groups_n, 16).permute(0, 3, 1, 4, 2)
        tiles = tiles.contiguous().view(torch.uint8).view(blocks, groups_n, 2, 16, 32)
        if bits == 4:
            tiles = tiles[..., 0::2, :] | (tiles[..., 1::2, :] << 4)
        self.codes = tiles.reshape(blocks, groups_n, -1).contiguous()
        self.scales = scale.view(blocks, GROUP, groups_n).transpose(1, 2).contiguous()
        self.offsets = None if offset is None else offset.view(blocks, GROUP, groups_n).transpose(1, 2).contiguous()
        self.nbytes = sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.offsets) if t is not None)
        self.kind = f"int{bits}"
        self.route = kernels.lowbit_linear_isa() if route is None else route
        kernels.load_cpu_kernels()  # the op the route runs on

    def on_route(self, route: str) -> GroupWeight:
        """The same codes (shared, not copied), multiplied by the given route: to test or measure one route on a
        CPU that has both."""
        other = copy.copy(self)
        other.route = route
        return other

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.llmserve_kernels.lowbit_linear(x, self.codes, self.scales, self.offsets, self.route)

    def dequantize(self) -> torch.Tensor:
        """The weight the codes stand for, float32 [out, in], unpacked here rather than by the kernel (for tests)."""
        blocks, groups_n, _ = self.codes.shape
        if self.offsets is not None:
            pairs = self.codes.view(blocks, groups_n, 2, 8, 1, 32)
            tiles = torch.cat((pairs & 15, pairs >> 4), dim=4).float()
        else:
            tiles = self.codes.view(torch.int8).float()
        q = tiles.view(blocks, groups_n, 2, 16, 16, 2).permute(0, 2, 4, 1, 3, 5).reshape(blocks * GROUP, groups_n, GROUP)
        w = q * self.scales.transpose(1, 2).reshape(-1, groups_n, 1).float()
        if self.offsets is not None:
            w += self.offsets.transpose(1, 2).reshape(-1, groups_n, 1).float()
        return w.view(blocks * GROUP, groups_n * GROUP)


def _nonzero(scale: torch.Tensor) -> torch.Tensor:
    """A group whose values are all equal has scale 0 and every code 0. A checkpoint's grid may have negative scales
    (llama.cpp's Q4_0 takes the block's largest-magnitude value, signed, as -8 d): they divide as they are."""
    s = scale.float()
    return torch.where(s != 0, s, torch.ones_like(s))


def lowbit_supported(kind: str, shape: torch.Size, native: bool = False) -> bool:
    """Whether there is a kernel for a [out, in] weight of this shape (served in bf16): llmserve's own if `native`,
    else this torch build's."""
    if native:
        return shape[0] % GROUP == 0 and shape[1] % GROUP == 0
    if kind == "int4":
        out_f, in_f = shape
        return (hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and in_f % INT4_GROUP == 0
                and in_f % (INT4_INNER_K_TILES * 16) == 0 and out_f % 8 == 0)
    return hasattr(torch.ops.aten, "_weight_int8pack_mm")


def quantize_weight(kind: str, weight: torch.Tensor, dtype: torch.dtype, route: str | None = None,
                    grid: tuple[torch.Tensor, torch.Tensor] | None = None,
                    codes: torch.Tensor | None = None) -> LowBitWeight:
    """Quantize a (preferably float32, as loaded) weight for llmserve's kernel by `route` ("amx", "avx512_bf16", "avx2", "avx2_int8"), or
    without one for torch's kernels, whose scales are kept in the activations' `dtype`. grid, codes: a pre-quantized
    checkpoint's int4 scale and offset per group, and its codes on them (GroupWeight), for llmserve's kernel."""
    if kind not in LOWBIT_KINDS:
        raise ValueError(f"unknown low-bit kind {kind!r}; expected one of {', '.join(LOWBIT_KINDS)}")
    if route:
        int4 = kind == "int4"
        return GroupWeight(weight, 4 if int4 else 8, route, grid if int4 else None, codes if int4 else None)
    if kind == "int4":
        return Int4Weight(weight, dtype)
    return Int8Weight(weight, dtype)
