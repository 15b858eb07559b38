"""What structured output costs on the default model, in one process.

    .venv/bin/python benchmarks/structured_output.py [--rounds 3] [--json bench-results/structured_output.json]

1. Grammar work per decode step, at batch 1 and 32, as a share of the step: the engine's mask fill
   (StructuredOutputManager.fill_bitmasks), the sampler's mask application (its GrammarBitmask processor) and the
   matchers' advance (GrammarMatcher.accept), timed by wrapping those three calls, against the step times the engine
   records (LLMEngine.step_stats). The schema makes every request write 64 tokens (a string of at least 400 chars).
2. Compile time of a mid-size schema (benchmarks/grammar_engines.py's MID_SCHEMA): the tokenizer index (once per
   process), the schema cold, and the schema again (cached).
3. Output tokens/s with 32 concurrent requests of 64 tokens each, json_schema against unconstrained (ignore_eos), in
   the engine (no HTTP); rounds alternate the two.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import write_json
from grammar_engines import MID_SCHEMA

from llmserve.config import EngineConfig
from llmserve.engine.llm_engine import LLMEngine
from llmserve.sample.logits_processors import GrammarBitmask
from llmserve.sampling_params import SamplingParams, StructuredOutputsParams
from llmserve.structured import GrammarMatcher, StructuredOutputManager

LONG = {"type": "object", "properties": {"story": {"type": "string", "minLength": 400}}, "required": ["story"]}
PROMPT = "Write a short story about a lighthouse keeper, as JSON."
TOKENS = 64


class Timed:
    """Adds up the seconds spent in one method while installed."""

    def __init__(self, owner, name):
        self.owner, self.name, self.seconds = owner, name, 0.0
        self.original = getattr(owner, name)

    def __enter__(self):
        original = self.original

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0

        setattr(self.owner, self.name, timed)
        return self

    def __exit__(self, *exc):
        setattr(self.owner, self.name, self.original)


def run(engine: LLMEngine, batch: int, structured: bool) -> tuple[float, int]:
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=TOKENS, ignore_eos=not structured,
                            structured_outputs=StructuredOutputsParams(json=LONG) if structured else None)
    for i in range(batch):
        engine.add_request(f"r{time.perf_counter_ns()}-{i}", PROMPT, params)
    t0 = time.perf_counter()
    tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens += sum(len(c.token_ids) for c in out.outputs)
    return time.perf_counter() - t0, tokens


def grammar_share(engine: LLMEngine, batch: int) -> dict:
    engine.step_stats.clear()
    with Timed(engine.structured, "fill_bitmasks") as fill, Timed(GrammarBitmask, "apply") as apply, \
            Timed(GrammarMatcher, "accept") as accept:
        run(engine, batch, structured=True)
    decode = [s for s in engine.step_stats if s.num_prefill_tokens == 0]
    step_s = sum(s.seconds for s in decode)
    grammar_s = fill.seconds + apply.seconds + accept.seconds  # prefill steps sample too; their share is small
    n = len(decode)
    return {"batch": batch, "decode_steps": n, "mean_step_ms": 1000 * step_s / n,
            "grammar_ms_per_step": 1000 * grammar_s / n, "fill_ms": 1000 * fill.seconds / n,
            "apply_ms": 1000 * apply.seconds / n, "accept_ms": 1000 * accept.seconds / n,
            "share_of_step": grammar_s / step_s}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    engine = LLMEngine(EngineConfig(max_num_seqs=32))
    results = {"command": " ".join(sys.argv)}

    manager = StructuredOutputManager(engine.tokenizer, engine.model_config.vocab_size, engine.eos_token_ids)
    t0 = time.perf_counter()
    manager.compile(StructuredOutputsParams(json={"type": "string"}))
    index_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    manager.compile(StructuredOutputsParams(json=MID_SCHEMA))
    cold_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    manager.matcher(StructuredOutputsParams(json=MID_SCHEMA))
    cached_s = time.perf_counter() - t0
    results["compile"] = {"tokenizer_index_s": index_s, "mid_schema_cold_ms": 1000 * cold_s, "mid_schema_cached_ms": 1000 * cached_s}
    print(results["compile"])

    run(engine, 4, structured=True)  # warm-up: compile the schema, settle the allocator
    results["grammar_share"] = [grammar_share(engine, b) for b in (1, 32)]
    for r in results["grammar_share"]:
        print(r)

    rates = {"json_schema": [], "unconstrained": []}
    for _ in range(args.rounds):
        for mode in ("unconstrained", "json_schema"):
            seconds, tokens = run(engine, 32, structured=mode == "json_schema")
            rates[mode].append(tokens / seconds)
    results["throughput_c32"] = {m: statistics.median(v) for m, v in rates.items()}
    results["throughput_c32"]["ratio"] = results["throughput_c32"]["json_schema"] / results["throughput_c32"]["unconstrained"]
    results["throughput_c32"]["rounds"] = rates
    print(results["throughput_c32"])
    write_json(args.json, results)


if __name__ == "__main__":
    main()
