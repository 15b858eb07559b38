"""Decode step time with the native paged-attention kernel against the SDPA backend, in one process.

    .venv/bin/python benchmarks/attention_backend.py [--batches 1 8 32] [--contexts 200 1000] [--steps 20]
                                                     [--with-compiled] [--json out.json]

Two engines on the default model (bf16, eager), one per backend; --with-compiled adds a third, native with
--compile. For each batch size and context length all prefill the same prompts, then decode steps are timed
alternately, engine by engine, three rounds of `--steps` steps each; the figure is the median step time, and each
ratio is SDPA's over the other's (above 1: faster than eager SDPA).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from llmserve import LLM, SamplingParams
from common import write_json


def start_batch(llm: LLM, tag: str, batch: int, context: int, max_tokens: int) -> None:
    e = llm.engine
    base = e.tokenizer.encode("the quick brown fox jumps over the lazy dog " * (context // 8 + 1))[:context]
    for i in range(batch):
        e.add_request(f"{tag}-{i}", [(t + 31 * i) % 5000 + 100 for t in base],
                      SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    while e.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in e.scheduler.running):
        e.step()


def timed_steps(llm: LLM, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        t = time.perf_counter()
        llm.engine.step()
        out.append((time.perf_counter() - t) * 1000)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--contexts", type=int, nargs="+", default=[200, 1000])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--with-compiled", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    engines = {b: LLM(max_num_seqs=max(args.batches), attention_backend=b) for b in ("native", "sdpa")}
    if args.with_compiled:
        engines["native_compiled"] = LLM(max_num_seqs=max(args.batches), attention_backend="native", compile=True)
    assert engines["native"].engine.executor.info.attention_backend == "native", "the native kernel did not build"
    rows = []
    for context in args.contexts:
        for batch in args.batches:
            times = {b: [] for b in engines}
            for b, llm in engines.items():
                start_batch(llm, f"c{context}b{batch}", batch, context, 3 * args.steps + 5)
            for _ in range(3):
                for b, llm in engines.items():
                    times[b] += timed_steps(llm, args.steps)
            for llm in engines.values():
                while llm.engine.has_unfinished_requests():
                    llm.engine.step()
            med = {b: statistics.median(t) for b, t in times.items()}
            row = {"context": context, "batch": batch}
            for b, ms in med.items():
                row[f"{b}_ms"] = ms
                if b != "sdpa":
                    row[f"{b}_speedup"] = med["sdpa"] / ms
            rows.append(row)
            print(json.dumps(rows[-1]), flush=True)
    write_json(args.json, rows)


if __name__ == "__main__":
    main()
