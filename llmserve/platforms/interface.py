"""The platform interface, with the defaults that hold on any device."""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field

import torch

from llmserve.attention.backend import AttentionBackend
from llmserve.config import EngineConfig, ModelConfig, parse_bytes
from llmserve.errors import InvalidRequestError

logger = logging.getLogger(__name__)


@dataclass
class WeightSummary:
    """What the platform did to the loaded weights, for logs and `llmserve info`."""

    decode_quantization: str = "none"  # the low-bit kind chosen
    lowbit_bytes: int = 0
    lowbit_kernel: str | None = None  # "avx2", "avx512_bf16", "amx", "torch", ...
    lowbit_max_rows: int | None = 0  # steps of at most this many rows use the low-bit codes (None: all, 0: none)
    num_packed: int = 0  # linears in a packed layout
    num_fused_norms: int = 0  # RMSNorms that run as one fused kernel call
    # each linear layer's weight method, e.g. {"model.layers.0.mlp.down_proj": "int4/avx2"}, and the bytes of float
    # weights the linears still hold (0 where the low-bit codes serve every step)
    methods: dict[str, str] = field(default_factory=dict)
    float_weight_bytes: int = 0

    def uses_lowbit(self, rows: int) -> bool:
        return self.lowbit_max_rows is None or rows <= self.lowbit_max_rows


class WeightPlan:
    """Each linear layer's weight method, decided once for the model and applied to a layer as soon as its weights
    are loaded (the model runner calls `apply` then, and once more over every layer at the end: layers never loaded
    on their own, such as a tied LM head): its float32 weight is then freed or narrowed to the serving dtype before
    the next layer's is read, so that loading peaks near the served size rather than at the float32 model. This one
    keeps every layer float."""

    def __init__(self):
        self.summary = WeightSummary()
        self._done: set[int] = set()

    def apply(self, name: str, layer) -> None:
        if id(layer) not in self._done:
            self._done.add(id(layer))
            self.choose(name, layer)
            layer.drop_int4_grid()  # whatever the method, the checkpoint's grid and codes are not read again

    def choose(self, name: str, layer) -> None:
        """Give `layer` (a LinearBase with its float32 weight loaded) its method."""


class Platform:
    name = "base"
    # Devices whose host memory is shared with everything else get a cap on the default KV pool.
    default_kv_cap_bytes: int | None = None
    pin_host_memory = False  # host-tier KV copies in page-locked memory (faster device transfers)
    device_is_host = False  # the device computes in host memory (the CPU): no copies to a device needed
    # Float32 logits larger than this are written into one buffer kept across steps (None: always fresh tensors, for
    # devices whose allocator caches freed blocks anyway).
    logits_buffer_min_bytes: int | None = None

    # Scheduling and memory defaults, for the EngineConfig fields left None: a step's most sequences and tokens,
    # and how the KV pool is sized: a share of the memory free after the weights, or on a GPU (where set) vLLM's
    # gpu_memory_utilization, the share of the device's memory that may be in use once the pool is made.
    default_max_num_seqs = 64
    default_max_num_batched_tokens = 1024
    default_kv_cache_fraction = 0.10
    default_gpu_memory_utilization: float | None = None

    def __init__(self, device: torch.device):
        self.device = device

    def with_defaults(self, config: EngineConfig) -> EngineConfig:
        """config with this platform's defaults where it leaves them unset (None)."""
        by_utilization = config.kv_cache_fraction is None and (
            config.gpu_memory_utilization or self.default_gpu_memory_utilization) is not None
        return dataclasses.replace(
            config,
            max_num_seqs=config.max_num_seqs or self.default_max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens or self.default_max_num_batched_tokens,
            kv_cache_fraction=None if by_utilization else config.kv_cache_fraction or self.default_kv_cache_fraction,
            gpu_memory_utilization=(config.gpu_memory_utilization or self.default_gpu_memory_utilization
                                    if by_utilization else config.gpu_memory_utilization))

    def kv_sizing(self, config: EngineConfig) -> str:
        """How the KV pool of a config with this platform's defaults is sized, in flags (for `llmserve info`)."""
        if config.kv_cache_memory is not None:
            return f"--kv-cache-memory {config.kv_cache_memory}"
        if config.kv_cache_fraction is None and self.default_gpu_memory_utilization is not None:
            return (f"--gpu-memory-utilization {config.gpu_memory_utilization:g} (of the device's memory, weights and "
                    "all else in use included)")
        cap = f", at most {self.default_kv_cap_bytes / 2**30:g} GiB" if self.default_kv_cap_bytes else ""
        fraction = config.kv_cache_fraction or self.default_kv_cache_fraction
        return f"--kv-cache-fraction {fraction:g} (of free memory after the weights{cap})"

    # ---- dtypes ------------------------------------------------------------------------------
    def default_dtype(self) -> torch.dtype:
        return torch.bfloat16

    def resolve_dtype(self, config: EngineConfig) -> torch.dtype:
        return self.default_dtype() if config.dtype == "auto" else getattr(torch, config.dtype)

    # ---- the server's engine: a process of its own, or a thread of the server's process ----------------
    # On a GPU a step is mostly the host's Python, which must not wait on the HTTP side's for the GIL. On a CPU the
    # model's arithmetic dominates, and a process of its own measured slower on the 2-core machine (serving c=8
    # 0.87x, c=32 0.95x; docs/benchmarks.md, "The engine in a process of its own").
    default_engine_process = False

    # ---- async output processing -------------------------------------------------------------
    # Whether the executor's step returns while the device computes (a GPU): then the engine makes the previous
    # step's outputs in that time. On a CPU the step's arithmetic runs in the call itself, so nothing would overlap.
    default_async_output_proc = False

    def resolve_async_output_proc(self, config: EngineConfig) -> bool:
        if config.async_output_proc is None:
            return self.default_async_output_proc
        return config.async_output_proc

    # ---- deterministic mode ------------------------------------------------------------------
    def resolve_deterministic(self, config: EngineConfig) -> bool:
        """config.deterministic decided: True checked (raises if this platform cannot), None the platform's default."""
        if config.deterministic:
            self.check_deterministic(config)
            return True
        return bool(config.deterministic is None and self.deterministic_by_default(config))

    def deterministic_by_default(self, config: EngineConfig) -> bool:
        return False

    def check_deterministic(self, config: EngineConfig) -> None:
        """Raises where this platform has no batch-invariant kernels for the configuration."""
        raise InvalidRequestError(f"deterministic mode runs on CPU only for now (no batch-invariant {self.name} kernels "
                                  "yet); use --device cpu", "deterministic")

    def resolve_kv_dtype(self, config: EngineConfig) -> torch.dtype:
        return self.resolve_dtype(config) if config.kv_cache_dtype == "auto" else torch.float8_e4m3fn

    # ---- tensor-parallel ranks ------------------------------------------------------------------
    dist_backend = "gloo"  # torch.distributed backend for the ranks' collectives

    def bind_rank(self, local_rank: int, local_size: int) -> None:
        """This process is tensor-parallel rank `local_rank` of `local_size` on this machine: take its share of the
        machine (cores, a GPU) before anything is built."""

    def release_rank(self) -> None:
        """The process goes on without its rank (rank 0 in an engine that shut down): undo bind_rank's settings."""

    # ---- process and memory ------------------------------------------------------------------
    def prepare_process(self) -> None:
        """Process-wide settings before the weights load."""

    def after_load(self) -> None:
        """Once the weights are in place (memory freed while loading can go back to the OS)."""

    def available_memory(self) -> int:
        raise NotImplementedError

    def kv_cache_budget(self, config: EngineConfig) -> int:
        """Bytes for the KV pool, on a config with this platform's defaults, once the weights are in place."""
        if config.kv_cache_memory is not None:
            return parse_bytes(config.kv_cache_memory)
        if config.kv_cache_fraction is None:
            return self.kv_budget_by_utilization(config.gpu_memory_utilization)
        return self.kv_budget_by_fraction(config.kv_cache_fraction)

    def kv_budget_by_fraction(self, fraction: float) -> int:
        budget = int(self.available_memory() * fraction)
        return min(budget, self.default_kv_cap_bytes) if self.default_kv_cap_bytes else budget

    def kv_budget_by_utilization(self, utilization: float) -> int:
        """A device whose memory is not its own to share out (the CPU): vLLM ignores the flag there, and so does
        llmserve, saying so (a command line copied from a GPU machine should not mislead)."""
        logger.warning("--gpu-memory-utilization applies to GPUs; on %s the KV cache is %s", self.name,
                       self.kv_sizing(EngineConfig(kv_cache_fraction=self.default_kv_cache_fraction)))
        return self.kv_budget_by_fraction(self.default_kv_cache_fraction)

    # ---- weights -----------------------------------------------------------------------------
    def weight_plan(self, config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype) -> WeightPlan:
        """Low-bit weight methods, chosen from the float32 weights as loaded (before the cast to dtype)."""
        if config.decode_quantization not in ("auto", "none"):
            raise InvalidRequestError(f"decode_quantization {config.decode_quantization} runs on CPU only",
                                      "decode_quantization")
        return WeightPlan()

    def finish_weights(self, model, config: EngineConfig, summary: WeightSummary) -> None:
        """After the cast to the serving dtype and device: packed layouts, fused norms."""

    # ---- attention, graphs, sampling -----------------------------------------------------------
    def attention_backend(self, config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype,
                          kv_dtype: torch.dtype, num_heads: int, num_kv_heads: int) -> AttentionBackend:
        from llmserve.attention.sdpa import SdpaBackend

        args = (num_heads, num_kv_heads, model_config.head_dim, config.block_size, dtype, kv_dtype, self.device,
                model_config.sliding_windows(), model_config.attn_logit_softcapping or 0.0)
        if config.attention_backend == "native":
            raise InvalidRequestError("attention_backend native runs on CPU only", "attention_backend")
        if config.attention_backend == "triton":
            return self.triton_attention(args)
        return SdpaBackend(*args)

    def triton_attention(self, backend_args: tuple) -> AttentionBackend:
        """The Triton paged-attention backend, where Triton can run it: on a CUDA device, or anywhere under Triton's
        interpreter (TRITON_INTERPRET=1, how the tests check the kernel on CPU)."""
        from llmserve.attention.triton_paged import TritonPagedBackend, triton_available

        missing = triton_available()
        if missing is None and self.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            missing = "it runs on CUDA GPUs (on other devices only under Triton's interpreter, TRITON_INTERPRET=1)"
        if missing:
            raise InvalidRequestError(f"attention_backend triton: {missing}", "attention_backend")
        return TritonPagedBackend(*backend_args)

    def graph_runner(self, runner):
        """The compiled-graph runner for `config.compile`: torch.compile of whole steps."""
        from llmserve.graphs.inductor import InductorGraphRunner

        return InductorGraphRunner(runner)

    def decode_graphs(self, runner):
        """The CUDA-graph runner for decode steps (graphs/cuda_graphs.py), or None where steps launch eagerly."""
        return None

    def prepare_compile(self) -> None:
        """Before graphs are traced (what they call must be loaded)."""

    def argmax_rows(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's first maximal index, as torch.max(dim=-1).indices gives it (a NaN counts as maximal)."""
        return logits.max(dim=-1).indices  # max().indices: the same as argmax(), faster on CPU over a large vocabulary
