"""The executor interface the engine depends on."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

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
    # CUDA graphs: the decode batch sizes captured (empty: every step launches eagerly), and the seconds it took
    cuda_graph_sizes: list[int] = field(default_factory=list)
    cuda_graph_seconds: float = 0.0

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
        if runner.cuda_graphs is not None:
            info.cuda_graph_sizes = list(runner.cuda_graphs.sizes)
            info.cuda_graph_seconds = runner.cuda_graphs.capture_seconds
        if runner.graphs is not None:
            info.compiled_decode_batch = runner.graphs.max_decode_batch
            info.compiled_prompt_lengths = runner.graphs.lone_prompt_trial_rows()
        return info


class Executor:
    info: ExecutorInfo
    runner = None  # the model runner in this process (rank 0's with tensor parallelism)

    def execute(self, step: StepInput) -> StepOutput:
        raise NotImplementedError

    def execute_async(self, step: StepInput) -> Callable[[], StepOutput]:
        """Starts the step and returns what waits for its output (the engine processes the previous step's
        outputs in between). Executors that cannot split a step run it here."""
        out = self.execute(step)
        return lambda: out

    @contextmanager
    def watch_logits(self, callback: Callable[[list[str], torch.Tensor], None]):
        """For tests and debugging: callback(request ids, float32 logits) with the rows each step samples one token
        from (before any sampling parameter is applied), as this process's runner sees them (whole, after the
        tensor-parallel gather)."""
        self.runner.logits_observers.append(callback)
        try:
            yield
        finally:
            self.runner.logits_observers.remove(callback)

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
