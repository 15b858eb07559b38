"""llmserve: an LLM inference engine and OpenAI-compatible server."""

from llmserve.config import EngineConfig
from llmserve.entrypoints.llm import LLM
from llmserve.lora.request import LoRARequest
from llmserve.outputs import CompletionOutput, RequestOutput
from llmserve.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "LoRARequest", "SamplingParams", "RequestOutputKind", "StructuredOutputsParams", "EngineConfig", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
