"""Fused elementwise kernels for CUDA: rotary embedding and SwiGLU, one launch each where eager PyTorch runs five to
seven (float conversions, the rotate-half concatenation, products, sums, the cast back). In a decode step of a small
model these small kernels, not the weights, take most of the time: each costs a few microseconds of GPU time even
inside a CUDA graph. The RMSNorm kernel is kernels/triton_batch_invariant.py's (a norm is per row anyway).

Each computes what the eager code does, in the same order and precision (float32 inside, rounded to the model's
dtype where the eager code rounds), so results match it to the last bit but for fused multiply-adds. Importing this
module needs triton; tests run it under TRITON_INTERPRET=1 on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SWIGLU_COLUMNS = 1024  # intermediate features per program


@triton.jit
def rotary_kernel(x_ptr, cos_ptr, sin_ptr, num_heads, stride_x_token, stride_x_head, stride_cos, stride_sin,
                  HALF: tl.constexpr, HALF_PAD: tl.constexpr, HEADS: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, HEADS)
    cols = tl.arange(0, HALF_PAD)
    col_mask = cols < HALF
    mask = (heads < num_heads)[:, None] & col_mask[None, :]
    first = x_ptr + token * stride_x_token + heads[:, None] * stride_x_head + cols[None, :]
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(first + HALF, mask=mask, other=0.0)
    # the tables as RotaryEmbedding.table gives them: cos repeated twice, sin signed as rotate-half needs (-sin | sin)
    cos = tl.load(cos_ptr + token * stride_cos + cols, mask=col_mask, other=0.0)[None, :]
    sin = tl.load(sin_ptr + token * stride_sin + HALF + cols, mask=col_mask, other=0.0)[None, :]
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(first, (a * cos - b * sin).to(x1.dtype), mask=mask)
    tl.store(first + HALF, (b * cos + a * sin).to(x1.dtype), mask=mask)


def rotary_in_place(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """RotaryEmbedding.apply's rotation of [T, H, D] heads, written over x (a view into the QKV projection's output
    is fine: any token and head strides, contiguous head_dim); returns x."""
    cos, sin = (t.reshape(t.shape[0], -1) for t in cos_sin)  # [T, D] float32
    tokens, heads, dim = x.shape
    assert x.stride(2) == 1 and dim % 2 == 0
    if tokens:
        rotary_kernel[(tokens,)](x, cos, sin, heads, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0),
                                 HALF=dim // 2, HALF_PAD=triton.next_power_of_2(dim // 2),
                                 HEADS=triton.next_power_of_2(heads))
    return x


@triton.jit
def silu_and_mul_kernel(x_ptr, out_ptr, n, stride_x, stride_out, COLUMNS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * COLUMNS + tl.arange(0, COLUMNS)
    mask = cols < n
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + n + cols, mask=mask, other=0.0).to(tl.float32)
    g = gate.to(tl.float32)
    # as F.silu(gate).mul_(up): silu in float32 rounded to the dtype, then the product rounded again
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (act * up).to(gate.dtype), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for [T, 2I] rows holding gate then up (the merged gate/up projection's output); [T, I]."""
    if gate_up.stride(1) != 1:
        gate_up = gate_up.contiguous()
    rows, width = gate_up.shape
    n = width // 2
    out = torch.empty((rows, n), dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        silu_and_mul_kernel[(rows, triton.cdiv(n, SWIGLU_COLUMNS))](gate_up, out, n, gate_up.stride(0), out.stride(0),
                                                                   COLUMNS=SWIGLU_COLUMNS)
    return out
