"""The executor interface the engine depends on."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from llmserve.engine.step_io import StepInput, StepOutput
from llmserve.platforms.interface import WeightSummary


@dataclass
class ExecutorInfo:
    """What the engine, the logs and `llmserve info` need to know of the workers, fixed after start-up."""

    device: str
    dtype: str
    kv_dtype: str
    num_blocks: int
    kv_cache_bytes: int
    load_seconds: float
    attention_backend: str
    weights: WeightSummary
    pin_host_memory: bool  # host-tier KV copies in page-locked memory
    deterministic: bool = False  # the batch-invariant mode (config.deterministic as the platform decided it)
    compile_seconds: float = 0.0
    # with compile: decode-only steps of up to this many rows run compiled, and lone prompts traced at these lengths
    compiled_decode_batch: int = 0
    compiled_prompt_lengths: list[int] = field(default_factory=list)
    tensor_parallel_size: int = 1

    @classmethod
    def of_runner(cls, runner, tensor_parallel_size: int = 1) -> "ExecutorInfo":
        """rank 0's model runner, described (every rank holds the same blocks, dtype and kernels)"""
        info = cls(
            device=str(runner.device), dtype=str(runner.dtype).removeprefix("torch."),
            kv_dtype=str(runner.kv_dtype).removeprefix("torch."), num_blocks=runner.num_blocks,
            kv_cache_bytes=runner.kv.nbytes, load_seconds=runner.load_seconds, attention_backend=runner.attention.name,
            weights=runner.weights, pin_host_memory=runner.platform.pin_host_memory, deterministic=runner.deterministic,
            compile_seconds=runner.graphs.compile_seconds if runner.graphs is not None else 0.0,
            tensor_parallel_size=tensor_parallel_size)
        if runner.graphs is not None:
            info.compiled_decode_batch = runner.graphs.max_decode_batch
            info.compiled_prompt_lengths = runner.graphs.lone_prompt_trial_rows()
        return info


class Executor:
    info: ExecutorInfo

    def execute(self, step: StepInput) -> StepOutput:
        raise NotImplementedError

    # KV blocks for the host and disk spill tiers: [layers, 2, block_size, kv_heads, head_dim] per block.
    def read_block(self, block: int) -> torch.Tensor:
        raise NotImplementedError

    def write_block(self, block: int, data: torch.Tensor) -> None:
        raise NotImplementedError

    # LoRA adapters: read into the workers' host memory when a request for one is admitted, dropped when unloaded.
    def add_lora(self, request) -> int:
        raise NotImplementedError

    def remove_lora(self, lora_int_id: int) -> None:
        raise NotImplementedError

    def pin_lora(self, lora_int_id: int, pinned: bool) -> None:
        """Live requests use the adapter (pinned): keep it in host memory until they are done."""
        raise NotImplementedError

    def lora_ids(self) -> list[int]:
        """The adapters the workers hold in host memory."""
        raise NotImplementedError

    def failure(self) -> str | None:
        """Why the executor can run no more steps (a worker process died), or None while it can."""
        return None

    def shutdown(self) -> None:
        pass
