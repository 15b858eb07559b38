"""GGUF files through the `gguf` package: metadata → ModelConfig, tensors → HF-named torch weights."""

from __future__ import annotations

import os
import re
import sys

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFValueType, LlamaFileType
from gguf.quants import dequantize

from llmserve.config import ModelConfig
from llmserve.errors import ModelLoadError, UnsupportedModelError
from llmserve.loader import ModelFiles
from llmserve.tokenizer import Tokenizer

# every type llama.cpp writes that the gguf package dequantizes (its legacy, K- and I-quants, ternary and MXFP4)
SUPPORTED_QUANTS = {Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K,
                    Q.Q6_K, Q.IQ1_S, Q.IQ1_M, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S, Q.IQ4_NL, Q.IQ4_XS,
                    Q.TQ1_0, Q.TQ2_0, Q.MXFP4}
SUPPORTED_ARCHS = {"llama": "llama", "granite": "llama", "qwen2": "qwen2", "qwen2moe": "qwen2", "qwen3": "qwen3",
                   "qwen3moe": "qwen3",
                   "phi3": "phi3", "smollm3": "smollm3", "olmo2": "olmo2", "gemma": "gemma", "gemma2": "gemma2", "gemma3": "gemma3"}
PERMUTED_ARCHS = ("llama", "smollm3")  # llama.cpp's converter interleaves their Q/K rows (unpermute_rotary)
GEMMA_ARCHS = ("gemma", "gemma2", "gemma3")

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
    "ffn_gate_inp": "mlp.gate",  # a mixture of experts' router
    # Qwen2-MoE's shared expert and its gate
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# A mixture of experts' expert tensors, all experts of a layer in one 3-D tensor ({} is the expert), or in older
# Mixtral files one 2-D tensor per expert (blk.N.ffn_gate.E)
_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_OLD_EXPERT = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)")
# Gemma 2 and 3's four norms a layer: ffn_norm is the one before its MLP, and two more follow the attention and the MLP
_GEMMA2_LAYER_NAMES = {**_LAYER_NAMES, "ffn_norm": "pre_feedforward_layernorm",
                       "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
# OLMo 2 and 3: no norm before a block, one after each (their q/k norms span every head)
_OLMO2_LAYER_NAMES = {**_LAYER_NAMES, "post_attention_norm": "post_attention_layernorm",
                      "post_ffw_norm": "post_feedforward_layernorm"}
# Phi-3's fused tensors, as in its Hugging Face checkpoints: q/k/v in one, gate and up in ffn_up (the model splits them)
_PHI3_LAYER_NAMES = {**_LAYER_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
GEMMA3_SLIDING_WINDOW_PATTERN = 6  # every sixth layer full: llama.cpp's, which older GGUF files do not record
GEMMA3_LOCAL_ROPE_BASE = 10_000.0  # the windowed layers' rope base: likewise fixed in llama.cpp
GEMMA2_SLIDING_WINDOW_PATTERN = 2  # Gemma 2: every other layer windowed, from the first (llama.cpp's, likewise)
SMOLLM3_NO_ROPE_STEP = 4  # SmolLM3: every fourth layer without rotary embeddings (llama.cpp's, likewise)


class PlainViewReader(GGUFReader):
    """The gguf package's reader, parsing from a plain ndarray view of its memory map, with arrays read whole. The
    package slices `data`, an np.memmap, once per value it reads, and every memmap slice runs memmap's
    __array_finalize__ in Python: the default model's vocabulary (49,152 tokens, their types, and 48,900 merges) is
    ~250,000 slices, 2.2 s of every start. Here a string array's lengths are read from the file's bytes in Python (two
    plain views per string, as the package's fields hold them) and a number array is one part (the whole array):
    0.1 s. Every field's contents() is the package's; tensors stay zero-copy views of the file."""

    def _plain(self) -> np.ndarray:
        plain = self.__dict__.get("_plain_data")
        if plain is None:
            plain = self._plain_data = self.data.view(np.ndarray)
        return plain

    def _get(self, offset, dtype, count=1, override_order=None):
        dtype, count = np.dtype(dtype), int(count)
        arr = self._plain()[offset:offset + dtype.itemsize * count].view(dtype)[:count]
        return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

    def _get_field_parts(self, orig_offs, raw_type):
        if GGUFValueType(raw_type) != GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        item_type = self._get(orig_offs, np.uint32)
        length = self._get(orig_offs + 4, np.uint64)
        offs, count = orig_offs + 12, int(length[0])
        sub = GGUFValueType(int(item_type[0]))
        types = [GGUFValueType.ARRAY] + ([sub] if count else [])
        parts: list[np.ndarray] = [item_type, length]
        if sub == GGUFValueType.STRING:
            plain, order = self._plain(), "big" if (self.byte_order == "S") == (sys.byteorder == "little") else "little"
            length_type = np.dtype(np.uint64).newbyteorder(self.byte_order)
            raw = memoryview(plain)
            for _ in range(count):
                n = int.from_bytes(raw[offs:offs + 8], order)
                parts += (plain[offs:offs + 8].view(length_type), plain[offs + 8:offs + 8 + n])
                offs += 8 + n
            return offs - orig_offs, parts, list(range(3, len(parts), 2)), types
        scalar = self.gguf_scalar_to_np.get(sub)
        if scalar is None:  # arrays of arrays: the package's way, item by item
            return super()._get_field_parts(orig_offs, raw_type)
        values = self._get(offs, scalar, count)
        return 12 + int(values.nbytes), parts + [values], [2] if count else [], types


def field_value(reader: GGUFReader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    base, _, suffix = gguf_name.rpartition(".")
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    layer_names = {"gemma2": _GEMMA2_LAYER_NAMES, "gemma3": _GEMMA2_LAYER_NAMES, "phi3": _PHI3_LAYER_NAMES,
                   "olmo2": _OLMO2_LAYER_NAMES}.get(arch, _LAYER_NAMES)
    if m and m.group(2) in layer_names:
        return f"model.layers.{m.group(1)}.{layer_names[m.group(2)]}.{suffix}"
    if m and m.group(2) in _EXPERT_NAMES:
        return f"model.layers.{m.group(1)}.mlp.experts.{{}}.{_EXPERT_NAMES[m.group(2)]}.{suffix}"
    old = _OLD_EXPERT.fullmatch(base)
    if old:
        return f"model.layers.{old.group(1)}.mlp.experts.{old.group(3)}.{old.group(2)}_proj.{suffix}"
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    return None


def window_layer_types(pattern, n_layers: int) -> list[str]:
    """Each layer's type from llama.cpp's sliding_window_pattern: a list (True where the layer is windowed) or a
    period n (every n-th layer full; Gemma 3's files leave it out for llama.cpp's fixed 6, Gemma 2's for 2)."""
    if isinstance(pattern, (list, tuple)):
        return ["sliding_attention" if windowed else "full_attention" for windowed in pattern]
    return ["full_attention" if (i + 1) % int(pattern) == 0 else "sliding_attention" for i in range(n_layers)]


def expert_names(name: str, tensor) -> list[str]:
    """The Hugging Face names a GGUF tensor stands for: one, or each expert's of a 3-D expert tensor."""
    return [name.format(e) for e in range(int(tensor.shape[2]))] if "{}" in name else [name]


def _dequantized(tensor) -> np.ndarray:
    return dequantize(tensor.data, tensor.tensor_type)


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
    n_layers = int(meta("block_count"))
    scaling = None
    context = int(meta("context_length", 2048))
    if meta("rope.scaling.type") == "linear" and meta("rope.scaling.factor"):
        scaling = {"rope_type": "linear", "factor": float(meta("rope.scaling.factor"))}
    elif meta("rope.scaling.type") == "yarn":  # as a Hugging Face config's (hf.yarn), from llama.cpp's keys
        from llmserve.loader.hf import yarn

        scaling, context = yarn({"factor": meta("rope.scaling.factor"),
                                 "original_max_position_embeddings": meta("rope.scaling.original_context_length"),
                                 "beta_fast": meta("rope.scaling.yarn_beta_fast"),
                                 "beta_slow": meta("rope.scaling.yarn_beta_slow")}, context)
    gemma = {}
    if arch in GEMMA_ARCHS:
        gemma = dict(hidden_activation="gelu_pytorch_tanh", final_logit_softcapping=meta("final_logit_softcapping"),
                     attn_logit_softcapping=meta("attn_logit_softcapping"))
    if arch in ("gemma2", "gemma3"):
        window = meta("attention.sliding_window")
        default = GEMMA2_SLIDING_WINDOW_PATTERN if arch == "gemma2" else GEMMA3_SLIDING_WINDOW_PATTERN
        gemma.update(
            sliding_window=int(window) if window else None,
            layer_types=window_layer_types(meta("attention.sliding_window_pattern", default), n_layers),
            # llama.cpp scales the 27B models' queries (Gemma 2's 46 layers, Gemma 3's 62) by hidden / heads, every
            # other size's by head_dim, as their query_pre_attn_scalar says
            query_pre_attn_scalar=hidden / n_heads if n_layers == (46 if arch == "gemma2" else 62) else head_dim)
    if arch == "gemma3":
        gemma.update(rope_local_theta=GEMMA3_LOCAL_ROPE_BASE)
    moe = {}
    if meta("expert_count"):  # Mixtral (llama), Qwen2/3-MoE: every layer's MLP a mixture of experts
        moe = dict(num_experts=int(meta("expert_count")), num_experts_per_tok=int(meta("expert_used_count")),
                   moe_intermediate_size=int(meta("expert_feed_forward_length") or meta("feed_forward_length")),
                   # llama.cpp renormalizes Mixtral's and Qwen3-MoE's picked weights, not Qwen2-MoE's; a file may say
                   norm_topk_prob=bool(meta("expert_weights_norm", arch != "qwen2moe")),
                   shared_expert_intermediate_size=int(meta("expert_shared_feed_forward_length") or 0))
    olmo = {}
    pattern = meta("attention.sliding_window_pattern")
    if arch == "olmo2" and meta("attention.sliding_window") and pattern:  # OLMo 3
        olmo = dict(sliding_window=int(meta("attention.sliding_window")),
                    layer_types=window_layer_types(pattern, n_layers),
                    rope_local_theta=float(meta("rope.freq_base", 10000.0)))  # unscaled, as transformers rotates them
    phi3 = {}
    if arch == "phi3":
        window = meta("attention.sliding_window")  # 0 in Phi-4's files: no window
        phi3 = dict(sliding_window=int(window) if window else None)
        factors = {t.name: t for t in reader.tensors
                   if t.name in ("rope_factors_long.weight", "rope_factors_short.weight")}
        if factors:  # LongRoPE (the 128k models): served as from a Hugging Face config (hf.longrope)
            from llmserve.loader.hf import longrope

            original = meta("rope.scaling.original_context_length")
            rope = {"rope_type": "longrope", "original_max_position_embeddings": original,
                    **{f"{kind}_factor": _dequantized(factors[f"rope_factors_{kind}.weight"]).tolist()
                       for kind in ("long", "short") if f"rope_factors_{kind}.weight" in factors}}
            if meta("rope.scaling.attn_factor") is not None:
                rope["attention_factor"] = float(meta("rope.scaling.attn_factor"))
            scaling, context = longrope({}, rope, context)
    return ModelConfig(
        architecture=SUPPORTED_ARCHS[arch],
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(meta("feed_forward_length") or meta("expert_feed_forward_length")),
        num_hidden_layers=n_layers,
        num_attention_heads=n_heads,
        num_key_value_heads=int(n_kv),
        head_dim=head_dim,
        max_position_embeddings=context,
        no_rope_layers=[i for i in range(n_layers) if (i + 1) % SMOLLM3_NO_ROPE_STEP == 0] if arch == "smollm3" else [],
        # the dimensions of each head that rotate (Phi's partial rotary); a file without the key rotates all
        rotary_dim=int(meta("rope.dimension_count", head_dim)),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        attention_bias="blk.0.attn_q.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=field_value(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=[int(e) for e in eos if e is not None],
        quantization=quant,
        num_parameters=int(sum(int(np.prod(t.shape)) for t in reader.tensors if not t.name.startswith("rope_"))),
        weight_file_bytes=int(sum(t.n_bytes for t in reader.tensors)),
        weight_formats={name: t.tensor_type.name for t in reader.tensors if len(t.shape) >= 2 and hf_name(t.name, arch)
                        for name in expert_names(hf_name(t.name, arch), t)},
        **gemma,
        **phi3,
        **moe,
        **olmo,
        # Granite's scales (llama.cpp's names)
        embedding_multiplier=float(meta("embedding_scale", 1.0)),
        residual_multiplier=float(meta("residual_scale", 1.0)),
        attention_multiplier=float(meta("attention.scale")) if meta("attention.scale") is not None else None,
        logits_scaling=float(meta("logit_scale", 1.0)),
    )


def load_gguf(path: str, load_tokenizer: bool = True) -> ModelFiles:
    try:
        reader = PlainViewReader(path)
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
        config.rope_scaling = {"rope_type": "gguf_freq_factors", "factors": _dequantized(rope_freqs).tolist()}

    def weights():
        for t in reader.tensors:
            name = hf_name(t.name, config.architecture)
            if name is None:
                continue
            # an expert tensor one expert at a time: its slice dequantized, so that the whole layer's float32 copy is
            # never held (a large MoE's layer holds 100+ experts)
            parts = zip(expert_names(name, t), t.data) if "{}" in name else [(name, t.data)]
            for part_name, data in parts:
                yield from tensor_weights(part_name, data, t.tensor_type)

    def tensor_weights(name: str, data: np.ndarray, qtype):
        """The HF-named weight of one tensor's raw data, after (for a 4-bit type) its grid and codes."""
        import torch  # here: the config and tokenizer alone (bench, plan) need no torch

        from llmserve.layers.linear import INT4_PARAMS
        from llmserve.loader.gguf_blocks import Int4Blocks, decode

        int4 = Int4Blocks.read(data, qtype)
        w = int4.weight() if int4 is not None else decode(data, qtype)
        if w is None:  # the other types: the package's decoding
            w = dequantize(data, qtype).astype(np.float32, copy=False)
            w = torch.from_numpy(w if w.flags.writeable else w.copy())  # F32 tensors are views of the read-only file
        if name.endswith("shared_expert_gate.weight") and w.ndim == 1:  # llama.cpp's is a vector: one output
            w = w.reshape(1, -1)
        if config.architecture in GEMMA_ARCHS and name.endswith("norm.weight"):
            w = w - 1  # stored as the multiplier, 1 + the checkpoint's weight (GemmaRMSNorm holds the latter)
        heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}.get(
            name.rsplit(".", 2)[-2]) if config.architecture in PERMUTED_ARCHS else None
        if heads:
            w = unpermute_rotary(w, heads)
        if int4 is not None and not name.startswith(("model.embed_tokens", "lm_head")):
            layer = name.removesuffix(".weight")  # before the weight: the layer may be quantized as soon as it is in
            for param, part in zip(INT4_PARAMS, (int4.scale, int4.offset, int4.codes)):
                yield f"{layer}.{param}", unpermute_rotary(part, heads) if heads else part
        yield name, w.contiguous()

    tokenizer = None
    if load_tokenizer:
        tokenizer = Tokenizer.from_gguf_metadata(lambda key, default=None: field_value(reader, key, default), config)
    return ModelFiles(path=path, name=os.path.basename(path).removesuffix(".gguf"), config=config, weights=weights, tokenizer=tokenizer)
