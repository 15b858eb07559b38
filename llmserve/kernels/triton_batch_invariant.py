"""Batch-invariant matmul and RMSNorm in Triton: the deterministic mode's kernels on CUDA.

cuBLAS picks a kernel (tile shape, split-K) by the problem's shape, so the order in which one row's products are
summed changes with the number of rows in the step; torch's row reductions likewise split a row across threads
differently as the number of rows changes. Here the shapes that set the order are constants:
- matmul: every output tile is [ROWS, COLUMNS] and walks K from 0 in steps of DEPTH with one accumulator, no split-K,
  whatever M is. A row's result depends on that row and the weight only.
- RMSNorm: one program per row, the whole row in one block.
Float32 inputs multiply in IEEE float32 (no TF32). Importing this module needs triton; under TRITON_INTERPRET=1 (read
when the kernels are defined, at import) both run on CPU tensors through Triton's interpreter, which is how the test
suite checks them without a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ROWS, COLUMNS, DEPTH = 32, 64, 32


@triton.jit
def matmul_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                  HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
                  ROWS: tl.constexpr, COLUMNS: tl.constexpr, DEPTH: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * COLUMNS + tl.arange(0, COLUMNS)
    depth = tl.arange(0, DEPTH)
    acc = tl.zeros([ROWS, COLUMNS], tl.float32)
    for k0 in range(0, K, DEPTH):
        ks = k0 + depth
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :],
                    mask=(rows[:, None] < M) & (ks[None, :] < K), other=0.0)
        w = tl.load(w_ptr + cols[None, :].to(tl.int64) * stride_wn + ks[:, None],
                    mask=(cols[None, :] < N) & (ks[:, None] < K), other=0.0)
        if IEEE:
            acc += tl.dot(x, w, input_precision="ieee")
        else:
            acc += tl.dot(x, w)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < N))


@triton.jit
def rms_norm_kernel(x_ptr, w_ptr, out_ptr, N, stride_x, stride_out, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / N + eps)
    # As Hugging Face's LlamaRMSNorm: normalise in float32, round to the input's dtype, then scale by the weight.
    normed = (x * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def batch_invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias, each row summed in the same order however many rows x has."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    m, k = rows.shape
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m:
        grid = (-(-m // ROWS), -(-n // COLUMNS))
        matmul_kernel[grid](rows, weight, bias if bias is not None else weight, out, m, n, k,
                                rows.stride(0), weight.stride(0), out.stride(0), HAS_BIAS=bias is not None,
                                IEEE=x.dtype == torch.float32, ROWS=ROWS, COLUMNS=COLUMNS, DEPTH=DEPTH)
    return out.view(*x.shape[:-1], n)


def batch_invariant_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension, one program per row."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    n = rows.shape[1]
    if rows.shape[0]:
        rms_norm_kernel[(rows.shape[0],)](rows, weight, out, n, rows.stride(0), out.stride(0), eps,
                                              BLOCK=max(16, triton.next_power_of_2(n)))
    return out.view(x.shape)
