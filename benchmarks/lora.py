"""Multi-LoRA serving cost on the default model, in one run.

    .venv/bin/python benchmarks/lora.py [--rounds 2] [--json bench-results/lora.json]

1. Throughput: 32 requests at once (200-token prompts of random ids, 128 tokens out, EOS ignored) on one engine with
   --max-loras 8, (a) all on the base model, (b) spread uniformly over 8 rank-16 adapters on q/k/v/o/gate/up/down.
   Output tokens per second over the whole run, prefill included; rounds alternate (a) and (b); the median of each.
2. Swapping an adapter in: from disk (read and checked: lora/adapter.py) and from host memory into a slot.
3. Host memory per adapter.

Adapters are made with peft on a random-weight model of the default model's shape (only shapes matter here).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import write_json  # noqa: E402

from llmserve.config import EngineConfig  # noqa: E402
from llmserve.engine.llm_engine import LLMEngine  # noqa: E402
from llmserve.lora import LoRARequest  # noqa: E402
from llmserve.lora.adapter import load_adapter  # noqa: E402
from llmserve.sampling_params import SamplingParams  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(folder: str, model_config, count: int, rank: int) -> list[str]:
    import peft
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=model_config.vocab_size, hidden_size=model_config.hidden_size,
                                   intermediate_size=model_config.intermediate_size,
                                   num_hidden_layers=model_config.num_hidden_layers,
                                   num_attention_heads=model_config.num_attention_heads,
                                   num_key_value_heads=model_config.num_key_value_heads, tie_word_embeddings=True)
    base = transformers.LlamaForCausalLM(cfg)
    paths = []
    for i in range(count):
        torch.manual_seed(i)
        model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(
            r=rank, lora_alpha=rank, target_modules=TARGETS, init_lora_weights=False, task_type="CAUSAL_LM"))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.mul_(0.05)  # a gentle adapter: the text stays text (lengths are fixed by ignore_eos anyway)
        path = os.path.join(folder, f"adapter{i}")
        model.save_pretrained(path, safe_serialization=True)
        paths.append(path)
    return paths


def run_batch(engine: LLMEngine, prompts, loras, max_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    for i, (p, lora) in enumerate(zip(prompts, loras)):
        engine.add_request(f"r{i}", p, params, lora_request=lora)
    tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens += len(out.outputs[0].token_ids)
    return tokens / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=200)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    engine = LLMEngine(EngineConfig(enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank,
                                    max_cpu_loras=args.adapters, max_num_seqs=args.concurrency,
                                    enable_prefix_caching=False))
    folder = tempfile.mkdtemp(prefix="lora_bench_")
    paths = make_adapters(folder, engine.model_config, args.adapters, args.rank)
    adapters = [LoRARequest(f"adapter{i}", i + 1, p) for i, p in enumerate(paths)]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, engine.model_config.vocab_size, (args.input_len,), generator=g).tolist()
               for _ in range(args.concurrency)]
    mixed = [adapters[i % args.adapters] for i in range(args.concurrency)]
    base = [None] * args.concurrency

    run_batch(engine, prompts[:4], mixed[:4], 8)  # warm-up: first steps, adapters read into host memory and slots
    results = {"base": [], "lora": []}
    for _ in range(args.rounds):
        results["base"].append(run_batch(engine, prompts, base, args.output_len))
        results["lora"].append(run_batch(engine, prompts, mixed, args.output_len))
    base_tps, lora_tps = statistics.median(results["base"]), statistics.median(results["lora"])

    # swapping in: from disk (read + checked) and from host memory into a slot
    disk = []
    for a in adapters:
        t = time.perf_counter()
        load_adapter(a, engine.model_config, args.rank)
        disk.append(time.perf_counter() - t)
    manager = engine.executor.runner.lora
    host_to_slot = []
    for a in adapters:
        slot = manager.slots.index(a.lora_int_id)
        t = time.perf_counter()
        manager._load_slot(slot, manager.host[a.lora_int_id])
        host_to_slot.append(time.perf_counter() - t)
    per_adapter = manager.host_bytes / len(manager.host)
    out = {
        "config": vars(args), "device": str(engine.executor.info.device), "dtype": engine.executor.info.dtype,
        "base_output_tok_s": results["base"], "lora_output_tok_s": results["lora"],
        "ratio": lora_tps / base_tps,
        "swap_from_disk_ms": 1000 * statistics.median(disk), "swap_from_host_ms": 1000 * statistics.median(host_to_slot),
        "host_bytes_per_adapter": per_adapter, "slot_bytes_per_adapter": sum(
            w.a_t[0].numel() * w.a_t.element_size() + w.b_t[0].numel() * w.b_t.element_size()
            for w in (layer.lora for layer in manager.layers.values())),
    }
    print(f"c={args.concurrency}: base {base_tps:.1f} tok/s, {args.adapters} adapters mixed {lora_tps:.1f} tok/s, "
          f"ratio {out['ratio']:.3f}")
    print(f"swap in: from disk {out['swap_from_disk_ms']:.1f} ms, from host memory {out['swap_from_host_ms']:.1f} ms; "
          f"host memory per adapter {per_adapter / 2**20:.1f} MiB, slot memory per adapter "
          f"{out['slot_bytes_per_adapter'] / 2**20:.1f} MiB")
    write_json(args.json, out)


if __name__ == "__main__":
    main()
