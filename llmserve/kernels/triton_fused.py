"""Fused kernels for CUDA: rotary embedding and SwiGLU, one launch each where eager PyTorch runs five to seven (float
conversions, the rotate-half concatenation, products, sums, the cast back); the residual add with the RMSNorm after
it; and the K and V writes into the paged cache in one launch. In a decode step of a small
model these small kernels, not the weights, take most of the time: each costs a few microseconds of GPU time even
inside a CUDA graph. The plain RMSNorm kernel is kernels/triton_batch_invariant.py's (a norm is per row anyway).

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


@triton.jit
def add_rms_norm_kernel(x_ptr, residual_ptr, w_ptr, out_ptr, sum_ptr, n, stride_x, stride_residual, stride_out,
                        stride_sum, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    r = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
    # the residual add as the eager code does it: in float32, rounded to the dtype
    total = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
    tl.store(sum_ptr + row * stride_sum + cols, total, mask=mask)
    s = total.to(tl.float32)
    # then the norm exactly as kernels/triton_batch_invariant.py's rms_norm_kernel
    rstd = 1.0 / tl.sqrt(tl.sum(s * s, 0) / n + eps)
    normed = (s * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (normed * w).to(x.dtype), mask=mask)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual), x + residual) over [T, N] rows in one pass: the decoder's residual add and the norm
    after it."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    residual = residual if residual.stride(-1) == 1 else residual.contiguous()
    rows, n = x.shape
    out, total = torch.empty_like(x), torch.empty_like(x)
    if rows:
        add_rms_norm_kernel[(rows,)](x, residual, weight, out, total, n, x.stride(0), residual.stride(0), out.stride(0),
                                     total.stride(0), eps, BLOCK=max(16, triton.next_power_of_2(n)))
    return out, total


@triton.jit
def store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, num_heads, stride_k_token, stride_k_head,
                    stride_v_token, stride_v_head, stride_cache_slot, stride_cache_head,
                    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, HEADS: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    heads = tl.arange(0, HEADS)
    dims = tl.arange(0, HEAD_DIM_PAD)
    mask = (heads < num_heads)[:, None] & (dims < HEAD_DIM)[None, :]
    cache = slot * stride_cache_slot + heads[:, None] * stride_cache_head + dims[None, :]
    k = tl.load(k_ptr + token * stride_k_token + heads[:, None] * stride_k_head + dims[None, :], mask=mask)
    tl.store(k_cache_ptr + cache, k, mask=mask)
    v = tl.load(v_ptr + token * stride_v_token + heads[:, None] * stride_v_head + dims[None, :], mask=mask)
    tl.store(v_cache_ptr + cache, v, mask=mask)


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """Writes the step's K and V rows ([T, kv_heads, head_dim], any token and head strides) into their cache slots,
    both in one launch (the cache in the rows' dtype; an FP8 cache takes layers/attention.py's path)."""
    tokens, heads, dim = k.shape
    assert k.stride(2) == 1 and v.stride(2) == 1 and k_cache.dtype == k.dtype
    if tokens:
        store_kv_kernel[(tokens,)](k, v, k_cache, v_cache, slots, heads, k.stride(0), k.stride(1), v.stride(0),
                                   v.stride(1), k_cache.stride(0), k_cache.stride(1), HEAD_DIM=dim,
                                   HEAD_DIM_PAD=triton.next_power_of_2(dim), HEADS=triton.next_power_of_2(heads))
