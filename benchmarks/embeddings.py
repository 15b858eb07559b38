"""Embedding throughput of an embedding engine (--runner pooling) against transformers on the same weights, in one run,
and each mode's distance from float32.

    .venv/bin/python benchmarks/embeddings.py [--num-prompts 256] [--json out.json]

Workload: N prompts of 32-256 tokens (lengths spread evenly) from the default model's tokenizer, embedded by last-token
pooling and normalized (vLLM's embed defaults). llmserve: LLM(runner="pooling").encode over all of them (continuous
batching, chunked prefill, default budget; prefix caching off, as the windows of one text share prefixes that
transformers would compute). transformers: the same dequantized weights in a LlamaModel, batches of
--batch-size prompts sorted by length (as sentence-transformers batches), right-padded with an attention mask, the last
real token's state. Throughput counts real prompt tokens (no padding) per second of wall time; each side gets one
warm-up pass first. Accuracy: cosine similarity of each mode's vectors with llmserve's float32 ones, and of those with
transformers' float32 ones.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch
import torch.nn.functional as F

from common import write_json
from engine_vs_transformers import TEXT, transformers_config
from llmserve import LLM, EmbeddingRequestOutput
from llmserve.loader import load_model_files


def make_prompts(tokenizer, n: int) -> list[list[int]]:
    ids = tokenizer.encode(TEXT * 60, add_special_tokens=False)
    return [ids[i * 5: i * 5 + 32 + (224 * i) // max(n - 1, 1)] for i in range(n)]


def llmserve_embed(prompts, dtype: str) -> tuple[float, torch.Tensor]:
    # Prefix caching off: the prompts are windows of one repeated text, whose shared prefixes a cache would skip
    # (transformers computes every token; a corpus of distinct documents shares little)
    llm = LLM(runner="pooling", dtype=dtype, enable_prefix_caching=False)
    llm.embed(prompts[:8], use_tqdm=False)  # warm-up
    t = time.perf_counter()
    outs = llm.encode(prompts, use_tqdm=False)
    seconds = time.perf_counter() - t
    assert not any(o.num_cached_tokens for o in outs)
    outs = [EmbeddingRequestOutput.from_base(o) for o in outs]
    return sum(map(len, prompts)) / seconds, torch.tensor([o.outputs.embedding for o in outs])


def transformers_embed(prompts, dtype: torch.dtype, batch_size: int) -> tuple[float, torch.Tensor]:
    import transformers

    files = load_model_files(None, load_tokenizer=False)
    model = transformers.LlamaModel(transformers_config(files.config))
    model.load_state_dict({k.removeprefix("model."): v for k, v in files.weights() if k.startswith("model.")},
                          strict=False)
    model = model.to(dtype).eval()

    def run(subset) -> torch.Tensor:
        order = sorted(range(len(subset)), key=lambda i: -len(subset[i]))  # as sentence-transformers batches
        out = [None] * len(subset)
        for b in range(0, len(order), batch_size):
            rows = [subset[i] for i in order[b: b + batch_size]]
            width = max(map(len, rows))
            ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
            mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
            with torch.inference_mode():
                hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
            last = hidden[torch.arange(len(rows)), mask.sum(1) - 1].float()
            for k, i in enumerate(order[b: b + batch_size]):
                out[i] = F.normalize(last[k], dim=-1)
        return torch.stack(out)

    run(prompts[:8])  # warm-up
    t = time.perf_counter()
    vectors = run(prompts)
    return sum(map(len, prompts)) / (time.perf_counter() - t), vectors


def cosines(a: torch.Tensor, b: torch.Tensor) -> dict:
    c = F.cosine_similarity(a, b, dim=-1)
    return {"mean": c.mean().item(), "min": c.min().item()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    prompts = make_prompts(load_model_files(None).tokenizer, args.num_prompts)
    ours_bf16, vec_bf16 = llmserve_embed(prompts, "bfloat16")
    ours_f32, vec_f32 = llmserve_embed(prompts, "float32")
    ref_bf16, ref_vec_bf16 = transformers_embed(prompts, torch.bfloat16, args.batch_size)
    ref_f32, ref_vec_f32 = transformers_embed(prompts, torch.float32, args.batch_size)
    result = {
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, torch {torch.__version__}, "
                   f"{torch.get_num_threads()} threads",
        "prompts": args.num_prompts, "prompt_tokens": sum(map(len, prompts)),
        "tokens_per_s": {"llmserve bf16": ours_bf16, "llmserve float32": ours_f32,
                         f"transformers bf16 (batch {args.batch_size})": ref_bf16,
                         f"transformers float32 (batch {args.batch_size})": ref_f32},
        "ratios": {"llmserve bf16 / transformers bf16": ours_bf16 / ref_bf16,
                   "llmserve float32 / transformers float32": ours_f32 / ref_f32},
        "cosine_with_llmserve_float32": {"llmserve bf16": cosines(vec_bf16, vec_f32),
                                         "transformers float32": cosines(ref_vec_f32, vec_f32),
                                         "transformers bf16": cosines(ref_vec_bf16, vec_f32)},
    }
    print(json.dumps(result, indent=2))
    write_json(args.json, result, indent=2)


if __name__ == "__main__":
    main()
