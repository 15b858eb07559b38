"""Reading a PEFT LoRA folder (adapter_config.json + adapter_model.safetensors) for a given base model.

Everything is checked before anything is kept, so a bad adapter leaves nothing half-loaded: the config's fields, the
target modules, every tensor's shape against the base model, and the rank against --max-lora-rank. Pickled weights
(adapter_model.bin) are refused, as model weights are. Each module's scale (alpha / r, or alpha / sqrt(r) with
rsLoRA) is folded into its B matrix here, once.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections import Counter
from dataclasses import dataclass

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from llmserve.config import ModelConfig
from llmserve.errors import InvalidRequestError
from llmserve.lora.request import LoRARequest
from llmserve.models.llama import LlamaForCausalLM

# PEFT's module name → (our module in a decoder layer, shard index inside it): the merged modules are the model's own
# checkpoint mapping (LlamaForCausalLM.stacked), the others keep their names. Phi-3's checkpoints (and so its
# adapters) hold q/k/v and gate/up fused: shard None, an adapter on every shard (its B split by the shards' rows).
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
TARGET_MODULES = {name: (f"{parent}.{LlamaForCausalLM.stacked.get(name, (name, 0))[0]}",
                         LlamaForCausalLM.stacked.get(name, (name, 0))[1]) for name, parent in _PARENT.items()}
# how many shards each of our adapted modules has (its LoRA rank space is that many times --max-lora-rank)
NUM_SHARDS = Counter(module for module, _ in TARGET_MODULES.values())
TARGET_MODULES.update({"qkv_proj": ("self_attn.qkv_proj", None), "gate_up_proj": ("mlp.gate_up_proj", None)})

_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")
_UNSUPPORTED_FLAGS = {"use_dora": "DoRA adapters (use_dora)", "fan_in_fan_out": "fan_in_fan_out layouts"}


class LoRAError(InvalidRequestError):
    """An adapter that cannot be served on this base model (400 on the API)."""


@dataclass
class LoRAAdapter:
    request: LoRARequest
    # (layer index, our module name, shard) → (A [r, in] float32, B [out, r] float32 with the scale folded in)
    weights: dict[tuple[int, str, int], tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


def expected_shape(cfg: ModelConfig, target: str) -> tuple[int, int]:
    """(out, in) of a PEFT target module in the whole (unsplit) base model."""
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    h, f = cfg.hidden_size, cfg.intermediate_size
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (f, h), "up_proj": (f, h), "down_proj": (h, f),
            "qkv_proj": (q + 2 * kv, h), "gate_up_proj": (2 * f, h)}[target]


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rank_pattern / alpha_pattern: the first key that matches the end of the module's dotted name."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?{key}$", module):
            return value
    return default


def _read_config(folder: str) -> dict:
    path = os.path.join(folder, "adapter_config.json")
    if not os.path.isfile(path):
        raise LoRAError(f"{folder} has no adapter_config.json; a LoRA adapter is a PEFT folder", "lora_path")
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoRAError(f"cannot read adapter_config.json: {e}", "lora_path") from None
    if not isinstance(cfg, dict):
        raise LoRAError("adapter_config.json must hold a JSON object", "lora_path")
    return cfg


def _check_config(cfg: dict) -> None:
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"adapter_config.json: peft_type {cfg['peft_type']!r} is not supported; only LORA", "peft_type")
    task = cfg.get("task_type")
    if task not in (None, "CAUSAL_LM"):
        raise LoRAError(f"adapter_config.json: task_type {task!r} is not a causal language model (CAUSAL_LM)", "task_type")
    for flag, what in _UNSUPPORTED_FLAGS.items():
        if cfg.get(flag):
            raise LoRAError(f"adapter_config.json: {what} are not supported", flag)
    if cfg.get("bias", "none") != "none":
        raise LoRAError(f"adapter_config.json: bias {cfg['bias']!r} is not supported; only 'none'", "bias")
    if cfg.get("modules_to_save"):
        raise LoRAError("adapter_config.json: modules_to_save (fully trained extra modules) is not supported",
                        "modules_to_save")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise LoRAError(f"adapter_config.json: r must be a positive integer, got {r!r}", "r")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise LoRAError(f"adapter_config.json: lora_alpha must be a number, got {alpha!r}", "lora_alpha")
    for field in ("rank_pattern", "alpha_pattern"):
        pattern = cfg.get(field) or {}
        if not isinstance(pattern, dict) or not all(
                isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) for k, v in pattern.items()):
            raise LoRAError(f"adapter_config.json: {field} must map module names to numbers", field)
    targets = cfg.get("target_modules")
    if targets is not None and not isinstance(targets, (str, list)):
        raise LoRAError("adapter_config.json: target_modules must be a list of module names or a regex", "target_modules")
    if isinstance(targets, list):
        unknown = [t for t in targets if not isinstance(t, str) or t.rsplit(".", 1)[-1] not in TARGET_MODULES]
        if unknown:
            raise LoRAError(f"adapter_config.json: target module {unknown[0]!r} is not one this model can adapt "
                            f"({', '.join(TARGET_MODULES)})", "target_modules")


def load_adapter(request: LoRARequest, cfg: ModelConfig, max_rank: int) -> LoRAAdapter:
    """Reads and checks the adapter at request.lora_path for a base model with config `cfg`."""
    folder = request.lora_path
    if not os.path.isdir(folder):
        raise LoRAError(f"LoRA adapter folder {folder} does not exist", "lora_path")
    config = _read_config(folder)
    _check_config(config)
    path = os.path.join(folder, "adapter_model.safetensors")
    if not os.path.isfile(path):
        pickled = [n for n in ("adapter_model.bin", "adapter_model.pt") if os.path.exists(os.path.join(folder, n))]
        if pickled:
            raise LoRAError(f"refusing to load {pickled[0]}: pickled weights can run code; save the adapter with "
                            "safetensors (PEFT's default)", "lora_path")
        raise LoRAError(f"{folder} has no adapter_model.safetensors", "lora_path")
    try:
        tensors = load_file(path)
    except (SafetensorError, OSError, ValueError) as e:
        raise LoRAError(f"cannot read adapter_model.safetensors (corrupt or truncated?): {e}", "lora_path") from None

    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if m is None and ".mlp.experts." in key:
            raise LoRAError(f"adapter tensor {key!r}: LoRA on a mixture of experts' experts is not supported (attention "
                            "projections and dense MLPs are)", "target_modules")
        if m is None:
            raise LoRAError(f"adapter tensor {key!r} adapts a module this model cannot adapt; supported targets: "
                            f"{', '.join(TARGET_MODULES)} of the decoder layers", "target_modules")
        layer, _, target, which = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        if target not in TARGET_MODULES:
            raise LoRAError(f"adapter tensor {key!r}: target module {target!r} is not one this model can adapt "
                            f"({', '.join(TARGET_MODULES)})", "target_modules")
        if m.group(2) == "mlp" and layer < cfg.num_hidden_layers and cfg.is_moe_layer(layer):
            raise LoRAError(f"adapter tensor {key!r} adapts layer {layer}'s MLP, which is a mixture of experts here: "
                            "LoRA on experts is not supported (attention projections and dense MLPs are)",
                            "target_modules")
        if layer >= cfg.num_hidden_layers:
            raise LoRAError(f"adapter tensor {key!r} is for layer {layer}, but the base model has "
                            f"{cfg.num_hidden_layers} layers: the adapter was made for a different base model",
                            "base_model_name_or_path")
        if not tensor.is_floating_point():
            raise LoRAError(f"adapter tensor {key!r} has dtype {tensor.dtype}; LoRA weights are floating point", "lora_path")
        pairs.setdefault((layer, target), {})[which] = tensor
    if not pairs:
        raise LoRAError("adapter_model.safetensors holds no LoRA weights", "lora_path")

    alpha, r_default = float(config["lora_alpha"]), config["r"]
    rank_pattern, alpha_pattern = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    weights = {}
    for (layer, target), ab in sorted(pairs.items()):
        name = f"model.layers.{layer}.{TARGET_MODULES[target][0].split('.')[0]}.{target}"
        if set(ab) != {"A", "B"}:
            missing = "lora_B" if "A" in ab else "lora_A"
            raise LoRAError(f"adapter module {name} has no {missing} weight", "lora_path")
        a, b = ab["A"], ab["B"]
        out_features, in_features = expected_shape(cfg, target)
        rank = a.shape[0] if a.dim() == 2 else -1
        expect_a, expect_b = (rank, in_features), (out_features, rank)
        if tuple(a.shape) != expect_a or tuple(b.shape) != expect_b:
            raise LoRAError(f"adapter module {name}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit "
                            f"the base model's {target} ({out_features} x {in_features}); the adapter was made for a "
                            "different base model", "lora_path")
        configured = _pattern_value(rank_pattern, name, r_default)
        if rank != configured:
            raise LoRAError(f"adapter module {name} has rank {rank}, but adapter_config.json says {configured}", "r")
        if rank > max_rank:
            raise LoRAError(f"the adapter's rank {rank} (r in adapter_config.json) is above --max-lora-rank {max_rank}",
                            "r")
        module_alpha = float(_pattern_value(alpha_pattern, name, alpha))
        scale = module_alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
        a32, b32 = a.float(), b.float() * scale
        if not (torch.isfinite(a32).all() and torch.isfinite(b32).all()):
            raise LoRAError(f"adapter module {name} has non-finite weights", "lora_path")
        module, shard = TARGET_MODULES[target]
        if shard is not None:
            weights[(layer, module, shard)] = (a32.contiguous(), b32.contiguous())
            continue
        parts = [expected_shape(cfg, p)[0] for p, (ours, _) in TARGET_MODULES.items() if ours == module and p != target]
        for shard, b_part in enumerate(b32.split(parts)):  # the shared A on each part (x A computed once per part)
            weights[(layer, module, shard)] = (a32.contiguous(), b_part.contiguous())
    return LoRAAdapter(request, weights)
