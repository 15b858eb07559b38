"""A pre-quantized checkpoint on CPU: the default model's weights made into a compressed-tensors W4A16 checkpoint
(int4, symmetric, group 64: llm-compressor's W4A16 scheme with
groups that divide the model's 576 columns) by the compressed-tensors library, served by llmserve
with its codes in the int4 kernel (--decode-quantization auto) and dequantized to float32 (none), against
transformers' float32 on the weights the checkpoint stands for (the library's own fake-quantized weights), same run.

    .venv/bin/python benchmarks/quantized_checkpoints.py [--decode-tokens 128] [--prompts 8]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def make_checkpoint(folder: str):
    import transformers
    from compressed_tensors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 QuantizationStatus, apply_quantization_config)
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    from llmserve.loader import default_model_path

    gguf_dir, gguf_name = os.path.split(default_model_path())
    gguf = transformers.AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name, dtype=torch.float32)
    # a plain float model with its weights (one loaded from GGUF is marked quantized and refuses to be saved)
    config = transformers.LlamaConfig(**{k: v for k, v in gguf.config.to_dict().items() if k != "quantization_config"})

    def load():
        model = transformers.LlamaForCausalLM(config).eval()
        model.load_state_dict(gguf.state_dict())
        return model

    model, reference = load(), load()
    apply_quantization_config(model, QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
            num_bits=4, type="int", symmetric=True, strategy="group", group_size=64))}, ignore=["lm_head"],
        quantization_status=QuantizationStatus.CALIBRATION))
    for name, layer in model.named_modules():
        if not hasattr(layer, "weight_scale"):
            continue
        args, w = layer.quantization_scheme.weights, layer.weight.data
        grouped = w.view(w.shape[0], -1, args.group_size)
        scale, _ = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args)
        layer.weight_scale.data = scale.half().float().view(layer.weight_scale.shape)
        reference.get_submodule(name).weight.data.copy_(fake_quantize(w, layer.weight_scale, None, args))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="pack-quantized")
    compressor.compress_model(model)
    model.save_pretrained(folder)
    compressor.update_config(folder)
    return reference


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=8)
    args = ap.parse_args()

    from llmserve import LLM, SamplingParams
    from llmserve.loader import default_model_path

    folder = tempfile.mkdtemp(prefix="llmserve-w4a16-")
    reference = make_checkpoint(folder)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 49152, (int(n),), generator=g).tolist()
               for n in torch.randint(16, 64, (args.prompts,), generator=g)]
    steps = 32
    result = {"checkpoint": "compressed-tensors W4A16 (int4 symmetric, group 64) of SmolLM2-135M-Instruct",
              "file_mib": round(sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder)
                                    if f.endswith(".safetensors")) / 2**20, 1)}

    with torch.no_grad():  # transformers: greedy tokens and the first step's logprobs, and batch-1 decode speed
        ref_tokens, ref_first = [], []
        for p in prompts:
            out = reference.generate(torch.tensor([p]), max_new_tokens=steps, do_sample=False, min_new_tokens=steps,
                                     output_scores=True, return_dict_in_generate=True)
            ref_tokens.append(out.sequences[0, len(p):].tolist())
            ref_first.append(torch.log_softmax(out.scores[0][0].float(), -1))
        t0 = time.perf_counter()
        reference.generate(torch.tensor([prompts[0]]), max_new_tokens=args.decode_tokens,
                           min_new_tokens=args.decode_tokens, do_sample=False)
        result["transformers_decode_tok_s"] = round(args.decode_tokens / (time.perf_counter() - t0), 1)

    for mode in ("auto", "none"):
        llm = LLM(model=folder, tokenizer=default_model_path(), dtype="float32", device="cpu",
                  decode_quantization=mode, kv_cache_memory="256MiB")
        weights = llm.engine.executor.info.weights
        greedy = SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True, logprobs=20)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
        same = sum(o.outputs[0].token_ids == r for o, r in zip(outs, ref_tokens))
        first_diff = max(abs(lp - ref[tok].item()) for o, ref in zip(outs, ref_first)
                         for tok, lp in o.outputs[0].logprobs[0].items())
        one = SamplingParams(max_tokens=args.decode_tokens, temperature=0, ignore_eos=True)
        llm.generate([{"prompt_token_ids": prompts[0]}], one, use_tqdm=False)  # warm
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompts[0]}], one, use_tqdm=False)
        result[mode] = {
            "decode_tok_s": round(args.decode_tokens / (time.perf_counter() - t0), 1),
            "same_greedy_tokens": f"{same}/{len(prompts)} ({steps} tokens each)",
            "max_first_logprob_diff": float(f"{first_diff:.2g}"),
            "methods": sorted(set(weights.methods.values())),
        }
        del llm
    result["auto_vs_none_decode"] = round(result["auto"]["decode_tok_s"] / result["none"]["decode_tok_s"], 2)
    result["auto_vs_transformers_decode"] = round(result["auto"]["decode_tok_s"] / result["transformers_decode_tok_s"], 2)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
