"""The command line as a user meets it: real subprocesses, one-line errors, no tracebacks."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")


def llmserve(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "llmserve", *args], capture_output=True, text=True, timeout=timeout)


def assert_one_line_error(result, *needles):
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = [l for l in result.stderr.strip().splitlines() if l.startswith("error:")]
    assert len(lines) == 1, result.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def write_gguf(path, arch="llama", tensor_type=gguf.GGMLQuantizationType.F32):
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(32)
    w.add_feed_forward_length(64)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-6)
    if tensor_type == gguf.GGMLQuantizationType.F32:
        w.add_tensor("token_embd.weight", np.zeros((16, 32), dtype=np.float32))
    else:
        block, size = gguf.GGML_QUANT_SIZES[tensor_type]
        raw = np.zeros((16, 32 // block * size), dtype=np.uint8)
        w.add_tensor("token_embd.weight", raw, raw_dtype=tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_generate_streams_text_from_default_model():
    r = llmserve("generate", "The capital of France is", "--max-tokens", "8", "--temperature", "0")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


def test_info_reports_gqa_kv_bytes():
    r = llmserve("info")
    assert r.returncode == 0, r.stderr
    assert "23,040" in r.stdout and "Q4_1" in r.stdout and "134.5M" in r.stdout and "8,192" in r.stdout
    assert "weights widened (bf16 / float32)  256.6 / 513.1 MiB" in r.stdout
    assert "linear weights' types             210 Q4_1, 1 Q8_0 (--decode-quantization auto" in r.stdout
    assert "runs as                           a text generator (--runner generate" in r.stdout
    if "cpu /" in r.stdout:  # the device's scheduling defaults, as the engine would choose them
        assert "--max-num-seqs 64, --max-num-batched-tokens 1024, --kv-cache-fraction 0.1 " in r.stdout
    else:
        assert "--max-num-seqs 256, --max-num-batched-tokens 8192, --gpu-memory-utilization 0.9 " in r.stdout


def test_missing_model_path():
    assert_one_line_error(llmserve("generate", "hi", "--model", "/nonexistent/model.gguf"), "model not found")


def test_pickle_refused():
    assert_one_line_error(llmserve("info", "/tmp/model.bin"), "safetensors or GGUF")


def test_unsupported_hf_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    assert_one_line_error(llmserve("generate", "hi", "--model", str(tmp_path)), "unsupported architecture", "GPT2LMHeadModel")


def test_unsupported_gguf_architecture(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(path, arch="gpt2")
    assert_one_line_error(llmserve("generate", "hi", "--model", str(path)), "unsupported architecture 'gpt2'")


def test_unsupported_gguf_quantization(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(path, tensor_type=gguf.GGMLQuantizationType.Q8_1)  # llama.cpp's activation type: no weights use it
    assert_one_line_error(llmserve("generate", "hi", "--model", str(path)), "unsupported quantization Q8_1")


def test_prompt_longer_than_context():
    r = llmserve("generate", "word " * 100, "--max-model-len", "32")
    assert_one_line_error(r, "maximum context length is 32 tokens")


def test_bad_sampling_value():
    assert_one_line_error(llmserve("generate", "hi", "--temperature", "-1"), "temperature")


def test_not_a_model_file(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("hello")
    assert_one_line_error(llmserve("generate", "hi", "--model", str(path)), "neither a GGUF file")


def test_generate_with_int8_decode_weights():
    r = llmserve("generate", "The capital of France is", "--max-tokens", "8", "--temperature", "0", "--decode-quantization", "int8",
                 "--device", "cpu")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


@pytest.mark.slow  # compiles four graphs cold for the default KV pool (~3 min); tests/test_compiled_steps.py covers compile
def test_generate_compiled():
    r = llmserve("generate", "The capital of France is", "--max-tokens", "8", "--temperature", "0", "--compile", timeout=600)
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


@pytest.mark.slow  # a failing native build takes 30-40 s on 2 cores; the error line is what it checks
def test_compile_without_a_compiler_is_one_line(tmp_path):
    env = dict(os.environ, CXX=str(tmp_path / "no-such-g++"), TORCHINDUCTOR_FORCE_DISABLE_CACHES="1",
               TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    r = subprocess.run([sys.executable, "-m", "llmserve", "generate", "hi", "--compile"], capture_output=True,
                       text=True, timeout=600, env=env)
    assert_one_line_error(r, "compile failed", "needs a C++ compiler")


def test_generate_with_structured_output(tmp_path):
    """llama.cpp's flags: --json-schema (text or @file), --regex, --choice, --grammar; a bad one is a one-line error."""
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                                  "required": ["city"], "additionalProperties": False}))
    r = llmserve("generate", "--chat", "Where is the Eiffel tower? Reply in JSON.", "--json-schema", f"@{schema}",
                 "--temperature", "0", "--max-tokens", "40")
    assert r.returncode == 0, r.stderr
    assert list(json.loads(r.stdout)) == ["city"]
    assert_one_line_error(llmserve("generate", "hi", "--regex", "[a-"), "structured_outputs", "regex")
    assert_one_line_error(llmserve("generate", "hi", "--grammar", "@/nonexistent/g.lark"), "--grammar", "cannot read")
    assert_one_line_error(llmserve("generate", "hi", "--regex", "a", "--choice", "a"), "exactly one of")


# ---- commands that read no weights start without torch ----------------------------------------
@pytest.fixture
def torch_tripwire(tmp_path):
    """An environment in which `import torch`, from this process or any it starts, writes who imported it to a file and
    fails: `plan`, `bench` against a server (and its client processes) and `gateway` must not load torch (a second
    and ~200 MB in each process)."""
    stub = tmp_path / "tripwire" / "torch"
    stub.mkdir(parents=True)
    marker = tmp_path / "torch-imported"
    (stub / "__init__.py").write_text(
        "import sys, traceback\n"
        f"with open({str(marker)!r}, 'a') as f:\n"
        "    f.write(' '.join(sys.argv) + '\\n' + ''.join(traceback.format_stack()))\n"
        "raise ImportError('torch imported by a command that needs no weights')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(stub.parent), os.environ.get("PYTHONPATH")]))}
    yield env
    assert not marker.exists(), marker.read_text()


def test_plan_and_bench_start_without_torch(torch_tripwire, default_gguf, tmp_path):
    from tests.scripted_server import ScriptedServer

    def run(*args):
        r = subprocess.run([sys.executable, "-m", "llmserve", *args], capture_output=True, text=True, timeout=300,
                           env=torch_tripwire)
        assert r.returncode == 0, r.stderr
        return r.stdout

    assert "break-even utilization" in run("plan", "Llama-3.1-8B", "--hardware", "h100")
    assert "134.5M" in run("plan", default_gguf, "--hardware", "h100")  # the model's config, read without its weights
    server = ScriptedServer()
    try:
        result = tmp_path / "bench.json"
        run("bench", "--base-url", server.base_url, "--input-len", "16", "--output-len", "4", "--concurrency", "2",
            "--num-requests", "6", "--warmup", "0", "--client-processes", "2", "--quiet", "--no-plots",
            "--result", str(result))  # the synthetic prompts come from the default model's tokenizer
        assert json.loads(result.read_text())["levels"][0]["summary"]["completed"] == 6
    finally:
        server.stop()


def test_a_missing_or_pickled_model_is_refused_before_torch_loads(torch_tripwire, tmp_path):
    """One line and exit code 2, before torch and the engine load (the tripwire): the path is checked first."""
    pickled = tmp_path / "model.bin"
    pickled.write_bytes(b"not read")
    for command, model, message in [("generate", tmp_path / "missing.gguf", "model not found"),
                                    ("serve", tmp_path / "missing", "model not found"),
                                    ("generate", pickled, "pickled weights can run code")]:
        args = [command, "hi"] if command == "generate" else [command]
        r = subprocess.run([sys.executable, "-m", "llmserve", *args, "--model", str(model)], capture_output=True,
                           text=True, timeout=120, env=torch_tripwire)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], r.stderr


def test_gateway_starts_without_torch(torch_tripwire, tmp_path):
    from tests.server_fixtures import ServerProcess

    config = tmp_path / "gateway.yaml"
    config.write_text("backends:\n  a: {url: 'http://127.0.0.1:9/v1', model: m}\nmodels:\n  chat: {targets: [a]}\n")
    gateway = ServerProcess("--config", str(config), command="gateway", env=torch_tripwire)
    try:
        gateway.wait_ready(timeout=60)
        assert [m.id for m in gateway.client().models.list()] == ["chat"]
    finally:
        gateway.stop()


def test_the_package_names_load_on_first_use():
    import llmserve

    assert {"LLM", "SamplingParams", "LoRARequest"} <= set(dir(llmserve))
    from llmserve import LLM, SamplingParams  # noqa: F401  (vLLM's import)
    assert llmserve.SamplingParams is SamplingParams and LLM.__module__ == "llmserve.entrypoints.llm"
    with pytest.raises(AttributeError, match="no attribute 'Engine'"):
        llmserve.Engine  # noqa: B018
