"""Decode step time of the offline engine at several batch sizes, bf16, with oneDNN prepacking on and off, or
with several low-bit row limits.

    .venv/bin/python benchmarks/decode_step.py [--batches 1 8 32] [--context 200] [--json out.json]
    .venv/bin/python benchmarks/decode_step.py --batches 8 16 32 48 64 --max-rows 0 auto [--rounds 3]
    .venv/bin/python benchmarks/decode_step.py --batches 1 8 32 --max-rows 0 auto --dtype float32 bfloat16
    .venv/bin/python benchmarks/decode_step.py --batches 1 8 32 --max-rows auto --dtype float32 --quantization int4 w4a8

Each batch size: that many 200-token prompts are prefilled, then 30 decode steps are timed (median). With
--max-rows, one engine per value of decode_quantization_max_rows (0: every step on the bf16 weights; auto: the
default), all in this process, taking turns batch by batch for --rounds rounds (median of the rounds), so the
machine's drift falls on all; with several --dtype or --quantization values, one engine per combination (keys
"dtype/limit" or "dtype/limit/quantization").
Without it, run it from two checkouts back to back to compare code changes on this noisy machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from llmserve import LLM, SamplingParams
from common import write_json


def step_ms(llm, batch: int, context: int, steps: int) -> float:
    e = llm.engine
    tok = e.tokenizer
    base = tok.encode("the quick brown fox jumps over the lazy dog " * 40)[:context]
    for i in range(batch):
        e.add_request(f"b{batch}-{i}", [(t + i) % 5000 + 100 for t in base], SamplingParams(temperature=0, max_tokens=steps + 10,
                                                                                           ignore_eos=True))
    while e.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in e.scheduler.running):
        e.step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        e.step()
        times.append((time.perf_counter() - t) * 1000)
    while e.has_unfinished_requests():
        e.step()
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--max-rows", nargs="+", default=None, help="decode_quantization_max_rows values (or auto)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", nargs="+", default=["auto"], help="engine dtypes (with --max-rows)")
    ap.add_argument("--quantization", nargs="+", default=["auto"], help="decode_quantization values (with --max-rows)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    if args.max_rows is not None:
        def key(d, n, q):
            return f"{d}/{n}/{q}" if len(args.quantization) > 1 else f"{d}/{n}" if len(args.dtype) > 1 else n

        llms = {key(d, n, q): LLM(max_num_seqs=max(args.batches), dtype=d, decode_quantization=q,
                                  decode_quantization_max_rows=None if n == "auto" else int(n))
                for d in args.dtype for n in args.max_rows for q in args.quantization}
        for b in args.batches:
            times: dict[str, list[float]] = {n: [] for n in llms}
            for _ in range(args.rounds):
                for n, llm in llms.items():
                    times[n].append(step_ms(llm, b, args.context, args.steps))
            ms = {n: statistics.median(t) for n, t in times.items()}
            rows.append({"batch": b, "step_ms_by_max_rows": ms, "kernel": {n: llm.engine.executor.info.weights.lowbit_kernel for n, llm in llms.items()}})
            print(json.dumps(rows[-1]), flush=True)
        write_json(args.json, rows)
        return
    for prepack in (False, True):
        try:
            llm = LLM(max_num_seqs=max(args.batches), cpu_prepack=prepack)
        except TypeError:  # an older checkout without the switch
            if prepack:
                continue
            llm = LLM(max_num_seqs=max(args.batches))
        for b in args.batches:
            ms = step_ms(llm, b, args.context, args.steps)
            rows.append({"cpu_prepack": prepack, "batch": b, "step_ms": ms, "tokens_per_s": b * 1000 / ms})
            print(json.dumps(rows[-1]))
    write_json(args.json, rows)


if __name__ == "__main__":
    main()
