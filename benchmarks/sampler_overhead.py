"""Sampler time per decode step at batch 64 with mixed parameters, as a fraction of the whole step.

    .venv/bin/python benchmarks/sampler_overhead.py [--batch 64] [--steps 40]

A third of the rows greedy, a third top-p, a third top-k with repetition/frequency/presence penalties.
"""

from __future__ import annotations

import argparse
import json
import time

from llmserve import LLM, SamplingParams


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    llm = LLM(dtype=args.dtype, max_num_seqs=args.batch)
    engine = llm.engine
    mixes = [
        SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, max_tokens=1000, ignore_eos=True),
        SamplingParams(temperature=0.8, top_k=40, repetition_penalty=1.1, frequency_penalty=0.3, presence_penalty=0.2,
                       max_tokens=1000, ignore_eos=True),
    ]
    for i in range(args.batch):
        engine.add_request(str(i), f"Request {i}: write a long essay about topic number {i}.", mixes[i % 3])
    while any(r.num_output_tokens == 0 for r in engine.scheduler.requests.values()):
        engine.step()  # prefill everything first
    sampler = engine.executor.runner.sampler
    inner = sampler.sample
    spent = [0.0]

    def timed(logits, requests):
        t = time.perf_counter()
        out = inner(logits, requests)
        spent[0] += time.perf_counter() - t
        return out

    sampler.sample = timed
    t = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    total = time.perf_counter() - t
    result = {"batch": args.batch, "steps": args.steps, "step_ms": 1000 * total / args.steps,
              "sampler_ms": 1000 * spent[0] / args.steps, "sampler_fraction": spent[0] / total}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
