"""The projections of one decode step, by kernel: oneDNN's bf16 matmul on packed weights, torch's int4 weight-only
kernel, and llmserve's low-bit kernel (4 and 8 bits) by each route this CPU has (AMX, AVX512-BF16), in one process,
alternating. With --dtype float32 (the engine's default on CPUs without native bf16): float32 matmul (MKL), torch's
int4 kernel and llmserve's AVX2 routes, on float32 activations as they are (avx2) or rounded to int8 (avx2_int8, the
w4a8 default).

Weights have the default model's layer shapes (SmolLM2-135M: fused QKV 960x576, O 576x576, fused gate/up 3072x576,
down 576x1536) and 30 layers of them, so each pass streams ~106M weights from memory as a real step does. Random
values: the kernels' speed does not depend on them. Times are medians over --repeats passes.

    .venv/bin/python benchmarks/lowbit_linear.py --rows 1 4 8 16 32 64 512 --json bench-results/lowbit_linear.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from llmserve import kernels
from llmserve.config import EngineConfig
from llmserve.platforms import get_platform
from llmserve.layers.quant import GroupWeight, Int4Weight
from common import write_json

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LAYERS = 30
TORCH_INT4_MAX_ROWS = 32  # beyond this torch's int4 kernel is far behind (blocks of 4 rows); skipped to save time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64, 512])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                    help="activations' dtype; auto: the engine's default on this CPU")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dtype = get_platform("cpu").resolve_dtype(EngineConfig(dtype=args.dtype, device="cpu"))
    if kernels.lowbit_linear_route(dtype) is None:
        sys.exit(f"llmserve's low-bit kernel has no {dtype} route here "
                 f"({kernels.build_error() or 'no AMX or AVX512-BF16 for bf16, no AVX2 for float32'})")
    if dtype == torch.float32:
        routes = ["avx2", "avx2_int8"]
    else:
        routes = ["avx512_bf16"] + (["amx"] if kernels.lowbit_linear_isa() == "amx" else [])

    g = torch.Generator().manual_seed(0)
    dense = [[torch.randn(n, k, generator=g) * 0.02 for n, k in SHAPES] for _ in range(LAYERS)]
    reference = "bf16" if dtype == torch.bfloat16 else "float32"
    kinds = {
        reference: [[torch.ops.mkldnn._reorder_linear_weight(w.bfloat16()) for w in layer] for layer in dense]
        if dtype == torch.bfloat16 else dense,
        "torch_int4": [[Int4Weight(w, dtype) for w in layer] for layer in dense],
    }
    for bits in (4, 8):
        group_weights = [[GroupWeight(w, bits) for w in layer] for layer in dense]
        for route in routes:
            kinds[f"{route}/int{bits}"] = [[gw.on_route(route) for gw in layer] for layer in group_weights]
        if bits == 4 and dtype == torch.bfloat16 and kernels.lowbit_linear_int8_isa():
            kinds["avx512_int8/int4"] = [[gw.on_route("avx512_int8") for gw in layer] for layer in group_weights]
    best = f"{routes[-1]}/int4"  # the default: AMX, or w4a8 in float32

    def one_pass(kind: str, rows: int) -> float:
        xs = {k: torch.randn(rows, k, generator=g).to(dtype) for k in (576, 1536)}
        t = time.perf_counter()
        for layer in kinds[kind]:
            for w, (_, k) in zip(layer, SHAPES):
                if kind == "bf16":
                    torch.ops.mkldnn._linear_pointwise(xs[k], w, None, "none", [], "")
                elif kind == "float32":
                    torch.nn.functional.linear(xs[k], w)
                else:
                    w.matmul(xs[k])
        return time.perf_counter() - t

    results = []
    print(f"{'rows':>5} " + " ".join(f"{k:>17}" for k in kinds) + f"   {best} vs {reference}")
    for rows in args.rows:
        times: dict[str, list[float]] = {k: [] for k in kinds if k != "torch_int4" or rows <= TORCH_INT4_MAX_ROWS}
        for _ in range(args.repeats):
            for kind in times:
                times[kind].append(one_pass(kind, rows))
        ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        results.append({"rows": rows, "ms": ms})
        cells = " ".join(f"{ms[k]:15.2f}ms" if k in ms else f"{'-':>17}" for k in kinds)
        print(f"{rows:>5} {cells}   {ms[reference] / ms[best]:.2f}x", flush=True)
    write_json(args.json, {"layers": LAYERS, "shapes": SHAPES, "dtype": str(dtype), "routes": routes, "results": results})


if __name__ == "__main__":
    main()
