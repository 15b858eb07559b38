"""Anthropic's Messages API (/v1/messages) with the real `anthropic` SDK against a live server on the default model:
each message equals the chat completion of the same conversation; stop sequences, the prefix cache's reads in the
usage, streamed events (the SDK's stream helper builds the same message), tool use and tool results, structured
output, thinking blocks, token counting, API keys in `x-api-key`, and Anthropic's error object for bad requests."""

from __future__ import annotations

import json
import re

import anthropic
import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from tests.server_fixtures import RunningServer

MODEL = "test-model"
GREEDY = {"temperature": 0}  # the SDK no longer has sampling keywords: vLLM's extras travel in the body
TOOLS = [{"name": "get_weather", "description": "Current weather in a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                           "required": ["city"]}}]
CHAT_TOOLS = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                "parameters": t["input_schema"]}} for t in TOOLS]


@pytest.fixture(scope="module")
def server(default_files):
    s = RunningServer(default_files, {}, {})
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def openai_client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def test_a_message_is_the_chat_completion_of_its_conversation(client, openai_client, server):
    for max_tokens in (8, 120):
        m = client.messages.create(model=MODEL, max_tokens=max_tokens, system="You are terse.",
                                   messages=[{"role": "user", "content": "Name a primary color."}], extra_body=GREEDY)
        c = openai_client.chat.completions.create(
            model=MODEL, max_tokens=max_tokens, temperature=0,
            messages=[{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a primary color."}])
        assert m.type == "message" and m.role == "assistant" and m.model == MODEL and m.id.startswith("msg_")
        [block] = m.content
        assert block.type == "text" and block.text == c.choices[0].message.content
        assert m.usage.input_tokens + m.usage.cache_read_input_tokens == c.usage.prompt_tokens
        assert m.usage.output_tokens == c.usage.completion_tokens
        assert m.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[c.choices[0].finish_reason]
        assert m.stop_sequence is None
    assert m.stop_reason == "end_turn"
    server.wait_idle()


def test_prefix_cache_reads_are_counted_apart(client):
    """As Anthropic counts them: input_tokens are the prompt tokens computed, cache_read_input_tokens those read."""
    kw = dict(model=MODEL, max_tokens=2, extra_body=GREEDY,
              messages=[{"role": "user", "content": "A fairly long question about colors, " * 8 + "which one?"}])
    first, second = client.messages.create(**kw), client.messages.create(**kw)
    total = first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert second.usage.cache_read_input_tokens > 0
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == total
    assert client.messages.count_tokens(model=MODEL, messages=kw["messages"]).input_tokens == total


def test_stop_sequences(client):
    whole = client.messages.create(model=MODEL, max_tokens=40, extra_body=GREEDY,
                                   messages=[{"role": "user", "content": "Name a primary color."}]).content[0].text
    word = whole.split()[3]
    m = client.messages.create(model=MODEL, max_tokens=40, stop_sequences=[word], extra_body=GREEDY,
                               messages=[{"role": "user", "content": "Name a primary color."}])
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", word)
    assert m.content[0].text == whole[:whole.index(word)]


def test_streamed_events_build_the_same_message(client):
    kw = dict(model=MODEL, max_tokens=120, extra_body=GREEDY,
              messages=[{"role": "user", "content": "Name a primary color."}])
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == whole.content[0].text
    assert (final.stop_reason, final.usage.output_tokens) == (whole.stop_reason, whole.usage.output_tokens)
    events = list(client.messages.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["message_start", "content_block_start", "content_block_delta"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert events[-2].delta.stop_reason == whole.stop_reason


def test_tool_use_and_tool_results(client, openai_client):
    """tool_choice any or a named tool gives a tool_use block whose input fits the schema; the conversation with the
    tool's result has the prompt of the chat API's with a tool message; streamed input_json_delta pieces add up."""
    question = [{"role": "user", "content": "What's the weather in Paris?"}]
    m = client.messages.create(model=MODEL, max_tokens=60, messages=question, tools=TOOLS, tool_choice={"type": "any"},
                               extra_body=GREEDY)
    [use] = m.content
    assert use.type == "tool_use" and use.name == "get_weather" and use.id.startswith("toolu_")
    assert m.stop_reason == "tool_use"
    jsonschema.validate(use.input, TOOLS[0]["input_schema"])
    named = client.messages.create(model=MODEL, max_tokens=60, messages=question, tools=TOOLS, extra_body=GREEDY,
                                   tool_choice={"type": "tool", "name": "get_weather"})
    assert [b.type for b in named.content] == ["tool_use"]

    turns = question + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
                        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                      "content": "22 degrees and sunny"}]}]
    answer = client.messages.create(model=MODEL, max_tokens=30, messages=turns, tools=TOOLS, extra_body=GREEDY)
    chat = openai_client.chat.completions.create(
        model=MODEL, max_tokens=30, temperature=0, tools=CHAT_TOOLS,
        messages=[question[0], {"role": "assistant", "content": None, "tool_calls": [
            {"id": use.id, "type": "function", "function": {"name": use.name, "arguments": json.dumps(use.input)}}]},
                  {"role": "tool", "tool_call_id": use.id, "content": "22 degrees and sunny"}])
    assert answer.usage.input_tokens + answer.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert "".join(b.text for b in answer.content if b.type == "text") == (chat.choices[0].message.content or "")
    assert client.messages.count_tokens(model=MODEL, messages=turns, tools=TOOLS).input_tokens == chat.usage.prompt_tokens

    events = list(client.messages.create(model=MODEL, max_tokens=60, messages=question, tools=TOOLS, stream=True,
                                         tool_choice={"type": "any"}, extra_body=GREEDY))
    pieces = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta")
    assert json.loads(pieces) == use.input
    assert events[-2].delta.stop_reason == "tool_use"


class Fruit(BaseModel):
    name: str
    color: str


def test_structured_output(client):
    """output_config.format (what messages.parse sends for a pydantic model)."""
    m = client.messages.parse(model=MODEL, max_tokens=60, output_format=Fruit, extra_body=GREEDY,
                              messages=[{"role": "user", "content": "Describe a banana as JSON."}])
    assert isinstance(m.parsed_output, Fruit) and m.parsed_output.name


def test_thinking_blocks(default_files):
    """With --reasoning-parser the thinking is a thinking block before the text, whole and streamed."""
    s = RunningServer(default_files, {}, {"reasoning_parser": "qwen3"})
    try:
        c = anthropic.Anthropic(base_url=s.base_url, api_key="x", max_retries=0)
        lark = 'start: "<think>" WORDS "</think>" "\\n\\n" WORDS\nWORDS: /[a-z]{1,8}( [a-z]{1,8}){1,3}/'
        kw = dict(model=MODEL, max_tokens=60, messages=[{"role": "user", "content": "Why is the sky blue?"}],
                  extra_body={"temperature": 1.0, "seed": 2, "structured_outputs": {"grammar": lark}})
        m = c.messages.create(**kw)
        assert [b.type for b in m.content] == ["thinking", "text"]
        assert re.fullmatch(r"[a-z]{1,8}( [a-z]{1,8}){1,3}", m.content[0].thinking)
        with c.messages.stream(**kw) as stream:
            final = stream.get_final_message()
        assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in final.content] == \
               [("thinking", m.content[0].thinking), ("text", m.content[1].text)]
        s.wait_idle()
    finally:
        s.stop()


def test_api_key_in_x_api_key(default_files):
    s = RunningServer(default_files, {"kv_cache_memory": "32MiB"}, {"api_key": "sekret"})
    try:
        ok = anthropic.Anthropic(base_url=s.base_url, api_key="sekret", max_retries=0)
        assert ok.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "Hi"}]).content
        with pytest.raises(anthropic.AuthenticationError) as err:
            anthropic.Anthropic(base_url=s.base_url, api_key="wrong", max_retries=0).messages.create(
                model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
        assert err.value.body["error"]["type"] == "authentication_error"
        # OpenAI clients' Bearer header works on every route, Anthropic's x-api-key too
        assert httpx.get(s.base_url + "/v1/models", headers={"x-api-key": "sekret"}).status_code == 200
        assert httpx.get(s.base_url + "/v1/models", headers={"x-api-key": "wrong"}).status_code == 401
    finally:
        s.stop()


@pytest.mark.parametrize("body, status, kind, message", [
    ({"messages": [{"role": "user", "content": "Hi"}]}, 400, "invalid_request_error", "max_tokens"),
    ({"max_tokens": 5, "messages": []}, 400, "invalid_request_error", "at least 1"),
    ({"max_tokens": 5, "messages": [{"role": "system", "content": "Hi"}]}, 400, "invalid_request_error", "role"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}]}, 400, "invalid_request_error",
     "content of type 'image' is not supported"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "Hi"}],
      "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400, "invalid_request_error",
     "only client tools"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "Hi"}], "tools": TOOLS,
      "tool_choice": {"type": "tool", "name": "nope"}}, 400, "invalid_request_error", "not in tools"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "Hi"}], "tool_choice": {"type": "sometimes"}}, 400,
     "invalid_request_error", "tool_choice.type must be"),
    ({"max_tokens": 100000, "messages": [{"role": "user", "content": "Hi"}]}, 400, "invalid_request_error",
     "maximum context length"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "Hi"}], "model": "claude-x"}, 404, "not_found_error",
     "claude-x"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "Hi"}],
      "output_config": {"format": {"type": "xml"}}}, 400, "invalid_request_error", "output_config.format"),
])
def test_bad_requests_get_anthropics_error_object(server, body, status, kind, message):
    r = httpx.post(server.base_url + "/v1/messages", json={"model": MODEL, **body})
    assert r.status_code == status, r.text
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == kind and message in r.json()["error"]["message"]
    # the OpenAI routes keep OpenAI's
    assert "error" in httpx.post(server.base_url + "/v1/chat/completions", json={"model": "claude-x"}).json()
