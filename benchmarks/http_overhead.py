"""What the HTTP server costs under load: `llmserve bench` against `llmserve serve`, and against the same engine in the
bench's own process (`llmserve bench --engine`: the engine thread and its queues, no HTTP, no SSE, no JSON).

    .venv/bin/python benchmarks/http_overhead.py [--concurrency 8,32] [--flags=--compile] [--json out.json]

Same workload as the comparison with llama.cpp (benchmarks/vs_llamacpp.py): 200-token prompts, 128 output tokens,
EOS ignored, 4 x concurrency requests per level. The figure is the server's output tok/s over the engine's: how
much of the engine's speed reaches HTTP clients. Both run with the same engine flags, one after the other.
"""

from __future__ import annotations

import argparse
import os
import shlex
import time

from serving import llmserve_server, sweep
from common import write_json


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", default="8,32")
    ap.add_argument("--flags", default="--compile", help="engine flags for both runs (quoted, e.g. '--compile --kv-cache-dtype fp8')")
    ap.add_argument("--out-dir", default="bench-results/http_overhead")
    ap.add_argument("--json", default="bench-results/http_overhead.json")
    args = ap.parse_args()
    flags = shlex.split(args.flags)
    os.makedirs(args.out_dir, exist_ok=True)
    report: dict = {"flags": flags, "date": time.strftime("%Y-%m-%d %H:%M")}
    report["engine"] = sweep("", "engine in process", args.concurrency, f"{args.out_dir}/engine.json", None, "--engine", *flags)
    with llmserve_server(*flags, ready_timeout=900) as url:
        report["server"] = sweep(url, "llmserve serve", args.concurrency, f"{args.out_dir}/server.json", None)

    print(f"\n{'concurrency':<13}{'engine tok/s':>14}{'server tok/s':>14}{'server/engine':>15}{'engine TTFT p50':>17}{'server TTFT p50':>17}")
    for c, engine in report["engine"].items():
        server = report["server"][c]
        print(f"{c:<13}{engine['output_throughput']:>14.1f}{server['output_throughput']:>14.1f}"
              f"{server['output_throughput'] / engine['output_throughput']:>14.2f}x"
              f"{engine['p50_ttft_ms']:>14.0f} ms{server['p50_ttft_ms']:>14.0f} ms")
    write_json(args.json, report)


if __name__ == "__main__":
    main()
