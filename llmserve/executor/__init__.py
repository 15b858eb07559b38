"""Executors run steps for the engine: StepInput in, StepOutput out (engine/step_io.py). The engine talks to nothing
below this seam, so an executor with one worker process per tensor-parallel rank can replace the in-process one."""

from llmserve.executor.base import Executor, ExecutorInfo
from llmserve.executor.uniproc import UniprocExecutor

__all__ = ["Executor", "ExecutorInfo", "UniprocExecutor", "make_executor"]


def make_executor(config, model_config, weights, vocab_size: int | None = None) -> Executor:
    """In this process for one rank; one process per rank for tensor parallelism."""
    if config.tensor_parallel_size > 1:
        from llmserve.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(config, model_config, weights, vocab_size)
    return UniprocExecutor(config, model_config, weights, vocab_size)
