"""Model architecture as the planner needs it: read from config.json, a GGUF file, or a preset.

Presets are written as the models' own config.json fields, so they go through the same reader as a
user's file. KV heads come from `num_key_value_heads` (falling back to the query heads only where a
config has no such field, i.e. true multi-head attention): sizing KV with query heads is the classic 8x error.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from llmserve.errors import InvalidRequestError


@dataclass(frozen=True)
class ModelSpec:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # dense MLP width (dense layers of an MoE model)
    vocab_size: int
    tie_embeddings: bool = False
    max_context: int | None = None
    # MoE: every expert is resident; only experts_per_token (+ shared) run per token
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    num_shared_experts: int = 0
    first_dense_layers: int = 0
    # MLA (DeepSeek): the cache holds one compressed latent plus the rope key per layer
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    # sliding-window attention on some layers
    sliding_window: int | None = None
    num_sliding_layers: int = 0
    native_weight_format: str | None = None  # e.g. "Q4_1" for a GGUF file, "MXFP4" for gpt-oss
    file_weight_bytes: int | None = None  # bytes of the weights as stored, when read from a file

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    # ---- parameters ------------------------------------------------------------------------------
    def _attention_params(self) -> int:
        h = self.hidden_size
        if self.is_mla:
            qk_head = self.qk_nope_head_dim + self.qk_rope_head_dim
            q = (h * self.q_lora_rank + self.q_lora_rank * self.num_heads * qk_head) if self.q_lora_rank else h * self.num_heads * qk_head
            kv = h * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank * self.num_heads * (self.qk_nope_head_dim + self.v_head_dim)
            return q + kv + self.num_heads * self.v_head_dim * h
        q_dim, kv_dim = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return h * q_dim + 2 * h * kv_dim + q_dim * h

    def _mlp_params(self, active: bool) -> int:
        """All layers' MLPs (gate, up, down); for MoE the experts resident, or those run per token."""
        h = self.hidden_size
        dense = 3 * h * self.intermediate_size
        if not self.is_moe:
            return self.num_layers * dense
        expert = 3 * h * self.moe_intermediate_size
        experts = (self.experts_per_token if active else self.num_experts) + self.num_shared_experts
        moe_layers = self.num_layers - self.first_dense_layers
        return self.first_dense_layers * dense + moe_layers * (experts * expert + h * self.num_experts)

    def _embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def total_params(self) -> int:
        """Every weight that must be resident (all experts)."""
        norms = self.num_layers * 2 * self.hidden_size + self.hidden_size
        lm_head = 0 if self.tie_embeddings else self._embedding_params()
        return self._embedding_params() + lm_head + self.num_layers * self._attention_params() + self._mlp_params(False) + norms

    @property
    def active_params(self) -> int:
        """Weights multiplied per token: the input embedding is a lookup, not a matmul, so it is left out."""
        return self._embedding_params() + self.num_layers * self._attention_params() + self._mlp_params(True)

    # ---- KV cache ------------------------------------------------------------------------------------
    def kv_elements_per_token_per_layer(self) -> int:
        if self.is_mla:
            return self.kv_lora_rank + self.qk_rope_head_dim  # one latent + rope key, shared by all heads
        return 2 * self.num_kv_heads * self.head_dim  # K and V, per KV head (GQA)

    def kv_bytes_per_token(self, kv_bytes: float) -> float:
        """At full attention on every layer (what a token costs while inside every window)."""
        return self.num_layers * self.kv_elements_per_token_per_layer() * kv_bytes

    def kv_bytes_per_request(self, context: int, kv_bytes: float) -> float:
        per_layer = self.kv_elements_per_token_per_layer() * kv_bytes
        full_layers = self.num_layers - self.num_sliding_layers
        window = min(context, self.sliding_window) if self.sliding_window else context
        return per_layer * (full_layers * context + self.num_sliding_layers * window)

    def attention_flops_per_token(self, context: int) -> float:
        """QK^T and AV for one new token against `context` cached tokens, every layer."""
        if self.is_mla:
            qk, v = self.qk_nope_head_dim + self.qk_rope_head_dim, self.v_head_dim
        else:
            qk = v = self.head_dim
        full_layers = self.num_layers - self.num_sliding_layers
        window = min(context, self.sliding_window) if self.sliding_window else context
        spans = full_layers * context + self.num_sliding_layers * window
        return 2.0 * self.num_heads * (qk + v) * spans


# ---- readers -------------------------------------------------------------------------------------------
def _need(cfg: dict, where: str, *names: str):
    for n in names:
        if cfg.get(n) is not None:
            return cfg[n]
    raise InvalidRequestError(f"{where} has no {' / '.join(names)}: the planner needs it", "model")


def from_hf_config(cfg: dict, name: str, where: str = "config.json") -> ModelSpec:
    if "text_config" in cfg and "num_hidden_layers" not in cfg:  # multimodal wrappers keep the LM here
        cfg = cfg["text_config"]
    layers = int(_need(cfg, where, "num_hidden_layers", "n_layer", "num_layers"))
    hidden = int(_need(cfg, where, "hidden_size", "n_embd", "d_model"))
    heads = int(_need(cfg, where, "num_attention_heads", "n_head"))
    kv_heads = int(cfg.get("num_key_value_heads") or cfg.get("num_kv_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    vocab = int(_need(cfg, where, "vocab_size"))
    num_experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts") or 0)
    spec = dict(
        name=name, num_layers=layers, hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        intermediate_size=int(cfg.get("intermediate_size") or 0), vocab_size=vocab,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)), max_context=cfg.get("max_position_embeddings"),
    )
    if num_experts:
        spec.update(
            num_experts=num_experts,
            experts_per_token=int(_need(cfg, where, "num_experts_per_tok", "experts_per_token", "moe_topk")),
            moe_intermediate_size=int(cfg.get("moe_intermediate_size") or _need(cfg, where, "intermediate_size")),
            num_shared_experts=int(cfg.get("n_shared_experts") or cfg.get("num_shared_experts") or 0),
            first_dense_layers=int(cfg.get("first_k_dense_replace") or 0),
        )
    elif not spec["intermediate_size"]:
        raise InvalidRequestError(f"{where} has no intermediate_size: the planner needs it", "model")
    if cfg.get("kv_lora_rank"):
        spec.update(kv_lora_rank=int(cfg["kv_lora_rank"]), q_lora_rank=int(cfg.get("q_lora_rank") or 0),
                    qk_rope_head_dim=int(_need(cfg, where, "qk_rope_head_dim")), qk_nope_head_dim=int(_need(cfg, where, "qk_nope_head_dim")),
                    v_head_dim=int(_need(cfg, where, "v_head_dim")))
    window = cfg.get("sliding_window")
    layer_types = cfg.get("layer_types")
    if window and (cfg.get("use_sliding_window", True) is not False):
        if layer_types:
            sliding = sum(t == "sliding_attention" for t in layer_types)
        elif cfg.get("max_window_layers") is not None and cfg.get("use_sliding_window"):
            sliding = max(0, layers - int(cfg["max_window_layers"]))  # Qwen2: layers from max_window_layers on slide
        else:
            sliding = layers  # Mistral 7B v0.1: every layer slides
        spec.update(sliding_window=int(window), num_sliding_layers=sliding)
    quant = cfg.get("quantization_config") or {}
    if quant.get("quant_method"):
        spec["native_weight_format"] = str(quant["quant_method"]).upper()
    return ModelSpec(**spec)


def from_gguf(path: str) -> ModelSpec:
    from llmserve.loader import load_model_files

    files = load_model_files(path, load_tokenizer=False)
    c = files.config
    return ModelSpec(
        name=files.name, num_layers=c.num_hidden_layers, hidden_size=c.hidden_size, num_heads=c.num_attention_heads,
        num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim, intermediate_size=c.intermediate_size, vocab_size=c.vocab_size,
        tie_embeddings=c.tie_word_embeddings, max_context=c.max_position_embeddings, native_weight_format=c.quantization,
        file_weight_bytes=c.weight_file_bytes,
    )


def load_spec(model: str | None) -> ModelSpec:
    """A preset name, a config.json, a Hugging Face folder or a GGUF file (default: the built-in model)."""
    if model is None:
        from llmserve.loader import default_model_path

        return from_gguf(default_model_path())
    key = model.lower()
    for name, cfg in PRESETS.items():
        if name.lower() == key:
            return from_hf_config(cfg, name, f"preset {name}")
    path = os.path.expanduser(model)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
        if not os.path.isfile(path):
            raise InvalidRequestError(f"{model} has no config.json", "model")
    if not os.path.isfile(path):
        raise InvalidRequestError(f"unknown model {model!r}: not a file, a folder or a preset (presets: {', '.join(PRESETS)})", "model")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic == b"GGUF":
        return from_gguf(path)
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise InvalidRequestError(f"{model} is neither a GGUF file nor a JSON config", "model") from None
    if not isinstance(cfg, dict):
        raise InvalidRequestError(f"{model} is not a model config (expected a JSON object)", "model")
    name = os.path.basename(os.path.dirname(os.path.abspath(path))) if path.endswith("config.json") else os.path.basename(path)
    return from_hf_config(cfg, name, model)


# The fields of each model's config.json that the planner reads.
PRESETS: dict[str, dict] = {
    "Llama-3.1-8B": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072),
    "Llama-3.1-70B": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                          num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072),
    "Llama-3.1-405B": dict(hidden_size=16384, intermediate_size=53248, num_hidden_layers=126, num_attention_heads=128,
                           num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072),
    "Qwen2.5-7B": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768),
    "Qwen2.5-72B": dict(hidden_size=8192, intermediate_size=29568, num_hidden_layers=80, num_attention_heads=64,
                        num_key_value_heads=8, vocab_size=152064, max_position_embeddings=32768),
    "Qwen3-8B": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960),
    "Qwen3-32B": dict(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64,
                      num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960),
    "Qwen3-30B-A3B": dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                          vocab_size=151936, max_position_embeddings=40960),
    "Qwen3-235B-A22B": dict(hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536, num_hidden_layers=94,
                            num_attention_heads=64, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                            vocab_size=151936, max_position_embeddings=40960),
    "Mixtral-8x7B": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000,
                         max_position_embeddings=32768),
    "DeepSeek-V3": dict(hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
                        first_k_dense_replace=3, n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8,
                        num_attention_heads=128, num_key_value_heads=128, kv_lora_rank=512, q_lora_rank=1536,
                        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, vocab_size=129280,
                        max_position_embeddings=163840),
    "gpt-oss-120b": dict(hidden_size=2880, intermediate_size=2880, num_hidden_layers=36, num_attention_heads=64,
                         num_key_value_heads=8, head_dim=64, num_local_experts=128, experts_per_token=4, vocab_size=201088,
                         sliding_window=128, layer_types=["sliding_attention", "full_attention"] * 18,
                         max_position_embeddings=131072, quantization_config={"quant_method": "mxfp4"}),
    "SmolLM2-135M": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=8192),
}
