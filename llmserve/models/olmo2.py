"""OLMo 2 and OLMo 3 (AI2's open models; transformers' Olmo2ForCausalLM, Olmo3ForCausalLM): Llama's projections and
MLP in another layout:
- no norm before a block: each block's output is normed (post_attention_layernorm, post_feedforward_layernorm) and
  then added to the stream;
- the q and k norms run over the whole projection (every head together) before the heads are split and rotated;
- OLMo 3 windows the layers its config lists (sliding_window, layer_types), as any model here, and those layers
  rotate with their own, unscaled rope (rope_local_theta), the full ones with the config's scaling.
"""

from __future__ import annotations

import torch
from torch import nn

from llmserve.attention.backend import AttentionMetadata
from llmserve.config import ModelConfig
from llmserve.distributed.parallel_state import tp_size
from llmserve.errors import UnsupportedModelError
from llmserve.layers.mlp import SwiGLUMLP
from llmserve.layers.norm import RMSNorm
from llmserve.layers.rotary import LayerTypeRopes, RotaryEmbedding
from llmserve.layers.vocab_parallel import VocabParallelEmbedding
from llmserve.models.llama import LlamaAttention, LlamaForCausalLM


class Olmo2Attention(LlamaAttention):
    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__(cfg, index)
        if tp_size() > 1:  # the norms' mean runs over every head, which the ranks would split
            raise UnsupportedModelError("OLMo 2's q/k norms span every head: tensor parallelism is not supported for "
                                        "it", "tensor_parallel_size")
        self.q_norm = RMSNorm(self.num_heads * self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.num_kv_heads * self.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope, meta: AttentionMetadata) -> torch.Tensor:
        T, d = x.shape[0], self.head_dim
        q_width, kv_width = self.num_heads * d, self.num_kv_heads * d
        qkv = self.qkv_proj(x)
        q = RotaryEmbedding.apply(self.q_norm(qkv[:, :q_width]).view(T, self.num_heads, d), rope)
        k = RotaryEmbedding.apply(self.k_norm(qkv[:, q_width:q_width + kv_width]).view(T, self.num_kv_heads, d), rope)
        v = qkv[:, q_width + kv_width:].view(T, self.num_kv_heads, d)
        return self.o_proj(self.attn(q, k, v, meta).reshape(T, -1))


class Olmo2DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        self.self_attn = Olmo2Attention(cfg, index)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.local_rope = (cfg.rope_local_theta is not None and bool(cfg.layer_types)
                           and cfg.layer_types[index] == "sliding_attention")

    def forward(self, x: torch.Tensor, rope, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(x, rope, meta))
        return x + self.post_feedforward_layernorm(self.mlp(x))


class Olmo2Model(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary = LayerTypeRopes(cfg.rotary_dim or cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                     cfg.rope_scaling, cfg.rope_local_theta)
        self.layers = nn.ModuleList(Olmo2DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids, positions, meta):
        x = self.embed_tokens(input_ids)
        rope, rope_local = self.rotary.tables(positions)
        for layer in self.layers:
            x = layer(x, rope_local if layer.local_rope else rope, meta)
        return self.norm(x)


class Olmo2ForCausalLM(LlamaForCausalLM):
    decoder = Olmo2Model
