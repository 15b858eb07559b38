"""SageMaker's /ping and /invocations (as vLLM serves them) and the dev-mode POST /reset_prefix_cache, on a real
server, with the openai client's answers from the ordinary routes as the reference."""

import json

import httpx
import openai
import pytest

from tests.server_fixtures import RunningServer

KEY = {"Authorization": "Bearer sk-ops"}


@pytest.fixture(scope="module")
def server(default_files):
    s = RunningServer(default_files, {}, {"api_key": "sk-ops", "dev_mode": True, "root_path": ""})
    yield s
    s.stop()


def test_ping_answers_as_health(server):
    assert httpx.get(server.base_url + "/ping").status_code == 200
    assert httpx.post(server.base_url + "/ping").status_code == 200


def test_invocations_route_by_the_bodys_shape(server):
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="sk-ops", max_retries=0)
    chat = {"model": "test-model", "messages": [{"role": "user", "content": "Name a fruit."}], "max_tokens": 8,
            "temperature": 0}
    got = httpx.post(server.base_url + "/invocations", json=chat, headers=KEY, timeout=60)
    assert got.status_code == 200
    want = client.chat.completions.create(**chat)
    assert got.json()["object"] == "chat.completion"
    assert got.json()["choices"][0]["message"]["content"] == want.choices[0].message.content

    completion = {"model": "test-model", "prompt": "The sky is", "max_tokens": 6, "temperature": 0}
    want_text = client.completions.create(**completion).choices[0].text
    with httpx.stream("POST", server.base_url + "/invocations", json={**completion, "stream": True}, headers=KEY,
                      timeout=60) as streamed:
        assert streamed.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in streamed.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == want_text

    response = httpx.post(server.base_url + "/invocations", headers=KEY, timeout=60,
                          json={"model": "test-model", "input": "Say hi.", "max_output_tokens": 5, "temperature": 0})
    assert response.status_code == 200 and response.json()["object"] == "response"


def test_invocations_errors(server):
    url = server.base_url + "/invocations"
    unknown = httpx.post(url, json={"model": "test-model", "question": "?"}, headers=KEY)
    assert unknown.status_code == 400
    error = unknown.json()["error"]
    assert "/invocations takes a body of a known shape" in error["message"] and error["type"] == "BadRequestError"
    not_json = httpx.post(url, content=b"{nope", headers={**KEY, "content-type": "application/json"})
    assert not_json.status_code == 400 and "takes a JSON object" in not_json.json()["error"]["message"]
    # the target route's own checks: credentials, then the request's fields
    assert httpx.post(url, json={"model": "test-model", "prompt": "x"}).status_code == 401
    bad = httpx.post(url, json={"model": "test-model", "prompt": "x", "max_tokens": -1}, headers=KEY)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"


def test_reset_prefix_cache_in_dev_mode(server, default_files):
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="sk-ops", max_retries=0)
    prompt = "You are a meticulous assistant who answers in one word. " * 6 + "Colour of grass?"

    def cached() -> int:
        out = client.completions.create(model="test-model", prompt=prompt, max_tokens=2, temperature=0)
        return out.usage.prompt_tokens_details.cached_tokens

    cached()
    assert cached() > 0
    assert httpx.post(server.base_url + "/reset_prefix_cache").status_code == 401  # behind the API key
    assert httpx.post(server.base_url + "/reset_prefix_cache", headers=KEY).status_code == 200
    assert cached() == 0
    server.wait_idle()


def test_dev_routes_are_absent_without_dev_mode(default_files):
    plain = RunningServer(default_files, {}, {})
    try:
        assert httpx.post(plain.base_url + "/reset_prefix_cache").status_code == 404
    finally:
        plain.stop()
