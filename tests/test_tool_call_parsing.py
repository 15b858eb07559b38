"""The tool-call and reasoning parsers on the text each model family writes: whole messages, and the same text arriving
in arbitrary pieces (hypothesis), whose deltas must reassemble to the whole message."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmserve.server.chat_output import ChatOutputParser
from llmserve.server.tool_calls import FORMATS, format_for_template, forcing_grammar, message_tool_calls

HERMES = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>')
LLAMA3 = '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "add", "parameters": {"a": 2, "b": 3}}'
SMOLLM2 = '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "add", "arguments": {"a": 2, "b": 3}}]</tool_call>'
# Mistral: a JSON list after [TOOL_CALLS] (v3 tokenizers), or name[ARGS]{…} after each (v11+, with [CALL_ID] in some)
MISTRAL = 'Let me check. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "add", "arguments": {"a": 2, "b": 3}}]'
MISTRAL_NAMED = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]add[CALL_ID]a1b2c3d4e[ARGS]{"a": 2, "b": 3}'
GRANITE = '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "add", "arguments": {"a": 2, "b": 3}}]'
QWEN3_CODER = ('Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n'
               '</tool_call>\n<tool_call>\n<function=add>\n<parameter=a>\n2\n</parameter>\n<parameter=b>\n3\n</parameter>\n'
               '</function>\n</tool_call>')
PYTHONIC = '[get_weather(city="Paris"), add(a=2, b=3)]'
OLMO3 = 'Checking.\n<function_calls>\nget_weather(city="Paris")\nadd(a=2, b=3)\n</function_calls>'
PHI4_MINI = 'functools[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "add", "arguments": {"a": 2, "b": 3}}]'
EXPECTED = [("get_weather", {"city": "Paris"}), ("add", {"a": 2, "b": 3})]


@pytest.mark.parametrize("fmt, text, content", [
    ("hermes", HERMES, "Let me check."), ("llama3_json", LLAMA3, None), ("smollm2", SMOLLM2, None),
    ("mistral", MISTRAL, "Let me check."), ("mistral", MISTRAL_NAMED, None), ("granite", GRANITE, None),
    # Granite's marker is a special token: decoded without special tokens, the list alone is the calls
    ("granite", GRANITE.removeprefix("<|tool_call|>"), None), ("granite", GRANITE.replace("<|tool_call|>", "<tool_call>"), None),
    ("qwen3_coder", QWEN3_CODER, "Let me check."), ("pythonic", PYTHONIC, None), ("phi4_mini_json", PHI4_MINI, None),
    ("phi4_mini_json", PHI4_MINI.replace("functools[", "functools [\n"), None), ("olmo3", OLMO3, "Checking."),
    ("pythonic", "<|python_start|>" + PYTHONIC.replace('"Paris"', "'Paris'") + "<|python_end|>", None),
])
def test_whole_messages(fmt, text, content):
    got_content, calls = message_tool_calls(FORMATS[fmt], text)
    assert got_content == content
    names_args = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]
    if fmt == "hermes":
        assert names_args == [("get_weather", {"city": "Paris", "unit": "celsius"}), ("add", {"a": 2, "b": 3})]
    else:
        assert names_args == EXPECTED
    assert all(c["type"] == "function" for c in calls)
    if fmt == "mistral":  # Mistral's templates take only ids of 9 letters and digits
        assert all(c["id"].isalnum() and len(c["id"]) == 9 for c in calls)
    else:
        assert all(c["id"].startswith("call_") for c in calls)


def test_plain_answers_and_other_key_orders():
    assert message_tool_calls(FORMATS["hermes"], "The weather is fine.") == ("The weather is fine.", [])
    assert message_tool_calls(FORMATS["llama3_json"], "Paris is sunny.") == ("Paris is sunny.", [])
    assert message_tool_calls(FORMATS["mistral"], "Paris is sunny [TOOL] today.") == ("Paris is sunny [TOOL] today.", [])
    assert message_tool_calls(FORMATS["granite"], "[1, 2] are the answers.") == ("[1, 2] are the answers.", [])
    _, calls = message_tool_calls(FORMATS["olmo3"], "<function_calls>\nf(on=true, off=false, none=null)\n</function_calls>")
    assert json.loads(calls[0]["function"]["arguments"]) == {"on": True, "off": False, "none": None}  # OLMo 3's JSON values
    assert message_tool_calls(FORMATS["olmo3"], "f(x=1) is a call.") == ("f(x=1) is a call.", [])
    for text in ("functools is a Python module.", "functools", "fun"):
        assert message_tool_calls(FORMATS["phi4_mini_json"], text) == (text, [])
    _, calls = message_tool_calls(FORMATS["hermes"], '<tool_call>{"arguments": {"x": 1}, "name": "f"}</tool_call>')
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [("f", {"x": 1})]
    # a call cut off by max_tokens is still reported (its arguments partial), as OpenAI does
    _, calls = message_tool_calls(FORMATS["hermes"], '<tool_call>\n{"name": "f", "arguments": {"x": 1')
    assert calls[0]["function"] == {"name": "f", "arguments": '{"x": 1'}


def test_format_read_from_the_chat_template():
    assert format_for_template("{% for tool in tools %}...<tool_call>...") == FORMATS["hermes"]
    assert format_for_template("{{- '<|python_tag|>' }} {% if tools %}") == FORMATS["llama3_json"]
    assert format_for_template("<|im_start|>{{ message['content'] }}") == FORMATS["smollm2"]
    assert format_for_template(None, "hermes") == FORMATS["hermes"]
    # vLLM's other names for the same formats
    assert format_for_template(None, "llama4_pythonic") == FORMATS["pythonic"]
    assert format_for_template(None, "qwen3_xml") == FORMATS["qwen3_coder"]
    assert format_for_template("[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS]...[TOOL_CALLS]") == FORMATS["mistral"]
    named = format_for_template("[TOOL_CALLS]{{ c.function.name }}[ARGS]{{ c.function.arguments }}")
    assert named.name == "mistral" and named.named_calls and not FORMATS["mistral"].named_calls
    assert format_for_template("<|start_of_role|>available_tools... <|tool_call|>{{ tools }}") == FORMATS["granite"]
    assert format_for_template("{% if tools %}<tool_call>\n<function={{ name }}>\n<parameter=") == FORMATS["qwen3_coder"]
    # vLLM's Phi-4-mini template asks for functools[…]; the model's vocabulary also has a <|tool_call|> token
    phi4 = "<|system|>To call functions, answer functools[{...}]<|tool|>{{ tools | tojson }}<|/tool|><|tool_call|>"
    assert format_for_template(phi4) == FORMATS["phi4_mini_json"]
    assert format_for_template("<functions>{{ tools }}</functions>...<function_calls>") == FORMATS["olmo3"]


def test_pythonic_values_are_literals_never_code():
    """Python literals (and JSON's true/false/null) become JSON; a call with positional or non-literal arguments keeps
    its text (never evaluated); a message that is not a list of calls is content."""
    fmt = FORMATS["pythonic"]
    _, calls = message_tool_calls(fmt, '[f(x=[1, -2.5, {"k": True}], y=None, z=null, s="a)b]\\"c", t=(1, 2))]')
    assert json.loads(calls[0]["function"]["arguments"]) == {"x": [1, -2.5, {"k": True}], "y": None, "z": None,
                                                             "s": 'a)b]"c', "t": [1, 2]}
    for text in ['[f(x=__import__("os").system("true"))]', "[f(1, 2)]"]:
        _, calls = message_tool_calls(fmt, text)
        assert calls[0]["function"] == {"name": "f", "arguments": text[1:-1]}
    for text in ["[link](https://example.com) is the page", "[get_weather] is a tool", "No tools needed."]:
        assert message_tool_calls(fmt, text) == (text, [])


def test_qwen3_coder_parameters_take_their_schemas_types():
    """A string parameter stays the text as written (digits too); others are read as JSON; text that is not JSON
    stays a string; a parameter is added once its closing tag is there, the object closed by </function>."""
    schema = {"type": "object", "properties": {"zip": {"type": "string"}, "days": {"type": "integer"},
                                               "opts": {"type": "object"}, "unit": {"enum": ["c", "f"]}}}
    fmt = FORMATS["qwen3_coder"].with_tools([{"type": "function", "function": {"name": "f", "parameters": schema}}])
    text = ("<tool_call>\n<function=f>\n<parameter=zip>\n10001\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
            "<parameter=opts>\n{\"a\": [1, null]}\n</parameter>\n<parameter=unit>\nc\n</parameter>\n"
            "<parameter=note>\nline one\nline <two>\n</parameter>\n</function>\n</tool_call>")
    _, calls = message_tool_calls(fmt, text)
    assert json.loads(calls[0]["function"]["arguments"]) == {"zip": "10001", "days": 3, "opts": {"a": [1, None]},
                                                             "unit": "c", "note": "line one\nline <two>"}
    _, untyped = message_tool_calls(FORMATS["qwen3_coder"], text)  # no schema: JSON where it reads as JSON
    assert json.loads(untyped[0]["function"]["arguments"])["zip"] == 10001
    cut = text[: text.index("<parameter=days>") + 20]  # cut off by max_tokens inside a parameter
    _, partial = message_tool_calls(fmt, cut)
    assert partial[0]["function"]["arguments"] == '{"zip": "10001"}'


def test_forcing_grammar_names_each_tool():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
             {"type": "function", "function": {"name": "g"}}]
    g = forcing_grammar(FORMATS["hermes"], tools, None, True)
    assert '"const": "f"' in g and '"const": "g"' in g and "<tool_call>" in g
    only = forcing_grammar(FORMATS["smollm2"], tools, "g", False)
    assert '"const": "g"' in only and '"const": "f"' not in only
    # a marker that is one special token is forced as that token; otherwise as its text
    special = {"[TOOL_CALLS]": 5, "[ARGS]": 6, "<|tool_call|>": 7}.get
    assert forcing_grammar(FORMATS["mistral"], tools, None, True, special).startswith('start: <[5]> "["')
    assert forcing_grammar(FORMATS["mistral"], tools, None, True).startswith('start: "[TOOL_CALLS]" "["')
    assert forcing_grammar(FORMATS["granite"], tools, None, False, special).startswith('start: <[7]> "[" call "]"')
    assert forcing_grammar(FORMATS["phi4_mini_json"], tools, None, True, special).startswith(
        'start: "functools" "[" call (", " call)* "]"')
    flag = [{"type": "function", "function": {"name": "h", "parameters": {"type": "object", "properties": {
        "on": {"type": "boolean"}}}}}]
    olmo3 = forcing_grammar(FORMATS["olmo3"], flag, None, True)
    assert olmo3.startswith('start: "<function_calls>\\n" call ("\\n" call)* "\\n</function_calls>"')
    assert '"on=" %json {"type": "boolean"' in olmo3  # JSON's true and false, as OLMo 3 writes them
    assert '"on=" ("True" | "False")' in forcing_grammar(FORMATS["pythonic"], flag, None, True)
    named = forcing_grammar(format_for_template("[TOOL_CALLS]x[ARGS]"), tools, None, True, special)
    assert "call: <[5]> (fn0 | fn1)" in named and 'fn1: "g" <[6]> %json' in named
    xml = forcing_grammar(FORMATS["qwen3_coder"], [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"s": {"type": "string", "maxLength": 9}, "n": {"type": "integer"}},
        "required": ["n"]}}}], None, False)
    assert 'fn0: "<function=f>\\n" p0_0? p0_1 "</function>"' in xml and "{0,9}" in xml and '%json {"type": "integer", ' in xml
    py = forcing_grammar(FORMATS["pythonic"], [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "boolean"}, "b": {"type": "integer"}, "c": {"type": "string"}},
        "required": ["b"]}}}], None, True)
    assert 'fn0: "f(" p0_1 (", " p0_0)? (", " p0_2)? ")"' in py and 'p0_0: "a=" ("True" | "False")' in py


def reassemble(parser: ChatOutputParser, text: str, cuts: list[int]):
    reasoning, content, calls, pos = "", "", {}, 0
    for i, cut in enumerate(sorted(set(cuts)) + [len(text)]):
        final = i == len(set(cuts))
        delta = parser.delta(text[:cut], text[pos:cut], final)
        pos = cut
        reasoning += delta.get("reasoning_content", "")
        content += delta.get("content", "")
        for d in delta.get("tool_calls", []):
            entry = calls.setdefault(d["index"], {"name": None, "arguments": ""})
            if "id" in d:
                assert entry["name"] is None
                entry["name"] = d["function"]["name"]
            entry["arguments"] += d["function"]["arguments"]
    return reasoning, content, [(c["name"], c["arguments"]) for _, c in sorted(calls.items())]


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([("hermes", HERMES), ("llama3_json", LLAMA3), ("smollm2", SMOLLM2), ("mistral", MISTRAL),
                        ("mistral", MISTRAL_NAMED), ("granite", GRANITE), ("granite", "[see](the docs) first"),
                        ("mistral", '[TOOL_CALLS]add[ARGS]{"a": 1, "b'), ("qwen3_coder", QWEN3_CODER),
                        ("qwen3_coder", "<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n<parameter=b>\n2"),
                        ("pythonic", PYTHONIC), ("pythonic", "[get_weather] is a tool"), ("pythonic", '[f(s="a)"), g(x=1'),
                        ("phi4_mini_json", PHI4_MINI), ("phi4_mini_json", "functools is a module"),
                        ("olmo3", OLMO3), ("olmo3", '<function_calls>\nf(s="a)", t=[1, 2])\ng(x=nu'),
                        ("phi4_mini_json", 'functools[{"name": "add", "arguments": {"a": 1'),
                        ("hermes", "No tools needed: 4 < 5 and <tool is not a tag."),
                        ("smollm2", '<tool_call>[{"name": "add", "arguments": {"a": 1, "b": 2}}')]),
       st.lists(st.integers(min_value=0, max_value=200), max_size=12), st.booleans())
def test_streamed_deltas_reassemble_to_the_whole_message(case, cuts, thinking):
    fmt, text = case
    if thinking:
        text = "<think>I should look this up.</think>\n\n" + text
    cuts = [c for c in cuts if c <= len(text)]
    whole, has_calls = ChatOutputParser("qwen3" if thinking else None, FORMATS[fmt], False).message(text)
    reasoning, content, calls = reassemble(ChatOutputParser("qwen3" if thinking else None, FORMATS[fmt], False), text, cuts)
    assert content == (whole["content"] or "")
    assert reasoning == (whole.get("reasoning_content") or "")
    assert calls == [(c["function"]["name"], c["function"]["arguments"]) for c in whole.get("tool_calls", [])]
    assert has_calls == bool(calls)


@pytest.mark.parametrize("parser, text, reasoning, content", [
    ("qwen3", "<think>hmm</think>\n\nIt is 4.", "hmm", "It is 4."),
    ("qwen3", "It is 4.", None, "It is 4."),
    ("deepseek_r1", "hmm, 2+2</think>It is 4.", "hmm, 2+2", "It is 4."),
    ("qwen3", "<think>still thinking when cut off", "still thinking when cut off", ""),
])
def test_reasoning_split(parser, text, reasoning, content):
    msg, _ = ChatOutputParser(parser, None, False).message(text)
    assert (msg["reasoning_content"], msg["content"]) == (reasoning, content)
