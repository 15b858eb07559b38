"""/v1/embeddings on a real server (--runner pooling), through the openai client: the engine's own embeddings in
OpenAI's shape (floats or base64), every input form, the errors, and the gateway in front."""

from __future__ import annotations

import base64
import json

import httpx
import numpy as np
import openai
import pytest
import torch

from llmserve.pooling_params import PoolingParams
from tests.helpers import run_to_completion
from tests.server_fixtures import RunningServer, ServerProcess
from tests.test_gateway import RunningGateway


@pytest.fixture(scope="module")
def pooling_server(default_files):
    server = RunningServer(default_files, {"runner": "pooling"}, {})
    yield server
    server.stop()


def engine_embedding(server, ids: list[int]) -> list[float]:
    """What the server's engine gives for these tokens directly (run between the server's own steps)."""
    def run(engine):
        engine.add_request("direct", ids, PoolingParams())
        return run_to_completion(engine)["direct"].outputs.data.tolist()
    return server.engine.call(run, server.llm).result()


def test_embeddings_through_the_openai_client(pooling_server):
    s = pooling_server
    client = openai.OpenAI(base_url=s.base_url + "/v1", api_key="x", max_retries=0)
    texts = ["The capital of France is Paris.", "def add(a, b): return a + b", "hi"]
    floats = client.embeddings.create(model="test-model", input=texts, encoding_format="float")
    assert [d.index for d in floats.data] == [0, 1, 2] and floats.model == "test-model"
    ids = [httpx.post(s.base_url + "/tokenize", json={"prompt": t}).json()["tokens"] for t in texts]
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == sum(len(i) for i in ids)
    for d, tokens in zip(floats.data, ids):
        assert len(d.embedding) == 576
        assert np.isclose(np.linalg.norm(d.embedding), 1.0, atol=1e-5)
        assert d.embedding == pytest.approx(engine_embedding(s, tokens), abs=1e-6)
    # the SDK's default asks for base64 and decodes it: the same float32 values
    b64 = client.embeddings.create(model="test-model", input=texts)
    for a, b in zip(b64.data, floats.data):
        assert a.embedding == pytest.approx(b.embedding, abs=1e-6)
    raw = httpx.post(s.base_url + "/v1/embeddings", json={"input": "hi", "encoding_format": "base64"}).json()
    assert np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), "<f4").tolist() == pytest.approx(
        floats.data[2].embedding, abs=1e-6)
    # token ids, one list or several; vLLM's chat form (the template's tokens)
    as_ids = client.embeddings.create(model="test-model", input=ids, encoding_format="float")
    assert as_ids.data[0].embedding == pytest.approx(floats.data[0].embedding, abs=1e-6)
    one = client.embeddings.create(model="test-model", input=ids[1], encoding_format="float")
    assert one.data[0].embedding == pytest.approx(floats.data[1].embedding, abs=1e-6)
    messages = [{"role": "user", "content": "Hello there"}]
    chat = httpx.post(s.base_url + "/v1/embeddings", json={"messages": messages}).json()
    rendered = httpx.post(s.base_url + "/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
    assert chat["usage"]["prompt_tokens"] == rendered["count"]
    assert chat["data"][0]["embedding"] == pytest.approx(engine_embedding(s, rendered["tokens"]), abs=1e-6)
    s.wait_idle()


@pytest.mark.parametrize("body, status, param, message", [
    ({"input": ""}, 400, "input", "empty strings"),
    ({"input": []}, 400, "input", "must not be empty"),
    ({}, 400, "input", "give input"),
    ({"input": [[1, 2], [99999]]}, 400, "input", "outside the vocabulary"),
    ({"input": "x " * 9000}, 400, "input", "maximum context length is 8192 tokens"),
    ({"input": "hi", "dimensions": 64}, 400, "dimensions", "does not support matryoshka"),
    ({"input": "hi", "encoding_format": "int8"}, 400, "encoding_format", "float"),
    ({"input": "hi", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens", "at least 1"),
    ({"input": "hi", "model": "nope"}, 404, "model", "does not exist"),
])
def test_embedding_errors(pooling_server, body, status, param, message):
    r = httpx.post(pooling_server.base_url + "/v1/embeddings", json=body, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and message in error["message"]


def cosine(a, b) -> float:
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_score_and_rerank_are_cosine_similarities_of_the_embeddings(pooling_server):
    """vLLM's /score (one text_1 against many, or pair by pair) and the Jina/Cohere rerank API, as vLLM serves them
    with an embedding model: the cosine similarity of the texts' embeddings."""
    s = pooling_server
    query = "What is the capital of France?"
    docs = ["The capital of Brazil is Brasilia.", "Paris is the capital of France.", "Horses are animals."]
    vecs = [d.embedding for d in openai.OpenAI(base_url=s.base_url + "/v1", api_key="x").embeddings.create(
        model="test-model", input=[query, *docs], encoding_format="float").data]
    expected = [cosine(vecs[0], v) for v in vecs[1:]]

    one_to_many = httpx.post(s.base_url + "/score", json={"text_1": query, "text_2": docs}).json()
    assert [d["index"] for d in one_to_many["data"]] == [0, 1, 2]
    assert [d["score"] for d in one_to_many["data"]] == pytest.approx(expected, abs=1e-5)
    pairwise = httpx.post(s.base_url + "/v1/score", json={"text_1": docs[:2], "text_2": docs[1:]}).json()
    assert [d["score"] for d in pairwise["data"]] == pytest.approx([cosine(vecs[1], vecs[2]), cosine(vecs[2], vecs[3])],
                                                                   abs=1e-5)
    ids = [httpx.post(s.base_url + "/tokenize", json={"prompt": t}).json()["count"] for t in [query, *docs]]
    assert one_to_many["usage"]["prompt_tokens"] == sum(ids)

    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        ranked = httpx.post(s.base_url + path, json={"query": query, "documents": docs, "top_n": 2}).json()
        order = sorted(range(3), key=lambda j: -expected[j])[:2]
        assert [r["index"] for r in ranked["results"]] == order
        assert [r["relevance_score"] for r in ranked["results"]] == pytest.approx([expected[j] for j in order], abs=1e-5)
        assert ranked["results"][0]["document"] == {"text": docs[order[0]]}
        assert ranked["usage"]["total_tokens"] == sum(ids)
    for body, param in (({"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2"),
                        ({"text_1": [], "text_2": ["c"]}, "text_1")):
        r = httpx.post(s.base_url + "/score", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param
    r = httpx.post(s.base_url + "/rerank", json={"query": "q", "documents": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "documents"
    s.wait_idle()


def test_long_input_truncated_and_generation_refused(pooling_server):
    s = pooling_server
    r = httpx.post(s.base_url + "/v1/embeddings", json={"input": "x " * 9000, "truncate_prompt_tokens": 100})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 100
    # a request that runs out of time gives no vector (and holds no block afterwards: wait_idle below)
    r = httpx.post(s.base_url + "/v1/embeddings", json={"input": "x " * 4000, "timeout": 0.01})
    assert r.status_code == 503 and r.json()["error"]["code"] == "request_timeout"
    r = httpx.post(s.base_url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_supported"
    assert "/v1/embeddings" in r.json()["error"]["message"]
    s.wait_idle()


def test_bench_an_embedding_server(pooling_server, tmp_path):
    """`llmserve bench --endpoint embeddings`, as vLLM's bench has an embeddings backend: every request answered, its
    input tokens counted from usage, latency as E2E (nothing streams)."""
    from llmserve.cli import main

    out = tmp_path / "embed.json"
    assert main(["bench", "--quiet", "--no-plots", "--base-url", pooling_server.base_url + "/v1", "--endpoint",
                 "embeddings", "--concurrency", "1,3", "--num-requests", "3", "--input-len", "40", "--warmup", "0",
                 "--client-processes", "1", "--result", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["endpoint"] == "embeddings" and len(r["levels"]) == 2
    for lv in r["levels"]:
        s = lv["summary"]
        assert s["completed"] == 3 and s["failed"] == 0 and s["total_input_tokens"] == 120
        assert s["mean_e2e_ms"] > 0 and s["mean_ttft_ms"] is None and s["total_output_tokens"] == 0
    with pytest.raises(SystemExit):  # (argparse) an endpoint the bench does not know
        main(["bench", "--endpoint", "rerank"])
    pooling_server.wait_idle()
    # the engine in this process, as an embedding engine
    assert main(["bench", "--engine", "--runner", "pooling", "--dtype", "float32", "--kv-cache-memory", "64MiB",
                 "--endpoint", "embeddings", "--quiet", "--no-plots", "--concurrency", "2", "--num-requests", "2",
                 "--input-len", "20", "--warmup", "0", "--result", str(out)]) == 0
    assert [(q["status"], q["input_tokens"]) for q in json.loads(out.read_text())["levels"][0]["requests"]] == \
        [("ok", 20), ("ok", 20)]


def test_a_generate_server_refuses_embeddings(default_files):
    server = RunningServer(default_files, {"max_num_seqs": 4}, {})
    try:
        r = httpx.post(server.base_url + "/v1/embeddings", json={"input": "hi"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_supported"
        assert "--runner pooling" in r.json()["error"]["message"]
    finally:
        server.stop()


def test_serve_runner_pooling_from_the_command_line(pooling_server):
    """`llmserve serve --runner pooling` with its engine in a process of its own: the same embeddings as the
    in-process engine; vLLM's older --task embed and its --pooler-config flag."""
    proc = ServerProcess("--task", "embed", "--dtype", "float32", "--kv-cache-memory", "128MiB", "--engine-process",
                         "--served-model-name", "test-model").wait_ready()
    try:
        mine = proc.client().embeddings.create(model="test-model", input=["one two three", "four"])
        ref = openai.OpenAI(base_url=pooling_server.base_url + "/v1", api_key="x").embeddings.create(
            model="test-model", input=["one two three", "four"])
        for a, b in zip(mine.data, ref.data):
            assert a.embedding == pytest.approx(b.embedding, abs=1e-5)
        assert "POST /v1/embeddings" in proc.output()
    finally:
        proc.stop()
    bad = ServerProcess("--runner", "pooling", "--pooler-config", '{"pooling_type": "ALL"}')
    assert bad.proc.wait(timeout=60) != 0
    assert "pooling_type must be one of LAST, MEAN, CLS" in bad.output() and "Traceback" not in bad.output()


def test_embeddings_through_the_gateway(pooling_server):
    config = {"backends": {"e": {"url": pooling_server.base_url + "/v1", "model": "test-model"}},
              "models": {"embed": {"targets": ["e"]}}}
    gw = RunningGateway(config)
    try:
        client = openai.OpenAI(base_url=gw.base_url, api_key="unused", max_retries=0)
        out = client.embeddings.create(model="embed", input=["a cat", "a dog"])
        direct = openai.OpenAI(base_url=pooling_server.base_url + "/v1", api_key="x").embeddings.create(
            model="test-model", input=["a cat", "a dog"])
        assert out.model == "embed" and out.usage.prompt_tokens == direct.usage.prompt_tokens
        assert out.data[1].embedding == pytest.approx(direct.data[1].embedding, abs=1e-6)
        with pytest.raises(openai.BadRequestError, match="input must not be empty"):
            client.embeddings.create(model="embed", input="")
        ranked = httpx.post(gw.base_url + "/rerank", json={"model": "embed", "query": "a cat",
                                                           "documents": ["a dog", "a car"]})
        assert ranked.status_code == 200 and ranked.headers["x-llmserve-backend"] == "e"
        assert len(ranked.json()["results"]) == 2 and ranked.json()["model"] == "embed"
        scored = httpx.post(gw.base_url + "/score", json={"model": "embed", "text_1": "a cat", "text_2": "a dog"})
        assert scored.status_code == 200 and scored.json()["data"][0]["score"] == pytest.approx(
            ranked.json()["results"][[r["index"] for r in ranked.json()["results"]].index(0)]["relevance_score"],
            abs=1e-5)
    finally:
        gw.stop()
    assert torch.tensor(out.data[0].embedding).norm().item() == pytest.approx(1.0, abs=1e-5)


def test_classify_api(tmp_path, default_gguf, pooling_server):
    """vLLM's /classify on a classifier (here a random-weight LlamaForSequenceClassification with the default
    model's tokenizer): each input's class probabilities and its most likely label, as transformers computes them."""
    from llmserve.loader import load_model_files
    from tests.test_embeddings import classifier_logits, save_classifier

    model = save_classifier(tmp_path, 3, vocab=49152)
    server = RunningServer(load_model_files(str(tmp_path), tokenizer=default_gguf), {}, {})
    try:
        texts = ["I loved this film.", "Terrible service, never again."]
        r = httpx.post(server.base_url + "/classify", json={"input": texts}).json()
        ids = [httpx.post(server.base_url + "/tokenize", json={"prompt": t}).json()["tokens"] for t in texts]
        assert r["usage"]["prompt_tokens"] == sum(map(len, ids))
        for d, tokens in zip(r["data"], ids):
            probs = torch.softmax(classifier_logits(model, tokens), -1)
            assert d["probs"] == pytest.approx(probs.tolist(), abs=1e-4) and d["num_classes"] == 3
            assert d["label"] == f"class_{int(probs.argmax())}"
        raw = httpx.post(server.base_url + "/v1/classify", json={"input": ids[0], "activation": False}).json()
        assert raw["data"][0]["probs"] == pytest.approx(classifier_logits(model, ids[0]).tolist(), abs=1e-4)
        bad = httpx.post(server.base_url + "/classify", json={"input": ["hi", ""]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "input"
        r = httpx.post(server.base_url + "/v1/embeddings", json={"input": "hi"})
        assert r.status_code == 400 and "POST /classify" in r.json()["error"]["message"]
        gw = RunningGateway({"backends": {"c": {"url": server.base_url + "/v1", "model": "test-model"}},
                             "models": {"sentiment": {"targets": ["c"]}}})
        try:
            via = httpx.post(gw.base_url + "/classify", json={"model": "sentiment", "input": texts[0]}).json()
            assert via["model"] == "sentiment" and via["data"][0]["probs"] == pytest.approx(
                torch.softmax(classifier_logits(model, ids[0]), -1).tolist(), abs=1e-4)
        finally:
            gw.stop()
        server.wait_idle()
    finally:
        server.stop()
    r = httpx.post(pooling_server.base_url + "/classify", json={"input": "hi"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_supported"


def test_embeddings_through_a_lora_adapter(tmp_path, default_gguf):
    """--lora-modules on an embedding server: a request's `model` names its adapter, whose merged model's vector it
    gets, and the answer names it."""
    from llmserve.loader import load_model_files
    from tests.lora_helpers import make_adapter, tiny_base

    base = tiny_base(tmp_path / "base", vocab_size=49152)
    merged = make_adapter(base, tmp_path / "a1", seed=1)
    files = load_model_files(str(tmp_path / "base"), tokenizer=default_gguf)
    server = RunningServer(files, {"runner": "pooling", "enable_lora": True}, {"lora_modules": {"a1": str(tmp_path / "a1")}})
    try:
        ids = httpx.post(server.base_url + "/tokenize", json={"prompt": "hello there"}).json()["tokens"]
        for name, model in (("test-model", base), ("a1", merged)):
            r = httpx.post(server.base_url + "/v1/embeddings", json={"model": name, "input": ids}).json()
            with torch.no_grad():
                ref = torch.nn.functional.normalize(model.model(torch.tensor([ids])).last_hidden_state[0, -1], dim=-1)
            assert r["model"] == name and r["data"][0]["embedding"] == pytest.approx(ref.tolist(), abs=1e-4)
        server.wait_idle()
    finally:
        server.stop()
