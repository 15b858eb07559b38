"""Offline engine speed on the default model, side by side with transformers on the same weights, in one run.

    .venv/bin/python benchmarks/engine_vs_transformers.py [--num-prompts 64] [--json out.json]

Figures: offline throughput (N prompts of ~200 tokens, 128 output tokens each, EOS ignored), batch-1
decode tokens/s, prefill tokens/s for a 512-token prompt. transformers runs generate() on the model it
dequantizes from the same GGUF, in bf16 (its fast path on this CPU), at batch 1 and a static batch of 16.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch

from llmserve import LLM, SamplingParams
from llmserve.loader import load_model_files
from common import write_json

TEXT = (
    "Large language models generate text one token at a time. Each step reads every weight of the model, so "
    "decoding is limited by memory bandwidth, while the prompt is processed in parallel and limited by compute. "
    "Serving systems batch many requests together to turn bandwidth-bound work into compute-bound work. "
)


def make_prompts(tokenizer, n: int, length: int) -> list[list[int]]:
    ids = tokenizer.encode(TEXT * 40, add_special_tokens=False)
    return [ids[i * 7 : i * 7 + length] for i in range(n)]


def transformers_config(c):
    """A transformers LlamaConfig of the same shape as our ModelConfig `c` (the default model's)."""
    import transformers

    return transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta, tie_word_embeddings=c.tie_word_embeddings,
    )


def bench_llmserve(args, prompts, prompt512):
    llm = LLM(dtype=args.dtype, max_num_seqs=max(64, args.num_prompts), max_num_batched_tokens=args.max_num_batched_tokens)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    offline = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t)
    # batch-1 decode: time of decode-only steps
    llm.engine.step_stats.clear()
    llm.generate([prompts[0]], params, use_tqdm=False)
    decode = [s for s in llm.engine.step_stats if not s.num_prefill_tokens]
    decode_tps = len(decode) / sum(s.seconds for s in decode)
    # prefill: one 512-token prompt, one step
    llm.engine.step_stats.clear()
    llm.generate([prompt512], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    prefill = [s for s in llm.engine.step_stats if s.num_prefill_tokens]
    prefill_tps = sum(s.num_prefill_tokens for s in prefill) / sum(s.seconds for s in prefill)
    return {"offline_tokens_per_s": offline, "batch1_decode_tokens_per_s": decode_tps, "prefill512_tokens_per_s": prefill_tps}


def bench_transformers(args, prompts, prompt512):
    import transformers

    # The same dequantized weights, in a plain transformers Llama (its GGUF loader would keep them packed).
    files = load_model_files(None, load_tokenizer=False)
    model = transformers.LlamaForCausalLM(transformers_config(files.config))
    model.load_state_dict(dict(files.weights()), strict=False)
    model = model.to(torch.bfloat16).eval()
    gen = dict(do_sample=False, min_new_tokens=args.output_len, max_new_tokens=args.output_len, pad_token_id=2)

    def timed(batch):
        ids = torch.tensor(batch)
        t = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), **gen)
        return (out.shape[1] - ids.shape[1]) * ids.shape[0] / (time.perf_counter() - t)

    timed([prompts[0][:16]])  # warm-up
    batch1 = timed([prompts[0]])
    static16 = timed(prompts[:16])
    ids = torch.tensor([prompt512])
    with torch.inference_mode():
        model(ids)
        t = time.perf_counter()
        model(ids)
        prefill = ids.shape[1] / (time.perf_counter() - t)
    return {"batch1_tokens_per_s": batch1, "static16_tokens_per_s": static16, "prefill512_tokens_per_s": prefill}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=200)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-num-batched-tokens", type=int, default=1024)
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    tok = load_model_files(None).tokenizer
    prompts = make_prompts(tok, args.num_prompts, args.input_len)
    prompt512 = tok.encode(TEXT * 40, add_special_tokens=False)[:512]
    ours = bench_llmserve(args, prompts, prompt512)
    ref = {} if args.skip_transformers else bench_transformers(args, prompts, prompt512)
    result = {"machine": f"{platform.machine()} {os.cpu_count()} cpus, torch {torch.__version__}, {torch.get_num_threads()} threads",
              "llmserve": ours, "transformers_bf16": ref}
    if ref:
        result["ratios"] = {
            "offline / transformers batch-1": ours["offline_tokens_per_s"] / ref["batch1_tokens_per_s"],
            "offline / transformers static batch 16": ours["offline_tokens_per_s"] / ref["static16_tokens_per_s"],
            "batch-1 decode / transformers batch-1": ours["batch1_decode_tokens_per_s"] / ref["batch1_tokens_per_s"],
            "prefill 512 / transformers prefill 512": ours["prefill512_tokens_per_s"] / ref["prefill512_tokens_per_s"],
        }
    print(json.dumps(result, indent=2))
    write_json(args.json, result, indent=2)


if __name__ == "__main__":
    main()
