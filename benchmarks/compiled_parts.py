"""With --compile, steps that mix decode rows and several new prompts run as compiled parts (the decode graph, then
each prompt as the lone-prompt graph) instead of one eager step. This times a wave of prompts arriving together, both
ways, alternately in one process.

    .venv/bin/python benchmarks/compiled_parts.py [--prompts 32] [--prompt-len 200] [--output-len 16] [--kv-cache-dtype fp8]

The wave: --prompts prompts of --prompt-len tokens (five of 200 to a step at the default 1,024-token budget), each
then generating --output-len tokens. The figure is the wave's time with those steps eager over its time in parts.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from llmserve import LLM, SamplingParams
from common import write_json


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--json", default="bench-results/compiled_parts.json")
    args = ap.parse_args()
    llm = LLM(compile=True, max_num_seqs=args.prompts, enable_prefix_caching=False, kv_cache_dtype=args.kv_cache_dtype)
    engine, graphs = llm.engine, llm.engine.executor.runner.graphs
    in_parts = graphs.parts
    words = engine.tokenizer.encode("the quick brown fox jumps over the lazy dog and keeps running through the forest " * 60)

    def wave(tag: str, count: int, output_len: int) -> float:
        for i in range(count):
            prompt = [(t + 13 * i) % 5000 + 100 for t in words[: args.prompt_len]]
            engine.add_request(f"{tag}-{i}", prompt, SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True))
        t = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        return time.perf_counter() - t

    wave("warm-up", 8, 2)
    times = {"parts": [], "eager": []}
    for r in range(args.reps):
        for mode in times:
            graphs.parts = in_parts if mode == "parts" else (lambda items, wanted_rows: None)
            times[mode].append(wave(f"{mode}{r}", args.prompts, args.output_len))
    graphs.parts = in_parts
    result = {mode: statistics.median(ts) for mode, ts in times.items()}
    result["speedup"] = result["eager"] / result["parts"]
    print(f"wave of {args.prompts} x {args.prompt_len} tokens, {args.output_len} out: parts {result['parts']:.2f} s, "
          f"eager mixed steps {result['eager']:.2f} s, {result['speedup']:.2f}x")
    write_json(args.json, {"settings": vars(args), "times": times, **result})


if __name__ == "__main__":
    torch.set_num_threads(os.cpu_count() or 1)
    main()
