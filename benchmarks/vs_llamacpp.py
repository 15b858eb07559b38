"""llmserve against llama.cpp on the same GGUF file, in one run: prefill, batch-1 decode, and serving under load.

    .venv/bin/python benchmarks/vs_llamacpp.py --llama-cpp-bin DIR [--concurrency 1,8,32] [--variants eager,compile]
        [--json out.json]

DIR holds a llama.cpp build's `llama-bench` and `llama-server` (llama.cpp is not a dependency: build it
yourself, outside this repository). Both engines get 2 threads' worth of machine, the default model unless
--model, and the same workloads:
- prefill: llama-bench pp512 against one 512-token prompt through llmserve's engine (median of 5);
- batch-1 decode: llama-bench tg128 against 128 greedy tokens from a 1-token prompt (median of 3);
- serving: `llmserve bench` (200-token prompts, 128 output tokens, EOS ignored, streaming) against llama-server
  (continuous batching, --parallel = the highest concurrency, flash attention off) and then `llmserve serve`.
llmserve is measured in each of --variants (offline pp512 and tg128, and serving at every concurrency): eager (the
default settings), compile (--compile: decode rows and prompts from position 0 run on compiled graphs, the rest
eager), fp8 (--kv-cache-dtype fp8), compile+fp8, and bf16 (--dtype bfloat16: the default's dtype where the CPU
computes bf16 natively; on AVX2-only CPUs, where the default is float32, it measures what bf16 would give), and
int4 (--decode-quantization int4: on AVX2-only CPUs, float32 activations instead of the default's int8, w4a8), and
w4a8 and compile+w4a8 (--decode-quantization w4a8: int8 activations where the default keeps bf16 ones).
Ratios are llmserve / llama.cpp (TTFT: llama.cpp / llmserve, so above 1 is better for both).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from serving import free_port, llmserve_server, sweep, wait_healthy

from llmserve import LLM, SamplingParams
from llmserve.loader import default_model_path
from common import write_json


VARIANTS = {"eager": [], "compile": ["--compile"], "fp8": ["--kv-cache-dtype", "fp8"],
            "compile+fp8": ["--compile", "--kv-cache-dtype", "fp8"], "bf16": ["--dtype", "bfloat16"],
            "int4": ["--decode-quantization", "int4"], "w4a8": ["--decode-quantization", "w4a8"],
            "compile+w4a8": ["--compile", "--decode-quantization", "w4a8"]}


def engine_settings(server_args: list[str]) -> dict:
    """The LLM(...) settings for a variant's server flags."""
    settings = {"compile": "--compile" in server_args}
    for flag in ("--kv-cache-dtype", "--dtype", "--decode-quantization"):
        if flag in server_args:
            settings[flag.removeprefix("--").replace("-", "_")] = server_args[server_args.index(flag) + 1]
    return settings


@contextlib.contextmanager
def llama_server(bin_dir: str, model: str, parallel: int, context: int, threads: int):
    port = free_port()
    args = [os.path.join(bin_dir, "llama-server"), "-m", model, "--port", str(port), "-t", str(threads), "-tb", str(threads),
            "--parallel", str(parallel), "-c", str(context), "-fa", "off", "--no-webui"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", timeout=120)
        yield f"http://127.0.0.1:{port}", args[1:]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def llama_bench(bin_dir: str, model: str, threads: int) -> dict:
    out = subprocess.run([os.path.join(bin_dir, "llama-bench"), "-m", model, "-t", str(threads), "-p", "512", "-n", "128",
                          "-r", "3", "-o", "json"], capture_output=True, text=True, check=True).stdout
    rows = json.loads(out)
    result = {"build_commit": rows[0].get("build_commit")}
    for r in rows:
        result["pp512" if r["n_prompt"] else "tg128"] = r["avg_ts"]
    return result


def llmserve_offline(model: str, decodes: int = 3, **engine_settings) -> dict:
    llm = LLM(model=model, max_num_batched_tokens=1024, **engine_settings)
    engine, tok = llm.engine, llm.engine.tokenizer
    words = tok.encode("the quick brown fox jumps over the lazy dog and keeps running through the forest " * 60)

    def prefill(i: int) -> float:
        prompt = [(t + 7 * i) % 5000 + 100 for t in words[:512]]  # fresh tokens each time: no prefix-cache hit
        engine.add_request(f"pp{i}", prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
        t = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        return time.perf_counter() - t

    def decode(i: int) -> float:
        engine.add_request(f"tg{i}", [words[i]], SamplingParams(max_tokens=129, temperature=0, ignore_eos=True))
        engine.step()  # the 1-token prefill and first token
        t = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        return time.perf_counter() - t

    prefill(-1), decode(99)  # warm-up
    pp = statistics.median(prefill(i) for i in range(5))
    tg = statistics.median(decode(i) for i in range(decodes))
    return {"pp512": 512 / pp, "tg128": 128 / tg}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-cpp-bin", required=True, help="folder with llama-bench and llama-server")
    ap.add_argument("--model", default=None, help="GGUF file (default: the built-in default model)")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--variants", default="eager,compile", help=f"llmserve settings to measure: {', '.join(VARIANTS)}")
    ap.add_argument("--skip-serving", action="store_true")
    ap.add_argument("--out-dir", default="bench-results")
    ap.add_argument("--json", default="bench-results/vs_llamacpp.json")
    args = ap.parse_args()
    model = args.model or default_model_path()
    os.makedirs(args.out_dir, exist_ok=True)
    report: dict = {"model": model, "threads": args.threads, "date": time.strftime("%Y-%m-%d %H:%M")}

    variants = args.variants.split(",")
    if unknown := [v for v in variants if v not in VARIANTS]:
        ap.error(f"unknown variant {unknown[0]!r}; choose from {', '.join(VARIANTS)}")
    report["llama_bench"] = llama_bench(args.llama_cpp_bin, model, args.threads)
    print("llama-bench", report["llama_bench"], flush=True)
    report["llmserve"] = {v: {} for v in variants}
    for v in variants:
        report["llmserve"][v]["offline"] = llmserve_offline(model, **engine_settings(VARIANTS[v]))
        print(f"llmserve offline, {v}", report["llmserve"][v]["offline"], flush=True)

    if not args.skip_serving:
        levels = [int(c) for c in args.concurrency.split(",")]
        context = max(levels) * (200 + 128 + 64)
        with llama_server(args.llama_cpp_bin, model, max(levels), context, args.threads) as (url, flags):
            report["llama_server_flags"] = flags
            report["llama_server"] = sweep(url, "llama-server", args.concurrency, f"{args.out_dir}/vs-llama-server.json", None)
        for v in variants:
            with llmserve_server("--model", model, *VARIANTS[v], ready_timeout=900) as url:
                report["llmserve"][v]["serve"] = sweep(url, f"llmserve {v}", args.concurrency,
                                                       f"{args.out_dir}/vs-llmserve-{v}.json", None)

    lb = report["llama_bench"]
    print(f"\n{'figure':<44}{'llmserve':>12}{'llama.cpp':>12}{'ratio':>9}")
    for v in variants:
        offline = report["llmserve"][v]["offline"]
        for name, key in (("prefill pp512 (tok/s)", "pp512"), ("batch-1 decode tg128 (tok/s)", "tg128")):
            print(f"{f'{name}, {v}':<44}{offline[key]:>12.1f}{lb[key]:>12.1f}{offline[key] / lb[key]:>8.2f}x")
    for v in variants:
        for c, a in report["llmserve"][v].get("serve", {}).items():
            b = report["llama_server"][c]
            print(f"{f'serving c={c}, {v}: output tok/s':<44}{a['output_throughput']:>12.1f}"
                  f"{b['output_throughput']:>12.1f}{a['output_throughput'] / b['output_throughput']:>8.2f}x")
            print(f"{f'serving c={c}, {v}: p50 TTFT (ms)':<44}{a['p50_ttft_ms']:>12.0f}{b['p50_ttft_ms']:>12.0f}"
                  f"{b['p50_ttft_ms'] / a['p50_ttft_ms']:>8.2f}x")
    write_json(args.json, report)


if __name__ == "__main__":
    main()
