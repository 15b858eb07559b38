"""Structured output, tool calls and reasoning output, with the real `openai` SDK against a live server on the default
model; the offline engine for n > 1 and speculative decoding under a grammar."""

from __future__ import annotations

import json
import re
from enum import Enum

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from llmserve.sampling_params import SamplingParams, StructuredOutputsParams
from tests.helpers import run_to_completion
from tests.server_fixtures import RunningServer

MODEL = "test-model"


@pytest.fixture(scope="module")
def server(default_files):
    s = RunningServer(default_files, {}, {})
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def chat(client, content, **kw):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], **kw)


# ---- response_format / structured_outputs ------------------------------------------------------------------------------
class Color(str, Enum):
    red = "red"
    blue = "blue"


class Pet(BaseModel):
    name: str
    kind: Color


class Person(BaseModel):
    name: str
    age: int
    pets: list[Pet]
    nickname: str | None = None


def test_parse_with_pydantic_model(client, server):
    """Nested objects, an array, an enum and an optional field, as client.chat.completions.parse sends them."""
    r = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Alice is 30. She has one pet, a red cat called Tom. Reply with JSON."}],
        response_format=Person, temperature=0, max_tokens=200)
    person = r.choices[0].message.parsed
    assert isinstance(person, Person) and r.choices[0].finish_reason == "stop"
    assert person.name == "Alice" and person.age == 30 and person.pets and isinstance(person.pets[0].kind, Color)
    server.wait_idle()


PERSON_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                                  "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                                  "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
                 "required": ["name", "age", "tags"], "additionalProperties": False}
PROMPTS = ["Make up a person.", "Who wrote Hamlet? Answer as JSON.", "Describe a cat.", "hello"]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_outputs_validate(client, temperature):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True}}
    for i, prompt in enumerate(PROMPTS):
        r = chat(client, prompt, response_format=fmt, temperature=temperature, seed=i, max_tokens=120, n=2)
        for c in r.choices:
            assert c.finish_reason == "stop", c.message.content
            jsonschema.validate(json.loads(c.message.content), PERSON_SCHEMA)


def test_json_object_in_completions_and_chat(client):
    r = client.completions.create(model=MODEL, prompt="A JSON object describing a dog:", max_tokens=100, temperature=0,
                                  extra_body={"response_format": {"type": "json_object"}})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].text), dict)
    else:  # cut off by max_tokens: a prefix of an object, and OpenAI's finish_reason
        assert r.choices[0].finish_reason == "length" and r.choices[0].text.startswith("{")
    r = chat(client, "Give me a JSON object with a key 'ok'.", response_format={"type": "json_object"}, temperature=0, max_tokens=100)
    assert r.choices[0].finish_reason == "length" or isinstance(json.loads(r.choices[0].message.content), dict)


def test_choice_regex_and_grammars(client):
    r = chat(client, "Is the sky blue?", temperature=1.0, seed=3, max_tokens=10, n=4,
             extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}})
    assert all(c.message.content in ("yes", "no", "maybe") for c in r.choices)
    r = chat(client, "Phone number?", temperature=1.0, seed=1, max_tokens=20, n=3,
             extra_body={"structured_outputs": {"regex": r"\(\d{3}\) \d{3}-\d{4}"}})
    assert all(re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", c.message.content) for c in r.choices)
    lark = 'start: "SELECT " COL " FROM " TABLE\nCOL: "name" | "age"\nTABLE: "users" | "pets"'
    r = client.completions.create(model=MODEL, prompt="SQL:", max_tokens=20, temperature=1.0, seed=5, n=3,
                                  extra_body={"structured_outputs": {"grammar": lark}})
    assert all(re.fullmatch(r"SELECT (name|age) FROM (users|pets)", c.text) for c in r.choices)
    gbnf = 'root ::= "The answer is " [0-9]+ "."'
    r = client.completions.create(model=MODEL, prompt="2+2?", max_tokens=20, temperature=0,
                                  extra_body={"structured_outputs": {"grammar": gbnf}})
    assert re.fullmatch(r"The answer is [0-9]+\.", r.choices[0].text)


def test_structured_stream_stop_strings_and_length(client, server):
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON_SCHEMA}}
    whole = chat(client, "Make up a person.", response_format=fmt, temperature=0, max_tokens=120)
    stream = chat(client, "Make up a person.", response_format=fmt, temperature=0, max_tokens=120, stream=True)
    pieces, finish = [], None
    for chunk in stream:
        pieces.append(chunk.choices[0].delta.content or "")
        finish = chunk.choices[0].finish_reason or finish
    assert "".join(pieces) == whole.choices[0].message.content and finish == "stop"
    # a stop string inside the structure cuts it there, as without a grammar
    r = chat(client, "Make up a person.", response_format=fmt, temperature=0, max_tokens=120, stop=['"age"'])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content == whole.choices[0].message.content.split('"age"')[0]
    r = chat(client, "Make up a person.", response_format=fmt, temperature=0, max_tokens=5)
    assert r.choices[0].finish_reason == "length" and whole.choices[0].message.content.startswith(r.choices[0].message.content)
    server.wait_idle()


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"structured_outputs": {"regex": "[a-z"}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"json": {"type": "object", "description": "x" * 70000}}}, "structured_outputs"),
    ({"structured_outputs": {"choice": ["a"]}, "response_format": {"type": "json_object"}}, "response_format"),
])
def test_bad_schemas_get_400_naming_the_field(server, body, param):
    r = httpx.post(server.base_url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "BadRequestError" and (err["code"] is None or isinstance(err["code"], str))
    server.wait_idle()


def test_grammar_compile_timeout_gets_400(default_files):
    s = RunningServer(default_files, {}, {"grammar_compile_timeout": 1e-4})
    try:
        schema = {"type": "object", "properties": {f"field_{i}": {"type": "string", "pattern": f"^[a-z]{{{i},{i + 40}}}$"}
                                                   for i in range(60)}}
        r = httpx.post(s.base_url + "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "big", "schema": schema}}})
        assert r.status_code == 400 and r.json()["error"]["code"] == "grammar_compile_timeout", r.text
        s.wait_idle()
    finally:
        s.stop()


# ---- tools ---------------------------------------------------------------------------------------------------------
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]}},
                                          "required": ["city", "unit"]}}},
    {"type": "function", "function": {"name": "add", "description": "Add two integers",
                                      "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                                                     "required": ["a", "b"]}}},
]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_forced_tool_calls_are_valid(client, tool_choice):
    for i, prompt in enumerate(["What's the weather in Paris?", "What is 2 + 3?", "Tell me a joke."]):
        r = chat(client, prompt, tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False, temperature=1.0, seed=i,
                 max_tokens=80)
        c = r.choices[0]
        assert len(c.message.tool_calls) == 1, c.message
        assert c.finish_reason == ("tool_calls" if tool_choice == "required" else "stop")
        for call in c.message.tool_calls:
            assert call.type == "function" and call.id.startswith("call_")
            if isinstance(tool_choice, dict):
                assert call.function.name == "add"
            jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


def test_streamed_tool_calls_reassemble_to_the_whole(client, server):
    kw = dict(tools=TOOLS, tool_choice="required", temperature=1.0, seed=11, max_tokens=160)
    whole = chat(client, "Weather in Rome, and add 4 and 5.", **kw).choices[0]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in chat(client, "Weather in Rome, and add 4 and 5.", stream=True, **kw):
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for d in choice.delta.tool_calls or []:
            entry = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
            if d.id:
                assert entry["id"] is None and d.function.name  # id, type and name arrive once, first
                entry["id"], entry["name"] = d.id, d.function.name
            entry["arguments"] += d.function.arguments or ""
    assert finish == whole.finish_reason and finish in ("tool_calls", "length") and whole.message.tool_calls
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == \
        [(t.function.name, t.function.arguments) for t in whole.message.tool_calls]
    server.wait_idle()


def test_tool_choice_none_and_tool_messages_render(client):
    r = chat(client, "What's the weather in Paris?", tools=TOOLS, tool_choice="none", temperature=0, max_tokens=20)
    assert not r.choices[0].message.tool_calls and r.choices[0].message.content
    # a follow-up turn with the assistant's call and the tool's answer goes through the chat template
    messages = [{"role": "user", "content": "What's the weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "22 degrees and sunny"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, temperature=0, max_tokens=30)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    tokens = httpx.post(str(client.base_url).replace("/v1/", "") + "/tokenize", json={"messages": messages}).json()["tokens"]
    assert len(tokens) > 20


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}]}, "tools[1].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_bad_tools_get_400_naming_the_field(server, body, param):
    r = httpx.post(server.base_url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


# ---- reasoning -----------------------------------------------------------------------------------------------------
def test_reasoning_content_split_whole_and_streamed(default_files):
    s = RunningServer(default_files, {}, {"reasoning_parser": "qwen3"})
    try:
        c = openai.OpenAI(base_url=s.base_url + "/v1", api_key="x", max_retries=0)
        # the default model does not think, so a grammar makes it write the Qwen3 shape
        lark = 'start: "<think>" WORDS "</think>" "\\n\\n" WORDS\nWORDS: /[a-z]{1,8}( [a-z]{1,8}){1,3}/'
        kw = dict(temperature=1.0, seed=2, max_tokens=60, extra_body={"structured_outputs": {"grammar": lark}})
        m = chat(c, "Why is the sky blue?", **kw).choices[0].message
        assert m.model_extra["reasoning_content"] and m.content
        assert re.fullmatch(r"[a-z]{1,8}( [a-z]{1,8}){1,3}", m.model_extra["reasoning_content"])
        assert re.fullmatch(r"[a-z]{1,8}( [a-z]{1,8}){1,3}", m.content)
        thinking, answer = "", ""
        for chunk in chat(c, "Why is the sky blue?", stream=True, **kw):
            d = chunk.choices[0].delta
            thinking += (d.model_extra or {}).get("reasoning_content") or ""
            answer += d.content or ""
        assert (thinking, answer) == (m.model_extra["reasoning_content"], m.content)
        s.wait_idle()
    finally:
        s.stop()


# ---- the offline engine: n > 1 and speculative decoding under a grammar ------------------------------------------------
def test_speculation_under_a_grammar_gives_the_plain_output(make_engine):
    """Drafts the grammar cannot take are cut, each verified position gets its own mask, and the greedy output equals
    decoding without speculation; sampled samples (n > 1) each follow the grammar."""
    schema = {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                         "maxItems": 6}}, "required": ["items"]}
    prompt = 'List: apple, apple, apple, apple, apple, apple. As JSON: {"items": ["apple", "apple", '
    params = SamplingParams(temperature=0, max_tokens=80, structured_outputs=StructuredOutputsParams(json=schema))

    def run(engine, p):
        engine.add_request("r", prompt, p)
        return run_to_completion(engine)["r"].outputs

    plain = run(make_engine(), params)[0]
    spec_engine = make_engine(speculative_method="ngram", num_speculative_tokens=4)
    spec = run(spec_engine, params)[0]
    assert spec.token_ids == plain.token_ids
    jsonschema.validate(json.loads(spec.text), schema)
    assert any(st.num_decode_tokens > st.num_decode_seqs for st in spec_engine.step_stats)  # drafts were verified
    sampled = SamplingParams(temperature=1.0, seed=7, n=4, max_tokens=80, structured_outputs=StructuredOutputsParams(json=schema))
    outs = run(spec_engine, sampled)
    assert len({tuple(c.token_ids) for c in outs}) > 1
    for c in outs:
        assert c.finish_reason == "length" or jsonschema.validate(json.loads(c.text), schema) is None
    assert spec_engine.kv.num_free_blocks == spec_engine.kv.num_blocks


# a Hermes-style template of our own that renders tools and earlier calls itself, as Qwen's do
NATIVE_TEMPLATE = """{%- if tools %}<|im_start|>system
Tools: {% for t in tools %}{{ t.function.name }};{% endfor %}<|im_end|>
{% endif %}{%- for m in messages %}<|im_start|>{{ m.role }}
{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def test_native_tool_template_renders_tools_calls_and_results(default_files):
    import dataclasses

    from llmserve.tokenizer import Tokenizer

    tok = default_files.tokenizer
    files = dataclasses.replace(default_files, tokenizer=Tokenizer(tok.tokenizer, NATIVE_TEMPLATE, tok.bos_token, tok.eos_token))
    s = RunningServer(files, {}, {})
    try:
        messages = [{"role": "user", "content": "Weather in Paris?"},
                    {"role": "assistant", "content": None, "tool_calls": [
                        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
                    {"role": "tool", "tool_call_id": "call_1", "content": "22 degrees"}]
        ids = httpx.post(s.base_url + "/tokenize", json={"messages": messages, "tools": TOOLS}).json()["tokens"]
        text = httpx.post(s.base_url + "/detokenize", json={"tokens": ids}).json()["prompt"]
        assert "Tools: get_weather;add;" in text
        assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>' in text
        assert "<|im_start|>tool\n22 degrees<|im_end|>" in text
        # the format is read from the template: forced calls come back in Hermes blocks, parsed into tool_calls
        c = openai.OpenAI(base_url=s.base_url + "/v1", api_key="x", max_retries=0)
        r = c.chat.completions.create(model=MODEL, messages=messages[:1], tools=TOOLS, tool_choice="required", temperature=0,
                                      max_tokens=60, parallel_tool_calls=False)
        call = r.choices[0].message.tool_calls[0]
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])
        s.wait_idle()
    finally:
        s.stop()
