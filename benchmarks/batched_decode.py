"""High-batch decode: llmserve against llama.cpp's `llama-batched-bench`, same GGUF file, same shapes, one run.

    .venv/bin/python benchmarks/batched_decode.py [--llama-cpp-bin DIR] [--batches 32,64,128,256] [--pp 128] [--tg 128]
        [--variants compile,compile+fp8] [--json out.json]

Each batch size B: B sequences, each a --pp-token prompt of its own, then --tg decode steps of B rows. The figure is
the decode rate, B * tg / (time of the tg steps), as llama-batched-bench's S_TG (run with `-npp PP -ntg TG -npl B`,
flash attention off, 2 threads). llmserve's steps also sample (greedy) and detokenize; llama-batched-bench's do not.
The prompts are prefilled before the clock starts, as llama-batched-bench's T_PP is not part of its S_TG.
The bar for high-batch decode is half the bf16 matrix-rate limit: no batch can decode faster than the machine's bf16
matrix rate over the model's 2 x params FLOPs per token. The rate is measured in the same run (torch's bf16 matmul,
n = 2048, --threads threads): it depends on the CPU (AMX or not), so the limit does too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from llmserve import LLM, SamplingParams
from llmserve.loader import default_model_path
from llmserve.plan.models import load_spec

sys.path.insert(0, os.path.dirname(__file__))
from vs_llamacpp import VARIANTS, engine_settings  # noqa: E402  (a sibling script, not a package)
from common import write_json


def bf16_matrix_rate(threads: int, n: int = 2048, reps: int = 7) -> float:
    """FLOP/s of torch's bf16 matmul, n x n x n, median of reps."""
    torch.set_num_threads(threads)
    a, b = torch.randn(n, n, dtype=torch.bfloat16), torch.randn(n, n, dtype=torch.bfloat16)
    torch.mm(a, b)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - t)
    return 2 * n**3 / statistics.median(times)


def llama_batched_bench(bin_dir: str, model: str, batches: list[int], pp: int, tg: int, threads: int) -> dict:
    args = [os.path.join(bin_dir, "llama-batched-bench"), "-m", model, "-c", str(max(batches) * (pp + tg)),
            "-b", "2048", "-ub", "512", "-npp", str(pp), "-ntg", str(tg), "-npl", ",".join(map(str, batches)),
            "-t", str(threads), "-tb", str(threads), "-fa", "off", "--output-format", "jsonl"]
    out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return {"flags": args[1:], "speed_tg": {str(r["pl"]): r["speed_tg"] for r in rows}}


def llmserve_batched(model: str, batches: list[int], pp: int, tg: int, reps: int, **settings) -> dict:
    most = max(batches)
    # Room for every sequence's whole context, beyond the default 1 GiB cap on CPU.
    llm = LLM(model=model, max_num_seqs=most, max_num_batched_tokens=max(2048, most),
              num_kv_blocks=most * -(-(pp + tg + 16) // 16) + 16, **settings)
    engine = llm.engine
    words = engine.tokenizer.encode("the quick brown fox jumps over the lazy dog and keeps running through the forest " * 30)

    def decode_rate(batch: int, rep: int) -> float:
        # distinct prompts: no prefix-cache hits between sequences or repetitions
        prompts = [[(t + 7 * i + 1009 * rep) % 20000 + 100 for t in words[:pp]] for i in range(batch)]
        # Every prompt is prefilled first (one token out), which leaves its blocks in the prefix cache; the same
        # prompts again then recompute only their last partial block, and every step after that has all `batch`
        # rows, as llama-batched-bench's decode does.
        for phase, max_tokens in (("prefill", 1), ("decode", tg + 1)):
            for i, prompt in enumerate(prompts):
                engine.add_request(f"{phase}-{batch}-{rep}-{i}", prompt,
                                   SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
            sched = engine.scheduler
            # prefill: until every prompt is done; decode: until each has its first token (from its recomputed tail)
            while (engine.has_unfinished_requests() if phase == "prefill"
                   else sched.waiting or any(not r.output_token_ids for r in sched.running)):
                engine.step()
        t = time.perf_counter()
        steps = 0
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        elapsed = time.perf_counter() - t
        assert steps == tg, f"expected {tg} decode steps of {batch} rows, ran {steps}"
        return batch * tg / elapsed

    decode_rate(min(batches), -1)  # warm-up
    return {str(b): statistics.median(decode_rate(b, r) for r in range(reps)) for b in batches}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-cpp-bin", default=None, help="folder with llama-batched-bench (omit to measure llmserve only)")
    ap.add_argument("--model", default=None, help="GGUF file (default: the built-in default model)")
    ap.add_argument("--batches", default="32,64,128,256")
    ap.add_argument("--pp", type=int, default=128, help="prompt tokens per sequence")
    ap.add_argument("--tg", type=int, default=128, help="decode steps timed")
    ap.add_argument("--reps", type=int, default=2, help="llmserve repetitions per batch size (median)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--variants", default="compile,compile+fp8", help=f"llmserve settings: {', '.join(VARIANTS)}")
    ap.add_argument("--json", default="bench-results/batched_decode.json")
    args = ap.parse_args()
    model = args.model or default_model_path()
    batches = [int(b) for b in args.batches.split(",")]
    variants = args.variants.split(",")
    if unknown := [v for v in variants if v not in VARIANTS]:
        ap.error(f"unknown variant {unknown[0]!r}; choose from {', '.join(VARIANTS)}")
    report: dict = {"model": model, "pp": args.pp, "tg": args.tg, "threads": args.threads,
                    "date": time.strftime("%Y-%m-%d %H:%M"), "llmserve": {}}
    rate = report["bf16_matrix_flops"] = bf16_matrix_rate(args.threads)
    limit = report["matrix_rate_limit_tok_s"] = rate / (2 * load_spec(model).total_params)
    print(f"bf16 matrix rate {rate / 1e12:.2f} TFLOP/s: decode limit {limit:,.0f} tok/s, half {limit / 2:,.0f}", flush=True)
    if args.llama_cpp_bin:
        report["llama_batched_bench"] = llama_batched_bench(args.llama_cpp_bin, model, batches, args.pp, args.tg, args.threads)
        print("llama-batched-bench", report["llama_batched_bench"]["speed_tg"], flush=True)
    for v in variants:
        report["llmserve"][v] = llmserve_batched(model, batches, args.pp, args.tg, args.reps, **engine_settings(VARIANTS[v]))
        print(f"llmserve {v}", report["llmserve"][v], flush=True)

    ref = report.get("llama_batched_bench", {}).get("speed_tg", {})
    print(f"\n{'decode tok/s, pp ' + str(args.pp) + ', tg ' + str(args.tg):<34}{'llama.cpp':>11}"
          + "".join(f"{v:>14}{'ratio':>8}{'/limit':>8}" for v in variants))
    for b in batches:
        line = f"{'B = ' + str(b):<34}{ref.get(str(b), float('nan')):>11.1f}"
        for v in variants:
            tok_s = report["llmserve"][v][str(b)]
            line += f"{tok_s:>14.1f}{tok_s / ref.get(str(b), float('nan')):>7.2f}x{tok_s / limit:>7.2f}x"
        print(line)
    write_json(args.json, report)


if __name__ == "__main__":
    main()
