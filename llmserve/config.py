"""Typed configuration, validated once where it enters (CLI, Python API, server)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from llmserve.errors import InvalidRequestError

if TYPE_CHECKING:  # torch is imported where a dtype is used: the CLI's parsing, the gateway and bench need no torch
    import torch


@dataclass
class ModelConfig:
    """Architecture of a decoder-only transformer, read from config.json or GGUF metadata."""

    # "llama" (also Mistral, Granite), "qwen2", "qwen3", "phi3", "smollm3", "gemma", "gemma2", "gemma3", "olmo2"
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    rotary_dim: int = 0  # the dimensions of each head that rotate (Phi's partial_rotary_factor); 0: all of head_dim
    no_rope_layers: list[int] = field(default_factory=list)  # layers that do not rotate at all (SmolLM3's NoPE ones)
    # Granite's scales: the embeddings times embedding_multiplier, each block's output times residual_multiplier before
    # its residual add, attention scores times attention_multiplier (instead of head_dim ** -0.5), logits divided by
    # logits_scaling
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    attention_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    quantization: str = "none"  # e.g. "Q4_1" for a GGUF file, "bf16" for safetensors, "GPTQ int4 (group 128)"
    # A pre-quantized checkpoint whose 4-bit codes llmserve's int4 kernel holds as they are (loader/quantized.py).
    checkpoint_int4_codes: bool = False
    # Each linear weight's format in the checkpoint, by Hugging Face name (a GGUF file's tensor types, e.g.
    # {"model.layers.0.mlp.down_proj.weight": "Q6_K"}): what --decode-quantization auto keeps on CPU
    weight_formats: dict[str, str] = field(default_factory=dict)
    num_parameters: int = 0
    weight_file_bytes: int = 0
    # Sliding-window attention (Mistral v0.1, Gemma 3, Qwen2 with use_sliding_window): a windowed layer's query at
    # position p reads only the keys at p - sliding_window + 1 .. p. The windowed layers are those layer_types names
    # "sliding_attention"; every layer when layer_types is empty. None: every layer reads every key.
    sliding_window: int | None = None
    layer_types: list[str] = field(default_factory=list)
    # Gemma 2/3: the attention scale is query_pre_attn_scalar ** -0.5 (not head_dim ** -0.5); Gemma 3's windowed
    # layers rotate with their own rope base (rope_local_theta, unscaled); the MLP's gate activation; the logits
    # soft-capped as cap * tanh(logits / cap) where final_logit_softcapping is set, and (Gemma 2) each attention
    # score before its softmax where attn_logit_softcapping is
    query_pre_attn_scalar: float | None = None
    rope_local_theta: float | None = None
    hidden_activation: str = "silu"
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    # Mixture of experts (Mixtral, Qwen3-MoE): each token's MLP is the weighted sum of num_experts_per_tok of
    # num_experts expert MLPs (of moe_intermediate_size) that a router picks; 0 experts: a dense model. The routing
    # weights are renormalized over the picked experts where norm_topk_prob. Layers in mlp_only_layers, and all but
    # every decoder_sparse_step-th, keep a dense MLP (Qwen's MoE configs).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's shared expert, every token's, behind a sigmoid gate
    # The sampling defaults its makers recommend (a Hugging Face folder's generation_config.json), as SamplingParams
    # fields: temperature, top_p, top_k, min_p, repetition_penalty, max_tokens (from max_new_tokens)
    generation_defaults: dict = field(default_factory=dict)
    # A checkpoint of the bare decoder (config.json's architectures *Model: an embedding model's) has no LM head: it can
    # only pool (--runner pooling)
    has_lm_head: bool = True
    # Embedding models: how their sentence-transformers config pools (a PoolerConfig's fields; None: it has none), and
    # the Matryoshka sizes their prefixes were trained at (None: not Matryoshka-trained; []: any size)
    pooler_defaults: dict | None = None
    matryoshka_dimensions: list[int] | None = None
    # A sequence classifier (architectures *ForSequenceClassification: reward models, classifiers): its head's classes
    # (0: not a classifier), their names, and transformers' problem_type (regression: the scores as they are)
    num_labels: int = 0
    id2label: dict[int, str] = field(default_factory=dict)
    problem_type: str | None = None
    # A language model run as a reranker (vLLM's hf_overrides recipe for Qwen3-Reranker and the like): its classes are
    # the LM head's rows for these token ids, kept as they are ("no_post_processing") or, for two tokens, one score
    # whose sigmoid is the second token's softmax probability against the first ("from_2_way_softmax")
    classifier_from_token_ids: list[int] | None = None
    classifier_method: str | None = None
    # How a cross-encoder (a one-label classifier) reads a pair of texts: through its tokenizer's pair template
    # (True, vLLM's use_pad_token default), or joined as one text (False: an LLM used as a reranker, whose prompt
    # format the two texts already carry)
    score_pair_template: bool = True

    def is_moe_layer(self, index: int) -> bool:
        return (self.num_experts > 0 and index not in self.mlp_only_layers
                and (index + 1) % max(self.decoder_sparse_step, 1) == 0)

    def layer_sliding_window(self, index: int) -> int:
        """The window of layer `index` (0: it reads every key)."""
        if not self.sliding_window or (self.layer_types and self.layer_types[index] != "sliding_attention"):
            return 0
        return self.sliding_window

    def sliding_windows(self) -> tuple[int, ...]:
        """The model's distinct windows (none for a model without windowed layers), for backends that build a mask
        per window."""
        return tuple(sorted({w for w in map(self.layer_sliding_window, range(self.num_hidden_layers)) if w}))

    @property
    def attention_scale(self) -> float:
        if self.attention_multiplier is not None:
            return self.attention_multiplier
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        # K and V, every layer, KV heads (not query heads: GQA shares them).
        elem = dtype.itemsize
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * elem


def parse_bytes(text: str | int | float, param: str = "kv_cache_memory") -> int:
    """'2GiB', '512MB', '1e9' or a number of bytes."""
    if isinstance(text, (int, float)):
        return int(text)
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([KMGT]?i?B?)?\s*", text)
    if not m:
        raise InvalidRequestError(f"cannot read {text!r} as a size for {param}; use e.g. 2GiB or 512MB", param)
    value = float(m.group(1))
    unit = (m.group(2) or "").upper().rstrip("B")
    scale = {"": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}
    return int(value * scale[unit])


def read_chat_template(value: str) -> str:
    """A chat template given as a path to its file or as the template itself (as vLLM's --chat-template), checked
    for Jinja syntax."""
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as f:
                value = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise InvalidRequestError(f"cannot read the chat template file {value}: {e}", "chat_template") from None
    elif not any(c in value for c in "{}\n"):  # no Jinja in it: a path that is not there
        raise InvalidRequestError(f"chat template {value!r} is neither a file nor a Jinja template", "chat_template")
    try:
        ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(value)
    except TemplateSyntaxError as e:
        raise InvalidRequestError(f"chat template: {e.message} (line {e.lineno})", "chat_template") from None
    return value


# generation_config.json's fields that set sampling defaults, and the SamplingParams field each sets (as vLLM reads them)
GENERATION_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                     "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def check_generation_overrides(overrides) -> None:
    """--override-generation-config: an object of generation_config.json's sampling fields."""
    if not isinstance(overrides, dict):
        raise InvalidRequestError('override_generation_config must be an object, e.g. {"temperature": 0.5}',
                                  "override_generation_config")
    unknown = sorted(set(overrides) - set(GENERATION_FIELDS))
    if unknown:
        raise InvalidRequestError(f"unknown override_generation_config keys: {', '.join(unknown)} (known: "
                                  f"{', '.join(GENERATION_FIELDS)})", "override_generation_config")


def speculative_settings(speculative_config: dict) -> dict:
    """vLLM's speculative_config ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 5} or
    {"model": PATH, ...}) as EngineConfig fields."""
    if not isinstance(speculative_config, dict):
        raise InvalidRequestError("speculative_config must be an object, e.g. {\"method\": \"ngram\", "
                                  "\"num_speculative_tokens\": 4}", "speculative_config")
    names = {"method": "speculative_method", "num_speculative_tokens": "num_speculative_tokens",
             "model": "draft_model", "prompt_lookup_min": "ngram_min", "prompt_lookup_max": "ngram_max"}
    unknown = set(speculative_config) - set(names)
    if unknown:
        raise InvalidRequestError(f"unknown speculative_config keys: {', '.join(sorted(unknown))} (known: "
                                  f"{', '.join(names)})", "speculative_config")
    settings = {names[k]: v for k, v in speculative_config.items()}
    method = settings.get("speculative_method")
    if method == "draft_model" or (method is None and settings.get("draft_model")):
        settings["speculative_method"] = "draft"  # vLLM names the method by its model, or not at all
    return settings


SPECULATIVE_METHODS = ("ngram", "suffix", "draft")
DECODE_QUANTIZATIONS = ("auto", "none", "int4", "int8", "w4a8")
ATTENTION_BACKENDS = ("auto", "native", "sdpa", "triton")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # fp8 is e4m3 (vLLM's name for the same)
MAX_SPECULATIVE_TOKENS = 16



LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
RUNNERS = ("auto", "generate", "pooling")
CONVERSIONS = ("auto", "embed", "classify")
# vLLM's --quantization names for the checkpoints llmserve reads (the *_marlin ones: vLLM's faster kernels, same files)
QUANTIZATION_METHODS = ("gptq", "gptq_marlin", "awq", "awq_marlin", "compressed-tensors", "fp8", "gguf")
POOLING_TYPES = ("LAST", "MEAN", "CLS")


@dataclass(frozen=True)
class PoolerConfig:
    """How a pooling engine turns a prompt's last-layer hidden states (after the final norm) into one embedding:
    the last token's (LAST: causal models, where only the last token has seen the whole prompt), their mean (MEAN),
    or the first token's (CLS); then scaled to unit length if `normalize` (vLLM's names and defaults for embed)."""

    pooling_type: str = "LAST"
    normalize: bool = True

    @classmethod
    def parse(cls, value, param: str = "pooler_config") -> "PoolerConfig":
        """vLLM's --pooler-config object ({"pooling_type": "MEAN", "normalize": false}), checked."""
        if isinstance(value, PoolerConfig):
            return value
        if not isinstance(value, dict):
            raise InvalidRequestError(f'{param} must be an object such as {{"pooling_type": "MEAN"}}, got {value!r}',
                                      param)
        unknown = sorted(set(value) - {"pooling_type", "normalize"})
        if unknown:
            raise InvalidRequestError(f"{param}: unknown keys {', '.join(unknown)} (llmserve reads pooling_type and "
                                      "normalize)", param)
        kind = value.get("pooling_type", "LAST")
        if not isinstance(kind, str) or kind.upper() not in POOLING_TYPES:
            raise InvalidRequestError(f"{param}: pooling_type must be one of {', '.join(POOLING_TYPES)}, got {kind!r}",
                                      param)
        normalize = value.get("normalize", True)
        if not isinstance(normalize, bool):
            raise InvalidRequestError(f"{param}: normalize must be true or false, got {normalize!r}", param)
        return cls(kind.upper(), normalize)

@dataclass
class EngineConfig:
    """Settings of one engine instance. Defaults suit a laptop CPU."""

    model: str | None = None  # None: the built-in default model
    device: str = "auto"
    # auto = bfloat16 on CUDA and on CPUs that compute it natively (AVX512-BF16, AMX); float32 on other CPUs (AVX2
    # only), where bf16 matmuls are emulated and measured ~4x slower than float32 (docs/performance.md)
    dtype: str = "auto"
    block_size: int = 16
    kv_cache_memory: str | int | None = None  # bytes for the KV pool; None: sized by one of the two below
    # None here and in max_num_seqs and max_num_batched_tokens: the platform's default (platforms/: CPU 0.10 of free
    # memory after the weights, 64, 1024; CUDA gpu_memory_utilization 0.9, 256, 8192, as vLLM's on a GPU), filled in
    # once by Platform.with_defaults when the engine starts
    kv_cache_fraction: float | None = None
    # vLLM's flag (GPUs): the share of the device's memory that may be in use once the KV pool is made, weights and
    # everything else on the device included; the KV pool takes what is left of it. Activations and CUDA graphs use
    # the rest (1 - this): llmserve does not profile a forward pass. Ignored on CPU (with a warning), as vLLM does.
    gpu_memory_utilization: float | None = None
    # "auto": the model's dtype. "fp8" (= "fp8_e4m3"): K and V stored as float8 e4m3fn with scale 1, as vLLM without
    # calibrated scales: half the bytes of bf16, so twice the tokens in the same memory and half the bytes per decode
    # step for the attention kernel to read; values beyond +-448 saturate. Accuracy cost: docs/performance.md.
    kv_cache_dtype: str = "auto"
    num_kv_blocks: int | None = None  # exact pool size (tests); overrides the memory settings
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    # vLLM's --long-prefill-token-threshold: each prompt gets at most this many tokens of a step (0: up to the whole
    # budget), so that one long prompt cannot hold back the other prompts' first tokens for a whole step
    long_prefill_token_threshold: int = 0
    scheduling_policy: str = "fcfs"  # or "priority"
    priority_aging_seconds: float = 30.0  # with "priority": each interval waited counts as one level
    seed: int = 0  # the sampler's generator for requests without a seed of their own (vLLM's --seed)
    # Sampling defaults for what a request leaves unset (vLLM's --generation-config): "auto" the model's
    # generation_config.json, "vllm" none (llmserve's and OpenAI's own defaults), or a folder holding such a file
    generation_config: str = "auto"
    # vLLM's --override-generation-config: sampling defaults in generation_config.json's names ({"temperature": 0.5,
    # "max_new_tokens": 64}) laid over those that generation_config chose (the model's, or none with "vllm")
    override_generation_config: dict | None = None
    # A Jinja chat template that replaces the model's (vLLM's --chat-template): the template itself, or a path to a
    # file holding it (read here, once)
    chat_template: str | None = None
    # A tokenizer other than the model's (vLLM's --tokenizer): a Hugging Face folder with tokenizer.json (its
    # tokenizer_config.json's chat template too), or a GGUF file's. For weights-only folders, or a fixed tokenizer.
    tokenizer: str | None = None
    # vLLM's skip_tokenizer_init: no tokenizer is loaded; prompts are token ids and outputs carry token ids, their
    # text empty (stop strings, bad words, structured outputs and chat templates, which need it, are refused)
    skip_tokenizer_init: bool = False
    # Most logprobs a request may ask for per token (vLLM's --max-logprobs; OpenAI's limit is 20); -1: the vocabulary
    max_logprobs: int = 20
    # vLLM's --trust-remote-code. llmserve runs no code from model folders (its architectures are its own code), so
    # this changes nothing; accepted so that vLLM's command lines run, and said so in the log.
    trust_remote_code: bool = False
    # A server's engine logs a line of throughput, requests and KV use every 10 s of activity (vLLM's; serve's
    # --disable-log-stats turns it off; server/stat_logger.py). Off for the offline engine, as vLLM's LLM.
    log_stats: bool = False
    # vLLM's --pipeline-parallel-size: only 1 (llmserve splits a model by tensor parallelism); more is refused.
    pipeline_parallel_size: int = 1
    # vLLM's --load-format: auto (the path says), safetensors (a Hugging Face folder), gguf (a GGUF file), or dummy:
    # random weights in the shape of a Hugging Face folder's config.json, to measure speed without the weights.
    load_format: str = "auto"
    # vLLM's --runner: "generate" (text: completions, chat, LLM.generate) or "pooling" (embeddings: /v1/embeddings,
    # LLM.embed; prompts are computed and pooled, nothing is sampled); "auto": pooling for a checkpoint without an LM
    # head (config.json's architectures *Model, as e5-mistral's MistralModel), generate otherwise.
    runner: str = "auto"
    # vLLM's --convert: what a generative checkpoint becomes under --runner pooling; "auto" and "embed" both mean an
    # embedding model (its hidden states pooled by pooler_config), "classify" a classifier over its LM head's rows
    # for hf_overrides' classifier_from_token (an LLM trained as a reranker)
    convert: str = "auto"
    # vLLM's --hf-overrides: keys of the model folder's config.json replaced, e.g. {"architectures":
    # ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": true}
    hf_overrides: dict | None = None
    # vLLM's --quantization: the method of a pre-quantized checkpoint (gptq, awq, compressed-tensors, fp8; gguf for a
    # GGUF file), checked against the checkpoint's own; None: whatever it is (its config.json says)
    quantization: str | None = None
    # vLLM's --pooler-config ({"pooling_type": "LAST"|"MEAN"|"CLS", "normalize": bool}); None: the model folder's
    # sentence-transformers settings (modules.json) where it has them, else LAST and normalized (vLLM's for embed)
    pooler_config: dict | PoolerConfig | None = None
    # vLLM's --tokenizer-mode: auto, hf and slow read tokenizer.json with `tokenizers` (one tokenizer, same ids)
    tokenizer_mode: str = "auto"
    cpu_prepack: bool = True  # bf16 on CPU: projections in oneDNN's packed layout (same results, faster)
    # Low-bit weights for steps of at most decode_quantization_max_rows rows. "auto" = on CPU, each layer of a GGUF
    # file as stored: int4 for Q4_0, Q4_1 and Q4_K layers (the file's own codes: in float32 the dequantized weights,
    # up to Q4_K's scales rounded to float16), int8 for its other low-bit layers, float for float ones; int4 for a
    # GPTQ, AWQ or compressed-tensors int4 checkpoint's layers whose codes the kernel holds as they are; none
    # otherwise. The LM head gets int8 where it is low-bit (Q8_0 in the default model). "w4a8" (opt-in) also rounds activations to int8 per group of 32, as
    # llama.cpp multiplies Q4_1. With llmserve's kernel None means every step and the float copy is dropped; with
    # torch's kernels, which lose to oneDNN bf16 from 5 rows on, it means 4 (platforms/cpu.py, docs/performance.md).
    decode_quantization: str = "auto"
    decode_quantization_max_rows: int | None = None
    # torch.compile small decode steps and lone prompts: fuses the per-layer elementwise ops that eager PyTorch runs
    # one by one. Compiles at start-up (a C++ compiler is needed); off by default because that takes a minute or
    # two on a laptop CPU.
    compile: bool = False
    # Decode-only steps of at most this many rows run compiled. None: all of them (max_num_seqs) with the native
    # attention kernel; 4 with SDPA, whose larger compiled steps measured no faster than eager (docs/benchmarks-history.md).
    compile_max_decode_batch: int | None = None
    # Attention: "native" reads the paged cache in place with llmserve's C++ kernels (CPU; built on first use,
    # needs a C++ compiler), "sdpa" gathers each sequence's blocks and runs torch's SDPA; "auto": native on CPU
    # where it builds, sdpa otherwise. Decode rows take the native kernel wherever it builds; prompt rows take it in
    # bf16 (with a bf16 cache) on CPUs with AVX512-BF16 but not AMX, and SDPA elsewhere (docs/performance.md).
    # "triton": one Triton kernel over the paged cache for every kind of row (CUDA; batch-invariant).
    attention_backend: str = "auto"
    # CUDA graphs (vLLM's names): decode-only steps of up to max_cudagraph_capture_size sequences (None: max_num_seqs,
    # at most 512) replay a graph captured at start-up per batch-size bucket (1, 2, 4, then multiples of 8), padded
    # to the bucket, instead of launching each layer's kernels from Python. enforce_eager turns them off.
    enforce_eager: bool = False
    # Async output processing (vLLM v0's, on by default there on CUDA): a step's tokens are detokenized and turned
    # into outputs while the next step computes on the device. None: on for CUDA, off on CPU (where the step's
    # arithmetic runs on the same cores, so nothing overlaps). A stop string then ends its request one step late (the
    # extra token is computed and dropped; outputs are the same).
    async_output_proc: bool | None = None
    # Async scheduling (vLLM's --async-scheduling): step N+1 is scheduled and launched before step N's sampled tokens
    # reach the host; its decode rows read those tokens on the device. All of the engine's own work (scheduling, step
    # input, token bookkeeping, outputs) then overlaps the device's. Off by default; not with speculative decoding,
    # tensor parallelism or disaggregated serving, and steps after a structured-output request's wait for its token.
    async_scheduling: bool = False
    max_cudagraph_capture_size: int | None = None
    enable_prefix_caching: bool = True
    kv_offload_memory: str | int | None = None  # host-memory tier for evicted prefix blocks (bytes); None/0: off
    kv_offload_dir: str | None = None  # disk tier folder for blocks evicted from the host tier (or the pool)
    kv_offload_disk: str | int | None = "10GiB"  # disk tier budget
    speculative_method: str | None = None  # "ngram", "suffix" or "draft"; None: off
    num_speculative_tokens: int = 4  # K: most drafts per sequence per step
    draft_model: str | None = None  # GGUF file or HF folder sharing the target's tokenizer (method "draft")
    ngram_min: int = 1  # ngram: shortest suffix to look up
    ngram_max: int = 5  # ngram: longest suffix to look up
    spec_max_tokens_per_step: int = 32  # drafts fill a step only up to this many tokens: busy steps get none
    # LoRA adapters (vLLM's names): a request may name an adapter; at most max_loras distinct adapters run in one step
    # (each has a slot in every adapted layer), of rank at most max_lora_rank; max_cpu_loras stay in host memory
    # (None: max_loras), least recently used out first.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # Batch-invariant, deterministic inference: a request's logits at every position are bit-for-bit the same whatever
    # else shares its steps, however its prompt is chunked, cached, preempted or speculatively verified (float32 on
    # CPU, every matmul and attention row summed in a fixed order; docs/deterministic.md). None: the platform decides
    # (on for CPUs that serve float32 anyway, where it costs little, when nothing else asked for is incompatible).
    deterministic: bool | None = None
    # Tensor parallelism (vLLM's flag): the model split over this many ranks, Megatron-style (layers/linear.py), one
    # process each; rank 0 is the engine's process and drives the others (executor/multiproc.py). Under torchrun the
    # ranks are the ones torchrun started, on one machine or several.
    tensor_parallel_size: int = 1
    # Disaggregated prefill and decode (kv_transfer/): this instance's role, the KV link's rendezvous HOST:PORT
    # (served by the prefill instance), and for the decode instance the prefill instance's URL and the bypass
    # threshold (Dynamo's max_local_prefill_length: prompts with fewer uncached tokens are prefilled here; None:
    # `llmserve plan`'s arithmetic for this model, this CPU and the measured link).
    kv_role: str | None = None
    kv_link: str | None = None
    prefill_url: str | None = None
    max_local_prefill_length: int | None = None

    def __post_init__(self):
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise InvalidRequestError("block_size must be a power of two", "block_size")
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise InvalidRequestError("max_num_seqs must be at least 1", "max_num_seqs")
        if self.long_prefill_token_threshold < 0:
            raise InvalidRequestError("long_prefill_token_threshold must not be negative", "long_prefill_token_threshold")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise InvalidRequestError("max_num_batched_tokens must be at least 1", "max_num_batched_tokens")
        if self.kv_cache_fraction is not None and not 0 < self.kv_cache_fraction <= 1:
            raise InvalidRequestError("kv_cache_fraction must be in (0, 1]", "kv_cache_fraction")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise InvalidRequestError("gpu_memory_utilization must be in (0, 1]", "gpu_memory_utilization")
        if self.gpu_memory_utilization is not None and self.kv_cache_fraction is not None:
            raise InvalidRequestError("kv_cache_fraction and gpu_memory_utilization both size the KV cache; give one",
                                      "gpu_memory_utilization")
        if self.chat_template is not None:
            self.chat_template = read_chat_template(self.chat_template)
        if self.override_generation_config is not None:
            check_generation_overrides(self.override_generation_config)
        if self.tokenizer is not None and not os.path.exists(os.path.expanduser(self.tokenizer)):
            raise InvalidRequestError(f"tokenizer not found: {self.tokenizer} (pass a Hugging Face folder with "
                                      "tokenizer.json, or a GGUF file)", "tokenizer")
        if isinstance(self.max_logprobs, bool) or not isinstance(self.max_logprobs, int) or self.max_logprobs < -1:
            raise InvalidRequestError(f"max_logprobs must be -1 (the whole vocabulary) or at least 0, got "
                                      f"{self.max_logprobs!r}", "max_logprobs")
        if self.load_format not in LOAD_FORMATS:
            raise InvalidRequestError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {self.load_format!r}",
                                      "load_format")
        if self.runner not in RUNNERS:
            raise InvalidRequestError(f"runner must be one of {', '.join(RUNNERS)}, got {self.runner!r}", "runner")
        if self.convert not in CONVERSIONS:
            raise InvalidRequestError(f"convert must be one of {', '.join(CONVERSIONS)}, got {self.convert!r}",
                                      "convert")
        if self.convert != "auto" and self.runner == "generate":
            raise InvalidRequestError(f"--convert {self.convert} makes a pooling model; it needs --runner pooling "
                                      "(or auto), not generate", "convert")
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise InvalidRequestError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)}, got "
                                      f"{self.quantization!r}", "quantization")
        if self.hf_overrides is not None and not isinstance(self.hf_overrides, dict):
            raise InvalidRequestError(f"hf_overrides must be a JSON object of config.json keys, got "
                                      f"{self.hf_overrides!r}", "hf_overrides")
        if self.pooler_config is not None:
            self.pooler_config = PoolerConfig.parse(self.pooler_config)
        if self.runner == "pooling":
            # nothing is sampled: the features that speed up or hand over decoding have nothing to act on
            for what, on, param in (("speculative decoding", self.speculative_method is not None, "speculative_method"),
                                    ("disaggregated prefill and decode", self.kv_role is not None, "kv_role"),
                                    ("async scheduling", self.async_scheduling, "async_scheduling")):
                if on:
                    raise InvalidRequestError(f"--runner pooling computes embeddings; {what} is not supported with it",
                                              param)
        elif self.runner == "generate" and self.pooler_config is not None:
            raise InvalidRequestError("pooler_config sets how embeddings are pooled; it needs --runner pooling",
                                      "pooler_config")
        if self.tokenizer_mode not in ("auto", "hf", "slow"):
            raise InvalidRequestError(f"tokenizer_mode must be auto, hf or slow (llmserve reads tokenizer.json), got "
                                      f"{self.tokenizer_mode!r}", "tokenizer_mode")
        if self.pipeline_parallel_size != 1:
            raise InvalidRequestError(f"pipeline parallelism is not supported (pipeline_parallel_size "
                                      f"{self.pipeline_parallel_size}); split the model over processes with "
                                      "--tensor-parallel-size", "pipeline_parallel_size")
        if self.generation_config not in ("auto", "vllm") and not os.path.isfile(
                os.path.join(self.generation_config, "generation_config.json")):
            raise InvalidRequestError(f"generation_config must be auto, vllm or a folder with generation_config.json; "
                                      f"{self.generation_config} has none", "generation_config")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise InvalidRequestError("scheduling_policy must be 'fcfs' or 'priority'", "scheduling_policy")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise InvalidRequestError("dtype must be auto, float32, bfloat16 or float16", "dtype")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise InvalidRequestError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                                      f"got {self.kv_cache_dtype!r}", "kv_cache_dtype")
        if self.decode_quantization not in DECODE_QUANTIZATIONS:
            raise InvalidRequestError(f"decode_quantization must be one of {', '.join(DECODE_QUANTIZATIONS)}, "
                                      f"got {self.decode_quantization!r}", "decode_quantization")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise InvalidRequestError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                                      f"got {self.attention_backend!r}", "attention_backend")
        if self.compile_max_decode_batch is not None and self.compile_max_decode_batch < 1:
            raise InvalidRequestError("compile_max_decode_batch must be at least 1", "compile_max_decode_batch")
        if self.decode_quantization_max_rows is not None and self.decode_quantization_max_rows < 0:
            raise InvalidRequestError("decode_quantization_max_rows must not be negative", "decode_quantization_max_rows")
        for name in ("kv_offload_memory", "kv_offload_disk"):
            value = getattr(self, name)
            if value is not None and parse_bytes(value, name) < 0:
                raise InvalidRequestError(f"{name} must not be negative", name)
        if self.speculative_method is not None:
            if self.speculative_method not in SPECULATIVE_METHODS:
                raise InvalidRequestError(f"speculative_method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                                          f"got {self.speculative_method!r}", "speculative_method")
            if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
                raise InvalidRequestError(f"num_speculative_tokens must be between 1 and {MAX_SPECULATIVE_TOKENS}, "
                                          f"got {self.num_speculative_tokens}", "num_speculative_tokens")
            if self.speculative_method == "draft" and not self.draft_model:
                raise InvalidRequestError("speculative_method 'draft' needs a draft model (--draft-model PATH)", "draft_model")
            if not 1 <= self.ngram_min <= self.ngram_max:
                raise InvalidRequestError("ngram sizes must satisfy 1 <= ngram_min <= ngram_max", "ngram_min")
        elif self.draft_model:
            raise InvalidRequestError("--draft-model is given but speculation is off; add --speculative-method draft", "draft_model")
        if self.max_loras < 1:
            raise InvalidRequestError("max_loras must be at least 1", "max_loras")
        if self.max_lora_rank < 1:
            raise InvalidRequestError("max_lora_rank must be at least 1", "max_lora_rank")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise InvalidRequestError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras "
                                      f"({self.max_loras})", "max_cpu_loras")
        if self.deterministic is True:
            # The modes below compute the same position in other ways depending on the step: compiled graphs fuse
            # decode steps' ops (prompts run eagerly), LoRA picks batched or per-adapter matmuls by the batch.
            if self.compile:
                raise InvalidRequestError("deterministic mode runs eagerly: --compile is not supported with it", "compile")
            if self.enable_lora:
                raise InvalidRequestError("deterministic mode does not support LoRA adapters yet", "enable_lora")
            if self.decode_quantization_max_rows is not None:
                raise InvalidRequestError("deterministic mode needs one matmul for every step size: leave "
                                          "decode_quantization_max_rows unset", "decode_quantization_max_rows")
            if self.attention_backend == "sdpa":
                raise InvalidRequestError("deterministic mode has its own attention backend; attention_backend sdpa "
                                          "is not batch-invariant", "attention_backend")
        if self.max_cudagraph_capture_size is not None and self.max_cudagraph_capture_size < 1:
            raise InvalidRequestError("max_cudagraph_capture_size must be at least 1", "max_cudagraph_capture_size")
        if self.tensor_parallel_size < 1:
            raise InvalidRequestError("tensor_parallel_size must be at least 1", "tensor_parallel_size")
        if self.tensor_parallel_size > 1:
            if self.compile:
                raise InvalidRequestError("--compile does not support tensor parallelism yet (the all-reduces would "
                                          "split each compiled graph)", "compile")
            if self.enable_lora:
                raise InvalidRequestError("LoRA adapters do not support tensor parallelism yet", "enable_lora")
        if self.async_scheduling:
            without = [what for what, on in (("speculative decoding", self.speculative_method is not None),
                                             ("tensor parallelism", self.tensor_parallel_size > 1),
                                             ("disaggregated serving", self.kv_role is not None)) if on]
            if without:
                raise InvalidRequestError(f"async scheduling does not work with {' or '.join(without)}",
                                          "async_scheduling")
        if self.kv_role is not None:
            if self.kv_role not in ("prefill", "decode"):
                raise InvalidRequestError(f"role must be prefill or decode, got {self.kv_role!r}", "kv_role")
            if not self.kv_link:
                raise InvalidRequestError(f"--role {self.kv_role} needs --kv-link HOST:PORT (the prefill instance "
                                          "serves it, the decode instance connects to it)", "kv_link")
            if self.kv_role == "decode" and not self.prefill_url:
                raise InvalidRequestError("--role decode needs --prefill-url (the prefill instance's server)",
                                          "prefill_url")
            if self.tensor_parallel_size > 1:
                raise InvalidRequestError("disaggregated serving does not support tensor parallelism yet",
                                          "tensor_parallel_size")
        elif self.kv_link or self.prefill_url:
            raise InvalidRequestError("--kv-link and --prefill-url need --role prefill|decode", "kv_role")
        if self.max_local_prefill_length is not None and self.max_local_prefill_length < 0:
            raise InvalidRequestError("max_local_prefill_length must not be negative", "max_local_prefill_length")
        if (self.kv_offload_memory or self.kv_offload_dir) and not self.enable_prefix_caching:
            raise InvalidRequestError("KV offload tiers hold prefix-cache blocks; they need prefix caching on", "kv_offload_memory")
