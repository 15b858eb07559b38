"""Tool calling: how a model family writes its calls, the grammar that forces one (tool_choice "required" or a named
function), and a parser that turns the model's text into OpenAI `tool_calls`, whole or as streamed deltas.

Formats (picked from the chat template, or --tool-call-parser, vLLM's names):
- hermes (Qwen2.5/Qwen3, Hermes): `<tool_call>\\n{"name": …, "arguments": {…}}\\n</tool_call>`, one block per call;
- llama3_json (Llama 3.x): the message is `{"name": …, "parameters": {…}}` (calls joined by "; ");
- mistral (Mistral, Ministral, Mixtral): `[TOOL_CALLS][{"name": …, "arguments": {…}}, …]` to the end of the message,
  or with the newer tokenizers (templates that write `[ARGS]`) `[TOOL_CALLS]name[ARGS]{…}` per call;
- granite (Granite 3.x): the message is `<|tool_call|>[{"name": …, "arguments": {…}}, …]`;
- phi4_mini_json (Phi-4-mini with vLLM's template, which asks for it): the message is
  `functools[{"name": …, "arguments": {…}}, …]`;
- pythonic (Llama 3.2 with vLLM's pythonic template, Llama 4): the message is a Python list of calls,
  `[get_weather(city="Paris"), add(a=2, b=3)]`;
- olmo3 (OLMo 3 Instruct): Python calls, one a line, between `<function_calls>` and `</function_calls>`, their values
  JSON (`null`, `true`, `false`);
- qwen3_coder (Qwen3-Coder): XML, `<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n…</function>\\n
  </tool_call>`, a string VALUE as it is and any other as JSON (the tool's parameter schema says which);
- smollm2 (SmolLM2, and templates that do not render tools): `<tool_call>[{"name": …, "arguments": {…}}, …]</tool_call>`,
  with the tool list written into the system message by llmserve.

The parser is incremental by re-reading: `parse(text, final)` reads the whole text so far and returns the content and
calls it is sure of; every value it returns only grows as text is added, so a stream's deltas are differences of
successive parses and reassemble to exactly the non-streamed result.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from llmserve.errors import InvalidRequestError


@dataclass(frozen=True)
class ToolFormat:
    """How one model family writes its calls. Layouts:
    - "blocks": each block of calls between `start` and `end`, anywhere in the message (hermes, qwen3_coder, olmo3,
      smollm2);
    - "leading": the message is calls when it begins (after one of `prefixes`) with a JSON object, or with a list of
      them (or of Python calls) when `in_list` (llama3_json, granite, phi4_mini_json, pythonic);
    - "marker": the calls run from `start` to the end of the message (mistral)."""
    name: str
    layout: str
    start: str  # the marker that opens the calls ("" for llama3_json)
    end: str  # the marker that closes a block ("blocks" only)
    arguments_key: str
    native: bool  # the model's chat template renders `tools` itself
    prefixes: tuple[str, ...] = ()  # "leading": tags that may come before the calls
    in_list: bool = False  # "leading": the calls are one JSON list
    named_calls: bool = False  # mistral's newer tokenizers: `[TOOL_CALLS]name[ARGS]{…}` (parsed either way)
    call_id_length: int | None = None  # Mistral's templates refuse tool-call ids that are not 9 letters and digits
    xml_calls: bool = False  # qwen3_coder: each block is <function=NAME> with <parameter=KEY> elements
    python_calls: bool = False  # pythonic, olmo3: the calls are Python's name(key=value, …), a list or a line each
    # the request's tools' parameter schemas by name (with_tools): how an XML parameter's text becomes a JSON value
    parameters: dict = field(default_factory=dict, compare=False)

    def with_tools(self, tools: list[dict] | None) -> ToolFormat:
        """This format for one request: with its tools' parameter schemas, where the format needs them."""
        if not self.xml_calls or not tools:
            return self
        return dataclasses.replace(self, parameters={t["function"]["name"]: parameters_schema(t["function"]) for t in tools})


FORMATS = {
    "hermes": ToolFormat("hermes", "blocks", "<tool_call>", "</tool_call>", "arguments", True),
    "llama3_json": ToolFormat("llama3_json", "leading", "", "", "parameters", True, prefixes=("<|python_tag|>",)),
    "mistral": ToolFormat("mistral", "marker", "[TOOL_CALLS]", "", "arguments", True, call_id_length=9),
    "granite": ToolFormat("granite", "leading", "<|tool_call|>", "", "arguments", True,
                          prefixes=("<|tool_call|>", "<tool_call>"), in_list=True),
    "phi4_mini_json": ToolFormat("phi4_mini_json", "leading", "functools", "", "arguments", True,
                                 prefixes=("functools",), in_list=True),
    "pythonic": ToolFormat("pythonic", "leading", "", "", "arguments", True, prefixes=("<|python_start|>",),
                           in_list=True, python_calls=True),
    "qwen3_coder": ToolFormat("qwen3_coder", "blocks", "<tool_call>", "</tool_call>", "arguments", True, xml_calls=True),
    "olmo3": ToolFormat("olmo3", "blocks", "<function_calls>", "</function_calls>", "arguments", True,
                        python_calls=True),
    "smollm2": ToolFormat("smollm2", "blocks", "<tool_call>", "</tool_call>", "arguments", False),
}


# vLLM's other names for these formats: its Llama 4 parser reads the pythonic calls (after <|python_start|>), and its
# qwen3_xml parser Qwen3-Coder's XML
ALIASES = {"llama4_pythonic": "pythonic", "qwen3_xml": "qwen3_coder"}
PARSER_NAMES = sorted([*FORMATS, *ALIASES])  # what --tool-call-parser takes, besides auto


def format_for_template(template: str | None, choice: str = "auto") -> ToolFormat:
    t = template or ""
    if choice != "auto":
        fmt = FORMATS[ALIASES.get(choice, choice)]
    elif "[TOOL_CALLS]" in t:
        fmt = FORMATS["mistral"]
    elif "functools" in t:  # (before Granite's marker: Phi-4-mini's vocabulary has a <|tool_call|> token too)
        fmt = FORMATS["phi4_mini_json"]
    elif "<|tool_call|>" in t:
        fmt = FORMATS["granite"]
    elif "<function=" in t and "<parameter=" in t:
        fmt = FORMATS["qwen3_coder"]
    elif "<function_calls>" in t:
        fmt = FORMATS["olmo3"]
    elif "<tool_call>" in t:
        fmt = FORMATS["hermes"] if "tools" in t else FORMATS["smollm2"]
    elif "<|python_tag|>" in t or "ipython" in t:
        fmt = FORMATS["llama3_json"]
    else:
        fmt = FORMATS["smollm2"]
    if fmt.name == "mistral" and "[ARGS]" in t:
        fmt = dataclasses.replace(fmt, named_calls=True)
    return fmt


_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def validate_tools(tools: list[dict], tool_choice) -> None:
    """OpenAI's rules for tool definitions and tool_choice; 400 naming the field."""
    seen = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise InvalidRequestError(f"{where}: only tools of type 'function' with a 'function' object are supported", where)
        fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise InvalidRequestError(f"{where}.function.name must be 1-64 letters, digits, '_' or '-', got {name!r}",
                                      f"{where}.function.name")
        if name in seen:
            raise InvalidRequestError(f"{where}.function.name: duplicate tool name {name!r}", f"{where}.function.name")
        seen.add(name)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise InvalidRequestError(f"{where}.function.parameters must be a JSON schema object", f"{where}.function.parameters")
        if params is not None:
            from jsonschema import Draft202012Validator
            from jsonschema.exceptions import SchemaError

            try:
                Draft202012Validator.check_schema(params)
            except SchemaError as e:
                raise InvalidRequestError(f"{where}.function.parameters is not a valid JSON schema: {e.message}",
                                          f"{where}.function.parameters") from None
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name") if tool_choice.get("type") == "function" else None
        if name is None:
            raise InvalidRequestError("tool_choice must be 'none', 'auto', 'required' or "
                                      "{'type': 'function', 'function': {'name': ...}}", "tool_choice")
        if name not in seen:
            raise InvalidRequestError(f"tool_choice names the function {name!r}, which is not in tools", "tool_choice")
    elif tool_choice not in (None, "none", "auto", "required"):
        raise InvalidRequestError(f"tool_choice must be 'none', 'auto', 'required' or a function, got {tool_choice!r}",
                                  "tool_choice")


def parameters_schema(fn: dict) -> dict:
    return fn.get("parameters") or {"type": "object", "properties": {}}


def forcing_grammar(fmt: ToolFormat, tools: list[dict], only: str | None, parallel: bool,
                    special_token_id: Callable[[str], int | None] = lambda text: None) -> str:
    """A Lark grammar (llguidance dialect, with %json) whose every sentence is a valid call in the model's format:
    the name one of the tools (or `only`), the arguments valid against that tool's parameters. A marker that is one
    special token of the vocabulary (Mistral's `[TOOL_CALLS]`, Granite's `<|tool_call|>`) is that token, as the model
    writes it, not its spelling in ordinary tokens."""

    def marker(text: str) -> str:
        token_id = special_token_id(text)
        return f"<[{token_id}]>" if token_id is not None else json.dumps(text)

    fns = [t["function"] for t in tools if only is None or t["function"]["name"] == only]
    if fmt.named_calls:  # [TOOL_CALLS]name[ARGS]{arguments}, per call
        rules = [f"fn{i}: {json.dumps(fn['name'])} {marker('[ARGS]')} {_json(parameters_schema(fn))}"
                 for i, fn in enumerate(fns)]
        return "\n".join(["start: call+" if parallel else "start: call",
                          f"call: {marker(fmt.start)} ({' | '.join(f'fn{i}' for i in range(len(fns)))})", *rules])
    if fmt.xml_calls:
        return _xml_forcing_grammar(fns, parallel)
    if fmt.python_calls and fmt.layout == "blocks":  # olmo3: a call a line, values as JSON
        return _python_forcing_grammar(fns, parallel, ('"<function_calls>\\n"', '"\\n"', '"\\n</function_calls>"'),
                                       json_literals=True)
    if fmt.python_calls:
        return _python_forcing_grammar(fns, parallel, ('"["', '", "', '"]"'))
    rules = []
    for i, fn in enumerate(fns):
        schema = {"type": "object", "properties": {"name": {"const": fn["name"]}, fmt.arguments_key: parameters_schema(fn)},
                  "required": ["name", fmt.arguments_key], "additionalProperties": False}
        rules.append(f"fn{i}: {_json(schema)}")
    call = "call: " + " | ".join(f"fn{i}" for i in range(len(fns)))
    calls = 'call (", " call)*' if parallel else "call"
    if fmt.name == "hermes":
        block = 'block: "<tool_call>\\n" call "\\n</tool_call>"'
        start = 'start: block ("\\n" block)*' if parallel else "start: block"
        return "\n".join([start, block, call, *rules])
    if fmt.name == "llama3_json":
        start = 'start: call ("; " call)*' if parallel else "start: call"
        return "\n".join([start, call, *rules])
    if fmt.name in ("mistral", "granite", "phi4_mini_json"):
        return "\n".join([f'start: {marker(fmt.start)} "[" {calls} "]"', call, *rules])
    return "\n".join([f'start: "<tool_call>[" {calls} "]</tool_call>"', call, *rules])


def _json(schema: dict) -> str:
    """A grammar's JSON value valid against `schema`, written compactly: ", " and ": " between items, no other
    whitespace (a sampled model left free would pad with it)."""
    separators = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    return f"%json {json.dumps({**schema, 'x-guidance': separators})}"


def _parameters(fn: dict) -> list[tuple[str, dict, bool]]:
    """A tool's parameters in its schema's order: (name, schema, whether required)."""
    schema = parameters_schema(fn)
    required = set(schema.get("required") or [])
    return [(key, prop if isinstance(prop, dict) else {}, key in required)
            for key, prop in (schema.get("properties") or {}).items()]


def _xml_forcing_grammar(fns: list[dict], parallel: bool) -> str:
    """Qwen3-Coder's calls: each parameter of the schema (the required ones always, the others optionally, in the
    schema's order) as <parameter=KEY>, its value written as the template writes it: a string as it is (of the
    schema's minLength-maxLength characters, or one of its enum), anything else as JSON valid against its schema."""
    close = json.dumps("\n</parameter>\n")
    rules, names = [], []
    for i, fn in enumerate(fns):
        parts = []
        for j, (key, prop, required) in enumerate(_parameters(fn)):
            opening, value = json.dumps(f"<parameter={key}>\n"), f"v{i}_{j}"
            if _is_text(prop) and isinstance(prop.get("enum"), list):
                rules.append(f"{value}: ({' | '.join(json.dumps(e) for e in prop['enum'])}) {close}")
            elif _is_text(prop):
                # the text and its closing tag as one terminal, which holds that tag only at its end: the text may
                # hold anything else, newlines and "<" included (the regex, not the lexer, decides where it ends)
                value, low, high = value.upper(), prop.get("minLength", 0), prop.get("maxLength", "")
                rules.append(f"{value}: /(.|\\n){{{low},{high}}}\\n<\\/parameter>\\n/ & "
                             f"~/(.|\\n)*<\\/parameter>(.|\\n)*<\\/parameter>(.|\\n)*/")
            else:
                rules.append(f"{value}: {_json(prop)} {close}")
            rules.append(f"p{i}_{j}: {opening} {value}")
            parts.append(f"p{i}_{j}" if required else f"p{i}_{j}?")
        head = json.dumps(f"<function={fn['name']}>\n")
        rules.append(f'fn{i}: {head} {" ".join(parts)} "</function>"')
        names.append(f"fn{i}")
    block = f'block: "<tool_call>\\n" ({" | ".join(names)}) "\\n</tool_call>"'
    start = 'start: block ("\\n" block)*' if parallel else "start: block"
    return "\n".join([start, block, *rules])


def _python_forcing_grammar(fns: list[dict], parallel: bool, around: tuple[str, str, str],
                            json_literals: bool = False) -> str:
    """Pythonic calls, name(key=value, …): the required parameters in the schema's order, then any of the others in
    that order; each value JSON valid against its schema (a JSON string, number, list or object is also a Python
    literal), booleans and null spelled True, False and None (unless `json_literals`). `around`: the terminals that
    open the calls, separate two, and close them."""
    rules, names = [], []
    for i, fn in enumerate(fns):
        params = []
        for j, (key, prop, required) in enumerate(_parameters(fn)):
            kind = None if json_literals else prop.get("type")
            value = ('("True" | "False")' if kind == "boolean" else '"None"' if kind == "null"
                     else _json(prop))
            rules.append(f"p{i}_{j}: {json.dumps(key + '=')} {value}")
            params.append((f"p{i}_{j}", required))
        mandatory = [p for p, req in params if req]
        optional = [p for p, req in params if not req]
        later = [f'(", " {p})?' for p in optional]
        if mandatory:
            body = " ".join([' ", " '.join(mandatory), *later])
        elif optional:  # the first one present, then any of those after it
            body = "(" + " | ".join(" ".join([p, *later[k + 1:]]) for k, p in enumerate(optional)) + ")?"
        else:
            body = ""
        rules.append(f'fn{i}: {json.dumps(fn["name"] + "(")} {body} ")"')
        names.append(f"fn{i}")
    opening, separator, closing = around
    start = f"start: {opening} call ({separator} call)* {closing}" if parallel else f"start: {opening} call {closing}"
    return "\n".join([start, f"call: {' | '.join(names)}", *rules])


def _is_text(schema: dict) -> bool:
    """A parameter the template writes as it is (a string) rather than as JSON."""
    types = schema.get("type")
    types = [types] if isinstance(types, str) else list(types or [])
    if types:
        return "string" in types
    enum = schema.get("enum")
    return isinstance(enum, list) and bool(enum) and all(isinstance(e, str) for e in enum)


def system_prompt_with_tools(fmt: ToolFormat, tools: list[dict]) -> str:
    """For templates that do not render tools: the tool list and the format to answer in, as a system message."""
    listed = json.dumps([t["function"] for t in tools], ensure_ascii=False)
    return ("You can call functions. These are available, as JSON Schema:\n"
            f"<tools>{listed}</tools>\n"
            "To call one or more of them, answer only with\n"
            '<tool_call>[{"name": "<function name>", "arguments": {<arguments as JSON>}}]</tool_call>\n'
            "Otherwise answer normally.")


# ---- parsing ---------------------------------------------------------------------------------------------------------
@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text as the model wrote it (whole once the call is complete)
    complete: bool


@dataclass
class Parsed:
    content: str
    calls: list[ParsedCall] = field(default_factory=list)


_HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


def _json_value_end(text: str, start: int) -> int | None:
    """End (exclusive) of the JSON object/array starting at text[start], or None if it is not closed yet."""
    depth, in_str, esc = 0, False, False
    for i in range(start, len(text)):
        ch = text[i]
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def _scalar_end(text: str, start: int) -> int | None:
    """End of a JSON string/number/literal at text[start] (a model may write scalar arguments), None if open."""
    if text[start] == '"':
        m = re.compile(r'"(?:[^"\\]|\\.)*"').match(text, start)
        return m.end() if m else None
    m = re.compile(r"[^,}\]\s]+").match(text, start)
    return m.end() if m and m.end() < len(text) else None


def _parse_calls(body: str, final: bool) -> list[ParsedCall]:
    calls, i = [], 0
    while i < len(body):
        if body[i] != "{":
            i += 1  # separators: whitespace, '[', ',', ']', ';'
            continue
        end = _json_value_end(body, i)
        head = _HEAD.match(body, i)
        if head is not None:
            name, a = json.loads(f'"{head.group(1)}"'), head.end()
            if a >= len(body):
                args, args_done = "", False
            else:
                args_end = _json_value_end(body, a) if body[a] in "{[" else _scalar_end(body, a)
                args, args_done = body[a: args_end if args_end is not None else len(body)], args_end is not None
            if end is not None or final:
                calls.append(ParsedCall(name, args.strip() if args_done or final else args, end is not None))
            elif a < len(body):
                calls.append(ParsedCall(name, args if args_done else args.rstrip(), False))
        elif end is not None:  # keys in another order: the call is known once its object closes
            try:
                obj = json.loads(body[i:end])
            except ValueError:
                obj = None
            if isinstance(obj, dict) and isinstance(obj.get("name"), str):
                args = obj.get("arguments", obj.get("parameters", {}))
                calls.append(ParsedCall(obj["name"], args if isinstance(args, str) else json.dumps(args), True))
        if end is None:
            break
        i = end
    return calls


def _held_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that could be the start of `marker` (held back while streaming)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def parse(fmt: ToolFormat, text: str, final: bool) -> Parsed:
    if fmt.layout == "leading":
        return _parse_leading(fmt, text, final)
    if fmt.layout == "marker":
        return _parse_after_marker(fmt, text, final)
    content, calls, i = [], [], 0
    while True:
        j = text.find(fmt.start, i)
        if j < 0:
            tail = text[i:]
            content.append(tail if final else tail[: len(tail) - _held_suffix(tail, fmt.start)])
            break
        content.append(text[i:j])
        body_start = j + len(fmt.start)
        e = text.find(fmt.end, body_start)
        body = text[body_start: e if e >= 0 else len(text)]
        closed = final or e >= 0
        calls += (_parse_xml_calls(body, closed, fmt.parameters) if fmt.xml_calls
                  else _parse_python_calls(body, closed) if fmt.python_calls else _parse_calls(body, closed))
        if e < 0:
            break
        i = e + len(fmt.end)
    # strip() of a prefix is a prefix of strip() of the whole: streamed content stays the non-streamed content
    return Parsed("".join(content).strip(), calls)


_FUNCTION = re.compile(r"<function=([^>\n]+)>")
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)


def _parse_xml_calls(body: str, closed: bool, parameters: dict) -> list[ParsedCall]:
    """Qwen3-Coder's <function=NAME> elements. A call's arguments grow a parameter at a time, as JSON: a parameter is
    added once its closing tag is there, and the object closes with </function> (or the end of the message)."""
    calls = []
    for head in _FUNCTION.finditer(body):
        end = body.find("</function>", head.end())
        name = head.group(1).strip()
        properties = (parameters.get(name) or {}).get("properties") or {}
        items = []
        for key, raw in _PARAMETER.findall(body, head.end(), end if end >= 0 else len(body)):
            raw = raw[1:] if raw.startswith("\n") else raw  # the template puts each value on lines of its own
            raw = raw[:-1] if raw.endswith("\n") else raw
            value = _xml_value(raw, properties.get(key.strip()))
            items.append(f"{json.dumps(key.strip())}: {json.dumps(value, ensure_ascii=False)}")
        done = end >= 0 or closed
        calls.append(ParsedCall(name, "{" + ", ".join(items) + ("}" if done else ""), done))
    return calls


def _xml_value(raw: str, schema):
    """A parameter's text as its value: as it is for a string parameter, else read as JSON (as the template wrote it);
    text that is not JSON stays a string."""
    if isinstance(schema, dict) and _is_text(schema):
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        return raw


_OPEN_LIST = re.compile(r"\[\s*")


def _parse_leading(fmt: ToolFormat, text: str, final: bool) -> Parsed:
    """A message that begins (after a prefix tag) with a call's JSON object, or a list of them, is calls; any other is
    content. While streaming, an opening that could still go either way is held back."""
    s = text.lstrip()
    for prefix in fmt.prefixes:
        if s.startswith(prefix):
            s = s[len(prefix):].lstrip()
            break
    if not final and (not s or any(p.startswith(s) for p in fmt.prefixes) or (fmt.in_list and _OPEN_LIST.fullmatch(s))):
        return Parsed("")
    body = s
    if fmt.in_list:
        body = s[_OPEN_LIST.match(s).end():] if s.startswith("[") else ""
    if fmt.python_calls:
        if not final and _PYTHON_OPENING.fullmatch(body):
            return Parsed("")  # "[get_wea": a call's name, or content such as "[get_weather] is…"
        if _PYTHON_CALL.match(body):
            return Parsed("", _parse_python_calls(body, final))
        return Parsed(text.strip())
    if body.startswith("{"):
        return Parsed("", _parse_calls(body, final))
    return Parsed(text.strip())


_PYTHON_OPENING = re.compile(r"[A-Za-z_][\w.]*")
_PYTHON_CALL = re.compile(r"([A-Za-z_][\w.]*)\(")


def _parse_python_calls(body: str, final: bool) -> list[ParsedCall]:
    """name(key=value, …) calls, separated by commas: a call's name once its "(" is there, its arguments (as JSON)
    once its ")" is."""
    calls, i = [], 0
    while True:
        while i < len(body) and body[i] in " ,\n":
            i += 1
        head = _PYTHON_CALL.match(body, i)
        if head is None:
            return calls
        end = _python_call_end(body, head.end())
        if end is None:
            calls.append(ParsedCall(head.group(1), "", final))
            return calls
        calls.append(ParsedCall(head.group(1), _python_arguments(body[i:end]), True))
        i = end


def _python_call_end(text: str, start: int) -> int | None:
    """End (exclusive) of the call whose arguments start at text[start] (after its "("), None if still open: brackets
    counted outside Python string literals."""
    depth, quote, i = 1, None, start
    while i < len(text):
        ch = text[i]
        if quote:
            if ch == "\\":
                i += 1
            elif text.startswith(quote, i):
                i += len(quote) - 1
                quote = None
        elif ch in "'\"":
            quote = text[i:i + 3] if text[i:i + 3] in ("'''", '"""') else ch
            i += len(quote) - 1
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


_PYTHON_NAMES = {"True": True, "False": False, "None": None, "true": True, "false": False, "null": None}


def _python_value(node):
    """A keyword argument's value: Python literals (and JSON's true/false/null, which a JSON-minded model writes);
    never evaluated as code."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name) and node.id in _PYTHON_NAMES:
        return _PYTHON_NAMES[node.id]
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return [_python_value(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        return {_python_value(k): _python_value(v) for k, v in zip(node.keys, node.values)}
    if (isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)) and isinstance(node.operand, ast.Constant)
            and isinstance(node.operand.value, (int, float))):
        return -node.operand.value if isinstance(node.op, ast.USub) else node.operand.value
    raise ValueError(f"not a literal: {ast.dump(node)[:60]}")


def _python_arguments(call_text: str) -> str:
    """A call's keyword arguments as a JSON object; a call that does not read as one keeps its text."""
    try:
        node = ast.parse(call_text, mode="eval").body
        if not isinstance(node, ast.Call) or node.args:
            raise ValueError("not keyword arguments alone")
        return json.dumps({k.arg: _python_value(k.value) for k in node.keywords}, ensure_ascii=False)
    except (SyntaxError, ValueError, TypeError, RecursionError):
        return call_text


_NAMED_CALL = re.compile(r"\s*([A-Za-z0-9_.-]+)(?:\[CALL_ID\][A-Za-z0-9]*)?\[ARGS\]")


def _parse_after_marker(fmt: ToolFormat, text: str, final: bool) -> Parsed:
    """Mistral: content, then from the marker to the end calls, as a JSON list or as `name[ARGS]{…}` after each
    marker."""
    j = text.find(fmt.start)
    if j < 0:
        return Parsed((text if final else text[: len(text) - _held_suffix(text, fmt.start)]).strip())
    content, body = text[:j].strip(), text[j + len(fmt.start):]
    if body.lstrip()[:1] in ("[", "{"):
        return Parsed(content, _parse_calls(body, final))
    calls = []
    pieces = body.split(fmt.start)
    for k, piece in enumerate(pieces):
        head = _NAMED_CALL.match(piece)
        if head is None:
            break  # the name is not whole yet
        args = piece[head.end():].lstrip()
        closed = final or k < len(pieces) - 1  # another call or the end of the message follows
        end = _json_value_end(args, 0) if args[:1] in ("{", "[") else None
        if end is not None:
            calls.append(ParsedCall(head.group(1), args[:end], True))
        else:
            calls.append(ParsedCall(head.group(1), args.strip() if closed else args.rstrip(), closed))
    return Parsed(content, calls)


class ToolCallStream:
    """Turns successive parses of one choice's text into OpenAI delta pieces: content text and tool_calls entries."""

    def __init__(self, fmt: ToolFormat):
        self.fmt = fmt
        self.sent_content = 0
        self.sent_args: list[int] = []
        self.ids: list[str] = []

    def update(self, text: str, final: bool) -> tuple[str, list[dict]]:
        parsed = parse(self.fmt, text, final)
        content = parsed.content[self.sent_content:]
        self.sent_content = max(self.sent_content, len(parsed.content))
        deltas = []
        for i, call in enumerate(parsed.calls):
            if i == len(self.sent_args):
                self.ids.append(new_call_id(self.fmt))
                self.sent_args.append(0)
                deltas.append({"index": i, "id": self.ids[i], "type": "function",
                               "function": {"name": call.name, "arguments": ""}})
            fragment = call.arguments[self.sent_args[i]:]
            if fragment:
                self.sent_args[i] = len(call.arguments)
                deltas.append({"index": i, "function": {"arguments": fragment}})
        return content, deltas


def new_call_id(fmt: ToolFormat | None = None) -> str:
    if fmt is not None and fmt.call_id_length is not None:
        return uuid.uuid4().hex[: fmt.call_id_length]
    return f"call_{uuid.uuid4().hex[:24]}"


def model_call_id(fmt: ToolFormat, call_id: str | None) -> str | None:
    """A client's tool-call id as the model's template accepts it: for Mistral's, its last 9 letters and digits (as
    vLLM does), so ids made by another model or API (`call_…`) still render."""
    if call_id is None or fmt.call_id_length is None:
        return call_id
    return re.sub(r"[^A-Za-z0-9]", "", call_id)[-fmt.call_id_length:]


def message_tool_calls(fmt: ToolFormat, text: str) -> tuple[str | None, list[dict]]:
    """The non-streamed message: (content or None, tool_calls)."""
    parsed = parse(fmt, text, final=True)
    calls = [{"id": new_call_id(fmt), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
             for c in parsed.calls]
    return (parsed.content or None) if calls else parsed.content, calls


def render_calls_as_text(fmt: ToolFormat, tool_calls: list[dict]) -> str:
    """An earlier assistant turn's calls in the model's own format (for templates that do not render tool_calls)."""
    objs = []
    for c in tool_calls:
        fn = c.get("function") or {}
        args = fn.get("arguments") or "{}"
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            pass
        objs.append({"name": fn.get("name"), fmt.arguments_key: args})
    if fmt.name == "hermes":
        return "\n".join(f"<tool_call>\n{json.dumps(o)}\n</tool_call>" for o in objs)
    if fmt.name == "llama3_json":
        return "; ".join(json.dumps(o) for o in objs)
    return f"<tool_call>{json.dumps(objs)}</tool_call>"
