"""One worker in this process: the model runner called directly."""

from __future__ import annotations

from typing import Callable

import torch

from llmserve.config import EngineConfig, ModelConfig
from llmserve.distributed.parallel_state import tp_size
from llmserve.engine.step_io import StepInput, StepOutput
from llmserve.errors import InvalidRequestError
from llmserve.executor.base import Executor, ExecutorInfo
from llmserve.worker.model_runner import ModelRunner


class UniprocExecutor(Executor):
    def __init__(self, config: EngineConfig, model_config: ModelConfig, weights, vocab_size: int | None = None):
        if tp_size() != 1:
            # the tensor-parallel state is the process's (as in vLLM): layers built now would be one rank's shards,
            # and the KV sizing would wait on the other engine's ranks
            raise InvalidRequestError(f"an engine with tensor_parallel_size {tp_size()} is running in this process; "
                                      "shut it down (engine.shutdown()) before building another", "tensor_parallel_size")
        self.runner = runner = ModelRunner(config, model_config, weights, vocab_size)
        self.info = ExecutorInfo.of_runner(runner)

    def execute(self, step: StepInput) -> StepOutput:
        return self.runner.execute(step)

    def execute_async(self, step: StepInput) -> Callable[[], StepOutput]:
        return self.runner.execute_deferred(step)

    def add_lora(self, request) -> int:
        return self.runner.add_lora(request)

    def remove_lora(self, lora_int_id: int) -> None:
        self.runner.remove_lora(lora_int_id)

    def pin_lora(self, lora_int_id: int, pinned: bool) -> None:
        if self.runner.lora is not None:
            self.runner.lora.pin(lora_int_id, pinned)

    def lora_ids(self) -> list[int]:
        return list(self.runner.lora.host) if self.runner.lora is not None else []

    def read_block(self, block: int) -> torch.Tensor:
        return self.runner.read_block(block)

    def write_block(self, block: int, data: torch.Tensor) -> None:
        self.runner.write_block(block, data)
