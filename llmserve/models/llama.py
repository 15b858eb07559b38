"""Llama-family decoder (Llama 2/3.x, SmolLM, Mistral, Qwen2, Qwen3, Phi-3/Phi-4; Mixtral and Qwen3-MoE with a sparse
MLP) over the paged KV cache."""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn

from llmserve.config import ModelConfig
from llmserve.attention.backend import AttentionMetadata
from llmserve.distributed.parallel_state import head_ranges
from llmserve.layers.attention import PagedAttention
from llmserve.layers.linear import INT4_PARAMS, LinearBase, QKVParallelLinear, RowParallelLinear
from llmserve.layers.mlp import SwiGLUMLP
from llmserve.layers.moe import SparseMoeBlock
from llmserve.layers.norm import RMSNorm
from llmserve.layers.rotary import RotaryEmbedding
from llmserve.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int = 0, qk_norm: type[nn.Module] = RMSNorm):
        """index: the layer's (for its sliding window, if any); qk_norm: the q/k norm's class where cfg.qk_norm
        (Qwen3's RMSNorm, Gemma's)."""
        super().__init__()
        # this rank's heads: query and KV heads are split across tensor-parallel ranks, by whole GQA groups
        q_heads, kv_heads = head_ranges(cfg.num_attention_heads, cfg.num_key_value_heads)
        self.num_heads, self.num_kv_heads = len(q_heads), len(kv_heads)
        self.head_dim = cfg.head_dim
        # Queries and keys meet in exponentiated scores: int8 inputs here (w4a8) cost ~3 % perplexity on the default
        # model, where rounding only the other projections' inputs moves it by under 1 % (docs/performance.md).
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads,
                                          cfg.num_key_value_heads, bias=cfg.attention_bias, int8_activations=False)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size,
                                        input_range=range(q_heads.start * cfg.head_dim, q_heads.stop * cfg.head_dim))
        self.q_norm = qk_norm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = qk_norm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, cfg.attention_scale,
                                   cfg.layer_sliding_window(index), cfg.attn_logit_softcapping or 0.0)
        # Set by the platform where a fused kernel rotates the queries and keys in place (one launch instead of ~7);
        # it rotates whole heads
        self.rotary_op = None
        self.full_rotary = cfg.rotary_dim in (0, cfg.head_dim)
        self.rotates = index not in cfg.no_rope_layers  # SmolLM3's NoPE layers: positions from the causal mask alone

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        T, hq, hkv = x.shape[0], self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).view(T, hq + 2 * hkv, self.head_dim)
        if not self.rotates:
            q, k = qkv[:, :hq], qkv[:, hq : hq + hkv]
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
        elif self.q_norm is None and self.rotary_op is not None and self.full_rotary and not torch.compiler.is_compiling():
            self.rotary_op(qkv[:, : hq + hkv], rope)
            q, k = qkv[:, :hq], qkv[:, hq : hq + hkv]
        elif self.q_norm is None:
            qk = RotaryEmbedding.apply(qkv[:, : hq + hkv], rope)
            q, k = qk[:, :hq], qk[:, hq:]
        else:
            q = RotaryEmbedding.apply(self.q_norm(qkv[:, :hq]), rope)
            k = RotaryEmbedding.apply(self.k_norm(qkv[:, hq : hq + hkv]), rope)
        v = qkv[:, hq + hkv :]
        return self.o_proj(self.attn(q, k, v, meta).reshape(T, -1))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, index)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.is_moe_layer(index):  # Mixtral, Qwen3-MoE: the same decoder with a sparse MLP
            self.mlp = SparseMoeBlock(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts,
                                      cfg.num_experts_per_tok, cfg.norm_topk_prob, cfg.shared_expert_intermediate_size)
        else:
            self.mlp = SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size)
        self.residual_multiplier = cfg.residual_multiplier  # Granite's; 1 elsewhere

    def forward(self, x, residual, rope, meta):
        """x: the previous layer's MLP output, residual: the stream it adds to (None for the first layer). Returns
        this layer's MLP output and the stream, so that each residual add happens inside the next norm (one fused
        kernel where the platform has one); the sums are the same as x + attn(norm(x)), x + mlp(norm(x))."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        if self.residual_multiplier != 1.0:  # Granite: each block's output scaled before its residual add
            x, residual = self.post_attention_layernorm(self.self_attn(x, rope, meta) * self.residual_multiplier,
                                                        residual)
            return self.mlp(x) * self.residual_multiplier, residual
        x, residual = self.post_attention_layernorm(self.self_attn(x, rope, meta), residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary = RotaryEmbedding(cfg.rotary_dim or cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                      cfg.rope_scaling)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.embedding_multiplier = cfg.embedding_multiplier  # Granite's; 1 elsewhere

    def forward(self, input_ids, positions, meta):
        x = self.embed_tokens(input_ids)
        if self.embedding_multiplier != 1.0:
            x = x * self.embedding_multiplier
        rope = self.rotary.table(positions)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, rope, meta)
        return self.norm(x, residual)[0]


class LlamaForCausalLM(nn.Module):
    decoder = LlamaModel  # the stack under the LM head (models/gemma.py has its own)
    # HF checkpoint name part → (our merged module part, shard index)
    stacked = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    # Mixtral's names for its MoE block and experts' projections
    renamed = {".block_sparse_moe.": ".mlp.", ".w1.": ".gate_proj.", ".w3.": ".up_proj.", ".w2.": ".down_proj."}

    def fused_parts(self, leaf: str) -> list[int] | None:
        """The rows of each part of a checkpoint tensor that holds a merged layer whole (Phi-3's qkv_proj and
        gate_up_proj): q, k, v or gate, up, unsplit."""
        c = self.config
        if leaf == "qkv_proj":
            return [c.num_attention_heads * c.head_dim] + [c.num_key_value_heads * c.head_dim] * 2
        if leaf == "gate_up_proj":
            return [c.intermediate_size] * 2
        return None

    def __init__(self, cfg: ModelConfig, lm_head: bool = True):
        """lm_head=False: an embedding model (--runner pooling), which reads the last layer's hidden states only; a
        checkpoint's LM head is then not loaded (for an untied one, as many parameters as the embeddings)."""
        super().__init__()
        self.config = cfg
        self.model = self.decoder(cfg)
        self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size) if lm_head else None
        if cfg.tie_word_embeddings and lm_head:
            self.lm_head.weight = self.model.embed_tokens.weight
        # a sequence classifier's head (transformers' name), whole on every rank: a few rows, read for one token each
        self.score = nn.Linear(cfg.hidden_size, cfg.num_labels, bias=False) if cfg.num_labels else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, logits_index: torch.Tensor) -> torch.Tensor:
        """Returns logits only for the rows in `logits_index` (the tokens that get sampled), in the model's dtype:
        the model runner widens them to float32, into memory it keeps across steps where they are large."""
        hidden = self.model(input_ids, positions, meta)
        logits = self.lm_head(hidden[logits_index])
        return logits if self.config.logits_scaling == 1.0 else logits / self.config.logits_scaling

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Every token's last-layer hidden state, after the final norm (what an embedding model pools)."""
        return self.model(input_ids, positions, meta)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]],
                     on_layer_loaded: Callable[[str, LinearBase], None] | None = None) -> None:
        """on_layer_loaded(name, layer): called once a linear layer has every part (each shard's weight and bias),
        so that it can be quantized or narrowed while the rest loads."""
        modules = dict(self.named_modules())
        loaded = set()
        missing_parts: dict[str, set] = {}
        for name, tensor in weights:
            if "rotary_emb" in name or (name == "lm_head.weight" and (self.config.tie_word_embeddings
                                                                      or self.lm_head is None)):
                continue
            if not name.startswith(("model.", "lm_head.", "score.")):  # a bare decoder's (LlamaModel): no prefix
                name = "model." + name
            if ".block_sparse_moe." in name:
                for theirs, ours in self.renamed.items():
                    name = name.replace(theirs, ours)
            module_path, param = name.rsplit(".", 1)
            parent, _, leaf = module_path.rpartition(".")
            shards = [(0, tensor)]
            if leaf in self.stacked:
                leaf, shard = self.stacked[leaf]
                module_path = f"{parent}.{leaf}"
                shards = [(shard, tensor)]
            elif self.fused_parts(leaf) and param in ("weight", "bias", *INT4_PARAMS):  # every part at once
                shards = list(enumerate(tensor.split(self.fused_parts(leaf))))
            module = modules.get(module_path)
            if module is None:
                raise ValueError(f"unexpected weight {name}")
            with torch.no_grad():
                for shard, part in shards:
                    if not isinstance(module, (LinearBase, VocabParallelEmbedding)):
                        getattr(module, param).data.copy_(part)
                        continue
                    module.load(param, part, shard)  # this rank's slice
                    if on_layer_loaded is not None and isinstance(module, LinearBase) and param in ("weight", "bias"):
                        parts = missing_parts.setdefault(module_path, module.parts())
                        parts.discard((param, shard))
                        if not parts:
                            on_layer_loaded(module_path, module)
            loaded.add(f"{module_path}.{param}")
        expected = {n for n, _ in self.named_parameters()}
        missing = expected - loaded
        if missing:
            raise ValueError(f"weights missing from the checkpoint: {sorted(missing)[:5]}")
