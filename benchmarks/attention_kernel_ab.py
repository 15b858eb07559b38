"""The native decode-attention kernel as it is in the working tree against the same kernel at another git revision,
both built in one process and timed alternately on the same caches.

    .venv/bin/python benchmarks/attention_kernel_ab.py --against HEAD~1 [--cases 32x264,256x140] [--dtypes fp8,bf16]
        [--json out.json]

The revision's paged_attention.cpp is compiled under another op namespace (llmserve_ab), with the same flags. Each
case is one decode step's attention over 30 layers in the default model's shape (9 query heads, 3 KV heads of 64),
B sequences with lengths drawn between C/2 and C, blocks scattered over a pool 4x the size in use. Reported: each
kernel's median of 15 (the two taking turns, each first in every other round) and the ratio (above 1: the working
tree is faster), and the largest difference between their outputs. With --hot, one layer's cache, exactly the
size in use, is read 30 times instead: it stays in L2/L3, so the figure is the kernel's compute without memory.
With --engine-batches, whole eager decode steps of the default model as well: B 200-token prompts prefilled, then the
engine's attention op swapped between the two kernels round by round (median of 6 rounds x 7 steps each).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from llmserve import kernels
from common import build_kernel_revision, engine_steps_ab, write_json

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK, REPS = 30, 9, 3, 64, 16, 15
DTYPES = {"fp8": torch.float8_e4m3fn, "bf16": torch.bfloat16}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--against", required=True, help="a git revision (commit, tag, HEAD~1)")
    ap.add_argument("--cases", default="8x1000,32x264,64x264,256x140", help="BxC: B sequences of up to C keys")
    ap.add_argument("--dtypes", default="fp8,bf16")
    ap.add_argument("--hot", action="store_true", help="one layer's cache read 30 times: compute, not memory")
    ap.add_argument("--engine-batches", default="", help="also whole decode steps at these batch sizes, e.g. 8,32")
    ap.add_argument("--json", default="bench-results/attention_kernel_ab.json")
    args = ap.parse_args()
    if not kernels.load_cpu_kernels():
        raise SystemExit(f"the native kernels did not build: {kernels.build_error()}")
    current = torch.ops.llmserve_kernels.paged_decode_attention
    digest = build_kernel_revision(args.against, ["paged_attention.cpp"], "llmserve_ab")
    other = torch.ops.llmserve_ab.paged_decode_attention
    g = torch.Generator().manual_seed(0)
    rows = []
    for case in args.cases.split(","):
        batch, context = map(int, case.split("x"))
        for name in args.dtypes.split(","):
            per_seq = -(-context // BLOCK)
            spread = 1 if args.hot else 4
            slots = per_seq * batch * spread * BLOCK
            tables = torch.randperm(per_seq * batch * spread, generator=g)[: per_seq * batch].view(batch, per_seq)
            lengths = torch.randint(context // 2, context + 1, (batch,), generator=g)
            q = torch.randn(batch, HEADS, HEAD_DIM, generator=g).bfloat16()
            layers = [tuple((torch.randn(slots, KV_HEADS, HEAD_DIM, generator=g) * 3).to(DTYPES[name]) for _ in range(2))
                      for _ in range(1 if args.hot else LAYERS)]
            if args.hot:
                layers = layers * LAYERS
            call = (tables, lengths, BLOCK, HEAD_DIM**-0.5, 0.7, 1.3)
            diff = (current(q, *layers[0], *call).float() - other(q, *layers[0], *call).float()).abs().max().item()
            times = {"current": [], "other": []}
            for rep in range(REPS):
                for which, op in (("current", current), ("other", other))[:: 1 if rep % 2 else -1]:
                    t = time.perf_counter()
                    for k, v in layers:
                        op(q, k, v, *call)
                    times[which].append((time.perf_counter() - t) * 1e3)
            ms = {which: statistics.median(ts) for which, ts in times.items()}
            row = {"batch": batch, "context": context, "cache": name, "hot": args.hot, "current_ms": ms["current"],
                   f"{digest}_ms": ms["other"], "ratio": ms["other"] / ms["current"], "max_abs_diff": diff}
            rows.append(row)
            print(f"{batch:>4} x {context:<5} {name:>4}: working tree {ms['current']:7.2f} ms  {digest} {ms['other']:7.2f} ms"
                  f"  ratio {row['ratio']:.3f}  max|diff| {diff:.3g}", flush=True)
            del layers
    steps = [engine_steps_ab(int(b), "paged_decode_attention", other, digest) for b in args.engine_batches.split(",") if b]
    write_json(args.json, {"against": args.against, "commit": digest, "rows": rows, "engine_steps": steps})


if __name__ == "__main__":
    torch.set_num_threads(os.cpu_count() or 1)
    main()
