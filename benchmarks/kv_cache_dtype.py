"""Decode attention on a bf16 against an FP8 (e4m3) KV cache: the native kernel, the default model's attention shape.

    .venv/bin/python benchmarks/kv_cache_dtype.py [--batches 8 32] [--contexts 264 1000] [--json out.json]

One decode step's attention over 30 layers (9 query heads, 3 KV heads of 64), each sequence's blocks scattered over
a pool 4x the size in use (as a busy server's pool is), so K and V come from memory as they do when serving. Both
dtypes are timed alternately in one process; the figure is the bf16 time over the FP8 time (above 1: FP8 faster).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from llmserve import kernels
from common import write_json

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 30, 9, 3, 64, 16


def pools(dtype, batch: int, context: int, generator):
    per_seq = -(-context // BLOCK)
    slots = per_seq * batch * 4 * BLOCK
    return [tuple(torch.randn(slots, KV_HEADS, HEAD_DIM, generator=generator).to(dtype) for _ in range(2))
            for _ in range(LAYERS)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--contexts", type=int, nargs="+", default=[264, 1000])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--json", default="bench-results/kv_cache_dtype.json")
    args = ap.parse_args()
    if not kernels.load_cpu_kernels():
        raise SystemExit(f"the native kernels did not build: {kernels.build_error()}")
    op = torch.ops.llmserve_kernels.paged_decode_attention
    g = torch.Generator().manual_seed(0)
    rows = []
    for batch in args.batches:
        for context in args.contexts:
            per_seq = -(-context // BLOCK)
            tables = torch.randperm(per_seq * batch * 4, generator=g)[: per_seq * batch].view(batch, per_seq)
            lengths = torch.full((batch,), context)
            q = torch.randn(batch, HEADS, HEAD_DIM, generator=g).bfloat16()
            caches = {"bf16": pools(torch.bfloat16, batch, context, g), "fp8": pools(torch.float8_e4m3fn, batch, context, g)}
            times = {name: [] for name in caches}
            for _ in range(args.reps):
                for name, layers in caches.items():
                    t = time.perf_counter()
                    for k, v in layers:
                        op(q, k, v, tables, lengths, BLOCK, HEAD_DIM**-0.5)
                    times[name].append((time.perf_counter() - t) * 1e3)
            ms = {name: statistics.median(ts) for name, ts in times.items()}
            kv_mb = {name: 2 * LAYERS * batch * context * KV_HEADS * HEAD_DIM * (2 if name == "bf16" else 1) / 1e6
                     for name in caches}
            row = {"batch": batch, "context": context, "bf16_ms": ms["bf16"], "fp8_ms": ms["fp8"],
                   "speedup": ms["bf16"] / ms["fp8"], "bf16_GBps": kv_mb["bf16"] / ms["bf16"], "fp8_GBps": kv_mb["fp8"] / ms["fp8"]}
            rows.append(row)
            print(f"batch {batch:>3} context {context:>5}: bf16 {ms['bf16']:7.2f} ms ({row['bf16_GBps']:.1f} GB/s)  "
                  f"fp8 {ms['fp8']:7.2f} ms ({row['fp8_GBps']:.1f} GB/s)  fp8 {row['speedup']:.2f}x faster", flush=True)
            del caches
    write_json(args.json, rows)


if __name__ == "__main__":
    torch.set_num_threads(os.cpu_count() or 1)
    main()
