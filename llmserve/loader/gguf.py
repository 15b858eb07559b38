"""GGUF files through the `gguf` package: metadata → ModelConfig, tensors → HF-named torch weights."""

from __future__ import annotations

import os
import re

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, LlamaFileType
from gguf.quants import dequantize

from llmserve.config import ModelConfig
from llmserve.errors import ModelLoadError, UnsupportedModelError
from llmserve.loader import ModelFiles
from llmserve.tokenizer import Tokenizer

SUPPORTED_QUANTS = {Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q6_K}
SUPPORTED_ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def field_value(reader: GGUFReader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def hf_name(gguf_name: str) -> str | None:
    base, _, suffix = gguf_name.rpartition(".")
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{suffix}"
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    return None


def unpermute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter interleaves each head's rotary halves in Q/K rows; restore HF's order."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_config(reader: GGUFReader, path: str) -> ModelConfig:
    arch = field_value(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise UnsupportedModelError(
            f"unsupported architecture {arch!r} in {os.path.basename(path)}; supported: {', '.join(SUPPORTED_ARCHS)}",
            "model",
        )

    def meta(key, default=None):
        return field_value(reader, f"{arch}.{key}", default)

    n_heads = int(meta("attention.head_count"))
    n_kv = meta("attention.head_count_kv", n_heads)
    hidden = int(meta("embedding_length"))
    head_dim = int(meta("attention.key_length", hidden // n_heads))
    names = {t.name for t in reader.tensors}
    eos = [field_value(reader, "tokenizer.ggml.eos_token_id")]
    eot = field_value(reader, "tokenizer.ggml.eot_token_id")
    if eot is not None and eot not in eos:
        eos.append(eot)
    file_type = field_value(reader, "general.file_type")
    try:
        quant = LlamaFileType(file_type).name.removeprefix("MOSTLY_") if file_type is not None else "unknown"
    except ValueError:
        quant = f"file_type {file_type}"
    vocab = meta("vocab_size") or len(field_value(reader, "tokenizer.ggml.tokens", []))
    return ModelConfig(
        architecture=SUPPORTED_ARCHS[arch],
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(meta("feed_forward_length")),
        num_hidden_layers=int(meta("block_count")),
        num_attention_heads=n_heads,
        num_key_value_heads=int(n_kv),
        head_dim=head_dim,
        max_position_embeddings=int(meta("context_length", 2048)),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        attention_bias="blk.0.attn_q.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=field_value(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=[int(e) for e in eos if e is not None],
        quantization=quant,
        num_parameters=int(sum(int(np.prod(t.shape)) for t in reader.tensors if t.name != "rope_freqs.weight")),
        weight_file_bytes=int(sum(t.n_bytes for t in reader.tensors)),
    )


def load_gguf(path: str, load_tokenizer: bool = True) -> ModelFiles:
    try:
        reader = GGUFReader(path)
    except Exception as e:  # the gguf package raises bare ValueErrors on damaged files
        raise ModelLoadError(f"cannot read GGUF file {path}: {e}", "model") from e
    config = read_config(reader, path)
    for t in reader.tensors:
        if t.tensor_type not in SUPPORTED_QUANTS:
            raise UnsupportedModelError(
                f"unsupported quantization {t.tensor_type.name} (tensor {t.name}); "
                f"supported: {', '.join(sorted(q.name for q in SUPPORTED_QUANTS))}",
                "model",
            )
    if "rope_freqs.weight" in {t.name for t in reader.tensors}:
        rope_freqs = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
        config.rope_scaling = {"rope_type": "gguf_freq_factors", "factors": dequantize(rope_freqs.data, rope_freqs.tensor_type).tolist()}

    def weights():
        import torch  # here: the config and tokenizer alone (bench, plan) need no torch

        for t in reader.tensors:
            name = hf_name(t.name)
            if name is None:
                continue
            w = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
            if config.architecture == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
                w = unpermute_rotary(w, config.num_attention_heads)
            elif config.architecture == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
                w = unpermute_rotary(w, config.num_key_value_heads)
            if not w.flags.writeable:  # F32 tensors are views of the read-only memory map
                w = w.copy()
            yield name, torch.from_numpy(np.ascontiguousarray(w))

    tokenizer = None
    if load_tokenizer:
        tokenizer = Tokenizer.from_gguf_metadata(lambda key, default=None: field_value(reader, key, default), config)
    return ModelFiles(path=path, name=os.path.basename(path).removesuffix(".gguf"), config=config, weights=weights, tokenizer=tokenizer)
