"""Executors run steps for the engine: StepInput in, StepOutput out (engine/step_io.py). The engine talks to nothing
below this seam, so an executor with one worker process per tensor-parallel rank can replace the in-process one."""

from llmserve.executor.base import Executor, ExecutorInfo
from llmserve.executor.uniproc import UniprocExecutor

__all__ = ["Executor", "ExecutorInfo", "UniprocExecutor"]
