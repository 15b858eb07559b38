"""LoRA adapters over HTTP, as vLLM serves them: adapters named by `model`, listed with their parent, loaded and
unloaded at run time behind the API key, folders confined to --lora-dir. Real server on 127.0.0.1, real `openai`
client, the default model with adapters made by peft."""

import asyncio
import os
import subprocess
import sys

import httpx
import openai
import pytest

from llmserve.config import EngineConfig
from llmserve.engine.llm_engine import LLMEngine
from llmserve.lora import LoRARequest
from tests.helpers import greedy, run_to_completion
from tests.lora_helpers import make_adapter
from tests.server_fixtures import RunningServer, ServerProcess, free_port

pytest.importorskip("peft")
MODEL, KEY = "test-model", "sekret"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory, hf_gguf_model):
    allowed = tmp_path_factory.mktemp("allowed")
    outside = tmp_path_factory.mktemp("outside")
    for i, name in enumerate(["french", "german", "spare"]):
        make_adapter(hf_gguf_model, allowed / name, seed=20 + i, r=8, alpha=8)
    make_adapter(hf_gguf_model, allowed / "too_wide", seed=30, r=32, alpha=32)
    make_adapter(hf_gguf_model, outside / "secret", seed=31, r=8, alpha=8)
    os.symlink(outside / "secret", allowed / "escape")
    return allowed, outside


@pytest.fixture(scope="module")
def expected(default_files, adapter_dirs, hf_gguf_tokenizer):
    """What the offline engine gives for the prompt under each adapter (and the base), greedy, 12 tokens."""
    allowed, _ = adapter_dirs
    engine = LLMEngine(EngineConfig(dtype="float32", kv_cache_memory="64MiB", enable_lora=True, max_loras=2),
                       files=default_files)
    texts = {}
    for i, name in enumerate([None, "french", "german", "spare"]):
        lora = LoRARequest(name, i, str(allowed / name)) if name else None
        engine.add_request("r", PROMPT, greedy(12, ignore_eos=True), lora_request=lora)
        texts[name or MODEL] = run_to_completion(engine)["r"].outputs[0].text
    assert len(set(texts.values())) == 4  # each adapter changes what the model says
    return texts


@pytest.fixture(scope="module")
def server(default_files, adapter_dirs):
    allowed, _ = adapter_dirs
    s = RunningServer(default_files, {"enable_lora": True, "max_loras": 2, "max_cpu_loras": 3, "kv_cache_memory": "64MiB"},
                      {"api_key": KEY, "lora_modules": {"french": str(allowed / "french"), "german": str(allowed / "german")},
                       "lora_dirs": [str(allowed)], "allow_runtime_lora_updating": True})
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0)


def _post(server, route, body, key=KEY):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.base_url + route, json=body, headers=headers, timeout=60)


def _complete(client, model, **kw):
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True}, **kw)


def test_models_lists_adapters_with_their_parent(client, adapter_dirs):
    models = {m.id: m for m in client.models.list().data}
    assert set(models) >= {MODEL, "french", "german"}
    assert models["french"].parent == MODEL and models["german"].parent == MODEL
    assert models["french"].root == str(adapter_dirs[0] / "french")


def test_requests_select_adapters_by_model_name(client, expected):
    for model in (MODEL, "french", "german"):
        r = _complete(client, model)
        assert r.model == model
        assert r.choices[0].text == expected[model]
    chat = client.chat.completions.create(model="french", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert chat.model == "french" and chat.usage.completion_tokens <= 4


def test_concurrent_mixed_adapters_match_their_offline_runs(server, expected):
    async def main():
        client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0)
        models = [MODEL, "french", "german"] * 3
        results = await asyncio.gather(*(client.completions.create(
            model=m, prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}) for m in models))
        await client.close()
        return models, results

    models, results = asyncio.run(main())
    for model, r in zip(models, results):
        assert r.choices[0].text == expected[model]
    server.wait_idle()


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as err:
        _complete(client, "no-such-adapter")
    assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"


def test_runtime_load_needs_the_api_key(server):
    r = _post(server, "/v1/load_lora_adapter", {"lora_name": "spare", "lora_path": "spare"}, key=None)
    assert r.status_code == 401
    r = _post(server, "/v1/unload_lora_adapter", {"lora_name": "french"}, key="wrong")
    assert r.status_code == 401


@pytest.mark.parametrize("path, message", [
    ("outside", "outside the directories"),
    ("dotdot", "must not contain '..'"),
    ("escape", "outside the directories"),
    ("escape_abs", "outside the directories"),
])
def test_runtime_load_is_confined_to_lora_dir(server, adapter_dirs, path, message):
    allowed, outside = adapter_dirs
    lora_path = {"outside": str(outside / "secret"), "dotdot": f"{allowed}/../{outside.name}/secret",
                 "escape": "escape", "escape_abs": str(allowed / "escape")}[path]
    r = _post(server, "/v1/load_lora_adapter", {"lora_name": "sneaky", "lora_path": lora_path})
    assert r.status_code == 400
    error = r.json()["error"]
    assert message in error["message"] and error["param"] == "lora_path" and error["type"] == "BadRequestError"
    assert "sneaky" not in {m["id"] for m in httpx.get(server.base_url + "/v1/models",
                                                        headers={"Authorization": f"Bearer {KEY}"}).json()["data"]}


def test_runtime_load_and_unload(server, client, expected):
    r = _post(server, "/v1/load_lora_adapter", {"lora_name": "spare", "lora_path": "spare"})
    assert r.status_code == 200, r.text
    assert "spare" in {m.id for m in client.models.list().data}
    assert _complete(client, "spare").choices[0].text == expected["spare"]
    again = _post(server, "/v1/load_lora_adapter", {"lora_name": "spare", "lora_path": "spare"})
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]

    r = _post(server, "/v1/unload_lora_adapter", {"lora_name": "spare"})
    assert r.status_code == 200, r.text
    assert "spare" not in {m.id for m in client.models.list().data}
    with pytest.raises(openai.NotFoundError):
        _complete(client, "spare")
    missing = _post(server, "/v1/unload_lora_adapter", {"lora_name": "spare"})
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "NotFoundError"
    # loaded again under the same name: works as before
    assert _post(server, "/v1/load_lora_adapter", {"lora_name": "spare", "lora_path": "spare"}).status_code == 200
    r = _complete(client, "spare")
    assert r.choices[0].text == expected["spare"]
    assert _post(server, "/v1/unload_lora_adapter", {"lora_name": "spare"}).status_code == 200


def test_bad_adapter_is_400_and_nothing_is_loaded(server, client):
    r = _post(server, "/v1/load_lora_adapter", {"lora_name": "wide", "lora_path": "too_wide"})
    assert r.status_code == 400
    error = r.json()["error"]
    assert "above --max-lora-rank 16" in error["message"] and error["param"] == "r"
    assert "wide" not in {m.id for m in client.models.list().data}
    r = _post(server, "/v1/load_lora_adapter", {"lora_name": "ghost", "lora_path": "nowhere"})
    assert r.status_code == 400 and "does not exist" in r.json()["error"]["message"]
    r = _post(server, "/v1/load_lora_adapter", {"lora_name": "", "lora_path": "spare"})
    assert r.status_code == 400
    r = _post(server, "/v1/load_lora_adapter", {"lora_name": MODEL, "lora_path": "spare"})
    assert r.status_code == 400 and "already been loaded" in r.json()["error"]["message"]


def test_unload_while_streaming_lets_the_request_finish(server, client, expected):
    assert _post(server, "/v1/load_lora_adapter", {"lora_name": "spare", "lora_path": "spare"}).status_code == 200
    stream = client.completions.create(model="spare", prompt=PROMPT, max_tokens=40, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True}, stream_options={"include_usage": True})
    chunks = iter(stream)
    text = next(chunks).choices[0].text
    assert _post(server, "/v1/unload_lora_adapter", {"lora_name": "spare"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        _complete(client, "spare")
    usage, finish = None, None
    for chunk in chunks:
        if chunk.choices:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            usage = chunk.usage
    assert finish == "length" and usage.completion_tokens == 40
    assert text.startswith(expected["spare"])  # the adapter stayed on until the end
    server.wait_idle()
    assert len(server.llm.executor.lora_ids()) == 2  # french and german; spare left with its last request


def test_metrics_name_running_adapters(server):
    async def main():
        client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0)
        task = asyncio.ensure_future(client.completions.create(model="german", prompt=PROMPT, max_tokens=60,
                                                                extra_body={"ignore_eos": True}))
        seen = set()
        async with httpx.AsyncClient() as http:
            while not task.done():
                text = (await http.get(server.base_url + "/metrics")).text
                seen.update(line for line in text.splitlines() if line.startswith("llmserve:lora_requests_info{"))
                await asyncio.sleep(0.05)
        await task
        await client.close()
        return seen

    seen = asyncio.run(main())
    assert any('running_lora_adapters="german"' in line and 'max_lora="2"' in line for line in seen), seen


def test_runtime_updating_is_off_by_default(default_files, adapter_dirs):
    s = RunningServer(default_files, {"enable_lora": True, "kv_cache_memory": "32MiB"}, {})
    try:
        r = httpx.post(s.base_url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "y"})
        assert r.status_code == 404
    finally:
        s.stop()


def test_serve_command_with_lora_modules(adapter_dirs, expected, tmp_path):
    """`llmserve serve --lora-modules` as a user starts it; a bad adapter stops the start-up with one line. With the
    engine in a process of its own (the CUDA default), so that adapters and their errors cross to it."""
    allowed, _ = adapter_dirs
    bad = subprocess.run([sys.executable, "-m", "llmserve", "serve", "--lora-modules", f"wide={allowed / 'too_wide'}",
                          "--port", str(free_port()), "--engine-process"], capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "Traceback" not in bad.stderr
    assert [l for l in bad.stderr.splitlines() if l.startswith("error:")] == [
        "error: the adapter's rank 32 (r in adapter_config.json) is above --max-lora-rank 16"]

    server = ServerProcess("--dtype", "float32", "--served-model-name", MODEL, "--lora-modules",
                          f"french={allowed / 'french'}", "--kv-cache-memory", "64MiB", "--engine-process")
    try:
        client = server.wait_ready().client()
        assert {m.id for m in client.models.list().data} == {MODEL, "french"}
        assert _complete(client, "french").choices[0].text == expected["french"]
        r = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "y"})
        assert r.status_code == 404  # runtime updating not allowed
    finally:
        server.stop()
