"""The native prompt-attention kernel against torch's flash attention (SDPA), which prompts take without it.

    .venv/bin/python benchmarks/prompt_attention.py [--lengths 200 512 1024] [--repeats 20] [--json out.json]

Two parts, each timed alternately in one process:
- one layer's attention in the default model's shape (9 query heads, 3 KV heads of 64, bf16) for a whole prompt of
  each length: the kernel reading the keys from scattered cache blocks, SDPA (causal, GQA) on the step's own keys,
  as the runner calls each; median of --repeats;
- a whole prefill of one 512-token prompt through the engine (bf16, eager, default settings), with the runner's
  prompt kernel on and off in turn; median of 5 each.
Ratios are SDPA's time over the kernel's (above 1: the kernel is faster). Needs a CPU with AVX512-BF16.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

from common import median_seconds, write_json
from llmserve import LLM, SamplingParams, kernels



def layer_times(length: int, repeats: int, heads: int = 9, kv_heads: int = 3, head_dim: int = 64, block_size: int = 16):
    g = torch.Generator().manual_seed(length)
    blocks = -(-length // block_size)
    k_cache, v_cache = (torch.randn(4 * blocks * block_size, kv_heads, head_dim, generator=g).bfloat16() for _ in range(2))
    table = torch.randperm(4 * blocks, generator=g)[:blocks].view(1, -1)
    slots = (table[0].repeat_interleave(block_size) * block_size + torch.arange(block_size).repeat(blocks))[:length]
    qkv = torch.randn(length, heads + 2 * kv_heads, head_dim, generator=g).bfloat16()
    q, k, v = qkv[:, :heads], k_cache[slots], v_cache[slots]
    spans = torch.tensor([[0, length, length]])
    scale = head_dim ** -0.5

    def native():
        return torch.ops.llmserve_kernels.prefill_attention(q, k_cache, v_cache, table, spans, block_size, scale)

    def sdpa():
        return F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                              is_causal=True, scale=scale, enable_gqa=True)

    rounds = {"native": [], "sdpa": []}
    for _ in range(3):
        rounds["native"].append(median_seconds(native, repeats) * 1e3)
        rounds["sdpa"].append(median_seconds(sdpa, repeats) * 1e3)
    result = {name: statistics.median(ts) for name, ts in rounds.items()}
    result["speedup"] = result["sdpa"] / result["native"]
    result["max_diff"] = (native()[:, :heads].float() - sdpa()[0].transpose(0, 1).float()).abs().max().item()
    return result


def prefill_times(rounds: int = 5) -> dict:
    llm = LLM(dtype="bfloat16", enable_prefix_caching=False)
    engine, backend = llm.engine, llm.engine.executor.runner.attention
    assert getattr(backend, "prompt_kernel_reads_cache", False), "this CPU or build does not take the prompt kernel"
    words = engine.tokenizer.encode("the quick brown fox jumps over the lazy dog and keeps running through the forest " * 60)

    def prefill(tag: str) -> float:
        engine.add_request(tag, [(t + 7 * len(tag)) % 5000 + 100 for t in words[:512]],
                           SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
        t = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        return time.perf_counter() - t

    times = {"native": [], "sdpa": []}
    for r in range(rounds + 1):
        for mode in times:
            backend.prompt_kernel_reads_cache = mode == "native"
            seconds = prefill(f"{mode}-{r}")
            if r:  # the first round warms both up
                times[mode].append(seconds)
    backend.prompt_kernel_reads_cache = True
    result = {f"{mode}_tok_s": 512 / statistics.median(ts) for mode, ts in times.items()}
    result["speedup"] = result["native_tok_s"] / result["sdpa_tok_s"]
    return {"times": times, **result}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[200, 512, 1024])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--json", default="bench-results/prompt_attention.json")
    args = ap.parse_args()
    if not kernels.prefill_attention_available(64):
        raise SystemExit("the prompt-attention kernel needs a CPU with AVX512-BF16 (and a C++ compiler)")
    layers = {}
    for length in args.lengths:
        layers[length] = r = layer_times(length, args.repeats)
        print(f"{length:5d} tokens, one layer: kernel {r['native']:.3f} ms, SDPA {r['sdpa']:.3f} ms, "
              f"{r['speedup']:.2f}x (outputs within {r['max_diff']:.4f})")
    prefill = prefill_times()
    print(f"prefill of 512 tokens, eager bf16: kernel {prefill['native_tok_s']:.0f} tok/s, "
          f"SDPA {prefill['sdpa_tok_s']:.0f} tok/s, {prefill['speedup']:.2f}x")
    write_json(args.json, {"settings": vars(args), "cpu_threads": torch.get_num_threads(), "layer": layers,
                           "prefill": prefill})


if __name__ == "__main__":
    torch.set_num_threads(os.cpu_count() or 1)
    main()
