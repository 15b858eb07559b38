"""Where a serving run's wall time goes, step by step: `llmserve bench --engine` (the engine in this process, as in
http_overhead.py) with every engine step timed, split into decode-only steps by their rows, steps that carry prompt
tokens, and the time between steps (the engine thread handing outputs to their streams, taking in new requests,
or waiting for them).

    .venv/bin/python benchmarks/serving_time_split.py [--concurrency 8] [--flags=--compile] [--json out.json]

Same workload as the comparison with llama.cpp (benchmarks/vs_llamacpp.py): 200-token prompts, 128 output tokens,
EOS ignored, max(16, 4 x concurrency) requests after --warmup ones. Steps are counted from the first step of the measured
requests (the warm-up's steps are left out).
"""

from __future__ import annotations

import argparse
import collections
import shlex
import statistics
import sys
import tempfile
import time

from common import write_json
from llmserve import cli
from llmserve.bench import report, runner
from llmserve.engine.llm_engine import LLMEngine


def timed_steps(records: list):
    """Wraps LLMEngine.step: each step's (start, end, prompt tokens, decode rows), from its StepStats."""
    step = LLMEngine.step

    def wrapper(self):
        last = self.step_stats[-1] if self.step_stats else None
        start = time.perf_counter()
        outputs = step(self)
        end = time.perf_counter()
        stats = self.step_stats[-1] if self.step_stats else None
        if stats is not None and stats is not last:  # a step that ran the model
            records.append((start, end, stats.num_prefill_tokens, stats.num_decode_tokens))
        return outputs
    return wrapper


def split(records: list) -> dict:
    span = records[-1][1] - records[0][0]
    decode = collections.defaultdict(list)
    prompt_seconds = 0.0
    prompt_tokens = prompt_steps = prompt_steps_with_rows = 0
    for start, end, prefill, rows in records:
        if prefill:
            prompt_seconds += end - start
            prompt_tokens += prefill
            prompt_steps += 1
            prompt_steps_with_rows += rows > 0
        else:
            decode[rows].append(end - start)
    gaps = sum(b[0] - a[1] for a, b in zip(records, records[1:]))
    return {
        "span_s": span,
        "decode_only": {rows: {"steps": len(t), "median_ms": statistics.median(t) * 1e3, "seconds": sum(t)}
                        for rows, t in sorted(decode.items())},
        "prompt_steps": {"steps": prompt_steps, "with_decode_rows": prompt_steps_with_rows,
                         "seconds": prompt_seconds, "prompt_tokens": prompt_tokens,
                         "prompt_tok_per_s": prompt_tokens / prompt_seconds if prompt_seconds else None},
        "between_steps_s": gaps,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--flags", default="", help="engine flags, e.g. --flags=--compile")
    ap.add_argument("--json")
    args = ap.parse_args()

    records: list = []
    LLMEngine.step = timed_steps(records)
    measured_from = []
    with tempfile.TemporaryDirectory() as tmp:
        argv = ["bench", "run", "--engine", "--concurrency", str(args.concurrency), "--input-len", "200",
                "--output-len", "128", "--ignore-eos", "--warmup", str(args.warmup), "--no-plots", "--quiet",
                "--result", f"{tmp}/result.json", *shlex.split(args.flags)]
        run_level = runner.run_level

        async def marked_level(*a, **kw):  # the warm-up runs through run_level too: keep the last level's start
            measured_from.append(len(records))
            return await run_level(*a, **kw)
        runner.run_level = marked_level
        rc = cli.main(argv)
        result = report.load_result(f"{tmp}/result.json") if rc == 0 else None
    if rc:
        return rc
    out = split(records[measured_from[-1]:])
    level = result["levels"][-1]["summary"]
    out.update(concurrency=args.concurrency, flags=args.flags, output_tok_per_s=level["output_throughput"])
    print(f"\nconcurrency {args.concurrency}: {level['output_throughput']:.1f} output tok/s; measured span {out['span_s']:.2f} s")
    for rows, d in out["decode_only"].items():
        print(f"  decode-only steps of {rows:2d} rows: {d['steps']:4d}, median {d['median_ms']:6.2f} ms, "
              f"{d['seconds']:6.2f} s ({d['seconds'] / out['span_s']:.0%})")
    p = out["prompt_steps"]
    print(f"  steps with prompt tokens: {p['steps']} ({p['with_decode_rows']} with decode rows), {p['prompt_tokens']} "
          f"tokens in {p['seconds']:.2f} s ({p['seconds'] / out['span_s']:.0%}, {p['prompt_tok_per_s'] or 0:.0f} prompt tok/s "
          "with those rows)")
    print(f"  between steps: {out['between_steps_s']:.2f} s ({out['between_steps_s'] / out['span_s']:.0%})")
    write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
