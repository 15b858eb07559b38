import dataclasses
import os

import pytest
import torch

from llmserve.config import EngineConfig
from llmserve.engine.llm_engine import LLMEngine
from llmserve.loader import default_model_path, load_model_files

torch.set_num_threads(os.cpu_count() or 1)
# Without a GPU, llmserve's Triton kernels (CUDA's attention backend, the CUDA deterministic mode's matmul and norm)
# run on CPU tensors under Triton's interpreter; it is chosen when a kernel is defined, so before any is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _interpreted_dot_sums_each_row_in_one_order() -> None:
    """The interpreter's tl.dot is numpy's matmul, so the host's BLAS. A GPU's MMA reduces every row of a tile in the
    same order, which is what makes the deterministic mode's kernels batch-invariant. OpenBLAS's Haswell sgemm
    kernel does not: a row's float32 sum changes with the row's place in the tile. numpy's OpenBLAS 0.3.31 picks
    that kernel on an AMD Zen 5 (family 26; OPENBLAS_VERBOSE=2 says so), where the bit-for-bit tests then failed
    while they passed on Zen 4 (SkylakeX kernel): they measured OpenBLAS, not our kernels' tiling. So float32 dots
    here sum each row's products in one order, the same for every row, as an MMA does."""
    import numpy as np
    from triton.runtime import interpreter

    matmul = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if not (a.data.dtype == b.data.dtype == d.data.dtype == np.float32):
            return matmul(self, a, b, d, input_precision, max_num_imprecise_acc)
        products = a.data[..., :, :, None] * b.data[..., None, :, :]  # [..., M, K, N]
        return interpreter.TensorHandle(np.add.reduce(products, axis=-2) + d.data, d.dtype.scalar)

    interpreter.InterpreterBuilder.create_dot = create_dot


if os.environ.get("TRITON_INTERPRET") == "1":
    try:
        import triton  # noqa: F401
    except ImportError:
        pass  # the Triton tests skip
    else:
        _interpreted_dot_sums_each_row_in_one_order()


@pytest.fixture(scope="session")
def default_gguf() -> str:
    if os.environ.get("LLMSERVE_TESTS_WITHOUT_DEFAULT_MODEL") == "1":
        # the GPU machine's run (benchmarks/gpu_suite.sh): the default model's file cannot be brought there
        pytest.skip("the default model is not on this machine (LLMSERVE_TESTS_WITHOUT_DEFAULT_MODEL=1)")
    return default_model_path()


def _read_once(path: str):
    """A model's files whose weights are read once: each engine built from them gets the same dequantized weights."""
    files = load_model_files(path)
    weights = list(files.weights())
    return dataclasses.replace(files, weights=lambda: iter(weights))


@pytest.fixture(scope="session")
def default_files(default_gguf):
    return _read_once(default_gguf)


@pytest.fixture(scope="session")
def shallow_gguf(default_gguf, tmp_path_factory) -> str:
    """The default model cut to its first 3 layers (tests/gguf_helpers.write_truncated_gguf: the same vocabulary, chat
    template, shapes and weight types). For tests that compare llmserve with itself (a server against the engine,
    one process layout against another) or check what an API returns, where the other 27 layers only cost time:
    reading and packing them at each start, and running them at each step."""
    from tests.gguf_helpers import write_truncated_gguf

    return write_truncated_gguf(tmp_path_factory.mktemp("shallow") / "SmolLM2-135M-Instruct-3-layers.gguf", default_gguf, 3)


@pytest.fixture(scope="session")
def shallow_files(shallow_gguf):
    return _read_once(shallow_gguf)


@pytest.fixture(scope="session")
def shallow_engine(shallow_files) -> LLMEngine:
    """The float32 engine on the 3-layer cut: the reference for servers and processes started on it."""
    return _engine_maker(shallow_files)()


def _engine_maker(files, **defaults):
    """Engines in float32, the reference mode: on a CPU the file's int4 codes against float32 activations (auto), the
    dequantized weights exactly, so results compare with transformers' float32; on a GPU the float weights."""

    def make(**overrides) -> LLMEngine:
        cfg = dict(dtype="float32", kv_cache_memory="256MiB", max_num_seqs=32, **defaults)
        cfg.update(overrides)
        return LLMEngine(EngineConfig(**cfg), files=files)

    return make


@pytest.fixture(scope="session")
def engine_maker():
    """For a module whose engines serve other model files the same way: engine_maker(files, **defaults)."""
    return _engine_maker


@pytest.fixture(scope="session")
def make_engine(default_files):
    return _engine_maker(default_files)


@pytest.fixture(scope="session")
def make_cpu_engine(default_files):
    """For the CPU-only features (native kernels, low-bit weights, compiled CPU graphs): on a machine with a GPU,
    `device="auto"` would pick CUDA, where these are refused or absent. Modules of such tests override make_engine
    with it."""
    return _engine_maker(default_files, device="cpu")


@pytest.fixture(scope="session")
def engine_f32(make_engine) -> LLMEngine:
    return make_engine()


@pytest.fixture(scope="session")
def hf_gguf_model(default_gguf):
    """transformers' own load of the same GGUF (it dequantizes): the reference for logits and tokens."""
    transformers = pytest.importorskip("transformers")
    folder, name = os.path.split(default_gguf)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def hf_gguf_tokenizer(default_gguf):
    transformers = pytest.importorskip("transformers")
    folder, name = os.path.split(default_gguf)
    return transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
