"""Hugging Face folders: config.json, *.safetensors (sharded too), tokenizer.json, tokenizer_config.json."""

from __future__ import annotations

import glob
import json
import math
import os

from safetensors import safe_open

from llmserve.config import GENERATION_FIELDS, EngineConfig, ModelConfig
from llmserve.errors import ModelLoadError, UnsupportedModelError
from llmserve.loader import PICKLE_SUFFIXES, ModelFiles
from llmserve.loader.quantized import CheckpointQuantization, dequantized_weights, read_quantization

# HF architecture name → (our family, qkv bias default, q/k RMSNorm)
SUPPORTED_ARCHS = {
    "LlamaForCausalLM": ("llama", False, False),
    "MistralForCausalLM": ("llama", False, False),
    "MinistralForCausalLM": ("llama", False, False),  # Ministral 8B: Mistral with a window on the layers it lists
    "Qwen2ForCausalLM": ("qwen2", True, False),
    "Qwen3ForCausalLM": ("qwen3", False, True),
    # mixtures of experts: the same decoder, a sparse MLP (layers/moe.py)
    "MixtralForCausalLM": ("llama", False, False),
    "Qwen3MoeForCausalLM": ("qwen3", False, True),
    "Qwen2MoeForCausalLM": ("qwen2", True, False),  # with a shared expert beside the routed ones
    # Granite (IBM's 3.x dense models): Llama's layers with its scales (embedding, residual, attention, logits)
    "GraniteForCausalLM": ("llama", False, False),
    # OLMo 2 and 3 (models/olmo2.py): norms after each block, q/k norms over the whole projection
    "Olmo2ForCausalLM": ("olmo2", False, False),
    "Olmo3ForCausalLM": ("olmo3", False, False),
    # SmolLM3: Llama's layers, every fourth (no_rope_layers) without rotary embeddings
    "SmolLM3ForCausalLM": ("smollm3", False, False),
    # Phi-3, Phi-3.5 and Phi-4 (q/k/v and gate/up stored fused; LongRoPE, partial rotary)
    "Phi3ForCausalLM": ("phi3", False, False),
    # Gemma 1, Gemma 2 (attention soft-capping), Gemma 3's text models (models/gemma.py); Gemma 3's image-text models'
    # language model, serving text (the vision tower is not read)
    "GemmaForCausalLM": ("gemma", False, False),
    "Gemma2ForCausalLM": ("gemma2", False, False),
    "Gemma3ForCausalLM": ("gemma3", False, True),
    "Gemma3ForConditionalGeneration": ("gemma3", False, True),
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

# Tensors of a checkpoint that llmserve serves without: an image-text model's vision tower and projector (it serves
# the language model, for text)
UNREAD_WEIGHTS = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")

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


def read_config(folder: str, hf_overrides: dict | None = None, convert: str = "auto",
                quantization: str | None = None) -> tuple[ModelConfig, CheckpointQuantization | None]:
    """hf_overrides: config.json's keys replaced (vLLM's --hf-overrides); convert "classify": a generative checkpoint
    read as a classifier over its LM head's rows (vLLM's --convert classify, with classifier_from_token);
    quantization: vLLM's --quantization, checked against the checkpoint's own. Returns the architecture and the
    checkpoint's quantization (None: float weights)."""
    cfg_path = os.path.join(folder, "config.json")
    if not os.path.isfile(cfg_path):
        raise ModelLoadError(f"{folder} has no config.json; pass a GGUF file or a Hugging Face model folder", "model")
    cfg = {**_read_json(cfg_path), **(hf_overrides or {})}
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHS), None)
    if arch is None:
        raise UnsupportedModelError(
            f"unsupported architecture {archs[0] if archs else cfg.get('model_type')!r}; "
            f"supported: {', '.join(SUPPORTED_ARCHS)}",
            "model",
        )
    if arch == "Gemma3ForConditionalGeneration":
        cfg, arch = gemma3_language_model_config(cfg), "Gemma3ForCausalLM"
    if convert == "classify" and not arch.endswith("ForSequenceClassification"):
        if not arch.endswith("ForCausalLM"):
            raise ModelLoadError(f"--convert classify turns a generative model (*ForCausalLM) into a classifier; "
                                 f"{arch} has no LM head to convert", "convert")
        arch = arch.replace("ForCausalLM", "ForSequenceClassification")
    from_token = classifier_from_token(folder, cfg, arch)
    quant = read_quantization(folder, cfg, quantization)
    try:
        return _model_config(folder, cfg, arch, from_token, quant), quant
    except KeyError as e:
        raise ModelLoadError(f"config.json in {folder} lacks the field {e.args[0]!r}", "model") from e


def _model_config(folder: str, cfg: dict, arch: str, from_token: dict | None,
                  quant: CheckpointQuantization | None) -> ModelConfig:
    family, default_bias, qk_norm = SUPPORTED_ARCHS[arch]
    heads = cfg["num_attention_heads"]
    hidden = cfg["hidden_size"]
    # transformers >= 5 writes `rope_parameters` (theta inside); older configs `rope_theta` + `rope_scaling`.
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    eos = cfg.get("eos_token_id")
    gen_path = os.path.join(folder, "generation_config.json")
    generation = _read_json(gen_path) if os.path.isfile(gen_path) else {}
    eos = generation.get("eos_token_id", eos)
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    windows = attention_window_fields(cfg, family)  # Gemma's rope settings among them
    head_dim = cfg.get("head_dim") or hidden // heads
    max_positions = cfg.get("max_position_embeddings", 2048)
    kind = rope.get("rope_type", rope.get("type", "default"))  # older configs (and Qwen's docs) say "type"
    if kind in ("longrope", "su"):  # "su": its name in early Phi-3 configs
        rope, max_positions = longrope(cfg, rope, max_positions)
    elif kind == "yarn":
        rope, max_positions = yarn(rope, max_positions)
    elif kind not in ROPE_TYPES:
        raise UnsupportedModelError(f"rope scaling {kind!r} is not supported; supported: {', '.join(ROPE_TYPES)}, "
                                    "longrope, yarn", "model")
    return ModelConfig(
        architecture=family,
        vocab_size=cfg["vocab_size"],
        hidden_size=hidden,
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        max_position_embeddings=max_positions,
        rotary_dim=int(head_dim * (cfg.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0)),
        no_rope_layers=no_rope_layers(cfg, family),
        embedding_multiplier=float(cfg.get("embedding_multiplier") or 1.0),
        residual_multiplier=float(cfg.get("residual_multiplier") or 1.0),
        attention_multiplier=cfg.get("attention_multiplier"),
        logits_scaling=float(cfg.get("logits_scaling") or 1.0),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=windows.pop("rope_theta", cfg.get("rope_theta", rope.get("rope_theta", 10000.0))),
        rope_scaling=windows.pop("rope_scaling", {**rope, "rope_type": kind} if kind not in ("default", "dynamic")
                                 else None),
        attention_bias=cfg.get("attention_bias", cfg.get("qkv_bias", default_bias)),  # (Qwen2-MoE: qkv_bias)
        qk_norm=qk_norm,
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos,
        quantization=quant.description if quant else str(cfg.get("torch_dtype") or cfg.get("dtype") or "unknown"),
        checkpoint_int4_codes=bool(quant and quant.int4_codes),
        generation_defaults=sampling_defaults(generation),
        has_lm_head=arch.endswith("ForCausalLM"),
        num_labels=(from_token["num_labels"] if from_token else
                    classifier_labels(cfg) if arch.endswith("ForSequenceClassification") else 0),
        id2label=(from_token["id2label"] if from_token else
                  {int(k): str(v) for k, v in (cfg.get("id2label") or {}).items()}),
        classifier_from_token_ids=from_token["token_ids"] if from_token else None,
        classifier_method=from_token["method"] if from_token else None,
        score_pair_template=bool(cfg.get("use_pad_token", not cfg.get("is_original_qwen3_reranker", False))),
        problem_type=cfg.get("problem_type"),
        pooler_defaults=sentence_transformers_pooling(folder),
        matryoshka_dimensions=matryoshka_dimensions(cfg),
        **moe_fields(cfg, arch),
        **windows,
    )


# transformers' Gemma3TextConfig defaults: Google's image-text configs give only the fields that differ from them
GEMMA3_TEXT_DEFAULTS = {"vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                        "query_pre_attn_scalar": 256, "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6,
                        "sliding_window": 4096, "sliding_window_pattern": 6, "rope_theta": 1_000_000.0,
                        "rope_local_base_freq": 10_000.0, "hidden_activation": "gelu_pytorch_tanh",
                        "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": 1}


def gemma3_language_model_config(cfg: dict) -> dict:
    """An image-text Gemma 3's config.json read as its language model's: text_config over transformers' defaults
    (the top level's embedding tie and special tokens where it sets them)."""
    top = {k: cfg[k] for k in ("tie_word_embeddings", "bos_token_id", "eos_token_id") if k in cfg}
    return {**GEMMA3_TEXT_DEFAULTS, **top, **(cfg.get("text_config") or {}), "architectures": ["Gemma3ForCausalLM"]}


# Rope types read as they are (dynamic NTK rotates every position within the model's context as the default does:
# transformers changes the frequencies only for sequences longer than max_position_embeddings, which is the cap here)
ROPE_TYPES = ("default", "linear", "llama3", "dynamic")


def yarn(rope: dict, max_positions: int) -> tuple[dict, int]:
    """YaRN as vLLM serves it: the context is the original one times the factor (Qwen's long-context recipe adds
    rope_scaling {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768} to a 32k model); a config
    without the factor (DeepSeek's style) has the context over the original length as its factor."""
    original = rope.get("original_max_position_embeddings")
    if not original:
        raise ModelLoadError("a yarn rope config needs original_max_position_embeddings", "model")
    factor = rope.get("factor") or max_positions / original
    return {**rope, "rope_type": "yarn", "factor": factor}, int(original * factor)


def longrope(cfg: dict, rope: dict, max_positions: int) -> tuple[dict, int]:
    """Phi-3's LongRoPE as served here: the short factors, with transformers' attention factor
    (sqrt(1 + ln(factor) / ln(original length)), factor = the context over the original length), and the context
    capped at the original length, beyond which transformers switches every position to the long factors."""
    original = rope.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
    if not original:
        raise ModelLoadError("a longrope config needs original_max_position_embeddings", "model")
    factor = rope.get("factor") or max_positions / original
    attention = rope.get("attention_factor") or (
        math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0)
    return {**rope, "rope_type": "longrope", "attention_factor": attention}, min(max_positions, int(original))


def attention_window_fields(cfg: dict, family: str) -> dict:
    """Sliding windows and Gemma's attention and rope settings, as ModelConfig fields. transformers >= 4.53 lists each
    layer's type (layer_types); older configs say it as Gemma 3's sliding_window_pattern (every n-th layer full),
    Gemma 2's fixed alternation (every other layer windowed, from the first) or Qwen's use_sliding_window with
    max_window_layers (the layers from that index on windowed)."""
    n = cfg["num_hidden_layers"]
    window = cfg.get("sliding_window")
    types = list(cfg.get("layer_types") or [])
    if family in ("qwen2", "qwen3", "smollm3"):
        if not cfg.get("use_sliding_window"):
            window, types = None, []
        elif not types and family == "smollm3":  # transformers windows SmolLM3's NoPE layers
            types = ["full_attention" if i not in no_rope_layers(cfg, family) else "sliding_attention"
                     for i in range(n)]
        elif not types:
            first = cfg.get("max_window_layers", n)
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
    if family == "olmo3":  # every fourth layer full by default; the windowed layers rotate unscaled
        types = types or ["sliding_attention" if (i + 1) % 4 else "full_attention" for i in range(n)]
        full, local = rope_by_layer_type(cfg, cfg.get("rope_theta", 500_000.0))
        return {"sliding_window": int(window) if window else None, "layer_types": types,
                "rope_theta": full["rope_theta"], "rope_local_theta": local["rope_theta"],
                "rope_scaling": full if full.get("rope_type", full.get("type", "default")) != "default" else None}
    if family not in ("gemma", "gemma2", "gemma3"):
        return {"sliding_window": int(window) if window else None, "layer_types": types}
    if cfg.get("use_bidirectional_attention"):
        raise UnsupportedModelError("bidirectional attention (EmbeddingGemma) is not supported", "model")
    activation = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    gemma = {"query_pre_attn_scalar": cfg.get("query_pre_attn_scalar"),
             # Gemma 1's configs say "gelu", which transformers reads as the tanh approximation it was trained with
             "hidden_activation": "gelu_pytorch_tanh" if activation == "gelu" else activation,
             "final_logit_softcapping": cfg.get("final_logit_softcapping"),
             "attn_logit_softcapping": cfg.get("attn_logit_softcapping")}
    if family == "gemma":
        return {"sliding_window": None, "layer_types": [], **gemma, "query_pre_attn_scalar": None}
    if family == "gemma2":
        if not types:
            types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
        return {"sliding_window": int(window) if window else None, "layer_types": types, **gemma}
    if not types:
        pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)]
    full, local = rope_by_layer_type(cfg, cfg.get("rope_local_base_freq", 10_000.0), 1_000_000.0)
    return {"sliding_window": int(window) if window else None, "layer_types": types, **gemma,
            "rope_theta": full["rope_theta"], "rope_local_theta": local["rope_theta"],
            "rope_scaling": full if full.get("rope_type", full.get("type", "default")) != "default" else None}


def no_rope_layers(cfg: dict, family: str) -> list[int]:
    """The layers without rotary embeddings: SmolLM3's no_rope_layers flags (1: the layer rotates), by default every
    no_rope_layer_interval-th layer (4) as transformers fills them in."""
    if family != "smollm3":
        return []
    n = cfg["num_hidden_layers"]
    flags = cfg.get("no_rope_layers") or [int((i + 1) % (cfg.get("no_rope_layer_interval") or 4) != 0)
                                          for i in range(n)]
    return [i for i, rotates in enumerate(flags) if not rotates]


def rope_by_layer_type(cfg: dict, local_theta: float, full_theta: float | None = None) -> tuple[dict, dict]:
    """The full-attention and the windowed layers' rope settings (Gemma 3, OLMo 3). transformers >= 5 nests them by
    layer type; older configs give rope_theta (+ rope_scaling) for the full layers and the windowed ones' base apart
    (Gemma 3's rope_local_base_freq; OLMo 3's rope_theta, unscaled)."""
    by_type = cfg.get("rope_parameters") or {}
    full = by_type.get("full_attention") or {**(cfg.get("rope_scaling") or {}),
                                             "rope_theta": cfg.get("rope_theta", full_theta or local_theta)}
    local = by_type.get("sliding_attention") or {"rope_theta": local_theta}
    return full, local


def moe_fields(cfg: dict, arch: str) -> dict:
    """A mixture of experts' routing (num_local_experts, or Qwen's num_experts), as ModelConfig fields."""
    experts = cfg.get("num_local_experts") or cfg.get("num_experts") or 0
    if not experts:
        return {}
    mixtral = arch.startswith("Mixtral")
    return {"num_experts": int(experts), "num_experts_per_tok": int(cfg["num_experts_per_tok"]),
            # Mixtral's experts are its intermediate_size; it always renormalizes over the picked experts
            "moe_intermediate_size": int(cfg["intermediate_size"] if mixtral else cfg["moe_intermediate_size"]),
            "norm_topk_prob": True if mixtral else bool(cfg.get("norm_topk_prob", False)),
            "decoder_sparse_step": int(cfg.get("decoder_sparse_step") or 1),
            "mlp_only_layers": [int(i) for i in cfg.get("mlp_only_layers") or []],
            "shared_expert_intermediate_size": int(cfg.get("shared_expert_intermediate_size") or 0)}


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


CLASSIFIER_METHODS = ("from_2_way_softmax", "no_post_processing")


def classifier_from_token(folder: str, cfg: dict, arch: str) -> dict | None:
    """A language model's LM head as a classifier's (vLLM's recipe for rerankers trained as LMs, e.g. Qwen3-Reranker:
    --hf-overrides '{"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
    "is_original_qwen3_reranker": true}'): the rows of the listed tokens become the classes; with method
    from_2_way_softmax (two tokens; the default for two) one class, the second row minus the first, whose sigmoid is the
    second token's probability against the first. None: the config names no tokens."""
    tokens = cfg.get("classifier_from_token")
    if tokens is None:
        return None
    if not arch.endswith("ForSequenceClassification"):
        raise ModelLoadError("classifier_from_token makes a classifier of a language model: it needs the "
                             "*ForSequenceClassification architecture (--hf-overrides '{\"architectures\": [...]}') "
                             "or --convert classify", "hf_overrides")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) and t for t in tokens):
        raise ModelLoadError(f"classifier_from_token must be a list of token strings, got {tokens!r}", "hf_overrides")
    method = cfg.get("method") or ("from_2_way_softmax" if len(tokens) == 2 or cfg.get("is_original_qwen3_reranker")
                                   else "no_post_processing")
    if method not in CLASSIFIER_METHODS:
        raise ModelLoadError(f"method must be one of {', '.join(CLASSIFIER_METHODS)}, got {method!r}", "hf_overrides")
    if method == "from_2_way_softmax" and len(tokens) != 2:
        raise ModelLoadError(f"from_2_way_softmax compares two tokens; classifier_from_token has {len(tokens)}",
                             "hf_overrides")
    path = os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(path):
        raise ModelLoadError(f"classifier_from_token names tokens, and {folder} has no tokenizer.json to find them in",
                             "hf_overrides")
    from tokenizers import Tokenizer as HFTokenizer

    vocab = HFTokenizer.from_file(path)
    ids = [vocab.token_to_id(t) for t in tokens]
    unknown = [t for t, i in zip(tokens, ids) if i is None]
    if unknown:
        raise ModelLoadError(f"classifier_from_token: {unknown[0]!r} is not a token of this model's vocabulary (a "
                             "token as the vocabulary spells it, e.g. \"yes\")", "hf_overrides")
    labels = tokens[1:] if method == "from_2_way_softmax" else tokens
    return {"token_ids": ids, "method": method, "num_labels": len(labels), "id2label": dict(enumerate(labels))}


def classifier_from_lm_head(weights, config: ModelConfig):
    """The checkpoint's weights with its LM head's rows for classifier_from_token_ids in the place of a classifier's
    `score` head (the head itself, vocabulary-sized, is not built for a pooling engine)."""
    ids = config.classifier_from_token_ids
    head_names = {"lm_head.weight"}
    if config.tie_word_embeddings:
        head_names |= {"model.embed_tokens.weight", "embed_tokens.weight"}
    given = False
    for name, tensor in weights:
        if name in head_names and not given:
            rows = tensor[ids].float()  # the difference of two rows in float32, not the checkpoint's bf16
            yield "score.weight", rows[1:] - rows[:1] if config.classifier_method == "from_2_way_softmax" else rows
            given = True
        if name != "lm_head.weight":
            yield name, tensor


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


def load_hf_folder(folder: str, load_tokenizer: bool = True, dummy: bool = False, hf_overrides: dict | None = None,
                   convert: str = "auto", quantization: str | None = None) -> ModelFiles:
    """dummy: no weights are read (there need be none); the model runner draws random ones (--load-format dummy).
    A pre-quantized checkpoint's layers come out as float weights (loader/quantized.py)."""
    config, quant = read_config(folder, hf_overrides, convert, quantization)
    files = [] if dummy else sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files and not dummy:
        pickled = [f for f in os.listdir(folder) if f.endswith(PICKLE_SUFFIXES)]
        hint = f" (found {pickled[0]}: pickled weights are refused because they can run code)" if pickled else ""
        raise ModelLoadError(f"{folder} has no *.safetensors weights; use safetensors or GGUF (or --load-format dummy "
                             f"for random weights){hint}", "model")
    num_params = 0
    for path in [] if quant else files:  # a quantized file's packed codes hold several parameters a number
        with safe_open(path, framework="numpy") as f:  # shapes only: no torch needed to read a config
            for key in f.keys():
                if key.startswith(UNREAD_WEIGHTS):
                    continue
                n = 1
                for d in f.get_slice(key).get_shape():
                    n *= d
                num_params += n
    if dummy or quant:  # counted from the shapes config.json gives
        from llmserve.plan.models import from_hf_config

        num_params = from_hf_config(_read_json(os.path.join(folder, "config.json")), folder).total_params
    config.num_parameters = num_params
    config.weight_file_bytes = sum(os.path.getsize(p) for p in files)

    def checkpoint_weights():
        for path in files:
            with safe_open(path, framework="pt") as f:
                for key in f.keys():
                    if not key.startswith(UNREAD_WEIGHTS):
                        yield key, f.get_tensor(key)

    def float_weights():
        return dequantized_weights(checkpoint_weights(), quant) if quant else checkpoint_weights()

    def weights():
        if config.classifier_from_token_ids is not None:
            return classifier_from_lm_head(float_weights(), config)
        return float_weights()

    tokenizer = None
    if load_tokenizer and os.path.isfile(os.path.join(folder, "tokenizer.json")):
        from llmserve.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_hf_folder(folder)
    return ModelFiles(path=folder, name=os.path.basename(os.path.normpath(folder)), config=config, weights=weights, tokenizer=tokenizer)
