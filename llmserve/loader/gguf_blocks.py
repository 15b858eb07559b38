"""GGUF's common block formats decoded in torch: Q4_0, Q4_1, Q8_0 and the K-quants of Q4_K_M/Q5_K_M files (Q4_K,
Q5_K, Q6_K). Each gives the same float32 weights as the gguf package's `dequantize` (the same float32 operations in
the same order, so bit for bit), about twice as fast (Q6_K: 1.2x; docs/benchmarks.md): the package's numpy code
makes many passes over groups of 16 rows in one thread, where torch's elementwise kernels make a few passes over the
whole tensor on every core. Other types go through the package.

The blocks (llama.cpp's ggml-common.h): a Q4_0 block of 32 weights is d (float16) and 16 bytes of 4-bit codes,
code j in byte j's low nibble and code j + 16 in its high one; Q4_1 adds m after d; Q8_0 is d and 32 int8 codes. A
K-quant block holds 256 weights in sub-blocks of 32 (Q6_K: 16) with 6-bit (Q6_K: 8-bit) scales of their own.

Int4Blocks keeps a 4-bit tensor's codes and grid as well, for the int4 kernel to take the file's codes as they are."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q


def _blocks(data: np.ndarray, qtype) -> tuple[torch.Tensor, int]:
    """The tensor's raw bytes as [blocks, bytes per block] (a view of the file: only read), and its rows."""
    rows = int(np.prod(data.shape[:-1]))
    with warnings.catch_warnings():  # torch warns that the read-only memory map it views is not writable
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.ascontiguousarray(data)).view(torch.uint8).view(-1, GGML_QUANT_SIZES[qtype][1]), rows


def _half(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """A float16 field of every block, as float32 [blocks, 1]."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


def _nibbles(packed: torch.Tensor, width: int) -> torch.Tensor:
    """Bytes [blocks, k * width] of 4-bit codes, each run of `width` bytes holding `width` codes in its low nibbles
    then `width` more in its high ones: the codes in order, uint8 [blocks, 2 * k * width]."""
    runs = packed.view(packed.shape[0], -1, 1, width)
    return torch.cat((runs & 15, runs >> 4), dim=2).view(packed.shape[0], -1)


def _k_scales(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's and Q5_K's 6-bit scale and min of each of a block's eight 32-weight parts, from the 12 bytes after d
    and dmin: the first four parts' in the low 6 bits of bytes 0-3 and 4-7, the last four's low 4 bits in bytes 8-11
    and high 2 bits in the top of bytes 0-3 and 4-7."""
    packed = blocks[:, 4:16].view(-1, 3, 4)
    low, high, extra = packed[:, 0], packed[:, 1], packed[:, 2]
    scale = torch.cat((low & 0x3F, (extra & 0x0F) | ((low >> 2) & 0x30)), dim=1)
    minimum = torch.cat((high & 0x3F, (extra >> 4) | ((high >> 2) & 0x30)), dim=1)
    return scale.float(), minimum.float()


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    scale, minimum = _k_scales(blocks)
    d = (_half(blocks, 0) * scale).unsqueeze(-1)
    dm = (_half(blocks, 2) * minimum).unsqueeze(-1)
    low = _nibbles(blocks[:, 48:], 32).view(-1, 8, 32)
    # the fifth bit of part i's 32 codes: bit i of the 32 bytes before them
    high = (blocks[:, 16:48].view(-1, 1, 32) >> torch.arange(8, dtype=torch.uint8).view(1, 8, 1)) & 1
    return (low | (high << 4)).float().mul_(d).sub_(dm)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d = (_half(blocks, 208) * blocks[:, 192:208].view(torch.int8).float()).view(n, 16, 1)
    low = _nibbles(blocks[:, :128], 64).view(n, 8, 32)
    # the top 2 bits of each code: in 2 halves of 32 bytes, four codes' bits per byte, lowest pair first
    high = (blocks[:, 128:192].view(n, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)) & 3
    q = ((low | (high.view(n, 8, 32) << 4)).view(torch.int8) - 32).view(n, 16, 16).float()
    return d.mul(q)


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    return blocks[:, 2:].view(torch.int8).float().mul_(_half(blocks, 0))


_DECODERS = {Q.Q5_K: _q5_k, Q.Q6_K: _q6_k, Q.Q8_0: _q8_0}  # (4-bit types: Int4Blocks)


def decode(data: np.ndarray, qtype) -> torch.Tensor | None:
    """The float32 weight [rows, cols] of a tensor's raw rows `data` in one of these formats (None for another)."""
    int4 = Int4Blocks.read(data, qtype)
    if int4 is not None:
        return int4.weight()
    decoder = _DECODERS.get(qtype)
    if decoder is None:
        return None
    blocks, rows = _blocks(data, qtype)
    return decoder(blocks).view(rows, -1)


@dataclass
class Int4Blocks:
    """A 4-bit tensor's own codes (uint8 [rows, cols], 0..15) and the grid they sit on per 32 columns, scale and offset
    [rows, cols / 32] in float32 (weight = offset + scale * code): Q4_0's d and -8 d, Q4_1's d and m (both exact in
    the int4 kernel's float16), Q4_K's d * sc and -dmin * m of each 32-weight part (6-bit sc and m: the kernel
    rounds them to float16, moving a weight by at most 2^-11 of its size)."""

    qtype: Q
    codes: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor

    @classmethod
    def read(cls, data: np.ndarray, qtype) -> Int4Blocks | None:
        if qtype not in (Q.Q4_0, Q.Q4_1, Q.Q4_K):
            return None
        blocks, rows = _blocks(data, qtype)
        if qtype == Q.Q4_K:
            scale, minimum = _k_scales(blocks)
            d, offset = _half(blocks, 0) * scale, -(_half(blocks, 2) * minimum)
            codes = _nibbles(blocks[:, 16:], 32)
        else:
            d = _half(blocks, 0)
            offset = d * -8 if qtype == Q.Q4_0 else _half(blocks, 2)
            codes = _nibbles(blocks[:, -16:], 16)
        return cls(Q(qtype), codes.view(rows, -1), d.view(rows, -1), offset.view(rows, -1))

    def weight(self) -> torch.Tensor:
        """float32 [rows, cols]: Q4_0's d * (q - 8), Q4_1's d * q + m, Q4_K's d * sc * q - dmin * m, in the gguf
        package's order of operations."""
        rows, cols = self.codes.shape
        q = self.codes.view(rows, -1, 32).float()
        if self.qtype == Q.Q4_0:
            return q.sub_(8).mul_(self.scale.unsqueeze(-1)).view(rows, cols)
        return q.mul_(self.scale.unsqueeze(-1)).add_(self.offset.unsqueeze(-1)).view(rows, cols)
