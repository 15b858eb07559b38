"""Tiny random-weight base models and PEFT LoRA adapters made in the test, with the merged model as the reference."""

from __future__ import annotations

import copy
import os

import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PHI3_TARGETS = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]  # Phi-3's modules: q/k/v and gate/up fused
TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6)


def tiny_base(folder, kind: str = "llama", seed: int = 0, **overrides):
    """A random-weight checkpoint of the given family saved at `folder`; returns the transformers model."""
    import transformers

    cfg = {**TINY, **overrides}
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg, tie_word_embeddings=True))
    elif kind == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**cfg, tie_word_embeddings=True))
    elif kind == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**cfg, head_dim=32, tie_word_embeddings=False))
    elif kind == "phi3":
        model = transformers.Phi3ForCausalLM(transformers.Phi3Config(**cfg, pad_token_id=0))
    else:
        raise ValueError(kind)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.15 + (1.0 if p.ndim == 1 else 0.0))
    model.eval().save_pretrained(folder, safe_serialization=True)
    return model


def make_adapter(base, folder, seed: int, r: int = 8, alpha: float = 16, targets=ALL_TARGETS, **lora_kw):
    """A PEFT adapter with non-zero A and B (PEFT's default leaves B at zero, which would change nothing) saved at
    `folder` as safetensors; returns peft's merged model, the reference for that adapter."""
    import peft

    torch.manual_seed(seed)
    config = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), init_lora_weights=False,
                             task_type="CAUSAL_LM", **lora_kw)
    model = peft.get_peft_model(copy.deepcopy(base), config)
    with torch.no_grad():  # B around the size of A: a visible change to every adapted layer's output
        for name, p in model.named_parameters():
            if "lora_B" in name or "lora_A" in name:
                p.copy_(torch.randn(p.shape) * 0.2)
    model.save_pretrained(folder, safe_serialization=True)
    assert os.path.isfile(os.path.join(folder, "adapter_model.safetensors"))
    return model.merge_and_unload().eval()
