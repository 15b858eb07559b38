"""Precision modes side by side: accuracy (perplexity, logit distance to float32) and decode step time.

    .venv/bin/python benchmarks/precision.py [--batches 1 4 8 32] [--json bench-results/precision.json]
    .venv/bin/python benchmarks/precision.py --modes float32 f32+int4 f32+w4a8   # CPUs without native bf16

Modes: float32 on the dequantized weights (the reference, always run first), bf16 weights (decode_quantization
none), bf16 with the int4 or int8 copy for small steps, int4 with an FP8 KV cache, the int4 codes against bf16
activations rounded to int8 (w4a8, AVX512-VNNI CPUs), and in float32 the int4 codes against float32 or int8 (w4a8)
activations. Perplexity runs the whole text through the mode's small-step weights
(decode_quantization_max_rows raised) so that it measures them; step times use the default max_rows, as served. Step
times are ratios against bf16 (or the first mode timed) in the same run.

A whole-text prompt attends to its own keys before they are stored, so it cannot see the KV cache's dtype. The
"cached" figures feed the text one token per step (max_num_batched_tokens 1), as decode reads it: every token attends
to keys and values read back from the cache.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from decode_step import step_ms

from llmserve import LLM
from llmserve.bench.accuracy import logit_distance, perplexity
from llmserve.config import EngineConfig
from llmserve.engine.llm_engine import LLMEngine
from llmserve.loader import default_model_path, load_model_files
from common import write_json

TEXT = """The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined a
screw press with movable metal type and an oil-based ink. Before that, books in Europe were copied by hand,
which made them rare and expensive. Within fifty years presses were working in more than two hundred cities,
and millions of books had been printed. Prices fell, literacy rose, and scholars could compare identical copies
of a text for the first time. The same technology spread news sheets, pamphlets and maps, and it changed how
science, religion and politics were argued. Historians still debate how quickly these effects followed, but
few doubt that cheap printed words reshaped the world that came after."""
MODES = {"float32": {"dtype": "float32", "decode_quantization": "none"}, "bf16": {"dtype": "bfloat16", "decode_quantization": "none"},
         "int4": {"dtype": "bfloat16", "decode_quantization": "int4"}, "int8": {"dtype": "bfloat16", "decode_quantization": "int8"},
         "int4+kv_fp8": {"dtype": "bfloat16", "decode_quantization": "int4", "kv_cache_dtype": "fp8"},
         "w4a8": {"dtype": "bfloat16", "decode_quantization": "w4a8"},
         "f32+int4": {"dtype": "float32", "decode_quantization": "int4"},
         "f32+w4a8": {"dtype": "float32", "decode_quantization": "w4a8"}}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8, 32])
    ap.add_argument("--json", default="bench-results/precision.json")
    ap.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    args = ap.parse_args()
    modes = ["float32"] + [m for m in args.modes if m != "float32"]
    files = load_model_files(default_model_path())
    weights = list(files.weights())
    files = dataclasses.replace(files, weights=lambda: iter(weights))
    text = files.tokenizer.encode(TEXT)
    prompt = files.tokenizer.encode("The printing press")

    rows, ref_logits, ref_cached = [], None, None
    for mode in modes:
        kw = MODES[mode]
        engine = LLMEngine(EngineConfig(kv_cache_memory="512MiB", decode_quantization_max_rows=10**6, **kw), files=files)
        ppl = perplexity(engine, text)
        logits = _last_logits(engine, prompt)
        ref_logits = logits if ref_logits is None else ref_logits
        one_token_steps = LLMEngine(EngineConfig(kv_cache_memory="512MiB", decode_quantization_max_rows=10**6,
                                                 max_num_batched_tokens=1, enable_prefix_caching=False, **kw), files=files)
        ppl_cached = perplexity(one_token_steps, text)
        cached_logits = _last_logits(one_token_steps, text)
        ref_cached = cached_logits if ref_cached is None else ref_cached
        cached_distance = logit_distance(cached_logits, ref_cached)
        row = {"mode": mode, "perplexity": ppl, **logit_distance(logits, ref_logits), "perplexity_cached": ppl_cached,
               "max_abs_cached": cached_distance["max_abs"], "lowbit_MiB": engine.executor.info.weights.lowbit_bytes / 2**20}
        if mode != "float32":
            llm = LLM(max_num_seqs=max(args.batches), **kw)
            row["step_ms"] = {b: step_ms(llm, b, 200, 20) for b in args.batches}
        rows.append(row)
        print(json.dumps(row), flush=True)
    base = next((r for r in rows if r["mode"] == "bf16"), rows[min(1, len(rows) - 1)])
    ref_ppl = rows[0]["perplexity"]
    ref_cached_ppl = rows[0]["perplexity_cached"]
    print(f"\n{'mode':<12}{'ppl':>8}{'vs f32':>8}{'max|dlogit|':>12}{'top1':>6}{'cached ppl':>12}{'vs f32':>8}{'max|dlogit|':>12}  "
          + "".join(f"{f'b={b} ms (x)':>16}" for b in args.batches))
    for r in rows:
        times = ("".join(f"{r['step_ms'][b]:>9.1f} ({base['step_ms'][b] / r['step_ms'][b]:.2f})" for b in args.batches)
                 if "step_ms" in r and "step_ms" in base else "")
        print(f"{r['mode']:<12}{r['perplexity']:>8.3f}{r['perplexity'] / ref_ppl - 1:>+8.2%}{r['max_abs']:>12.3f}"
              f"{r['top1_agreement']:>6.0%}{r['perplexity_cached']:>12.3f}{r['perplexity_cached'] / ref_cached_ppl - 1:>+8.2%}"
              f"{r['max_abs_cached']:>12.3f}  {times}")
    write_json(args.json, rows)


def _last_logits(engine, prompt):
    """Logits of the prompt's next token, read through the engine's sampler."""
    from llmserve.sampling_params import SamplingParams

    seen = []
    with engine.executor.watch_logits(lambda ids, logits: seen.append(logits.detach().clone())):
        engine.add_request("logits", prompt, SamplingParams(max_tokens=1, temperature=0))
        while engine.has_unfinished_requests():
            engine.step()
    return next(s for s in seen if len(s))[0].float().unsqueeze(0)  # steps before the last prompt token sample no row


if __name__ == "__main__":
    torch.set_num_threads(os.cpu_count() or 1)
    main()
