"""Greedy decode steps with llmserve's logits path (a float32 buffer kept across steps for large batches, the native
argmax) against the path before it (fresh float32 logits every step, torch's max(dim=-1)), in one process.

    .venv/bin/python benchmarks/logits_path.py [--batches 32,256] [--context 128] [--kv-cache-dtype fp8] [--no-compile]
        [--json out.json]

Each batch size: one engine (--compile by default), B prompts of --context tokens prefilled, then rounds of 12 decode
steps alternate between the two paths (12 rounds each); the figure is the median step time of each, and the ratio
old / new (above 1: the current path is faster). Both paths pick the same tokens.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from llmserve import LLM, kernels
from llmserve.worker.model_runner import ModelRunner

sys.path.insert(0, os.path.dirname(__file__))
from attention_backend import start_batch  # noqa: E402  (a sibling script, not a package)
from common import write_json

ROUNDS, STEPS = 12, 12


def measure(batch: int, context: int, kv_cache_dtype: str, compile_steps: bool) -> dict:
    decode_tokens = ROUNDS * 2 * (STEPS + 1) + 4
    llm = LLM(compile=compile_steps, kv_cache_dtype=kv_cache_dtype, max_num_seqs=max(batch, 32),
              max_num_batched_tokens=max(2048, batch), num_kv_blocks=batch * ((context + decode_tokens + 31) // 16) + 16)
    start_batch(llm, "r", batch, context, decode_tokens)
    engine = llm.engine
    current_widen, current_argmax = ModelRunner._float_logits, kernels.fast_argmax_available
    times: dict[str, list[float]] = {"current": [], "fresh_float32_torch_max": []}
    try:
        for r in range(2 * ROUNDS):
            mode = "current" if r % 2 == 0 else "fresh_float32_torch_max"
            ModelRunner._float_logits = current_widen if mode == "current" else (lambda self, logits: logits.float())
            kernels.fast_argmax_available = current_argmax if mode == "current" else (lambda: False)
            engine.step()  # the first step after a switch is not timed
            for _ in range(STEPS):
                t = time.perf_counter()
                engine.step()
                times[mode].append(time.perf_counter() - t)
    finally:
        ModelRunner._float_logits, kernels.fast_argmax_available = current_widen, current_argmax
    new, old = statistics.median(times["current"]), statistics.median(times["fresh_float32_torch_max"])
    return {"batch": batch, "context": context, "current_ms": new * 1e3, "old_ms": old * 1e3,
            "current_tok_s": batch / new, "old_tok_s": batch / old, "ratio": old / new}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="32,256")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--kv-cache-dtype", default="fp8")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = []
    for b in (int(x) for x in args.batches.split(",")):
        rows.append(measure(b, args.context, args.kv_cache_dtype, not args.no_compile))
        r = rows[-1]
        print(f"B={b}: current {r['current_ms']:.1f} ms/step ({r['current_tok_s']:.0f} tok/s), fresh float32 + torch max "
              f"{r['old_ms']:.1f} ms/step ({r['old_tok_s']:.0f} tok/s), ratio {r['ratio']:.3f}", flush=True)
    write_json(args.json, rows)


if __name__ == "__main__":
    main()
