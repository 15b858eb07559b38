"""Disaggregated prefill/decode against one colocated server, same run, on this machine's two cores; and the KV
transfer time against `llmserve plan`'s prediction for the same bytes and link.

    .venv/bin/python benchmarks/disaggregated.py [--rate 0.12] [--requests 36] [--slo ttft_ms=2000,tpot_ms=100]
        [--json bench-results/disaggregated.json]

Workload (bursty and mixed, written as a `llmserve bench --dataset` file): short chat turns (80-token prompts, 96
tokens out) with long prompts (2,000 tokens, 32 out) arriving in bursts of three, every 12th request, at a Poisson
rate. Each configuration is `llmserve serve` loaded by `llmserve bench --dataset ... --request-rate R --slo ...`
(EOS ignored):
- colocated: one server, both cores (2 threads);
- disaggregated: `serve --disaggregated`: a prefill and a decode instance with one core each, the bypass threshold
  from the planner's arithmetic (the default);
- disaggregated with `--max-local-prefill-length 512`: chat turns prefilled on the decode instance, long prompts
  on the prefill instance.

Transfer: five fresh 2,000-token prompts sent to the disaggregated server one at a time; each response's usage
reports the bytes and seconds its KV took over the link; the prediction is the planner's kv_transfer_seconds (as
`llmserve plan --link-gbps G --kv-dtype K --prompt-len 2000` prints it) with G the link's measured rate and K the
servers' KV dtype.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

sys.path.insert(0, os.path.dirname(__file__))
from common import write_json
from serving import LLMSERVE, free_port, wait_healthy

LONG, SHORT, LONG_OUT, SHORT_OUT = 2000, 80, 32, 96


def build_dataset(path: str, requests: int, seed: int = 0) -> None:
    from llmserve.bench.workloads import WordSource
    from llmserve.loader import load_model_files

    words = WordSource(load_model_files(None).tokenizer, seed)
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(requests):
            burst = i % 12 in (5, 6, 7)  # three long prompts back to back, every 12 requests
            prompt = words.text(LONG if burst else SHORT + rng.randint(-20, 20))
            f.write(json.dumps({"prompt": prompt, "max_tokens": LONG_OUT if burst else SHORT_OUT}) + "\n")


def metric(text: str, name: str, **labels) -> float:
    return sum(float(l.rsplit(" ", 1)[1]) for l in text.splitlines()
               if l.startswith(name) and all(f'{k}="{v}"' in l for k, v in labels.items()))


def run_config(name: str, flags: list[str], dataset: str, args, out_dir: str) -> dict:
    port = free_port()
    log = open(os.path.join(out_dir, f"{name}.log"), "w+")
    server = subprocess.Popen([LLMSERVE, "serve", "--port", str(port), "--no-webui", *flags], stderr=log)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, 600)
        result = os.path.join(out_dir, f"{name}.json")
        subprocess.run([LLMSERVE, "bench", "--base-url", base + "/v1", "--dataset", dataset, "--request-rate",
                        str(args.rate), "--num-requests", str(args.requests), "--warmup", "0", "--ignore-eos",
                        "--slo", args.slo, "--label", name, "--result", result, "--no-plots", "--quiet",
                        "--seed", "1"], check=True)
        with open(result) as f:
            summary = json.load(f)["levels"][0]["summary"]
        text = httpx.get(base + "/metrics", timeout=10).text
        figures = {k: summary[k] for k in ("completed", "goodput", "request_throughput", "output_throughput",
                                           "p50_ttft_ms", "p99_ttft_ms", "p50_itl_ms", "p99_itl_ms", "p99_tpot_ms")}
        figures["remote_prefills"] = metric(text, "llmserve:disagg_prefill_requests_total", route="remote")
        figures["bypasses"] = metric(text, "llmserve:disagg_prefill_requests_total", route="bypass")
        figures["fallbacks"] = metric(text, "llmserve:kv_transfer_fallbacks_total")
        log.seek(0)
        found = re.search(r"KV link ([\d.]+) GB/s measured, prompts with fewer than (\d+) uncached", log.read())
        if found:
            figures["link_GBps"], figures["bypass_threshold"] = float(found.group(1)), int(found.group(2))
        log.seek(0)
        kv_dtype = re.search(r"KV cache: .* in (\w+)", log.read())
        figures["kv_dtype"] = kv_dtype.group(1) if kv_dtype else "float32"
        if "--disaggregated" in flags and name == "disaggregated":
            figures["transfers"] = measure_transfers(base, figures.get("link_GBps"), figures["kv_dtype"])
        print(f"{name}: " + ", ".join(f"{k} {v}" for k, v in figures.items() if k != "transfers"), flush=True)
        return figures
    finally:
        server.terminate()
        server.wait(timeout=60)


KV_FORMATS = {"float32": "FP32", "bfloat16": "BF16", "float16": "FP16", "float8_e4m3fn": "FP8"}


def measure_transfers(base: str, link_gbytes_per_s: float | None, kv_dtype: str) -> dict:
    from llmserve.bench.workloads import WordSource
    from llmserve.loader import load_model_files
    from llmserve.plan.estimate import PlanInputs, Planner
    from llmserve.plan.hardware import get_hardware
    from llmserve.plan.models import load_spec

    words = WordSource(load_model_files(None).tokenizer, 99)
    model = httpx.get(base + "/v1/models").json()["data"][0]["id"]
    seconds, sizes = [], []
    for _ in range(5):
        r = httpx.post(base + "/v1/completions", json={"model": model, "prompt": words.text(LONG), "max_tokens": 1},
                       timeout=600).json()
        details = r["usage"]["prompt_tokens_details"]
        seconds.append(details["kv_transfer_seconds"])
        sizes.append(details["kv_transfer_bytes"])
    link_gbps = link_gbytes_per_s * 8
    kv_format = KV_FORMATS[kv_dtype]  # the servers' KV dtype (bf16 on CPUs with AVX512-BF16)
    planner = Planner(PlanInputs(spec=load_spec(None), hardware=get_hardware("H100-SXM"), kv_format=kv_format,
                                 link_gbps=link_gbps))  # the hardware does not enter the transfer arithmetic
    predicted = planner.kv_transfer_seconds(LONG)
    measured = statistics.median(seconds)
    return {"bytes": statistics.median(sizes), "planned_bytes": planner.kv_per_request(LONG),
            "measured_s": measured, "predicted_s": predicted, "measured_over_predicted": measured / predicted,
            "plan_command": f"llmserve plan --link-gbps {link_gbps:.1f} --kv-dtype {kv_format} --prompt-len {LONG}"}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=0.12, help="requests per second (Poisson)")
    ap.add_argument("--requests", type=int, default=36)
    ap.add_argument("--slo", default="ttft_ms=2000,tpot_ms=100")
    ap.add_argument("--json", default="bench-results/disaggregated.json")
    args = ap.parse_args()
    out_dir = tempfile.mkdtemp(prefix="disagg-bench-")
    dataset = os.path.join(out_dir, "workload.jsonl")
    build_dataset(dataset, args.requests)
    configs = [("colocated", []), ("disaggregated", ["--disaggregated"]),
               ("disaggregated-bypass-512", ["--disaggregated", "--max-local-prefill-length", "512"])]
    results = {}
    for name, flags in configs:
        t = time.perf_counter()
        results[name] = run_config(name, flags, dataset, args, out_dir)
        print(f"  ({time.perf_counter() - t:.0f} s)", flush=True)
    write_json(args.json, {"rate": args.rate, "requests": args.requests, "slo": args.slo, "results": results})
    print(json.dumps(results.get("disaggregated", {}).get("transfers"), indent=1))


if __name__ == "__main__":
    main()
