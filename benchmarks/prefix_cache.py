"""Prefix caching on the shared-prefix workload: TTFT with the cache (pool, and disk tier) against without, one run.

    .venv/bin/python benchmarks/prefix_cache.py [--prefix-len 2000] [--num-requests 24] [--out bench-results/prefix]

Three servers in turn on the default model: caching off; caching on; caching on with a KV pool too small to
keep the prefixes, so that they are evicted to the disk tier and come back from it. Each gets the same
`llmserve bench --workload shared-prefix` run (2 system prompts of --prefix-len tokens, 32-token questions,
8 output tokens, concurrency 1), and the mean TTFTs are compared.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile

import httpx
from common import write_json
from serving import LLMSERVE, llmserve_server

def run_case(name: str, server_args: list[str], bench_args: list[str], out: str) -> dict:
    with llmserve_server(*server_args) as url:
        result = f"{out}-{name}.json"
        subprocess.run([LLMSERVE, "bench", "--base-url", f"{url}/v1", "--quiet", "--no-plots", "--label", name,
                        "--result", result, *bench_args], check=True, stdout=subprocess.DEVNULL)
        metrics = httpx.get(f"{url}/metrics").text
    hits = {line.split("tier=\"")[1].split("\"")[0]: float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines() if line.startswith("llmserve:prefix_cache_hits_total{")}
    with open(result) as f:
        summary = json.load(f)["levels"][0]["summary"]
    return {"mean_ttft_ms": summary["mean_ttft_ms"], "p50_ttft_ms": summary["p50_ttft_ms"],
            "cached_input_tokens": summary["cached_input_tokens"], "total_input_tokens": summary["total_input_tokens"],
            "hits_by_tier": hits}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefix-len", type=int, default=2000)
    ap.add_argument("--num-requests", type=int, default=24)
    ap.add_argument("--out", default="bench-results/prefix")
    args = ap.parse_args()
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    bench = ["--workload", "shared-prefix", "--num-prefixes", "2", "--prefix-len", str(args.prefix_len), "--question-len", "32",
             "--output-len", "8", "--ignore-eos", "--concurrency", "1", "--num-requests", str(args.num_requests)]
    disk = tempfile.mkdtemp(prefix="llmserve-kv-")
    # a pool that holds one prefix and a bit: the other prefix is evicted to disk every time
    small_pool = str(int((args.prefix_len + 200) * 23_040 * 1.3))
    try:
        results = {
            "off": run_case("off", ["--no-prefix-caching"], bench, args.out),
            "on": run_case("on", [], bench, args.out),
            "disk": run_case("disk", ["--kv-cache-memory", small_pool, "--kv-offload-dir", disk], bench, args.out),
        }
    finally:
        shutil.rmtree(disk, ignore_errors=True)
    off = results["off"]["mean_ttft_ms"]
    results["ratios"] = {"on_over_off": results["on"]["mean_ttft_ms"] / off, "disk_over_off": results["disk"]["mean_ttft_ms"] / off}
    print(json.dumps(results, indent=1))
    write_json(args.out + ".json", results)


if __name__ == "__main__":
    main()
