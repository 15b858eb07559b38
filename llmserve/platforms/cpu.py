"""CPUs: instruction-set probing, the low-bit weight policy, oneDNN packing, llmserve's native kernels and the
allocator settings that suit an inference loop.

- dtype: bf16 where oneDNN computes it natively (AVX512-BF16, AMX), float32 elsewhere (bf16 emulated, ~4x slower).
- weights: a GGUF file's 4-bit layers (Q4_0, Q4_1, Q4_K) keep their own 4-bit codes, its other low-bit layers and
  the LM head 8-bit ones (LowBitPlan.auto_kind), multiplied by llmserve's kernel where it builds (bf16 with AMX or AVX512-BF16, float32 with AVX2), which serves every step; with torch's
  weight-only kernels only steps of up to 4 rows, where they beat oneDNN's bf16 matmul. float32 keeps float32
  activations (the codes are the file's weights exactly): the reference mode. w4a8, which rounds activations to int8
  as llama.cpp does, is opt-in.
- attention: the native kernels where they build (attention/cpu_native.py), else SDPA.
- deterministic mode: float32, the low-bit codes through the AVX2 route and float layers through its float twin
  (layers/quant/float_panel.py), attention row by row (attention/cpu_batch_invariant.py): every sum in an order that
  does not depend on the step.
"""

from __future__ import annotations

import os

import torch

from llmserve import kernels
from llmserve.attention.backend import AttentionBackend
from llmserve.config import EngineConfig, ModelConfig
from llmserve.errors import InvalidRequestError
from llmserve.layers.linear import LinearBase
from llmserve.layers.norm import RMSNorm
from llmserve.layers.quant import FloatWeight, LowBitMethod, lowbit_supported, quantize_weight
from llmserve.layers.quant.onednn_packed import OneDNNPackedWeight
from llmserve.platforms import cpu_memory
from llmserve.platforms.interface import Platform, WeightPlan, WeightSummary

# The largest steps that take the low-bit weights by default with torch's kernels, which work in blocks of 4 rows and
# lose to oneDNN's bf16 matmul from the second block on. llmserve's own (AMX or AVX512-BF16) serves every step.
TORCH_LOWBIT_MAX_ROWS = 4
LOWBIT_DTYPES = (torch.bfloat16, torch.float32)  # the activations' dtypes the low-bit kernels take


# Checkpoint formats (ModelConfig.weight_formats: a GGUF file's tensor types) that --decode-quantization auto serves
# as int4 holding the file's own codes (Q4_1 blocks through their min/max, Q4_0 and Q4_K through the grid the loader
# hands over), as float (nothing low-bit to keep), or else as int8: 5-, 6- and 8-bit codes (Q8_0's exactly) and the
# 2- and 3-bit K- and I-quants, whose grids int4 groups of 32 cannot hold.
INT4_FORMATS = frozenset({"Q4_0", "Q4_1", "Q4_K"})
FLOAT_FORMATS = frozenset({"F32", "F16", "BF16"})


def checkpoint_formats(name: str, model_config: ModelConfig) -> set[str]:
    """The checkpoint formats of the tensors a linear layer was loaded from (empty where the loader records none): a
    merged layer's parts (q/k/v, gate/up), a tied LM head's embedding."""
    from llmserve.models.llama import LlamaForCausalLM

    formats = model_config.weight_formats
    parent, _, leaf = name.rpartition(".")
    # a merged layer's parts, or the layer whole where the checkpoint stores it fused (Phi-3)
    parts = [f"{parent}.{theirs}" for theirs, (ours, _) in LlamaForCausalLM.stacked.items() if ours == leaf] + [name]
    if name == "lm_head" and "lm_head.weight" not in formats:
        parts = ["model.embed_tokens"]
    return {formats[f"{p}.weight"] for p in parts if f"{p}.weight" in formats}


class LowBitPlan(WeightPlan):
    def __init__(self, kind: str, isa: str | None, int8_route: str | None, max_rows: int | None, dtype: torch.dtype,
                 model_config: ModelConfig):
        """kind "auto": each layer as its checkpoint stored it (auto_kind)."""
        super().__init__()
        self.kind, self.isa, self.int8_route, self.max_rows, self.dtype = kind, isa, int8_route, max_rows, dtype
        self.model_config = model_config
        self.auto_kinds: set[str] = set()
        self.summary = WeightSummary(kind, 0, isa or "torch", max_rows)

    def auto_kind(self, name: str, m: LinearBase) -> str | None:
        """--decode-quantization auto: int4 where the layer's codes are 4-bit ones the kernel holds as they are, int8
        for other low-bit GGUF types, float (None) for float tensors: no rounding beyond the file's own (int8 and
        a Q4_K grid's scales rounded to float16 aside)."""
        if m.int4_grid() is not None:
            return "int4"
        formats = checkpoint_formats(name, self.model_config)
        if not formats or formats <= FLOAT_FORMATS:
            return None
        return "int4" if formats <= INT4_FORMATS else "int8"

    def choose(self, name: str, m: LinearBase) -> None:
        # The LM head gets int8 whatever the kind: it is often the embedding, which GGUF files tend to keep at
        # more bits than the layers (Q8_0 in the default model), where 4 bits would add error of its own. Its
        # activations stay in float with w4a8, as do those of layers that ask (int8_activations): with 8-bit
        # codes vpmaddubsw needs twice the integer multiplies, and Zen's one integer-multiply pipe then loses to
        # float FMAs from 16 rows on.
        head = name.endswith("lm_head")
        if not m.low_bit:
            return
        if self.kind == "auto":
            kind = self.auto_kind(name, m)
            if kind is None:
                return
            kind = "int8" if head else kind
            # what auto came to, for logs and info: the layers' kinds ("int4", "int4+int8"), the head's if alone
            if not head:
                self.auto_kinds.add(kind)
            self.summary.decode_quantization = "+".join(sorted(self.auto_kinds)) or kind
        else:
            kind = "int8" if head else "int4" if self.kind == "w4a8" else self.kind
        route = self.int8_route if self.kind == "w4a8" and not head and m.int8_activations else self.isa
        if lowbit_supported(kind, m.weight.shape, self.isa is not None):
            weight = quantize_weight(kind, m.weight, self.dtype, route, m.int4_grid(), m.int4_codes())
            m.method = LowBitMethod(weight, self.max_rows, m.method)
            if self.max_rows is None:  # the float weight would never be read again
                m.drop_float_weight()
            self.summary.lowbit_bytes += weight.nbytes


def cpu_has_fast_bf16() -> bool:
    """Whether oneDNN runs bf16 matmuls natively on this CPU (AVX512-BF16/AVX512BW, AMX or AVX-NE-CONVERT)."""
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(check()) if check is not None else True


class CpuPlatform(Platform):
    name = "cpu"
    default_kv_cap_bytes = 1 << 30  # a laptop shares this memory with everything else
    device_is_host = True
    # above glibc's mmap threshold every fresh tensor is new pages, faulted in each step (cpu_memory.py)
    logits_buffer_min_bytes = cpu_memory.MMAP_THRESHOLD_BYTES

    def default_dtype(self) -> torch.dtype:
        return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32

    def resolve_dtype(self, config: EngineConfig) -> torch.dtype:
        if config.deterministic and config.dtype == "auto":  # resolved and checked by resolve_deterministic
            return torch.float32
        dtype = super().resolve_dtype(config)
        if dtype == torch.float16:
            raise InvalidRequestError("float16 is slow and inexact on CPU; use bfloat16 or float32", "dtype")
        return dtype

    def deterministic_by_default(self, config: EngineConfig) -> bool:
        """On where the CPU serves float32 anyway (no fast bf16), where it measured no cost (docs/benchmarks.md),
        unless something asked for computes positions differently by step (compiled graphs, LoRA, a chosen attention
        backend or low-bit row limit), or check_deterministic refuses (bf16, no kernels)."""
        if config.compile or config.enable_lora or config.attention_backend != "auto":
            return False
        if config.decode_quantization_max_rows is not None or (config.dtype == "auto" and cpu_has_fast_bf16()):
            return False
        try:
            self.check_deterministic(config)
        except InvalidRequestError:
            return False
        return True

    def check_deterministic(self, config: EngineConfig) -> None:
        """The batch-invariant kernels are llmserve's float32 AVX2 ones (matmuls) and its decode attention kernel."""
        if config.dtype not in ("auto", "float32"):
            raise InvalidRequestError("deterministic mode runs in float32 on CPU (its batch-invariant matmuls are "
                                      f"float32 ones); drop --dtype {config.dtype}", "dtype")
        if not kernels.load_cpu_kernels():
            raise InvalidRequestError(f"deterministic mode needs llmserve's native CPU kernels, which could not be "
                                      f"built ({kernels.build_error()}): a C++ compiler with OpenMP on PATH",
                                      "deterministic")
        if kernels.lowbit_linear_float32_isa() != "avx2":
            raise InvalidRequestError("deterministic mode needs a CPU with AVX2, FMA and F16C", "deterministic")
        if config.tensor_parallel_size > 2:
            # two ranks' partial sums add the same either way round; gloo's order for more may depend on the size
            raise InvalidRequestError("deterministic mode supports a tensor-parallel size of at most 2",
                                      "tensor_parallel_size")

    def bind_rank(self, local_rank: int, local_size: int) -> None:
        """Each rank its own cores (an even share of those this process may use) and as many threads: ranks that
        shared cores would take turns inside every all-reduce."""
        cores = sorted(os.sched_getaffinity(0))
        if len(cores) < local_size:
            return  # more ranks than cores: leave the kernel to spread them
        base, extra = divmod(len(cores), local_size)
        start = local_rank * base + min(local_rank, extra)
        share = cores[start:start + base + (local_rank < extra)]
        self._unbound = (cores, torch.get_num_threads())
        os.sched_setaffinity(0, share)  # this thread, and the threads it starts from now on
        torch.set_num_threads(len(share))

    def release_rank(self) -> None:
        if getattr(self, "_unbound", None):
            cores, threads = self._unbound
            os.sched_setaffinity(0, cores)
            torch.set_num_threads(threads)
            self._unbound = None

    def prepare_process(self) -> None:
        cpu_memory.keep_freed_memory()

    def after_load(self) -> None:
        cpu_memory.release_freed_memory()

    def available_memory(self) -> int:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")

    # ---- weights -----------------------------------------------------------------------------
    def weight_plan(self, config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype) -> WeightPlan:
        kind = config.decode_quantization
        # auto: each layer as the file stored it (LowBitPlan.auto_kind), where it has low-bit layers. A pre-quantized
        # checkpoint's float LM head stays float rather than take int8's rounding, as do its float layers.
        if kind == "auto":
            low_bit_file = model_config.checkpoint_int4_codes or any(
                f not in FLOAT_FORMATS for f in model_config.weight_formats.values())
            kind = "auto" if low_bit_file and dtype in LOWBIT_DTYPES else "none"
        if kind == "none" or config.decode_quantization_max_rows == 0:
            return WeightPlan()
        if dtype not in LOWBIT_DTYPES:
            raise InvalidRequestError(f"decode_quantization {kind} runs in bfloat16 or float32 only",
                                      "decode_quantization")
        isa = kernels.lowbit_linear_route(dtype)
        int8_route = kernels.lowbit_linear_int8_route(dtype)
        if kind == "w4a8" and int8_route is None:
            raise InvalidRequestError("decode_quantization w4a8 runs on CPU with llmserve's kernels only: in float32 "
                                      "on a CPU with AVX2, FMA and F16C, or in bfloat16 with AVX512-VNNI and "
                                      "AVX512-BF16 (and a C++ compiler)", "decode_quantization")
        max_rows = config.decode_quantization_max_rows
        # llmserve's kernel matches or beats oneDNN's bf16 (or MKL's float32) matmul at every size measured
        # (docs/performance.md), so it serves every step and the float copy is dropped; torch's only the smallest.
        max_rows = max_rows if max_rows is not None or isa else TORCH_LOWBIT_MAX_ROWS
        return LowBitPlan(kind, isa, int8_route, max_rows, dtype, model_config)

    def finish_weights(self, model, config: EngineConfig, summary: WeightSummary) -> None:
        if config.deterministic:
            # Float layers (a float checkpoint's, or those without low-bit codes) in the batch-invariant layout.
            from llmserve.layers.quant.float_panel import FloatPanelWeight

            for m in model.modules():
                if isinstance(m, LinearBase) and isinstance(m.method, FloatWeight):
                    m.method = FloatPanelWeight(m.weight.data)
                    m.drop_float_weight()
        elif config.cpu_prepack:
            # The LM head too: with tied embeddings this keeps a second (packed) copy of that weight, for faster
            # logits. Packing gives identical results; the plain weight is dropped.
            for m in model.modules():
                if isinstance(m, LinearBase) and m.weight.numel():
                    packed = OneDNNPackedWeight.pack(m.weight)
                    if packed is None:
                        continue
                    if isinstance(m.method, LowBitMethod):
                        m.method.fallback = packed
                    else:
                        m.method = packed
                    m.drop_float_weight()
                    summary.num_packed += 1
        # The fused norm where the kernels are loaded, or about to be for the native attention backend.
        if kernels.loaded() or (config.attention_backend != "sdpa" and kernels.load_cpu_kernels()):
            for m in model.modules():
                if isinstance(m, RMSNorm) and m.weight.dtype in (torch.float32, torch.bfloat16):
                    m.fused_op = torch.ops.llmserve_kernels.rms_norm
                    summary.num_fused_norms += 1

    # ---- attention, graphs, sampling -----------------------------------------------------------
    def attention_backend(self, config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype,
                          kv_dtype: torch.dtype, num_heads: int, num_kv_heads: int) -> AttentionBackend:
        from llmserve.attention.cpu_native import CpuNativeBackend
        from llmserve.attention.sdpa import SdpaBackend

        args = (num_heads, num_kv_heads, model_config.head_dim, config.block_size, dtype, kv_dtype, self.device,
                model_config.sliding_windows(), model_config.attn_logit_softcapping or 0.0)
        if config.attention_backend == "triton":
            return self.triton_attention(args)
        if config.deterministic:
            from llmserve.attention.cpu_batch_invariant import BatchInvariantBackend

            unsupported = CpuNativeBackend.supports(num_heads, model_config.head_dim)
            if unsupported:
                raise InvalidRequestError(f"deterministic mode: {unsupported}", "deterministic")
            return BatchInvariantBackend(*args)
        choice = config.attention_backend
        if choice == "sdpa":
            return SdpaBackend(*args)
        unsupported = CpuNativeBackend.supports(num_heads, model_config.head_dim)
        if unsupported is None and not kernels.load_cpu_kernels():
            unsupported = (f"the native attention kernel could not be built ({kernels.build_error()}); it needs a "
                           "C++ compiler with OpenMP on PATH, or use attention_backend sdpa")
        if unsupported is None:
            return CpuNativeBackend(*args)
        if choice == "native":
            raise InvalidRequestError(unsupported, "attention_backend")
        return SdpaBackend(*args)

    def prepare_compile(self) -> None:
        kernels.load_cpu_kernels()  # their C++ packed_linear spares the graph a call into Python per projection

    def argmax_rows(self, logits: torch.Tensor) -> torch.Tensor:
        if kernels.fast_argmax_available():
            return torch.ops.llmserve_kernels.argmax_rows(logits)  # 8x max() at 256 rows (docs/benchmarks.md)
        return super().argmax_rows(logits)
