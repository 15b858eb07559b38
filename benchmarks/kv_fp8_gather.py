"""Would an FP8 KV cache speed up CPU decode? Times the per-layer K gather of a batch-32 decode step.

    .venv/bin/python benchmarks/kv_fp8_gather.py [--batch 32] [--context 256]

Attention reads each sequence's cache blocks every layer (index_select of whole blocks, then SDPA in bf16).
FP8 (e4m3) halves the bytes read but needs a conversion to bf16 before SDPA. This measures both, on the default
model's KV shape (3 KV heads x 64), as a ratio in the same run. (The int8 view is how an FP8 pool would be
written: index_copy_ has no FP8 kernel on CPU.)
"""

from __future__ import annotations

import argparse

import torch

from common import median_seconds


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=16)
    args = ap.parse_args()
    bs, blocks_per_seq = args.block_size, -(-args.context // args.block_size)
    num_blocks = 4096
    cache_bf16 = torch.randn(num_blocks * bs, 3, 64).bfloat16()
    cache_fp8 = cache_bf16.to(torch.float8_e4m3fn)
    index = torch.randperm(num_blocks)[: args.batch * blocks_per_seq]

    def gather_bf16():
        return cache_bf16.view(-1, bs, 3, 64).index_select(0, index)

    def gather_fp8():
        return cache_fp8.view(-1, bs, 3, 64).index_select(0, index).to(torch.bfloat16)

    a, b = (median_seconds(fn, 200, warmup=10) * 1e6 for fn in (gather_bf16, gather_fp8))
    print(f"batch {args.batch}, context {args.context}: K gather per layer bf16 {a:.0f} us, fp8 + convert {b:.0f} us, "
          f"fp8 / bf16 = {b / a:.2f}x (bytes read: 0.50x)")


if __name__ == "__main__":
    main()
