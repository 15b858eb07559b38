"""Hugging Face folders: config.json, *.safetensors (sharded too), tokenizer.json, tokenizer_config.json."""

from __future__ import annotations

import glob
import json
import os

from safetensors import safe_open

from llmserve.config import GENERATION_FIELDS, EngineConfig, ModelConfig
from llmserve.errors import ModelLoadError, UnsupportedModelError
from llmserve.loader import PICKLE_SUFFIXES, ModelFiles

# HF architecture name → (our family, qkv bias default, q/k RMSNorm)
SUPPORTED_ARCHS = {
    "LlamaForCausalLM": ("llama", False, False),
    "MistralForCausalLM": ("llama", False, False),
    "Qwen2ForCausalLM": ("qwen2", True, False),
    "Qwen3ForCausalLM": ("qwen3", False, True),
    # the bare decoders, as embedding models are saved (no LM head: --runner pooling)
    "LlamaModel": ("llama", False, False),
    "MistralModel": ("llama", False, False),
    "Qwen2Model": ("qwen2", True, False),
    "Qwen3Model": ("qwen3", False, True),
    # sequence classifiers (reward models, classifiers): the decoder and a `score` head over the last token
    "LlamaForSequenceClassification": ("llama", False, False),
    "MistralForSequenceClassification": ("llama", False, False),
    "Qwen2ForSequenceClassification": ("qwen2", True, False),
    "Qwen3ForSequenceClassification": ("qwen3", False, True),
}

# sentence-transformers' Pooling module settings → our pooling type (the first one set wins, in this order)
SENTENCE_TRANSFORMERS_POOLING = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN",
                                 "pooling_mode_cls_token": "CLS"}


def _read_json(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def sampling_defaults(generation_config: dict) -> dict:
    return {ours: generation_config[theirs] for theirs, ours in GENERATION_FIELDS.items()
            if generation_config.get(theirs) is not None}


def generation_defaults(engine_config: EngineConfig, model_config: ModelConfig) -> dict:
    """The sampling defaults that --generation-config chooses (the model's, none, or another folder's), with
    --override-generation-config's laid over them."""
    if engine_config.generation_config == "vllm":
        chosen = {}
    elif engine_config.generation_config == "auto":
        chosen = dict(model_config.generation_defaults)
    else:
        chosen = sampling_defaults(_read_json(os.path.join(engine_config.generation_config, "generation_config.json")))
    return {**chosen, **sampling_defaults(engine_config.override_generation_config or {})}


def read_config(folder: str) -> ModelConfig:
    cfg_path = os.path.join(folder, "config.json")
    if not os.path.isfile(cfg_path):
        raise ModelLoadError(f"{folder} has no config.json; pass a GGUF file or a Hugging Face model folder", "model")
    cfg = _read_json(cfg_path)
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHS), None)
    if arch is None:
        raise UnsupportedModelError(
            f"unsupported architecture {archs[0] if archs else cfg.get('model_type')!r}; "
            f"supported: {', '.join(SUPPORTED_ARCHS)}",
            "model",
        )
    family, default_bias, qk_norm = SUPPORTED_ARCHS[arch]
    try:
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        # transformers >= 5 writes `rope_parameters` (theta inside); older configs `rope_theta` + `rope_scaling`.
        rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
        eos = cfg.get("eos_token_id")
        gen_path = os.path.join(folder, "generation_config.json")
        generation = _read_json(gen_path) if os.path.isfile(gen_path) else {}
        eos = generation.get("eos_token_id", eos)
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        return ModelConfig(
            architecture=family,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get("rope_theta", rope.get("rope_theta", 10000.0)),
            rope_scaling=rope if rope.get("rope_type", "default") != "default" else None,
            attention_bias=cfg.get("attention_bias", default_bias),
            qk_norm=qk_norm,
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos,
            quantization=str(cfg.get("torch_dtype") or cfg.get("dtype") or "unknown"),
            generation_defaults=sampling_defaults(generation),
            has_lm_head=arch.endswith("ForCausalLM"),
            num_labels=classifier_labels(cfg) if arch.endswith("ForSequenceClassification") else 0,
            id2label={int(k): str(v) for k, v in (cfg.get("id2label") or {}).items()},
            problem_type=cfg.get("problem_type"),
            pooler_defaults=sentence_transformers_pooling(folder),
            matryoshka_dimensions=matryoshka_dimensions(cfg),
        )
    except KeyError as e:
        raise ModelLoadError(f"config.json in {folder} lacks the field {e.args[0]!r}", "model") from e


def sentence_transformers_pooling(folder: str) -> dict | None:
    """A sentence-transformers folder's pooling (modules.json: its Pooling module's config, and whether a Normalize
    module follows), as a PoolerConfig's fields, so that llmserve's embeddings are the ones that library computes.
    None: the folder has no such config, or one llmserve cannot follow (then vLLM's defaults apply)."""
    path = os.path.join(folder, "modules.json")
    if not os.path.isfile(path):
        return None
    try:
        modules = _read_json(path)
        pooling = next(m for m in modules if str(m.get("type", "")).endswith("models.Pooling"))
        settings = _read_json(os.path.join(folder, pooling.get("path", ""), "config.json"))
    except (OSError, ValueError, StopIteration, AttributeError, TypeError):
        return None
    kind = next((ours for key, ours in SENTENCE_TRANSFORMERS_POOLING.items() if settings.get(key)), None)
    if kind is None:
        return None
    normalize = any(str(m.get("type", "")).endswith("models.Normalize") for m in modules)
    return {"pooling_type": kind, "normalize": normalize}


def classifier_labels(cfg: dict) -> int:
    """A classifier's number of classes, as transformers reads it: num_labels, else the size of id2label (2 when a
    config gives neither)."""
    if isinstance(cfg.get("num_labels"), int) and cfg["num_labels"] > 0:
        return cfg["num_labels"]
    return len(cfg.get("id2label") or {}) or 2


def matryoshka_dimensions(cfg: dict) -> list[int] | None:
    """config.json's Matryoshka fields, as vLLM reads them: `matryoshka_dimensions` (the sizes trained), or
    `is_matryoshka` (any size)."""
    dims = cfg.get("matryoshka_dimensions")
    if isinstance(dims, list) and dims and all(isinstance(d, int) and not isinstance(d, bool) for d in dims):
        return sorted(dims)
    return [] if cfg.get("is_matryoshka") else None


def load_hf_folder(folder: str, load_tokenizer: bool = True, dummy: bool = False) -> ModelFiles:
    """dummy: no weights are read (there need be none); the model runner draws random ones (--load-format dummy)."""
    config = read_config(folder)
    files = [] if dummy else sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files and not dummy:
        pickled = [f for f in os.listdir(folder) if f.endswith(PICKLE_SUFFIXES)]
        hint = f" (found {pickled[0]}: pickled weights are refused because they can run code)" if pickled else ""
        raise ModelLoadError(f"{folder} has no *.safetensors weights; use safetensors or GGUF (or --load-format dummy "
                             f"for random weights){hint}", "model")
    num_params = 0
    for path in files:
        with safe_open(path, framework="numpy") as f:  # shapes only: no torch needed to read a config
            for key in f.keys():
                n = 1
                for d in f.get_slice(key).get_shape():
                    n *= d
                num_params += n
    if dummy:  # counted from the shapes config.json gives
        from llmserve.plan.models import from_hf_config

        num_params = from_hf_config(_read_json(os.path.join(folder, "config.json")), folder).total_params
    config.num_parameters = num_params
    config.weight_file_bytes = sum(os.path.getsize(p) for p in files)

    def weights():
        for path in files:
            with safe_open(path, framework="pt") as f:
                for key in f.keys():
                    yield key, f.get_tensor(key)

    tokenizer = None
    if load_tokenizer and os.path.isfile(os.path.join(folder, "tokenizer.json")):
        from llmserve.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_hf_folder(folder)
    return ModelFiles(path=folder, name=os.path.basename(os.path.normpath(folder)), config=config, weights=weights, tokenizer=tokenizer)
