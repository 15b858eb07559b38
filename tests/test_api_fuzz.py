"""The HTTP API under generated requests, against a live server on the default model:
- from OpenAI's published schema, as the `openai` SDK's request types carry it (generated from that schema), for the
  chat and completions routes;
- from llmserve's own OpenAPI document (its request models), with schemathesis, for every route.

No response may be a 5xx, every error body must be OpenAI's error object (`code` a string or null), and every 200 from
the generation routes must parse as the SDK's response type. The default run is bounded; the slow-marked runs take
thousands of cases (docs/structured-output.md records their figures)."""

from __future__ import annotations

import collections.abc
import json
import os

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
import anthropic.types as anthropic_types
from openai.types import Completion, ErrorObject
from openai.types import completion_create_params as completion_params
from openai.types.chat import ChatCompletion
from openai.types.chat import completion_create_params as chat_params
from openai.types.responses import Response
from openai.types.responses import response_create_params

from tests.server_fixtures import RunningServer

MODEL = "test-model"
FAST = int(os.environ.get("LLMSERVE_FUZZ_EXAMPLES", "40"))
SLOW = 1500

# the SDK types say Iterable[...] where JSON has arrays
st.register_type_strategy(collections.abc.Iterable, lambda t: st.lists(st.from_type(t.__args__[0]), max_size=3)
                          if getattr(t, "__args__", None) else st.lists(st.integers(), max_size=3))


@pytest.fixture(scope="module")
def server(shallow_files):
    s = RunningServer(shallow_files, {"max_model_len": 512}, {})
    yield s
    s.stop()


STATUSES: collections.Counter = collections.Counter()  # per (route, status): printed with -s, for the figures


def check_response(r: httpx.Response, ok_type) -> None:
    STATUSES[(r.request.url.path, r.status_code)] += 1
    assert r.status_code < 500, r.text
    if r.request.url.path.startswith("/v1/messages"):  # Anthropic's API: its error object and types
        if r.status_code >= 400:
            body = r.json()
            anthropic_types.ErrorResponse.model_validate(body, strict=True)
            assert body["error"]["type"] in (*anthropic_types.ErrorType.__args__, "request_too_large")
        elif ok_type is not None:
            body = r.json()
            if body.get("stop_reason") == "timeout":  # llmserve's documented extension, as in the OpenAI routes
                body["stop_reason"] = "max_tokens"
            ok_type.model_validate(body)
        return
    if r.status_code >= 400:
        body = r.json()
        ErrorObject.model_validate(body["error"], strict=True)
        assert set(body["error"]) >= {"message", "type", "param", "code"}
        assert body["error"]["code"] is None or isinstance(body["error"]["code"], str)
    elif ok_type is not None:
        body = r.json()
        for choice in body.get("choices", []):
            # llmserve's one documented extension of the enum: a request's own `timeout` ends it with "timeout"
            if choice.get("finish_reason") == "timeout":
                choice["finish_reason"] = "length"
            # with echo, the first prompt token has no logprob: null, as OpenAI's legacy completions return it (the
            # SDK's type says float)
            lp = (choice.get("logprobs") or {}) if ok_type is Completion else {}
            lp["token_logprobs"] = [0.0 if v is None else v for v in lp.get("token_logprobs") or []]
            lp["top_logprobs"] = [{} if v is None else v for v in lp.get("top_logprobs") or []]
        # the same extension in the Responses API: an incomplete response's reason "timeout"
        if (body.get("incomplete_details") or {}).get("reason") == "timeout":
            body["incomplete_details"]["reason"] = "max_output_tokens"
        ok_type.model_validate(body)


def bounded(body: dict) -> dict:
    """Mostly our model (else every case is a 404), and a few output tokens (else a case could run to the context)."""
    body = dict(body)
    body.pop("stream", None)
    for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        if isinstance(body.get(key), int):
            body[key] = min(body[key], 4)
    body.setdefault("max_output_tokens" if "input" in body else "max_tokens", 4)
    return body


VALID_INPUT = {"messages": [{"role": "user", "content": "Hello"}], "prompt": "Hello", "input": "Hello"}


def openai_requests(request_type):
    """As the SDK's types allow; a third with our model name, a third with that and a valid prompt or messages
    (so that the other fields reach the engine)."""
    def shape(pair):
        body, how = bounded(pair[0]), pair[1]
        if how >= 1:
            body["model"] = MODEL
        if how == 2:
            key = next(k for k in ("messages", "input", "prompt") if k in request_type.__annotations__)
            body[key] = VALID_INPUT[key]
        return body

    return st.tuples(st.from_type(request_type), st.sampled_from([0, 1, 2])).map(shape)


def post(server, path: str, body) -> httpx.Response:
    return httpx.post(server.base_url + path, content=json.dumps(body, default=str), timeout=120,
                      headers={"content-type": "application/json"})


def fuzz_openai_schema(server, examples: int):
    routes = [("/v1/chat/completions", chat_params.CompletionCreateParamsNonStreaming, ChatCompletion),
              ("/v1/completions", completion_params.CompletionCreateParamsNonStreaming, Completion),
              ("/v1/responses", response_create_params.ResponseCreateParamsNonStreaming, Response)]
    for path, request_type, ok_type in routes:
        @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(openai_requests(request_type))
        def one(body):
            check_response(post(server, path, body), ok_type)

        one()
    server.wait_idle(60)
    print(sorted(STATUSES.items()))


# Anthropic's Messages API: the SDK's request types (pydantic response blocks inside TypedDict unions) are beyond
# hypothesis' from_type, so requests are drawn from the API's shape directly, valid and not
_TEXT = st.text(max_size=12)
_BLOCK = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": _TEXT}),
    st.fixed_dictionaries({"type": st.just("tool_use"), "id": _TEXT, "name": _TEXT,
                           "input": st.dictionaries(_TEXT, st.integers(), max_size=2)}),
    st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": st.one_of(_TEXT, st.integers()),
                           "content": st.one_of(_TEXT, st.lists(st.fixed_dictionaries(
                               {"type": st.just("text"), "text": _TEXT}), max_size=2))},
                          optional={"is_error": st.booleans()}),
    st.fixed_dictionaries({"type": st.sampled_from(["thinking", "image", "document", "redacted_thinking", "nope"])},
                          optional={"thinking": _TEXT, "source": st.just({"type": "url", "url": "http://x/y.png"})}),
    _TEXT)
_TOOL = st.one_of(
    st.fixed_dictionaries({"name": st.sampled_from(["get_weather", "add", "bad name!"]),
                           "input_schema": st.sampled_from([{"type": "object", "properties": {"a": {"type": "integer"}}},
                                                            {"type": "nonsense"}, {}])},
                          optional={"description": _TEXT, "type": st.sampled_from(["custom", "bash_20250124"])}),
    st.fixed_dictionaries({"type": st.just("web_search_20250305"), "name": st.just("web_search")}))
_MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]),
                                  "content": st.one_of(_TEXT, st.lists(_BLOCK, max_size=3))})
ANTHROPIC_REQUESTS = st.fixed_dictionaries(
    {"model": st.sampled_from([MODEL, MODEL, "claude-x"]), "messages": st.lists(_MESSAGE, max_size=4)},
    optional={"max_tokens": st.integers(-1, 4), "system": st.one_of(_TEXT, st.lists(_BLOCK, max_size=2)),
              "stop_sequences": st.lists(_TEXT, max_size=2), "tools": st.lists(_TOOL, max_size=2),
              "tool_choice": st.fixed_dictionaries({"type": st.sampled_from(["auto", "any", "tool", "none", "x"])},
                                                   optional={"name": st.sampled_from(["get_weather", "add", "y"]),
                                                             "disable_parallel_tool_use": st.booleans()}),
              "temperature": st.floats(-1, 3), "top_k": st.integers(-2, 50), "thinking": st.just({"type": "disabled"}),
              "output_config": st.fixed_dictionaries({"format": st.sampled_from([
                  {"type": "json_schema", "schema": {"type": "object"}}, {"type": "xml"}])})})


def fuzz_messages_api(server, examples: int):
    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(ANTHROPIC_REQUESTS, st.sampled_from(["/v1/messages", "/v1/messages/count_tokens"]))
    def one(body, path):
        ok = anthropic_types.Message if path == "/v1/messages" else anthropic_types.MessageTokensCount
        check_response(post(server, path, body), ok)

    one()
    server.wait_idle(60)


def test_requests_to_the_messages_api(server):
    fuzz_messages_api(server, FAST * 2)


@pytest.mark.slow
def test_requests_to_the_messages_api_long(server):
    fuzz_messages_api(server, SLOW)


def test_requests_from_openai_schema(server):
    fuzz_openai_schema(server, FAST)


@pytest.mark.slow
def test_requests_from_openai_schema_long(server):
    fuzz_openai_schema(server, SLOW)


def fuzz_own_schema(server, examples: int):
    """Every route of llmserve's own OpenAPI document (its pydantic request models), cases made by schemathesis."""
    schema = schemathesis.openapi.from_url(server.base_url + "/openapi.json")
    ok_types = {"/v1/chat/completions": ChatCompletion, "/v1/completions": Completion, "/v1/responses": Response,
                "/v1/messages": anthropic_types.Message, "/v1/messages/count_tokens": anthropic_types.MessageTokensCount}
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= set(ok_types)
    for op in operations:
        @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(op.as_strategy())
        def one(case):
            body = bounded(case.body) if isinstance(case.body, dict) and case.path.startswith("/v1/") else case.body
            r = httpx.request(case.method, server.base_url + case.formatted_path, params=case.query, timeout=120,
                              content=None if body is None else json.dumps(body, default=str),
                              headers={"content-type": "application/json"})
            check_response(r, ok_types.get(case.path))

        one()
    server.wait_idle(60)
    print(sorted(STATUSES.items()))


def test_requests_from_own_schema(server):
    fuzz_own_schema(server, max(FAST // 4, 5))


@pytest.mark.slow
def test_requests_from_own_schema_long(server):
    fuzz_own_schema(server, SLOW // 4)
