"""llmserve: an LLM inference engine and OpenAI-compatible server."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# The public names load on first use (PEP 562): `llmserve gateway`, `bench`, `plan` and the CLI's argument checks import
# this package without needing the engine, and torch alone costs them a second and ~200 MB per process.
_EXPORTS = {
    "LLM": "llmserve.entrypoints.llm",
    "LoRARequest": "llmserve.lora.request",
    "SamplingParams": "llmserve.sampling_params",
    "RequestOutputKind": "llmserve.sampling_params",
    "StructuredOutputsParams": "llmserve.sampling_params",
    "EngineConfig": "llmserve.config",
    "RequestOutput": "llmserve.outputs",
    "CompletionOutput": "llmserve.outputs",
    "PoolingParams": "llmserve.pooling_params",
    "PoolingRequestOutput": "llmserve.outputs",
    "EmbeddingRequestOutput": "llmserve.outputs",
    "ClassificationRequestOutput": "llmserve.outputs",
    "ScoringRequestOutput": "llmserve.outputs",
    "BeamSearchParams": "llmserve.beam_search",
}
__all__ = ["LLM", "LoRARequest", "SamplingParams", "RequestOutputKind", "StructuredOutputsParams", "EngineConfig",
           "RequestOutput", "CompletionOutput", "PoolingParams", "PoolingRequestOutput", "EmbeddingRequestOutput",
           "ClassificationRequestOutput", "ScoringRequestOutput", "BeamSearchParams"]
__version__ = "0.1.0"

if TYPE_CHECKING:
    from llmserve.beam_search import BeamSearchParams
    from llmserve.config import EngineConfig
    from llmserve.entrypoints.llm import LLM
    from llmserve.lora.request import LoRARequest
    from llmserve.outputs import (ClassificationRequestOutput, CompletionOutput, EmbeddingRequestOutput,
                                  PoolingRequestOutput, RequestOutput, ScoringRequestOutput)
    from llmserve.pooling_params import PoolingParams
    from llmserve.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'llmserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
