"""CUDA GPUs: bf16 by default, the Triton paged-attention kernel (SDPA where triton is missing, or asked for), CUDA
graphs for decode steps (graphs/cuda_graphs.py; --enforce-eager turns them off), float weights, page-locked host
tiers.

Deterministic mode (opt-in here): every linear layer through the batch-invariant Triton matmul, every RMSNorm
through the per-row Triton kernel, attention through the Triton paged kernel (batch-invariant by construction), so a
request's logits do not depend on what else the step holds (kernels/triton_batch_invariant.py,
attention/triton_paged.py)."""

from __future__ import annotations

import logging

import torch

from llmserve.config import EngineConfig, ModelConfig
from llmserve.errors import InvalidRequestError
from llmserve.platforms.interface import Platform

logger = logging.getLogger(__name__)


class CudaPlatform(Platform):
    name = "cuda"
    pin_host_memory = True

    dist_backend = "nccl"
    # As vLLM's on a GPU: up to 256 sequences and 8192 tokens a step, and --gpu-memory-utilization 0.9: the KV pool
    # fills the device up to 90 % of its memory (the rest is for activations, CUDA graphs and the allocator's slack).
    default_max_num_seqs = 256
    default_max_num_batched_tokens = 8192
    default_gpu_memory_utilization = 0.90
    default_engine_process = True  # the server's engine steps in a process of its own
    default_async_output_proc = True  # kernels are queued: the host is free until it waits for the sampled tokens

    def bind_rank(self, local_rank: int, local_size: int) -> None:
        if local_size > torch.cuda.device_count():
            raise InvalidRequestError(f"tensor-parallel size {local_size} on this machine needs as many GPUs; torch "
                                      f"sees {torch.cuda.device_count()}", "tensor_parallel_size")
        self.device = torch.device("cuda", local_rank)
        torch.cuda.set_device(self.device)

    def available_memory(self) -> int:
        free, _ = torch.cuda.mem_get_info(self.device)
        return free

    def kv_budget_by_utilization(self, utilization: float) -> int:
        """What is left of utilization x the device's memory after all that is in use on it now: this process's
        weights, its CUDA context and the allocator's cache, and other processes' memory (stricter than vLLM,
        which counts only its own instance's: another process's growth cannot take the pool's room)."""
        torch.cuda.empty_cache()  # memory freed while loading is not in use
        free, total = torch.cuda.mem_get_info(self.device)
        budget = int(utilization * total) - (total - free)
        if budget <= 0:
            gib = 2**30
            raise InvalidRequestError(
                f"--gpu-memory-utilization {utilization:g} allows {utilization * total / gib:.1f} GiB of this GPU's "
                f"{total / gib:.1f} GiB, and {(total - free) / gib:.1f} GiB are in use already (the weights, other "
                "processes): no room for the KV cache; raise it, or give --kv-cache-memory", "gpu_memory_utilization")
        return budget

    # ---- deterministic mode ------------------------------------------------------------------
    def check_deterministic(self, config: EngineConfig) -> None:
        from llmserve.attention.triton_paged import triton_available

        missing = triton_available()
        if missing:
            raise InvalidRequestError(f"deterministic mode on CUDA runs Triton kernels, and {missing}",
                                      "deterministic")
        if config.tensor_parallel_size > 1:
            # NCCL picks its all-reduce algorithm and chunking by message size, i.e. by the step's rows.
            raise InvalidRequestError("deterministic mode on CUDA does not support tensor parallelism (NCCL's "
                                      "all-reduce order depends on the message size)", "tensor_parallel_size")

    def finish_weights(self, model, config: EngineConfig, summary) -> None:
        """Fused Triton kernels for RMSNorm (with the residual add before it), rotary and SwiGLU (per row or per
        element, so batch-invariant too), and in deterministic mode the batch-invariant matmul for every linear
        layer."""
        from llmserve.attention.triton_paged import triton_available

        if triton_available() is not None:
            return  # check_deterministic has refused deterministic mode already
        from llmserve.kernels.triton_batch_invariant import batch_invariant_rms_norm
        from llmserve.kernels.triton_fused import add_rms_norm, rotary_in_place, silu_and_mul
        from llmserve.layers.linear import LinearBase
        from llmserve.layers.mlp import SwiGLUMLP
        from llmserve.layers.norm import RMSNorm
        from llmserve.layers.quant import FloatWeight
        from llmserve.layers.quant.triton_invariant import TritonInvariantWeight
        from llmserve.kernels import fused_kernels_disabled
        from llmserve.models.llama import LlamaAttention

        # LLMSERVE_FUSED_KERNELS=0: torch's own ops instead (to measure the kernels, or to get around one); the
        # deterministic mode keeps its batch-invariant norm
        fused = config.deterministic or not fused_kernels_disabled()
        for m in model.modules():
            if isinstance(m, LinearBase) and isinstance(m.method, FloatWeight) and config.deterministic:
                m.method = TritonInvariantWeight()
            elif not fused:
                continue
            elif isinstance(m, RMSNorm):
                m.fused_op, m.fused_add_op = batch_invariant_rms_norm, add_rms_norm
                summary.num_fused_norms += 1
            elif isinstance(m, SwiGLUMLP):
                m.act_op = silu_and_mul
            elif isinstance(m, LlamaAttention):
                m.rotary_op = rotary_in_place

    def attention_backend(self, config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype,
                          kv_dtype: torch.dtype, num_heads: int, num_kv_heads: int):
        from llmserve.attention.triton_paged import triton_available

        # auto: the Triton paged kernel, which reads the cache in place and whose decode steps CUDA graphs capture
        # (SDPA gathers every sequence's blocks and pads to the longest, so its shapes change every step).
        wants_triton = config.deterministic or (config.attention_backend == "auto" and triton_available() is None)
        if wants_triton and config.attention_backend != "triton":
            args = (num_heads, num_kv_heads, model_config.head_dim, config.block_size, dtype, kv_dtype, self.device,
                    model_config.sliding_windows(), model_config.attn_logit_softcapping or 0.0)
            return self.triton_attention(args)
        return super().attention_backend(config, model_config, dtype, kv_dtype, num_heads, num_kv_heads)

    def decode_graphs(self, runner):
        config = runner.config
        reason = ("--enforce-eager" if config.enforce_eager
                  else "tensor parallelism (not captured yet)" if config.tensor_parallel_size > 1
                  else f"the {runner.attention.name} attention backend" if runner.attention.name != "triton"
                  else None)
        if reason is not None:
            logger.info("CUDA graphs off: %s", reason)
            return None
        from llmserve.graphs.cuda_graphs import CudaGraphRunner

        return CudaGraphRunner(runner)
