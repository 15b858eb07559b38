"""Each precision mode's distance from transformers' float32 on the default model (the precision contract).

    .venv/bin/python benchmarks/vs_transformers_float32.py [--json bench-results/vs_transformers_float32.json]

For the prompt "The three primary colors of light are": the first token's logprobs against transformers' float32 on
the same GGUF (its own dequantization), as the largest difference over the reference's 20 most likely tokens and over
the whole vocabulary, and whether the top token is the same. Then 4 prompts x 32 greedy tokens: the positions where
the mode's token differs from transformers' argmax on the same context, and how many of those are near-ties (the
reference's top two within 1e-3 nats).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import transformers

sys.path.insert(0, os.path.dirname(__file__))
from common import write_json

from llmserve.config import EngineConfig
from llmserve.engine.llm_engine import LLMEngine
from llmserve.loader import default_model_path, load_model_files
from llmserve.sampling_params import SamplingParams

PROMPT = "The three primary colors of light are"
PROMPTS = [PROMPT, "The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
MODES = {
    "float32 (default: int4 codes, float32 activations)": dict(dtype="float32"),
    "float32, decode_quantization none": dict(dtype="float32", decode_quantization="none"),
    "float32, w4a8 (int8 activations)": dict(dtype="float32", decode_quantization="w4a8"),
    "bf16 (default where bf16 is native)": dict(dtype="bfloat16"),
    "bf16, FP8 KV cache": dict(dtype="bfloat16", kv_cache_dtype="fp8"),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default="bench-results/vs_transformers_float32.json")
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    path = default_model_path()
    files = load_model_files(path)
    weights = list(files.weights())
    files.weights = lambda: iter(weights)
    folder, name = os.path.split(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    encode = files.tokenizer.encode
    rows = []
    for mode, settings in MODES.items():
        try:
            engine = LLMEngine(EngineConfig(device="cpu", kv_cache_memory="256MiB", **settings), files=files)
        except Exception as e:  # a mode this CPU or build lacks
            print(f"{mode}: skipped ({e})")
            continue
        seen: dict[str, list[torch.Tensor]] = {}
        with engine.executor.watch_logits(lambda ids, logits: [seen.setdefault(i, []).append(r.clone())
                                                               for i, r in zip(ids, logits)]):
            for i, p in enumerate(PROMPTS):
                engine.add_request(str(i), encode(p), SamplingParams(temperature=0, max_tokens=args.tokens,
                                                                     ignore_eos=True))
            done = {}
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        done[out.request_id] = out.outputs[0].token_ids
        differ = near_ties = 0
        first = {}
        for i, p in enumerate(PROMPTS):
            ids = encode(p)
            tokens = done[str(i)]
            with torch.no_grad():
                ref = torch.log_softmax(hf(torch.tensor([ids + tokens[:-1]])).logits[0, len(ids) - 1:].double(), -1)
            ours = torch.log_softmax(torch.stack(seen[str(i)]).double(), -1)
            for pos, token in enumerate(tokens):
                if token != int(ref[pos].argmax()):
                    differ += 1
                    top2 = ref[pos].topk(2).values
                    near_ties += int(top2[0] - top2[1] <= 1e-3)
            if p == PROMPT:
                top20 = ref[0].topk(20).indices
                first = {"max_abs_top20": float((ours[0, top20] - ref[0, top20]).abs().max()),
                         "max_abs_vocab": float((ours[0] - ref[0]).abs().max()),
                         "same_top_token": int(ours[0].argmax()) == int(ref[0].argmax())}
        row = {"mode": mode, **first, "greedy_positions": args.tokens * len(PROMPTS), "differ": differ,
               "differ_not_near_tie": differ - near_ties}
        rows.append(row)
        print(row, flush=True)
    write_json(args.json, {"prompt": PROMPT, "rows": rows})


if __name__ == "__main__":
    main()
