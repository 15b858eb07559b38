"""Gemma 1, 2 and 3 (text): Llama's attention and projections, with Gemma's differences (transformers'
GemmaForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM):
- embeddings scaled by sqrt(hidden_size), rounded to the model's dtype; RMSNorms whose weight is an offset from 1;
  a gated GELU (tanh) MLP;
- Gemma 1: Llama's two norms per layer, each before its block;
- Gemma 2 and 3: four norms per layer: around the attention (input, post-attention) and around the MLP (pre- and
  post-feedforward), the post norms applied to a block's output before its residual add; an attention scale of
  query_pre_attn_scalar ** -0.5; sliding-window layers (every other one in Gemma 2, five of every six in Gemma 3);
  logits soft-capped where final_logit_softcapping is set;
- Gemma 2: attention scores soft-capped (attn_logit_softcapping; every attention backend caps them);
- Gemma 3: q/k norms; its windowed layers rotate with their own, unscaled, rope base, the full-attention layers with
  the config's rope_theta and its scaling.
"""

from __future__ import annotations

import torch
from torch import nn

from llmserve.attention.backend import AttentionMetadata
from llmserve.config import ModelConfig
from llmserve.layers.mlp import GeGLUMLP
from llmserve.layers.norm import GemmaRMSNorm
from llmserve.layers.rotary import LayerTypeRopes
from llmserve.layers.vocab_parallel import VocabParallelEmbedding
from llmserve.models.llama import LlamaAttention, LlamaForCausalLM


class GemmaDecoderLayer(nn.Module):
    """Gemma 1: a norm before the attention and one before the MLP, as Llama's."""

    local_rope = False

    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.self_attn = LlamaAttention(cfg, index)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.mlp = GeGLUMLP(h, cfg.intermediate_size, cfg.hidden_activation)

    def forward(self, x: torch.Tensor, rope, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class Gemma2DecoderLayer(nn.Module):
    """Gemma 2 and 3: each block between two norms (q/k norms where the config has them: Gemma 3)."""

    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.self_attn = LlamaAttention(cfg, index, qk_norm=GemmaRMSNorm)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.mlp = GeGLUMLP(h, cfg.intermediate_size, cfg.hidden_activation)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)
        # Gemma 3's windowed layers' rope (rope_local_theta): transformers picks it by the layer's type
        self.local_rope = (cfg.rope_local_theta is not None and bool(cfg.layer_types)
                           and cfg.layer_types[index] == "sliding_attention")

    def forward(self, x: torch.Tensor, rope, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope, meta))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class GemmaModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        layer = GemmaDecoderLayer if cfg.architecture == "gemma" else Gemma2DecoderLayer
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        # a buffer: the model runner's cast to the serving dtype rounds it there, as transformers rounds it
        self.register_buffer("embed_scale", torch.tensor(cfg.hidden_size**0.5), persistent=False)
        self.rotary = LayerTypeRopes(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling,
                                     cfg.rope_local_theta)
        self.layers = nn.ModuleList(layer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids, positions, meta):
        x = self.embed_tokens(input_ids)
        x = x * self.embed_scale
        rope, rope_local = self.rotary.tables(positions)
        for layer in self.layers:
            x = layer(x, rope_local if layer.local_rope else rope, meta)
        return self.norm(x)


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 1, 2 and 3's language models."""

    decoder = GemmaModel

    def load_weights(self, weights, on_layer_loaded=None):
        """An image-text Gemma 3 checkpoint (Gemma3ForConditionalGeneration) holds the language model under
        language_model. (transformers >= 5 in memory: model.language_model.); the loader does not read its vision
        tower."""
        def language_model(weights):
            for name, tensor in weights:
                if name.startswith("model.language_model."):
                    name = "model." + name.removeprefix("model.language_model.")
                yield name.removeprefix("language_model."), tensor

        super().load_weights(language_model(weights), on_layer_loaded)

    def forward(self, input_ids, positions, meta, logits_index):
        logits = super().forward(input_ids, positions, meta, logits_index)
        cap = self.config.final_logit_softcapping
        return logits if not cap else torch.tanh(logits / cap) * cap
