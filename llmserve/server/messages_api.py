"""Anthropic's Messages API (POST /v1/messages, as vLLM, SGLang and llama.cpp serve it, for clients such as Claude
Code) as a face of the chat path.

A request's `system` and `messages` (text, tool_use and tool_result blocks) become chat messages, its tools chat tools;
the chat output parser's deltas become Anthropic content blocks (thinking, text, tool_use) and their stream events.
Errors are Anthropic's error object. Usage counts prompt tokens read from the prefix cache apart, as Anthropic
does: `input_tokens` are the others, `cache_read_input_tokens` those.
"""

from __future__ import annotations

import json
import uuid

from pydantic import ValidationError

from llmserve.server.errors import APIError, from_validation_error
from llmserve.server.protocol import ChatCompletionRequest, CountTokensRequest, MessagesRequest, content_text


def _text_of(content, where: str) -> str:
    return content_text(content, where, "messages", ("text",), ("image", "document", "search_result",
                                                              "container_upload"))


def chat_messages(req: MessagesRequest | CountTokensRequest) -> list[dict]:
    """system and messages as chat messages. A user turn's tool_result blocks become tool messages (before its
    text); an assistant turn's tool_use blocks its tool_calls; thinking blocks are not shown to the model again."""
    messages: list[dict] = []
    if req.system:
        messages.append({"role": "system", "content": _text_of(req.system, "system")})
    for i, m in enumerate(req.messages):
        where = f"messages[{i}].content"
        if isinstance(m.content, str):
            messages.append({"role": m.role, "content": m.content})
            continue
        text, calls = [], []
        for j, block in enumerate(m.content):
            at = f"{where}[{j}]"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "tool_result" and m.role == "user":
                if not isinstance(block.get("tool_use_id"), str):
                    raise APIError(400, f"{at}.tool_use_id must be a string", param="messages")
                result = _text_of(block.get("content"), f"{at}.content")
                messages.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                                 "content": f"Error: {result}" if block.get("is_error") else result})
            elif kind == "tool_use" and m.role == "assistant":
                if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                    raise APIError(400, f"{at} needs an id and a name", param="messages")
                calls.append({"id": block["id"], "type": "function",
                              "function": {"name": block["name"], "arguments": json.dumps(block.get("input") or {})}})
            elif kind in ("thinking", "redacted_thinking") and m.role == "assistant":
                continue
            else:
                text.append(_text_of(block, at))
        if not m.content:
            raise APIError(400, f"{where} must not be empty", param="messages")
        if text or calls or m.role == "assistant":
            messages.append({"role": m.role, "content": "".join(text) if text or not calls else None,
                             **({"tool_calls": calls} if calls else {})})
    return messages


def chat_tools(req: MessagesRequest | CountTokensRequest) -> tuple[list[dict] | None, str | dict | None, bool]:
    """Anthropic's tools and tool_choice in chat's shape, and whether parallel calls are allowed."""
    tools = None
    if req.tools is not None:
        tools = []
        for i, tool in enumerate(req.tools):
            if not isinstance(tool, dict) or tool.get("type", "custom") != "custom" or "input_schema" not in tool:
                kind = tool.get("type") if isinstance(tool, dict) else None
                raise APIError(400, f"tools[{i}]: only client tools (a name and an input_schema) are supported here, "
                                    f"not type {kind!r}", param="tools")
            fn = {"name": tool.get("name"), "parameters": tool["input_schema"]}
            if tool.get("description"):
                fn["description"] = tool["description"]
            tools.append({"type": "function", "function": fn})
    choice, parallel = req.tool_choice, True
    if choice is None:
        return tools, None, parallel
    kind = choice.get("type")
    parallel = not choice.get("disable_parallel_tool_use", False)
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise APIError(400, "tool_choice.name is required for type 'tool'", param="tool_choice")
        return tools, {"type": "function", "function": {"name": choice["name"]}}, parallel
    named = {"auto": "auto", "any": "required", "none": "none"}
    if kind not in named:
        raise APIError(400, "tool_choice.type must be 'auto', 'any', 'tool' or 'none'", param="tool_choice")
    return tools, named[kind], parallel


def response_format(req: MessagesRequest) -> dict | None:
    """output_config.format (Anthropic's structured outputs, what messages.parse sends) as chat's response_format."""
    fmt = (req.output_config or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise APIError(400, "output_config.format must be {'type': 'json_schema', 'schema': {...}}",
                       param="output_config")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"], "strict": True}}


def chat_request(req: MessagesRequest) -> ChatCompletionRequest:
    tools, tool_choice, parallel = chat_tools(req)
    try:
        return ChatCompletionRequest(**req.chat_fields(), model=req.model, messages=chat_messages(req), tools=tools,
                                     tool_choice=tool_choice, parallel_tool_calls=parallel, max_tokens=req.max_tokens,
                                     stop=req.stop_sequences, response_format=response_format(req))
    except ValidationError as e:
        raise from_validation_error(e, "messages") from None


def stop_reason(finish_reason: str | None, matched, has_calls: bool) -> tuple[str, str | None]:
    """Anthropic's stop_reason and stop_sequence for how the request finished. `matched`: the engine's stop_reason
    (the stop string that ended it, a stop token id, or None at EOS)."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason == "timeout":
        return "timeout", None  # llmserve's extension, as finish_reason "timeout" in the OpenAI routes
    if has_calls:
        return "tool_use", None
    if isinstance(matched, str):
        return "stop_sequence", matched
    return "end_turn", None


def usage_object(prompt_tokens: int, cached_tokens: int, output_tokens: int) -> dict:
    return {"input_tokens": prompt_tokens - cached_tokens, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached_tokens, "output_tokens": output_tokens}


class ContentBlocks:
    """The message's content blocks, built from the chat output parser's deltas, with the stream events each change
    makes. A block ends (content_block_stop) when another starts, or at the end."""

    def __init__(self):
        self.blocks: list[dict] = []
        self._arguments: list[str] = []  # a tool_use block's input as JSON text, as it arrives
        self._calls: dict[int, int] = {}  # the chat delta's call index -> its block index
        self._open: int | None = None

    def _start(self, block: dict) -> list[dict]:
        events = self._stop()
        self.blocks.append(block)
        self._arguments.append("")
        self._open = len(self.blocks) - 1
        shown = {**block, "input": {}} if block["type"] == "tool_use" else dict(block)
        return events + [{"type": "content_block_start", "index": self._open, "content_block": shown}]

    def _stop(self) -> list[dict]:
        if self._open is None:
            return []
        index, self._open = self._open, None
        block = self.blocks[index]
        if block["type"] == "tool_use":
            try:
                block["input"] = json.loads(self._arguments[index] or "{}")
            except ValueError:  # cut by max_tokens mid-call (stop_reason says so); the stream had the pieces
                block["input"] = {}
        return [{"type": "content_block_stop", "index": index}]

    def feed(self, delta: dict) -> list[dict]:
        events: list[dict] = []
        if delta.get("reasoning_content"):
            if self._open is None or self.blocks[self._open]["type"] != "thinking":
                events += self._start({"type": "thinking", "thinking": "", "signature": ""})
            self.blocks[self._open]["thinking"] += delta["reasoning_content"]
            events.append({"type": "content_block_delta", "index": self._open,
                           "delta": {"type": "thinking_delta", "thinking": delta["reasoning_content"]}})
        if delta.get("content"):
            if self._open is None or self.blocks[self._open]["type"] != "text":
                events += self._start({"type": "text", "text": ""})
            self.blocks[self._open]["text"] += delta["content"]
            events.append({"type": "content_block_delta", "index": self._open,
                           "delta": {"type": "text_delta", "text": delta["content"]}})
        for call in delta.get("tool_calls") or []:
            if call.get("id"):
                events += self._start({"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"),
                                       "name": call["function"]["name"], "input": {}})
                self._calls[call["index"]] = self._open
            fragment = call["function"].get("arguments") or ""
            if fragment:
                index = self._calls[call["index"]]
                self._arguments[index] += fragment
                events.append({"type": "content_block_delta", "index": index,
                               "delta": {"type": "input_json_delta", "partial_json": fragment}})
        return events

    def close(self) -> list[dict]:
        return self._stop()

    @property
    def has_calls(self) -> bool:
        return any(b["type"] == "tool_use" for b in self.blocks)


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"
