"""GGUF files written the way llama.cpp's converter writes them, from tiny transformers models and SentencePiece
vocabularies trained here: llama's Q/K rows permuted, Gemma's norm weights stored plus one, Phi-3's fused tensors and
LongRoPE factors, the vocabulary's pieces, scores and types in tokenizer.ggml.*."""

from __future__ import annotations

import math
import os

import gguf
import numpy as np
import sentencepiece as spm

CORPUS_FILES = ("README.md", "docs/architecture.md", "docs/server.md", "docs/sampling.md")
USER_SYMBOLS = ["<start_of_turn>", "<end_of_turn>"]


def train_sentencepiece(folder, add_dummy_prefix: bool, vocab_size: int = 700) -> spm.SentencePieceProcessor:
    """A SentencePiece BPE model with byte fallback and no normalization (as Llama's, Mistral's and Gemma's are),
    trained on this repository's docs."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    lines = []
    for name in CORPUS_FILES:
        with open(os.path.join(root, name), encoding="utf-8") as f:
            lines += [line for line in f.read().splitlines() if line.strip()]
    prefix = os.path.join(str(folder), f"spm_{int(add_dummy_prefix)}")
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=prefix, vocab_size=vocab_size,
                                   model_type="bpe", byte_fallback=True, normalization_rule_name="identity",
                                   add_dummy_prefix=add_dummy_prefix, remove_extra_whitespaces=False,
                                   split_digits=True, user_defined_symbols=USER_SYMBOLS, unk_id=0, bos_id=1, eos_id=2,
                                   pad_id=3, minloglevel=2)
    return spm.SentencePieceProcessor(model_file=prefix + ".model")


def token_type(sp: spm.SentencePieceProcessor, i: int) -> int:
    if sp.is_unknown(i):
        return gguf.TokenType.UNKNOWN
    if sp.is_control(i):
        return gguf.TokenType.CONTROL
    if sp.is_byte(i):
        return gguf.TokenType.BYTE
    if sp.id_to_piece(i) in USER_SYMBOLS:
        return gguf.TokenType.USER_DEFINED
    return gguf.TokenType.NORMAL


def add_sentencepiece_vocab(writer: gguf.GGUFWriter, sp: spm.SentencePieceProcessor, add_space_prefix: bool,
                            eot: str | None = None) -> None:
    n = sp.get_piece_size()
    writer.add_tokenizer_model("llama")
    writer.add_token_list([sp.id_to_piece(i) for i in range(n)])
    writer.add_token_scores([sp.get_score(i) for i in range(n)])
    writer.add_token_types([int(token_type(sp, i)) for i in range(n)])
    writer.add_unk_token_id(sp.unk_id())
    writer.add_bos_token_id(sp.bos_id())
    writer.add_eos_token_id(sp.eos_id())
    if eot is not None:
        writer.add_eot_token_id(sp.piece_to_id(eot))
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(add_space_prefix)


def permute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's interleaving of each head's rotary halves in Q/K rows (the loader undoes it)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


LAYER_PARTS = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
               "input_layernorm": "attn_norm"}
LLAMA_PARTS = {**LAYER_PARTS, "post_attention_layernorm": "ffn_norm", "mlp.gate": "ffn_gate_inp",
               "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
               "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}
OLMO2_PARTS = {**LAYER_PARTS, "post_attention_layernorm": "post_attention_norm",
               "post_feedforward_layernorm": "post_ffw_norm"}
PHI3_PARTS = {**LLAMA_PARTS, "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}  # kept fused
GEMMA2_PARTS = {**LAYER_PARTS, "post_attention_layernorm": "post_attention_norm",
                "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}


def gguf_tensors(state: dict, arch: str, heads: int, kv_heads: int) -> dict[str, np.ndarray]:
    parts = {"gemma2": GEMMA2_PARTS, "gemma3": GEMMA2_PARTS, "phi3": PHI3_PARTS,
             "olmo2": OLMO2_PARTS}.get(arch, LLAMA_PARTS)
    out = {}
    for name, tensor in state.items():
        w = tensor.float().numpy()
        if name == "model.embed_tokens.weight":
            key = "token_embd.weight"
        elif name == "model.norm.weight":
            key = "output_norm.weight"
        elif name == "lm_head.weight":
            key = "output.weight"
        elif ".mlp.experts." in name:  # transformers holds a layer's experts as 3-D tensors, gate and up together
            layer = name.split(".")[2]
            if name.endswith("gate_up_proj"):
                gate, up = np.split(w, 2, axis=1)
                experts = {"gate": gate, "up": up}
            else:
                experts = {"down": w}
            for proj, stacked in experts.items():
                if arch == "llama":  # Mixtral as older files hold it: a 2-D tensor per expert
                    out.update({f"blk.{layer}.ffn_{proj}.{e}.weight": np.ascontiguousarray(stacked[e])
                                for e in range(len(stacked))})
                else:  # qwen3moe: all of a layer's experts in one 3-D tensor
                    out[f"blk.{layer}.ffn_{proj}_exps.weight"] = np.ascontiguousarray(stacked)
            continue
        else:
            _, _, layer, rest = name.split(".", 3)
            module, param = rest.rsplit(".", 1)
            key = f"blk.{layer}.{parts[module]}.{param}"
            if arch in ("llama", "smollm3", "granite") and module == "self_attn.q_proj":
                w = permute_rotary(w, heads)
            elif arch in ("llama", "smollm3", "granite") and module == "self_attn.k_proj":
                w = permute_rotary(w, kv_heads)
        if key.endswith("ffn_gate_inp_shexp.weight"):  # llama.cpp holds the shared expert's gate as a vector
            w = w.reshape(-1)
        if arch.startswith("gemma") and key.endswith("norm.weight"):
            w = w + 1  # Gemma's converter stores each norm's weight as the multiplier itself, 1 + w
        out[key] = np.ascontiguousarray(w, dtype=np.float32)
    return out


def write_gguf(path, model, sp: spm.SentencePieceProcessor | None = None, add_space_prefix: bool = True,
               quant: gguf.GGMLQuantizationType | None = None, extra=None) -> str:
    """A GGUF file of a transformers Llama or Gemma (1, 2, 3) model (its tied LM head left out, as the converter
    does), with a SentencePiece vocabulary; quant: the linear layers' type (the norms and embeddings stay F32)."""
    cfg = model.config
    families = ("gemma3", "gemma2", "gemma", "phi3", "smollm3", "granite")
    arch = "olmo2" if cfg.model_type in ("olmo2", "olmo3") else next(
        (a for a in families if cfg.model_type.startswith(a)),
        {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe"}.get(cfg.model_type, "llama"))  # (Mixtral: llama)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    if arch == "gemma3":
        writer.add_rope_freq_base(cfg.rope_parameters["full_attention"]["rope_theta"])
        writer.add_sliding_window(cfg.sliding_window)
    else:  # (OLMo 3 nests them by layer type, its full layers' first)
        writer.add_rope_freq_base(cfg.rope_parameters.get("full_attention", cfg.rope_parameters)["rope_theta"])
        if cfg.rope_parameters.get("rope_type") == "yarn":  # as llama.cpp's converter writes YaRN
            writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            writer.add_rope_scaling_factor(cfg.rope_parameters["factor"])
            writer.add_rope_scaling_orig_ctx_len(cfg.rope_parameters["original_max_position_embeddings"])
    if arch == "phi3":  # as llama.cpp's converter writes Phi-3: rotary dimensions per head, window (0: none), LongRoPE
        rope = cfg.rope_parameters
        writer.add_rope_dimension_count(int(head_dim * (getattr(cfg, "partial_rotary_factor", None) or 1.0)))
        writer.add_sliding_window(cfg.sliding_window or 0)
        if rope.get("rope_type") == "longrope":
            writer.add_rope_scaling_orig_ctx_len(cfg.original_max_position_embeddings)
            scale = cfg.max_position_embeddings / cfg.original_max_position_embeddings
            writer.add_rope_scaling_attn_factors(
                math.sqrt(1 + math.log(scale) / math.log(cfg.original_max_position_embeddings)) if scale > 1 else 1.0)
            writer.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32))
            writer.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32))
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        if arch in ("qwen3moe", "qwen2moe"):
            writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        if arch == "qwen2moe":
            writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if cfg.model_type == "olmo3":  # as llama.cpp's converter writes OLMo 3's windows
        writer.add_sliding_window(cfg.sliding_window)
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
    if arch == "granite":  # as llama.cpp's converter writes Granite's scales
        writer.add_float32("granite.embedding_scale", cfg.embedding_multiplier)
        writer.add_float32("granite.residual_scale", cfg.residual_multiplier)
        writer.add_float32("granite.attention.scale", cfg.attention_multiplier)
        writer.add_float32("granite.logit_scale", cfg.logits_scaling)
    if arch == "gemma2":  # as llama.cpp's converter writes them
        writer.add_sliding_window(cfg.sliding_window)
        writer.add_float32(f"{arch}.attn_logit_softcapping", cfg.attn_logit_softcapping)
        writer.add_float32(f"{arch}.final_logit_softcapping", cfg.final_logit_softcapping)
    (extra or (lambda w: None))(writer)
    if sp is not None:
        add_sentencepiece_vocab(writer, sp, add_space_prefix, "<end_of_turn>" if arch.startswith("gemma") else None)
    state = {k: v for k, v in model.state_dict().items()
             if not (k == "lm_head.weight" and cfg.tie_word_embeddings)}
    for key, w in gguf_tensors(state, arch, cfg.num_attention_heads, cfg.num_key_value_heads).items():
        # (llama.cpp keeps a router, ffn_gate_inp, in float)
        if quant is not None and w.ndim >= 2 and key != "token_embd.weight" and "ffn_gate_inp" not in key:
            writer.add_tensor(key, gguf.quants.quantize(w, quant), raw_dtype=quant)
        else:
            writer.add_tensor(key, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def write_quantized_gguf(path, model, sp, quant: gguf.GGMLQuantizationType, **kw) -> str:
    """write_gguf with the linear layers (and experts) in `quant`, and the model's own weights set to what the file's
    codes stand for (the reference for the file; embeddings, norms and routers stay as they are, as in the file)."""
    import torch

    path = write_gguf(path, model, sp, quant=quant, **kw)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2 and "embed_tokens" not in name and not name.endswith("mlp.gate.weight"):
                p.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(p.numpy(), quant), quant)))
    return path


def write_truncated_gguf(path, source: str, num_layers: int) -> str:
    """A copy of the GGUF file `source` (the default model) with only its first num_layers layers: the same vocabulary,
    chat template, shapes and quantization types, its tensors' bytes as they are. For tests of what the default model
    runs whose cost grows with its depth (compiling its graphs), at a tenth of it."""
    from llmserve.loader.gguf import PlainViewReader  # the package's reader, faster (test_gguf_models checks it)

    reader = PlainViewReader(source)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(path), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":  # the writer's own
            continue
        value = num_layers if name == f"{arch}.block_count" else field.contents()
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, value, field.types[0], sub_type)
    for t in reader.tensors:
        if t.name.startswith("blk.") and int(t.name.split(".")[1]) >= num_layers:
            continue
        writer.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)
