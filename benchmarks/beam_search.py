"""Beam search: llmserve's LLM.beam_search against transformers' generate(num_beams=...) on the same weights, in one
run, and llmserve with prefix caching off (every step recomputes every beam from its first token).

    .venv/bin/python benchmarks/beam_search.py [--width 4] [--max-tokens 32] [--json out.json]

Workload: 8 prompts of 48-110 tokens from the default model's text, beam width --width, --max-tokens new tokens with
ignore_eos (every beam runs to the end, so both sides do the same number of steps), float32 (the reference mode, in
which both find the same beams). transformers: one generate call per prompt (its beams batched, their KV cache
reordered each step), as it is used; llmserve: all prompts in one call (their beams batched together each step).
Seconds of wall time after one warm-up run each; the beams are checked equal.
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import torch

from common import write_json
from engine_vs_transformers import TEXT, transformers_config
from llmserve import LLM, BeamSearchParams
from llmserve.loader import load_model_files


def make_prompts(tokenizer, n: int) -> list[list[int]]:
    ids = tokenizer.encode(TEXT * 20, add_special_tokens=False)
    return [ids[i * 37: i * 37 + 48 + 9 * i] for i in range(n)]


def llmserve_beams(prompts, params: BeamSearchParams, caching: bool) -> tuple[float, list[list[list[int]]]]:
    llm = LLM(dtype="float32", enable_prefix_caching=caching)
    llm.beam_search(prompts[:1], params)  # warm-up
    t = time.perf_counter()
    outs = llm.beam_search(prompts, params)
    seconds = time.perf_counter() - t
    llm.engine.shutdown()
    return seconds, [[s.tokens[len(p):] for s in o.sequences] for p, o in zip(prompts, outs)]


def transformers_beams(prompts, params: BeamSearchParams) -> tuple[float, list[list[list[int]]]]:
    import transformers

    files = load_model_files(None, load_tokenizer=False)
    model = transformers.LlamaForCausalLM(transformers_config(files.config))
    model.load_state_dict(dict(files.weights()), strict=False)
    model.tie_weights()
    model = model.float().eval()

    def run(subset):
        found = []
        for p in subset:
            ids = torch.tensor([p])
            with torch.no_grad():
                out = model.generate(ids, num_beams=params.beam_width, num_return_sequences=params.beam_width,
                                     do_sample=False, max_new_tokens=params.max_tokens, length_penalty=0.0,
                                     eos_token_id=None, pad_token_id=0, early_stopping=True)
            found.append([row[len(p):].tolist() for row in out])
        return found

    run(prompts[:1])  # warm-up
    t = time.perf_counter()
    found = run(prompts)
    return time.perf_counter() - t, found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    prompts = make_prompts(load_model_files(None).tokenizer, args.num_prompts)
    # length_penalty 0: beams ranked by cumulative logprob, transformers' order when every beam has one length
    params = BeamSearchParams(beam_width=args.width, max_tokens=args.max_tokens, ignore_eos=True, length_penalty=0.0)
    cached_s, cached = llmserve_beams(prompts, params, caching=True)
    uncached_s, uncached = llmserve_beams(prompts, params, caching=False)
    hf_s, hf = transformers_beams(prompts, params)
    same = sum(a == b for a, b in zip(cached, hf))
    tokens = args.num_prompts * args.width * args.max_tokens
    result = {"machine": platform.processor() or platform.machine(), "cores": os.cpu_count(), "width": args.width,
              "max_tokens": args.max_tokens, "prompts": args.num_prompts,
              "prompt_tokens": sum(map(len, prompts)),
              "seconds": {"llmserve": cached_s, "llmserve_no_prefix_caching": uncached_s, "transformers": hf_s},
              "beam_tokens_per_s": {"llmserve": tokens / cached_s,
                                    "llmserve_no_prefix_caching": tokens / uncached_s, "transformers": tokens / hf_s},
              "speedup_vs_transformers": hf_s / cached_s, "prefix_caching_speedup": uncached_s / cached_s,
              "prompts_with_the_same_beams": f"{same}/{len(prompts)}",
              "uncached_same_as_cached": cached == uncached}
    print(result)
    write_json(args.json, result)


if __name__ == "__main__":
    main()
