"""Tool calling in Mistral's, Granite's, Qwen3-Coder's, Phi-4-mini's, OLMo 3's and the pythonic formats through a real server: a tiny random-weight Llama whose vocabulary
has the families' control tokens ([TOOL_CALLS], [ARGS], <|tool_call|>, … as special tokens, as in their tokenizers)
and chat templates of our own written in their shapes. The random model cannot choose to call a tool, so
tool_choice "required" or a named function forces calls in the format the template shows; what comes back must be
OpenAI tool_calls, whole and streamed."""

from __future__ import annotations

import dataclasses
import json

import httpx
import jsonschema
import openai
import pytest
from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

from llmserve.loader import load_model_files
from tests.helpers import save_tiny_llama
from tests.server_fixtures import RunningServer

MISTRAL_TOKENS = ["[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_CALLS]", "[TOOL_RESULTS]",
                  "[/TOOL_RESULTS]", "[ARGS]", "[CALL_ID]"]
GRANITE_TOKENS = ["<|start_of_role|>", "<|end_of_role|>", "<|end_of_text|>", "<|tool_call|>"]

# Mistral's v3 shape: tools before the messages, calls as a JSON list after [TOOL_CALLS], ids of 9 letters and digits
# (the real templates raise on others, as this one does)
MISTRAL_TEMPLATE = """{{ bos_token }}{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}
{% for m in messages %}
{% if m.role == 'user' %}[INST]{{ m.content }}[/INST]
{% elif m.role == 'assistant' and m.tool_calls %}[TOOL_CALLS][
{%- for c in m.tool_calls %}
{% if c.id is not string or c.id | length != 9 %}{{ raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}{% endif %}
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}, "id": "{{ c.id }}"}{% if not loop.last %}, {% endif %}
{% endfor %}]{{ eos_token }}
{% elif m.role == 'assistant' %}{{ m.content }}{{ eos_token }}
{% elif m.role == 'tool' %}[TOOL_RESULTS]{"call_id": "{{ m.tool_call_id }}", "content": {{ m.content | tojson }}}[/TOOL_RESULTS]
{% endif %}
{% endfor %}"""

# the newer tokenizers' shape: [TOOL_CALLS]name[ARGS]{arguments} per call
MISTRAL_NAMED_TEMPLATE = """{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}
{% for m in messages %}
{% if m.role == 'user' %}[INST]{{ m.content }}[/INST]
{% elif m.role == 'assistant' and m.tool_calls %}{% for c in m.tool_calls %}[TOOL_CALLS]{{ c.function.name }}[ARGS]{{ c.function.arguments | tojson }}{% endfor %}{{ eos_token }}
{% elif m.role == 'assistant' %}{{ m.content }}{{ eos_token }}
{% elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]
{% endif %}
{% endfor %}"""

# Granite 3's shape: roles between markers, calls as <|tool_call|> and a JSON list
GRANITE_TEMPLATE = """{% if tools %}<|start_of_role|>available_tools<|end_of_role|>{{ tools | tojson }}<|end_of_text|>
{% endif %}
{% for m in messages %}
<|start_of_role|>{{ m.role }}<|end_of_role|>{% if m.tool_calls %}<|tool_call|>{{ m.tool_calls | map(attribute='function') | list | tojson }}{% else %}{{ m.content }}{% endif %}<|end_of_text|>
{% endfor %}
{% if add_generation_prompt %}<|start_of_role|>assistant<|end_of_role|>{% endif %}"""

# Qwen3-Coder's shape: XML calls, a string parameter as it is and any other value as JSON
QWEN3_CODER_TEMPLATE = """{% if tools %}<|im_start|>system
<tools>
{% for t in tools %}<function><name>{{ t.function.name }}</name></function>
{% endfor %}</tools>
To call a function, reply with
<tool_call>
<function=example_function_name>
<parameter=example_parameter>
value
</parameter>
</function>
</tool_call><|im_end|>
{% endif %}
{% for m in messages %}<|im_start|>{{ m.role }}
{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>
<function={{ c.function.name }}>
{% for k, v in c.function.arguments.items() %}<parameter={{ k }}>
{{ v if v is string else v | tojson }}
</parameter>
{% endfor %}</function>
</tool_call>{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

# vLLM's pythonic shape for Llama 3.2 (chosen with --tool-call-parser pythonic): a Python list of calls
PYTHONIC_TEMPLATE = """{% if tools %}<|im_start|>system
You can call these functions: {{ tools | tojson }}
To call them, answer with a Python list: [func_name(param=value), ...]<|im_end|>
{% endif %}
{% for m in messages %}<|im_start|>{{ m.role }}
{% if m.tool_calls %}[{% for c in m.tool_calls %}{{ c.function.name }}({% for k, v in c.function.arguments.items() %}{{ k }}={{ v | tojson }}{% if not loop.last %}, {% endif %}{% endfor %}){% if not loop.last %}, {% endif %}{% endfor %}]{% else %}{{ m.content }}{% endif %}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
# vLLM's shape for Phi-4-mini: the tools between <|tool|> and <|/tool|>, calls as functools and a JSON list
PHI4_MINI_TEMPLATE = """{% if tools %}<|system|>If you call functions, answer only with functools[{"name": ..., "arguments": {...}}, ...]<|tool|>{{ tools | tojson }}<|/tool|><|end|>{% endif %}
{% for m in messages %}<|{{ m.role }}|>{% if m.tool_calls %}functools{{ m.tool_calls | map(attribute='function') | list | tojson }}{% else %}{{ m.content }}{% endif %}<|end|>
{% endfor %}
{% if add_generation_prompt %}<|assistant|>{% endif %}"""
# OLMo 3's shape: the functions in the system turn, calls as Python, one a line, between <function_calls> tags
OLMO3_TEMPLATE = """{% if tools %}<|im_start|>system
You can call these functions: <functions>{{ tools | tojson }}</functions>
To call them, answer with <function_calls>
func_name(param=value)
</function_calls><|im_end|>
{% endif %}
{% for m in messages %}<|im_start|>{{ m.role }}
{% if m.tool_calls %}<function_calls>
{% for c in m.tool_calls %}{{ c.function.name }}({% for k, v in c.function.arguments.items() %}{{ k }}={{ v | tojson }}{% if not loop.last %}, {% endif %}{% endfor %})
{% endfor %}</function_calls>{% else %}{{ m.content }}{% endif %}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
PARSERS = {PYTHONIC_TEMPLATE: "pythonic"}  # templates whose format is not read from the template: the flag's value

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"enum": ["Paris", "Rome", "Oslo"]}, "unit": {"enum": ["celsius", "fahrenheit"]}},
                                          "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "description": "Add two integers",
                                      "parameters": {"type": "object", "properties": {
                                          "a": {"type": "integer", "minimum": 0, "maximum": 99},
                                          "b": {"type": "integer", "minimum": 0, "maximum": 99}},
                                          "required": ["a", "b"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "remember", "description": "Store a note",
                                      "parameters": {"type": "object", "properties": {
                                          "note": {"type": "string", "minLength": 1, "maxLength": 24},
                                          "tags": {"type": "array", "items": {"enum": ["home", "work"]}, "maxItems": 2}},
                                          "required": ["note"], "additionalProperties": False}}},
]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def control_token_model(tmp_path_factory, default_files):
    """The default model's tokenizer with both families' control tokens added as special tokens, and a tiny Llama
    whose vocabulary covers them."""
    folder = tmp_path_factory.mktemp("tools") / "model"
    base = default_files.tokenizer
    vocab = HFTokenizer.from_str(base.tokenizer.to_str())
    vocab.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in MISTRAL_TOKENS + GRANITE_TOKENS])
    save_tiny_llama(folder, vocab.get_vocab_size(with_added_tokens=True), seed=3, max_positions=2048)
    vocab.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": MISTRAL_TEMPLATE, "bos_token": base.bos_token, "eos_token": base.eos_token}))
    return load_model_files(str(folder))


@pytest.fixture(scope="module")
def serve(control_token_model):
    """serve(template): a server on the tiny model with that chat template; stopped at the module's end."""
    servers = {}

    def start(template: str) -> RunningServer:
        if template not in servers:
            files = dataclasses.replace(control_token_model, tokenizer=control_token_model.tokenizer.with_chat_template(template))
            servers[template] = RunningServer(files, {"kv_cache_memory": "32MiB", "device": "cpu"},
                                              {"tool_call_parser": PARSERS.get(template, "auto")})
        return servers[template]

    yield start
    for s in servers.values():
        s.stop()


def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)


def forced(server, tool_choice, stream=False, **kw):
    return client(server).chat.completions.create(
        model="test-model", messages=[{"role": "user", "content": "Weather in Paris, and 2 + 3?"}], tools=TOOLS,
        tool_choice=tool_choice, temperature=1.0, max_tokens=400, stream=stream, **kw)


def earlier_call(name: str, arguments: str, call_id: str, answer: str) -> list[dict]:
    """A conversation in which the assistant called a tool and the tool answered."""
    return [{"role": "user", "content": "Go on"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": call_id, "content": answer}]


def rendered(server, messages) -> str:
    """The prompt the server's chat template makes of the messages (with the tools)."""
    ids = httpx.post(server.base_url + "/tokenize", json={"messages": messages, "tools": TOOLS}).json()["tokens"]
    return httpx.post(server.base_url + "/detokenize", json={"tokens": ids}).json()["prompt"]


def assert_valid_calls(calls, only=None):
    assert calls
    for call in calls:
        assert call.type == "function" and (only is None or call.function.name == only)
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


@pytest.mark.parametrize("template, parallel", [(MISTRAL_TEMPLATE, True), (MISTRAL_NAMED_TEMPLATE, True),
                                                (MISTRAL_TEMPLATE, False), (GRANITE_TEMPLATE, True),
                                                (QWEN3_CODER_TEMPLATE, True), (PYTHONIC_TEMPLATE, True),
                                                (PHI4_MINI_TEMPLATE, True), (OLMO3_TEMPLATE, True)])
def test_forced_calls_come_back_as_tool_calls(serve, control_token_model, template, parallel):
    server = serve(template)
    tok = control_token_model.tokenizer
    marker = {GRANITE_TEMPLATE: tok.special_token_id("<|tool_call|>"),
              QWEN3_CODER_TEMPLATE: tok.encode("<tool_call>", add_special_tokens=False)[0],
              PYTHONIC_TEMPLATE: tok.encode("[", add_special_tokens=False)[0],
              PHI4_MINI_TEMPLATE: tok.encode("functools", add_special_tokens=False)[0],
              OLMO3_TEMPLATE: tok.encode("<function_calls>", add_special_tokens=False)[0]}.get(
                  template, tok.special_token_id("[TOOL_CALLS]"))
    for seed in range(3):
        r = forced(server, "required", seed=seed, parallel_tool_calls=parallel, extra_body={"return_token_ids": True})
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
        assert_valid_calls(choice.message.tool_calls)
        assert parallel or len(choice.message.tool_calls) == 1
        # the model wrote the control token itself (one token, as a real model does), not its spelling in pieces
        assert choice.model_extra["token_ids"][0] == marker
        if template in (MISTRAL_TEMPLATE, MISTRAL_NAMED_TEMPLATE):
            assert all(c.id.isalnum() and len(c.id) == 9 for c in choice.message.tool_calls)
    named = forced(server, {"type": "function", "function": {"name": "add"}}, seed=7)
    assert named.choices[0].finish_reason == "stop"  # OpenAI's for a named function
    assert_valid_calls(named.choices[0].message.tool_calls, only="add")
    server.wait_idle()


@pytest.mark.parametrize("template", [MISTRAL_TEMPLATE, MISTRAL_NAMED_TEMPLATE, GRANITE_TEMPLATE, QWEN3_CODER_TEMPLATE,
                                      PYTHONIC_TEMPLATE, PHI4_MINI_TEMPLATE, OLMO3_TEMPLATE])
def test_streamed_calls_reassemble_to_the_whole(serve, template):
    server = serve(template)
    whole = forced(server, "required", seed=11).choices[0]
    calls, content, finish = {}, "", None
    for chunk in forced(server, "required", stream=True, seed=11):
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            entry = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
            if d.id:
                assert entry["id"] is None and d.function.name
                entry["id"], entry["name"] = d.id, d.function.name
            entry["arguments"] += d.function.arguments or ""
    assert content == "" and finish == whole.finish_reason == "tool_calls"  # no marker or EOS text leaks as content
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == \
        [(t.function.name, t.function.arguments) for t in whole.message.tool_calls]
    server.wait_idle()


def test_earlier_calls_render_with_ids_the_mistral_template_takes(serve):
    """Clients send back ids made elsewhere (OpenAI's `call_…`); Mistral's templates take only 9 letters and digits,
    so they are cut to their last 9 (as vLLM does), the same way in the call and in the tool's answer."""
    server = serve(MISTRAL_TEMPLATE)
    messages = earlier_call("get_weather", '{"city": "Paris", "unit": "celsius"}', "call_0123456789abcdef", "22 degrees")
    text = rendered(server, messages)
    assert '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}, "id": "789abcdef"}]' in text
    assert '[TOOL_RESULTS]{"call_id": "789abcdef", "content": "22 degrees"}[/TOOL_RESULTS]' in text
    r = client(server).chat.completions.create(model="test-model", messages=messages, tools=TOOLS, max_tokens=5, seed=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # an id with fewer than 9 letters and digits is the template's error: a 400, the server serving on
    messages[1]["tool_calls"][0]["id"] = messages[2]["tool_call_id"] = "call_1"
    bad = httpx.post(server.base_url + "/v1/chat/completions", json={"messages": messages, "tools": TOOLS, "max_tokens": 5})
    assert bad.status_code == 400 and "length 9" in bad.json()["error"]["message"], bad.text
    server.wait_idle()


def test_qwen3_coder_values_take_their_parameters_types(serve):
    """Qwen3-Coder writes a string parameter as it is and any other value as JSON: each comes back as the JSON value
    its schema says (an enum's string, an integer, an array, a string of digits stays a string), and an earlier
    call goes back to the model as the template writes it."""
    server = serve(QWEN3_CODER_TEMPLATE)
    seen = set()
    for seed in range(6):
        r = forced(server, "required", seed=seed, parallel_tool_calls=False)
        call = r.choices[0].message.tool_calls[0]
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, PARAMS[call.function.name])  # types included: "3" would not pass as an integer
        seen.add(call.function.name)
    note = forced(server, {"type": "function", "function": {"name": "remember"}}, seed=3).choices[0].message.tool_calls[0]
    assert isinstance(json.loads(note.function.arguments)["note"], str)
    assert len(seen) > 1
    text = rendered(server, earlier_call("remember", '{"note": "1234", "tags": ["home"]}', "call_1", "stored"))
    assert ('<tool_call>\n<function=remember>\n<parameter=note>\n1234\n</parameter>\n<parameter=tags>\n["home"]\n'
            '</parameter>\n</function>\n</tool_call>') in text
    server.wait_idle()


def test_pythonic_calls_render_back_and_plain_answers_stay_content(serve):
    """An earlier call goes back to the model in the template's Python form; with tool_choice "none" the answer is
    content even if it starts with "[" (the random model writes anything)."""
    server = serve(PYTHONIC_TEMPLATE)
    messages = earlier_call("remember", '{"note": "buy milk", "tags": ["home"]}', "call_1", "stored")
    assert '[remember(note="buy milk", tags=["home"])]' in rendered(server, messages)
    olmo3 = rendered(serve(OLMO3_TEMPLATE), messages)
    assert '<function_calls>\nremember(note="buy milk", tags=["home"])\n</function_calls>' in olmo3
    r = client(server).chat.completions.create(model="test-model", messages=messages, tools=TOOLS, tool_choice="none",
                                               max_tokens=8, seed=0, temperature=1.0)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content
    server.wait_idle()


def test_the_parser_named_on_the_command_line_wins_over_the_template(control_token_model):
    """--tool-call-parser granite on a server whose template looks like Mistral's: calls are forced and read in
    Granite's format."""
    server = RunningServer(control_token_model, {"kv_cache_memory": "32MiB", "device": "cpu"}, {"tool_call_parser": "granite"})
    try:
        r = forced(server, "required", seed=1, extra_body={"return_token_ids": True})
        assert r.choices[0].model_extra["token_ids"][0] == control_token_model.tokenizer.special_token_id("<|tool_call|>")
        assert_valid_calls(r.choices[0].message.tool_calls)
        server.wait_idle()
    finally:
        server.stop()
