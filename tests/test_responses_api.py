"""OpenAI's Responses API (/v1/responses) with the real `openai` SDK against a live server on the default model: each
response equals the chat completion of the same conversation; stored responses continue through
previous_response_id; streamed events reassemble to the response (the SDK's own stream helper checks them); function
calls go out and their outputs come back in; text.format, logprobs, reasoning items, background responses and their
cancelling; and each bad request is the OpenAI error object."""

from __future__ import annotations

import json
import re
import time

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from tests.server_fixtures import RunningServer

MODEL = "test-model"
STORED = 6  # the server keeps this many responses
TOOLS = [{"type": "function", "name": "get_weather", "description": "Current weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                         "required": ["city"]}}]
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS]


@pytest.fixture(scope="module")
def server(default_files):
    s = RunningServer(default_files, {"max_model_len": 512}, {"max_stored_responses": STORED})
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def chat(client, messages, **kw):
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kw)


def test_a_response_is_the_chat_completion_of_its_conversation(client, server):
    """instructions become the system message; the text, token counts and finish match the chat API's exactly."""
    for max_tokens in (8, 120):
        r = client.responses.create(model=MODEL, instructions="You are terse.", input="Name a primary color.",
                                    max_output_tokens=max_tokens, temperature=0)
        c = chat(client, [{"role": "system", "content": "You are terse."},
                          {"role": "user", "content": "Name a primary color."}], max_tokens=max_tokens)
        assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
        assert r.output_text == c.choices[0].message.content and r.output_text
        assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == \
               (c.usage.prompt_tokens, c.usage.completion_tokens, c.usage.total_tokens)
        [message] = r.output
        assert message.type == "message" and message.role == "assistant" and message.content[0].type == "output_text"
        if c.choices[0].finish_reason == "length":
            assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
            assert message.status == "incomplete"
        else:
            assert r.status == "completed" and r.incomplete_details is None and message.status == "completed"
        assert r.instructions == "You are terse." and r.max_output_tokens == max_tokens and r.temperature == 0
        assert r.store is True and r.tool_choice == "auto" and r.tools == []
    assert r.status == "completed"  # the longer one finished by itself
    server.wait_idle()


def test_previous_response_id_continues_the_stored_conversation(client):
    """The second turn sees the first's input and answer (not its instructions, as OpenAI); retrieve gives the same
    object back; input_items lists that request's own input; deleted, it is gone."""
    first = client.responses.create(model=MODEL, instructions="Answer in French.", input="Name a fruit.",
                                    max_output_tokens=10, temperature=0, metadata={"trace": "t-1"})
    second = client.responses.create(model=MODEL, input="And a vegetable?", previous_response_id=first.id,
                                     max_output_tokens=10, temperature=0)
    expected = chat(client, [{"role": "user", "content": "Name a fruit."},
                             {"role": "assistant", "content": first.output_text},
                             {"role": "user", "content": "And a vegetable?"}], max_tokens=10)
    assert second.output_text == expected.choices[0].message.content
    assert second.usage.input_tokens == expected.usage.prompt_tokens
    assert second.previous_response_id == first.id
    # a third turn goes on from the second (two turns of history)
    third = client.responses.create(model=MODEL, input=[{"role": "user", "content": [{"type": "input_text",
                                                                                      "text": "Thanks!"}]}],
                                    previous_response_id=second.id, max_output_tokens=6, temperature=0)
    assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens

    again = client.responses.retrieve(first.id)
    assert again.model_dump() == first.model_dump() and again.metadata == {"trace": "t-1"}
    items = client.responses.input_items.list(second.id)
    assert [(i.type, i.role, i.content[0].text) for i in items.data] == [("message", "user", "And a vegetable?")]

    client.responses.delete(first.id)
    for call in (lambda: client.responses.retrieve(first.id), lambda: client.responses.delete(first.id)):
        with pytest.raises(openai.NotFoundError) as err:
            call()
        assert err.value.body["code"] == "response_not_found"
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model=MODEL, input="Hi", previous_response_id=first.id)
    assert err.value.body["param"] == "previous_response_id"
    assert err.value.body["message"] == f"Previous response with id '{first.id}' not found."
    # the second still continues: it holds its whole conversation
    assert client.responses.create(model=MODEL, input="Bye", previous_response_id=second.id,
                                   max_output_tokens=4).status == "incomplete"


def test_input_items_pages(client):
    turns = [{"role": "user", "content": f"Message {i}"} for i in range(5)]
    r = client.responses.create(model=MODEL, input=turns, max_output_tokens=2, temperature=0)
    texts = [i.content[0].text for i in client.responses.input_items.list(r.id, order="asc").data]
    assert texts == [t["content"] for t in turns]
    newest = client.responses.input_items.list(r.id, limit=2)  # newest first, as OpenAI's
    assert [i.content[0].text for i in newest.data] == ["Message 4", "Message 3"] and newest.has_more
    rest = client.responses.input_items.list(r.id, limit=10, after=newest.last_id)
    assert [i.content[0].text for i in rest.data] == ["Message 2", "Message 1", "Message 0"] and not rest.has_more


def test_stored_responses_are_bounded(client):
    """--max-stored-responses: beyond it the oldest are forgotten; store=false keeps none."""
    ids = [client.responses.create(model=MODEL, input=f"Count {i}", max_output_tokens=1).id for i in range(STORED + 1)]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[0])
    assert [client.responses.retrieve(i).id for i in ids[1:]] == ids[1:]
    unstored = client.responses.create(model=MODEL, input="Hi", max_output_tokens=1, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_streamed_events_reassemble_to_the_response(client, server):
    """The SDK's stream helper accepts the event sequence and builds the same response as the plain call; the stored
    response is the final event's; sequence numbers count up from 0."""
    kw = dict(model=MODEL, input="Name a primary color.", max_output_tokens=120, temperature=0)
    whole = client.responses.create(**kw)
    assert whole.status == "completed"
    with client.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert final.output_text == whole.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    stored = client.responses.retrieve(final.id)
    assert (stored.status, stored.output_text, [o.id for o in stored.output], stored.usage) == \
           ("completed", final.output_text, [o.id for o in final.output], final.usage)
    assert final.usage.output_tokens == whole.usage.output_tokens

    # a stream cut by max_output_tokens ends with response.incomplete
    cut = list(client.responses.create(**{**kw, "max_output_tokens": 5}, stream=True))
    assert cut[-1].type == "response.incomplete" and cut[-1].response.incomplete_details.reason == "max_output_tokens"
    assert cut[-1].response.output[0].content[0].text == whole.output_text[:len(cut[-1].response.output[0].content[0].text)]
    server.wait_idle()


def test_function_calls_and_their_outputs(client):
    """A forced call is a function_call item with arguments that fit the schema; its output comes back as a
    function_call_output item, by previous_response_id or with the whole history in `input` (the same prompt
    both ways, and the chat API's for the same messages)."""
    question = "What's the weather in Paris?"
    r = client.responses.create(model=MODEL, input=question, tools=TOOLS, tool_choice="required", temperature=0,
                                max_output_tokens=60)
    [call] = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), TOOLS[0]["parameters"])
    named = client.responses.create(model=MODEL, input=question, tools=TOOLS, temperature=0, max_output_tokens=60,
                                    tool_choice={"type": "function", "name": "get_weather"})
    assert [o.type for o in named.output] == ["function_call"] and named.tool_choice.name == "get_weather"

    answer = {"type": "function_call_output", "call_id": call.call_id, "output": "22 degrees and sunny"}
    chained = client.responses.create(model=MODEL, input=[answer], previous_response_id=r.id, tools=TOOLS,
                                      temperature=0, max_output_tokens=30)
    stateless = client.responses.create(model=MODEL, store=False, tools=TOOLS, temperature=0, max_output_tokens=30,
                                        input=[{"role": "user", "content": question},
                                               *[o.model_dump(exclude_none=True) for o in r.output], answer])
    expected = chat(client, [{"role": "user", "content": question},
                             {"role": "assistant", "content": None, "tool_calls": [
                                 {"id": call.call_id, "type": "function",
                                  "function": {"name": call.name, "arguments": call.arguments}}]},
                             {"role": "tool", "tool_call_id": call.call_id, "content": "22 degrees and sunny"}],
                    tools=CHAT_TOOLS, max_tokens=30)
    assert chained.usage.input_tokens == stateless.usage.input_tokens == expected.usage.prompt_tokens
    assert chained.output_text == stateless.output_text == (expected.choices[0].message.content or "")

    # streamed: the arguments' deltas add up to the item's arguments
    events = list(client.responses.create(model=MODEL, input=question, tools=TOOLS, tool_choice="required",
                                          temperature=0, max_output_tokens=60, stream=True))
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert deltas == done[0].arguments == call.arguments and done[0].name == "get_weather"
    assert events[-1].response.output[0].arguments == call.arguments


class Fruit(BaseModel):
    name: str
    color: str


def test_text_format_and_parse(client):
    """text.format json_schema (as responses.parse sends a pydantic model) and json_object."""
    r = client.responses.parse(model=MODEL, input="Describe a banana as JSON.", text_format=Fruit,
                               max_output_tokens=60, temperature=0)
    assert isinstance(r.output_parsed, Fruit) and r.output_parsed.name
    assert r.text.format.type == "json_schema"
    obj = client.responses.create(model=MODEL, input="Describe an apple as JSON.", max_output_tokens=300,
                                  temperature=0, text={"format": {"type": "json_object"}})
    assert obj.text.format.type == "json_object"
    if obj.status == "completed":
        assert isinstance(json.loads(obj.output_text), dict)
    else:  # cut by max_output_tokens: still the start of an object
        assert obj.output_text.lstrip().startswith("{")


def test_logprobs_equal_the_chat_apis(client):
    kw = dict(max_output_tokens=6, temperature=0, top_logprobs=3)
    r = client.responses.create(model=MODEL, input="Say hi", include=["message.output_text.logprobs"], **kw)
    c = chat(client, [{"role": "user", "content": "Say hi"}], max_tokens=6, logprobs=True, top_logprobs=3)
    got = r.output[0].content[0].logprobs
    want = c.choices[0].logprobs.content
    assert [(x.token, x.logprob, [(t.token, t.logprob) for t in x.top_logprobs]) for x in got] == \
           [(x.token, x.logprob, [(t.token, t.logprob) for t in x.top_logprobs]) for x in want]
    assert len(got) == r.usage.output_tokens and all(len(x.top_logprobs) == 3 for x in got)
    plain = client.responses.create(model=MODEL, input="Say hi", max_output_tokens=6, temperature=0)
    assert plain.output[0].content[0].logprobs == []


def test_background_responses_finish_or_are_cancelled(client, server):
    """background=true answers at once (queued); polling finds it completed, equal to the plain call. A long one
    cancelled stops (its KV blocks freed) and stays cancelled; cancelling a finished or plain response changes
    nothing or is refused."""
    kw = dict(model=MODEL, input="Name a primary color.", max_output_tokens=20, temperature=0)
    plain = client.responses.create(**kw)
    queued = client.responses.create(**kw, background=True)
    assert queued.status in ("queued", "in_progress") and queued.background is True
    deadline = time.time() + 60
    while (done := client.responses.retrieve(queued.id)).status in ("queued", "in_progress"):
        assert time.time() < deadline
        time.sleep(0.05)
    assert done.status == plain.status and done.output_text == plain.output_text
    assert client.responses.cancel(queued.id).status == plain.status  # finished: unchanged
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.cancel(plain.id)
    assert err.value.body["message"] == "Cannot cancel a synchronous response."

    long = client.responses.create(model=MODEL, input="Write a long story.", max_output_tokens=400, background=True,
                                   extra_body={"ignore_eos": True})
    assert client.responses.cancel(long.id).status == "cancelled"
    server.wait_idle()
    time.sleep(0.2)
    assert client.responses.retrieve(long.id).status == "cancelled"
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=MODEL, input="Hi", background=True, store=False)


def test_background_streams_are_followed_and_resumed(client, server):
    """background + stream (OpenAI's): the events as they come, numbered; the response runs on when the stream is
    dropped, and GET ?stream=true&starting_after=N resumes after event N, to the end; its events equal a plain
    stream's; a plain response cannot be streamed again."""
    kw = dict(model=MODEL, input="Name three fruits.", max_output_tokens=24, temperature=0)
    plain = [e.model_dump() for e in client.responses.create(**kw, stream=True)]
    events = [e.model_dump() for e in client.responses.create(**kw, stream=True, background=True)]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["type"] == "response.created" and events[0]["response"]["status"] == "queued"
    assert events[-1]["type"] == "response.completed" and events[-1]["response"]["background"] is True
    # the same text events as a plain stream's
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert deltas == [e["delta"] for e in plain if e["type"] == "response.output_text.delta"]
    rid = events[0]["response"]["id"]
    again = [e.model_dump() for e in client.responses.retrieve(rid, stream=True, starting_after=4)]
    assert again == events[5:]
    # dropped after its first events: the response goes on, and resuming gives the rest
    with httpx.stream("POST", server.base_url + "/v1/responses", json={**kw, "stream": True, "background": True,
                                                                       "max_output_tokens": 40}, timeout=60) as r:
        head = []
        for line in r.iter_lines():
            if line.startswith("data: "):
                head.append(json.loads(line[6:]))
            if len(head) == 3:
                break
    rid = head[0]["response"]["id"]
    rest = [e.model_dump() for e in client.responses.retrieve(rid, stream=True, starting_after=2)]
    assert rest[0]["sequence_number"] == 3 and rest[-1]["type"] == "response.completed"
    assert rest[-1]["response"]["output"][0]["content"][0]["text"] == client.responses.retrieve(rid).output_text
    with pytest.raises(openai.BadRequestError, match="only a background response can be streamed again"):
        list(client.responses.retrieve(client.responses.create(**kw).id, stream=True))
    server.wait_idle()


def test_truncation_auto_drops_the_oldest_turns(client):
    """With a 512-token context: a continuation that would not fit is refused (truncation disabled, OpenAI's
    default) or answered without the oldest turns (auto)."""
    long = " ".join(["tomato"] * 250)
    first = client.responses.create(model=MODEL, input=f"Repeat: {long}", max_output_tokens=4, temperature=0)
    for max_output_tokens, param in ((4, "max_output_tokens"), (None, "input")):  # None: the prompt alone is too long
        with pytest.raises(openai.BadRequestError) as err:
            client.responses.create(model=MODEL, input=f"Now: {long}", previous_response_id=first.id,
                                    max_output_tokens=max_output_tokens)
        assert (err.value.body["code"], err.value.body["param"]) == ("context_length_exceeded", param)
        assert "maximum context length is 512 tokens" in err.value.body["message"]
    r = client.responses.create(model=MODEL, input=f"Now: {long}", previous_response_id=first.id, max_output_tokens=4,
                                truncation="auto", temperature=0)
    alone = client.responses.create(model=MODEL, input=f"Now: {long}", max_output_tokens=4, temperature=0)
    assert r.truncation == "auto" and r.usage.input_tokens == alone.usage.input_tokens
    assert r.output_text == alone.output_text


@pytest.mark.parametrize("body, status, param, message", [
    ({"input": []}, 400, "input", "input must not be empty"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]}, 400, "input",
     "content of type 'input_image' is not supported"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, 400, "input", "input items of type 'web_search_call'"),
    ({"input": [{"role": "robot", "content": "hi"}]}, 400, "input", "input[0].role must be"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, 400, "tools", "tools of type 'web_search' are not supported"),
    ({"input": "hi", "tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, 400, "tool_choice",
     "not in tools"),
    ({"input": "hi", "text": {"format": {"type": "xml"}}}, 400, "text", "text.format.type must be"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "text", "schema is required"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "n" * 65, "schema": {}}}}, 400, "text",
     "at most 64 characters"),
    ({"input": "hi", "metadata": {f"k{i}": "v" for i in range(17)}}, 400, "metadata", "at most 16 pairs"),
    ({"input": "hi", "top_logprobs": 21}, 400, "top_logprobs", "greater than max allowed: 20"),
    ({"input": "hi", "max_output_tokens": 0}, 400, "max_output_tokens", "max_output_tokens must be at least 1"),
    ({"input": "hi", "tools": [{"type": "function", "name": "bad name!"}]}, 400, "tools[0].name", "tools[0].name must be"),
    ({"input": "hi", "previous_response_id": "resp_nope"}, 404, "previous_response_id", "not found"),
    ({"input": "hi", "model": "other-model"}, 404, "model", "other-model"),
    ({"input": "hi", "truncation": "sometimes"}, 400, "truncation", "truncation"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, 400, "input", "call_id must be a string"),
    ({"input": "hi", "conversation": "conv_1"}, 400, "conversation", "use previous_response_id"),
    ({"input": "hi", "prompt": {"id": "pmpt_1"}}, 400, "prompt", "not supported"),
])
def test_bad_requests(server, body, status, param, message):
    r = httpx.post(server.base_url + "/v1/responses", json={"model": MODEL, **body})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and message in error["message"], error
    assert error["code"] is None or isinstance(error["code"], str)


def test_unknown_response_ids(server):
    for method, path in (("GET", "resp_nope"), ("DELETE", "resp_nope"), ("POST", "resp_nope/cancel"),
                         ("GET", "resp_nope/input_items")):
        r = httpx.request(method, f"{server.base_url}/v1/responses/{path}")
        assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found", r.text


def test_reasoning_items(default_files):
    """With --reasoning-parser, the thinking is a reasoning item before the message, whole and streamed alike, and
    counted in output_tokens_details.reasoning_tokens."""
    s = RunningServer(default_files, {}, {"reasoning_parser": "qwen3"})
    try:
        c = openai.OpenAI(base_url=s.base_url + "/v1", api_key="x", max_retries=0)
        # the default model does not think, so a grammar makes it write the Qwen3 shape
        lark = 'start: "<think>" WORDS "</think>" "\\n\\n" WORDS\nWORDS: /[a-z]{1,8}( [a-z]{1,8}){1,3}/'
        kw = dict(model=MODEL, input="Why is the sky blue?", temperature=1.0, max_output_tokens=60,
                  extra_body={"seed": 2, "structured_outputs": {"grammar": lark}})
        r = c.responses.create(**kw)
        assert [o.type for o in r.output] == ["reasoning", "message"]
        thought = r.output[0].content[0].text
        assert re.fullmatch(r"[a-z]{1,8}( [a-z]{1,8}){1,3}", thought)
        assert re.fullmatch(r"[a-z]{1,8}( [a-z]{1,8}){1,3}", r.output_text)
        assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens
        with c.responses.stream(**kw) as stream:
            events = list(stream)
            final = stream.get_final_response()
        assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == thought
        assert final.output_text == r.output_text and final.output[0].content[0].text == thought
        s.wait_idle()
    finally:
        s.stop()
