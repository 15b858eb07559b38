"""OpenAI's Responses API (POST /v1/responses) as a face of the chat path.

A request's `input` items become chat messages (after `instructions` and, with `previous_response_id`, the stored
conversation); its function tools become chat tools and `text.format` a response_format. The chat output parser
(reasoning, tool calls) then reads the model's text, and OutputItems turns what it finds into the Responses output
items (reasoning, message, function_call) and their stream events. Stored responses (responses_store.py) carry a
conversation on to the next request.
"""

from __future__ import annotations

import json
import time
import uuid

from pydantic import ValidationError

from llmserve.server.errors import APIError, from_validation_error
from llmserve.server.protocol import ChatCompletionRequest, ResponsesRequest, content_text

# the include value that asks for the message text's logprobs
LOGPROBS_INCLUDE = "message.output_text.logprobs"
_TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text", "refusal")


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _content_text(content, where: str) -> str:
    return content_text(content, where, "input", _TEXT_PARTS, ("input_image", "input_file", "input_audio"))


def _required_str(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or (key != "arguments" and not value):
        raise APIError(400, f"{where}.{key} must be a string", param="input")
    return value


def input_messages(items: str | list[dict]) -> tuple[list[dict], list[dict]]:
    """The request's input as chat messages, and as the input items a stored response lists (each with an id).
    Consecutive function_call items are one assistant turn's calls; reasoning items are not shown to the model
    again (as chat templates drop earlier thinking)."""
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": items}]
    if not items:
        raise APIError(400, "input must not be empty", param="input")
    messages: list[dict] = []
    listed: list[dict] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise APIError(400, f"{where} must be an object", param="input")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(400, f"{where}.role must be 'user', 'system', 'developer' or 'assistant', got {role!r}",
                               param="input")
            text = _content_text(item.get("content"), f"{where}.content")
            messages.append({"role": role, "content": text})
            part = "output_text" if role == "assistant" else "input_text"
            shown = {"type": part, "text": text, **({"annotations": []} if role == "assistant" else {})}
            listed.append({"type": "message", "id": item.get("id") or new_id("msg"), "role": role,
                           "content": [shown], "status": "completed"})
        elif kind == "function_call":
            call = {"id": _required_str(item, "call_id", where), "type": "function",
                    "function": {"name": _required_str(item, "name", where),
                                 "arguments": _required_str(item, "arguments", where)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            listed.append({"type": "function_call", "id": item.get("id") or new_id("fc"), "call_id": call["id"],
                           "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                           "status": "completed"})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _content_text(output, f"{where}.output")
            call_id = _required_str(item, "call_id", where)
            messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
            listed.append({"type": "function_call_output", "id": item.get("id") or new_id("fco"), "call_id": call_id,
                           "output": text, "status": "completed"})
        elif kind == "reasoning":
            listed.append({**item, "id": item.get("id") or new_id("rs")})
        else:
            raise APIError(400, f"{where}: input items of type {kind!r} are not supported (message, function_call, "
                                "function_call_output and reasoning are)", param="input")
    return messages, listed


def chat_tools(tools: list[dict] | None, tool_choice) -> tuple[list[dict] | None, str | dict | None]:
    """Responses' flat function tools ({"type": "function", "name": ...}) and tool_choice in chat's nested shape."""
    converted = None
    if tools is not None:
        converted = []
        for i, tool in enumerate(tools):
            if not isinstance(tool, dict) or tool.get("type") != "function":
                kind = tool.get("type") if isinstance(tool, dict) else None
                raise APIError(400, f"tools[{i}]: tools of type {kind!r} are not supported; this server runs function "
                                    "tools, which your code executes", param="tools")
            fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
            converted.append({"type": "function", "function": fn})
    if isinstance(tool_choice, dict):
        if tool_choice.get("type") != "function" or not isinstance(tool_choice.get("name"), str):
            raise APIError(400, "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}",
                           param="tool_choice")
        tool_choice = {"type": "function", "function": {"name": tool_choice["name"]}}
    return converted, tool_choice


def response_format(text: dict | None) -> dict | None:
    """text.format as chat's response_format."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise APIError(400, "text.format.type must be 'text', 'json_object' or 'json_schema'", param="text")
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"]}
    if not isinstance(fmt.get("schema"), dict):
        raise APIError(400, "text.format.schema is required for type json_schema", param="text")
    if not isinstance(fmt.get("name", ""), str) or len(fmt.get("name", "")) > 64:
        raise APIError(400, "text.format.name must be a string of at most 64 characters", param="text")
    spec = {k: fmt[k] for k in ("name", "description", "schema", "strict") if fmt.get(k) is not None}
    return {"type": "json_schema", "json_schema": spec}


def logprobs_wanted(req: ResponsesRequest) -> bool:
    return LOGPROBS_INCLUDE in (req.include or []) or req.top_logprobs is not None


def chat_request(req: ResponsesRequest, conversation: list[dict]) -> ChatCompletionRequest:
    """The chat request that computes this response: instructions, then `conversation` (the earlier turns and this
    input, as chat messages)."""
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + conversation
    tools, tool_choice = chat_tools(req.tools, req.tool_choice)
    try:
        return ChatCompletionRequest(
            **req.chat_fields(), model=req.model, parallel_tool_calls=req.parallel_tool_calls, logit_bias=req.logit_bias,
            stop=req.stop, user=req.user, messages=messages, tools=tools, tool_choice=tool_choice, response_format=response_format(req.text),
            max_completion_tokens=req.max_output_tokens, logprobs=logprobs_wanted(req),
            top_logprobs=(req.top_logprobs or 0) if logprobs_wanted(req) else None)
    except ValidationError as e:
        raise from_validation_error(e, "input") from None


# a chat request's fields, as errors name them, and the Responses request's
_RESPONSES_PARAMS = {"logprobs": "top_logprobs", "max_tokens": "max_output_tokens", "messages": "input",
                     "response_format": "text"}


def in_responses_terms(e: APIError) -> APIError:
    """An error of the chat path, naming the Responses request's fields (max_output_tokens, not max_tokens)."""
    param, message = e.param, e.message
    if param in _RESPONSES_PARAMS:
        param = _RESPONSES_PARAMS[param]
        if e.param == "max_tokens":
            message = message.replace("max_tokens", "max_output_tokens")
    elif param and param.startswith("tools["):  # chat's tools[i].function.name is Responses' tools[i].name
        param, message = param.replace(".function.", "."), message.replace(".function.", ".")
    return APIError(e.status, message, param, e.code, e.headers)


def output_messages(output: list[dict]) -> list[dict]:
    """A response's output items as the chat messages of its assistant turn (for the next turn's prompt)."""
    text = "".join(p["text"] for item in output if item["type"] == "message" for p in item["content"])
    calls = [{"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    if not text and not calls:
        return []
    return [{"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})}]


class OutputItems:
    """A response's output items, built from the chat output parser's deltas (reasoning_content, content,
    tool_calls), with the stream events each change makes. A reasoning or message item closes when another kind of
    output starts; function calls stay open to the end, where everything closes."""

    def __init__(self):
        self.items: list[dict] = []
        self._open: list[int] = []  # indexes of the items not yet done, in order
        self._calls: dict[int, int] = {}  # the chat delta's call index -> its output index

    def _start(self, item: dict) -> tuple[int, list[dict]]:
        self.items.append(item)
        index = len(self.items) - 1
        self._open.append(index)
        return index, [{"type": "response.output_item.added", "output_index": index, "item": json.loads(json.dumps(item))}]

    def _current(self, kind: str) -> int | None:
        return self._open[-1] if self._open and self.items[self._open[-1]]["type"] == kind else None

    def _close_text_items(self) -> list[dict]:
        events = []
        for index in [i for i in self._open if self.items[i]["type"] in ("reasoning", "message")]:
            events += self._done(index, "completed")
        return events

    def _done(self, index: int, status: str) -> list[dict]:
        self._open.remove(index)
        item = self.items[index]
        item["status"] = status
        events = []
        if item["type"] == "reasoning":
            part = item["content"][0]
            events += [{"type": "response.reasoning_text.done", "item_id": item["id"], "output_index": index,
                        "content_index": 0, "text": part["text"]},
                       {"type": "response.content_part.done", "item_id": item["id"], "output_index": index,
                        "content_index": 0, "part": dict(part)}]
        elif item["type"] == "message":
            part = item["content"][0]
            events += [{"type": "response.output_text.done", "item_id": item["id"], "output_index": index,
                        "content_index": 0, "text": part["text"], "logprobs": list(part["logprobs"])},
                       {"type": "response.content_part.done", "item_id": item["id"], "output_index": index,
                        "content_index": 0, "part": json.loads(json.dumps(part))}]
        else:
            events.append({"type": "response.function_call_arguments.done", "item_id": item["id"],
                           "output_index": index, "name": item["name"], "arguments": item["arguments"]})
        events.append({"type": "response.output_item.done", "output_index": index, "item": json.loads(json.dumps(item))})
        return events

    def feed(self, delta: dict, logprobs: list[dict] | None) -> list[dict]:
        """Takes one chat delta (and its tokens' logprobs, in chat's content shape); returns the events it makes."""
        events: list[dict] = []
        if delta.get("reasoning_content"):
            index = self._current("reasoning")
            if index is None:
                events += self._close_text_items()
                index, added = self._start({"type": "reasoning", "id": new_id("rs"), "summary": [], "content": [],
                                            "status": "in_progress"})
                part = {"type": "reasoning_text", "text": ""}
                self.items[index]["content"].append(part)
                events += added + [{"type": "response.content_part.added", "item_id": self.items[index]["id"],
                                    "output_index": index, "content_index": 0, "part": dict(part)}]
            self.items[index]["content"][0]["text"] += delta["reasoning_content"]
            events.append({"type": "response.reasoning_text.delta", "item_id": self.items[index]["id"],
                           "output_index": index, "content_index": 0, "delta": delta["reasoning_content"]})
        if delta.get("content"):
            index = self._current("message")
            if index is None:
                events += self._close_text_items()
                index, added = self._start({"type": "message", "id": new_id("msg"), "role": "assistant",
                                            "status": "in_progress", "content": []})
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                self.items[index]["content"].append(part)
                events += added + [{"type": "response.content_part.added", "item_id": self.items[index]["id"],
                                    "output_index": index, "content_index": 0, "part": json.loads(json.dumps(part))}]
            part = self.items[index]["content"][0]
            part["text"] += delta["content"]
            part["logprobs"] += logprobs or []
            events.append({"type": "response.output_text.delta", "item_id": self.items[index]["id"],
                           "output_index": index, "content_index": 0, "delta": delta["content"],
                           "logprobs": logprobs or []})
        for call in delta.get("tool_calls") or []:
            if call.get("id"):  # a new call: its name comes whole, its arguments in pieces
                events += self._close_text_items()
                index, added = self._start({"type": "function_call", "id": new_id("fc"), "call_id": call["id"],
                                            "name": call["function"]["name"], "arguments": "", "status": "in_progress"})
                self._calls[call["index"]] = index
                events += added
            fragment = call["function"].get("arguments") or ""
            if fragment:
                index = self._calls[call["index"]]
                self.items[index]["arguments"] += fragment
                events.append({"type": "response.function_call_arguments.delta", "item_id": self.items[index]["id"],
                               "output_index": index, "delta": fragment})
        return events

    def close(self, status: str) -> list[dict]:
        """The end of the output: every open item done, with `status` (completed or incomplete)."""
        events = []
        for index in list(self._open):
            events += self._done(index, status)
        return events


def status_of(finish_reason: str | None) -> tuple[str, dict | None]:
    """The response's status and incomplete_details for how its request finished."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if finish_reason == "timeout":
        return "incomplete", {"reason": "timeout"}
    if finish_reason == "abort":
        return "cancelled", None
    return "completed", None


def response_object(req: ResponsesRequest, rid: str, model: str, created: int, params, stored: bool,
                    status: str = "in_progress", output: list[dict] | None = None, usage: dict | None = None,
                    incomplete: dict | None = None, error: dict | None = None) -> dict:
    """The Response object; `params` (the SamplingParams used) gives the values the request left to defaults."""
    tool_choice = req.tool_choice if req.tool_choice is not None else "auto"
    return {
        "id": rid, "object": "response", "created_at": created, "status": status, "background": req.background,
        "completed_at": int(time.time()) if status == "completed" else None, "error": error,
        "incomplete_details": incomplete, "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
        "max_tool_calls": None, "metadata": req.metadata or {}, "model": model, "output": output or [],
        "parallel_tool_calls": req.parallel_tool_calls, "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": (req.reasoning or {}).get("effort"), "summary": None},
        "service_tier": "default", "store": stored, "temperature": params.temperature,
        "text": {"format": (req.text or {}).get("format") or {"type": "text"}}, "tool_choice": tool_choice,
        "tools": req.tools or [], "top_logprobs": req.top_logprobs or 0, "top_p": params.top_p,
        "truncation": req.truncation, "usage": usage, "user": req.user,
    }


def usage_object(chat_usage: dict, reasoning_tokens: int) -> dict:
    """The Responses usage from the chat one (its cost fields, when pricing is on, kept)."""
    details = chat_usage.get("prompt_tokens_details") or {}
    out = {"input_tokens": chat_usage["prompt_tokens"],
           "input_tokens_details": {"cached_tokens": details.get("cached_tokens", 0), "cache_write_tokens": 0},
           "output_tokens": chat_usage["completion_tokens"],
           "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
           "total_tokens": chat_usage["total_tokens"]}
    for key in ("cost", "cost_details"):
        if key in chat_usage:
            out[key] = chat_usage[key]
    return out


def sse_event(event: dict, sequence_number: int) -> str:
    event["sequence_number"] = sequence_number
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


class ResponseAssembler:
    """One response as it is generated: the engine's outputs through the chat output parser into OutputItems, and
    the Response object at each stage (queued, in progress, done)."""

    def __init__(self, req: ResponsesRequest, rid: str, model: str, params, stored: bool, parser, formatter,
                 top_logprobs: int | None, prompt_len: int):
        self.req, self.rid, self.model, self.params, self.stored = req, rid, model, params, stored
        self.parser, self.formatter, self.k, self.prompt_len = parser, formatter, top_logprobs, prompt_len
        self.created = int(time.time())
        self.items = OutputItems()
        self._sent_tokens = self._sent_chars = 0

    def response(self, status: str, **done) -> dict:
        return response_object(self.req, self.rid, self.model, self.created, self.params, self.stored, status, **done)

    def feed(self, out) -> list[dict]:
        """The stream events of one RequestOutput (its new tokens)."""
        c = out.outputs[0]
        new_ids, new_lps = c.token_ids[self._sent_tokens:], c.logprobs[self._sent_tokens:] if c.logprobs else []
        self._sent_tokens = len(c.token_ids)
        if not new_ids and c.finish_reason is None:
            return []
        logprobs = self.formatter.chat_logprobs(new_ids, new_lps, self.k)["content"] if self.k is not None else None
        # the text since the last call (a final output's delta_text is only its last step's)
        delta = self.parser.delta(c.text, c.text[self._sent_chars:], c.finish_reason is not None)
        self._sent_chars = len(c.text)
        return self.items.feed(delta, logprobs)

    def finish(self, out) -> tuple[dict, list[dict]]:
        """The finished Response and the events that close its items. `out`: the request's final output (None
        when it was aborted before one came)."""
        finish_reason = out.outputs[0].finish_reason if out is not None else "abort"
        status, incomplete = status_of(finish_reason)
        events = self.items.close("incomplete" if status != "completed" else "completed")
        usage = None
        if out is not None:
            reasoning = "".join(p["text"] for item in self.items.items if item["type"] == "reasoning"
                                for p in item["content"])
            reasoning_tokens = len(self.formatter.tok.encode(reasoning, add_special_tokens=False)) if reasoning else 0
            usage = usage_object(self.formatter.usage([self.prompt_len], [out]), reasoning_tokens)
        response = self.response(status, output=self.items.items, usage=usage, incomplete=incomplete)
        return response, events
