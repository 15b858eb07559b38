"""llmserve's low-bit kernel (bf16 activations) as it is in the working tree against the same kernel at another git
revision, both built in one process and timed alternately on the same weights.

    .venv/bin/python benchmarks/lowbit_kernel_ab.py --against HEAD~1 [--rows 1,4,8,16] [--json out.json]

The revision's lowbit_linear*.cpp are compiled under another op namespace (llmserve_lowbit_ab), with the same flags.
Each case is one decode step's weights in the default model's shapes, from memory: the projections of 30 layers in
4 bits, and the 49,152 x 576 LM head in 8 bits. Reported: each kernel's median of 11 (the two taking turns, each
first in every other round), the ratio (above 1: the working tree is faster), and the largest difference between
their outputs. With --engine-batches, whole eager decode steps of the default model as well, the engine's low-bit
op swapped between the two kernels round by round (common.engine_steps_ab).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from llmserve import kernels
from llmserve.layers.quant import GroupWeight
from common import build_kernel_revision, engine_steps_ab, write_json

PROJECTIONS = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # fused QKV, O, fused gate/up, down
LM_HEAD = [(49152, 576)]
LAYERS, REPS = 30, 11


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--against", required=True, help="a git revision (commit, tag, HEAD~1)")
    ap.add_argument("--rows", default="1,4,5,6,7,8,9,16", help="comma-separated; empty for none")
    ap.add_argument("--engine-batches", default="", help="also whole decode steps at these batch sizes, e.g. 8,32")
    ap.add_argument("--json", default="bench-results/lowbit_kernel_ab.json")
    args = ap.parse_args()
    route = kernels.lowbit_linear_route(torch.bfloat16)
    if route is None:
        reason = kernels.build_error() or "CPU without AMX or AVX512-BF16"
        raise SystemExit(f"no low-bit kernel for bf16 here ({reason})")
    current = torch.ops.llmserve_kernels.lowbit_linear
    sources = ["lowbit_linear.cpp", "lowbit_linear_avx2.cpp", "lowbit_linear_vnni.cpp"]
    digest = build_kernel_revision(args.against, sources, "llmserve_lowbit_ab")
    other = torch.ops.llmserve_lowbit_ab.lowbit_linear
    g = torch.Generator().manual_seed(0)

    def random_weights(shapes, bits):
        return [GroupWeight(torch.randn(n, k, generator=g) * 0.02, bits).on_route(route) for n, k in shapes]

    cases = {"projections, 4 bits": [random_weights(PROJECTIONS, 4) for _ in range(LAYERS)],
             "LM head, 8 bits": [random_weights(LM_HEAD, 8)]}

    def one_pass(op, layers, xs) -> float:
        t = time.perf_counter()
        for layer in layers:
            for w in layer:
                op(xs[w.codes.shape[1] * 32], w.codes, w.scales, w.offsets, w.route)
        return time.perf_counter() - t

    print(f"route {route}, against {digest}")
    rows_out = []
    for rows in (int(r) for r in args.rows.split(",") if r):
        xs = {k: torch.randn(rows, k, generator=g).bfloat16() for k in (576, 1536)}
        for name, layers in cases.items():
            w = layers[0][0]
            x = xs[w.codes.shape[1] * 32]
            diff = (current(x, w.codes, w.scales, w.offsets, route).float()
                    - other(x, w.codes, w.scales, w.offsets, route).float()).abs().max().item()
            times = {"current": [], "other": []}
            for rep in range(REPS):
                for which, op in (("current", current), ("other", other))[:: 1 if rep % 2 else -1]:
                    times[which].append(one_pass(op, layers, xs) * 1e3)
            ms = {which: statistics.median(ts) for which, ts in times.items()}
            row = {"rows": rows, "case": name, "current_ms": ms["current"], f"{digest}_ms": ms["other"],
                   "ratio": ms["other"] / ms["current"], "max_abs_diff": diff}
            rows_out.append(row)
            print(f"{rows:>4} rows, {name:<19}: working tree {ms['current']:7.2f} ms  {digest} {ms['other']:7.2f} ms"
                  f"  ratio {row['ratio']:.3f}  max|diff| {diff:.3g}", flush=True)
    steps = [engine_steps_ab(int(b), "lowbit_linear", other, digest) for b in args.engine_batches.split(",") if b]
    write_json(args.json, {"against": args.against, "commit": digest, "route": route, "rows": rows_out,
                           "engine_steps": steps})


if __name__ == "__main__":
    main()
