"""OpenAI chat completions <-> Anthropic's Messages API, both ways: the request (system prompt, turns, tool
definitions, tool calls and results, tool_choice, sampling fields), the response, the streamed events, and the usage
with its cache reads (Anthropic counts them apart from input_tokens; OpenAI counts them inside prompt_tokens)."""

from __future__ import annotations

import json
import time

FINISH_REASONS = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length", "tool_use": "tool_calls",
                  "pause_turn": "stop", "refusal": "content_filter"}

# OpenAI fields that have no Messages-API equivalent and would change the answer if ignored: a request that sets
# them is not sent to an Anthropic backend (it goes to the next backend, or gets a 400 naming the field).
UNTRANSLATABLE = ("n", "logprobs", "top_logprobs", "logit_bias", "response_format", "structured_outputs", "echo",
                  "suffix", "best_of")


class Untranslatable(ValueError):
    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def _text(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type", "text") == "text")
    return str(content)


def _sets(field: str, value) -> bool:
    """Whether a request asks for something with this field (its defaults ask for nothing)."""
    if value is None or value is False:
        return False
    if field in ("n", "best_of"):
        return value != 1
    if field == "top_logprobs":
        return value != 0
    if field == "response_format":
        return not (isinstance(value, dict) and value.get("type") in (None, "text"))
    return True


def chat_request(body: dict, model: str, default_max_tokens: int) -> dict:
    """An OpenAI chat request as a Messages API request for `model`."""
    for field in UNTRANSLATABLE:
        if _sets(field, body.get(field)):
            raise Untranslatable(f"'{field}' is not supported by the Anthropic Messages API", field)
    system: list[str] = []
    turns: list[dict] = []

    def add(role: str, blocks: list[dict]) -> None:
        if not blocks:
            return
        if turns and turns[-1]["role"] == role:  # the Messages API wants user and assistant to alternate
            turns[-1]["content"].extend(blocks)
        else:
            turns.append({"role": role, "content": list(blocks)})

    for m in body.get("messages") or []:
        role, text = m.get("role"), _text(m.get("content"))
        if role in ("system", "developer"):
            system.append(text)
        elif role == "user":
            add("user", [{"type": "text", "text": text}] if text else [])
        elif role == "assistant":
            blocks = [{"type": "text", "text": text}] if text else []
            for call in m.get("tool_calls") or []:
                fn = call.get("function") or {}
                args = fn.get("arguments") or "{}"
                try:
                    parsed = json.loads(args) if isinstance(args, str) else args
                except ValueError:
                    raise Untranslatable("an earlier tool call's arguments are not valid JSON", "messages") from None
                blocks.append({"type": "tool_use", "id": call.get("id", ""), "name": fn.get("name", ""), "input": parsed})
            add("assistant", blocks)
        elif role == "tool":
            add("user", [{"type": "tool_result", "tool_use_id": m.get("tool_call_id", ""), "content": text}])
    out: dict = {"model": model, "messages": turns,
                 "max_tokens": body.get("max_completion_tokens") or body.get("max_tokens") or default_max_tokens}
    if system:
        out["system"] = "\n\n".join(system)
    for field in ("temperature", "top_p", "top_k"):
        if body.get(field) is not None:
            out[field] = body[field]
    stop = body.get("stop")
    if stop:
        out["stop_sequences"] = [stop] if isinstance(stop, str) else list(stop)
    if body.get("stream"):
        out["stream"] = True
    if body.get("user"):
        out["metadata"] = {"user_id": str(body["user"])}
    tools = body.get("tools")
    if tools:
        out["tools"] = [{"name": t["function"]["name"], "description": t["function"].get("description", ""),
                         "input_schema": t["function"].get("parameters") or {"type": "object", "properties": {}}}
                        for t in tools if isinstance(t, dict) and isinstance(t.get("function"), dict)]
        choice = body.get("tool_choice")
        mapped = None
        if choice == "auto":
            mapped = {"type": "auto"}
        elif choice == "none":
            mapped = {"type": "none"}
        elif choice == "required":
            mapped = {"type": "any"}
        elif isinstance(choice, dict) and isinstance(choice.get("function"), dict):
            mapped = {"type": "tool", "name": choice["function"].get("name", "")}
        if body.get("parallel_tool_calls") is False:
            mapped = {**(mapped or {"type": "auto"}), "disable_parallel_tool_use": True}
        if mapped:
            out["tool_choice"] = mapped
    return out


def usage(u: dict | None) -> dict:
    """Anthropic's usage in OpenAI's shape: prompt_tokens includes the cache reads (and writes), and cached_tokens
    says how many were reads."""
    u = u or {}
    reads = u.get("cache_read_input_tokens") or 0
    writes = u.get("cache_creation_input_tokens") or 0
    prompt = (u.get("input_tokens") or 0) + reads + writes
    completion = u.get("output_tokens") or 0
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": reads}}


def chat_response(resp: dict, model: str) -> dict:
    """A Messages API response as an OpenAI chat completion."""
    text, calls = [], []
    for block in resp.get("content") or []:
        if block.get("type") == "text":
            text.append(block.get("text", ""))
        elif block.get("type") == "tool_use":
            calls.append({"id": block.get("id", ""), "type": "function",
                          "function": {"name": block.get("name", ""), "arguments": json.dumps(block.get("input", {}))}})
    message: dict = {"role": "assistant", "content": "".join(text) if text or not calls else None}
    if calls:
        message["tool_calls"] = calls
    return {"id": resp.get("id", "chatcmpl-anthropic"), "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": [{"index": 0, "message": message, "logprobs": None,
                                         "finish_reason": FINISH_REASONS.get(resp.get("stop_reason"), "stop")}],
            "usage": usage(resp.get("usage"))}


class StreamTranslator:
    """Messages API stream events in, OpenAI chat.completion.chunk objects out."""

    def __init__(self, model: str):
        self.model = model
        self.id = "chatcmpl-anthropic"
        self.created = int(time.time())
        self.raw_usage: dict = {}
        self.tool_index: dict[int, int] = {}  # content block index -> tool call index

    def _chunk(self, delta: dict | None = None, finish: str | None = None) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "delta": delta or {}, "logprobs": None, "finish_reason": finish}]}

    def feed(self, event: dict) -> list[dict]:
        kind = event.get("type")
        if kind == "message_start":
            message = event.get("message") or {}
            self.id = message.get("id", self.id)
            self.raw_usage.update(message.get("usage") or {})
            return [self._chunk({"role": "assistant", "content": ""})]
        if kind == "content_block_start":
            block = event.get("content_block") or {}
            if block.get("type") == "tool_use":
                index = self.tool_index[event.get("index", 0)] = len(self.tool_index)
                return [self._chunk({"tool_calls": [{"index": index, "id": block.get("id", ""), "type": "function",
                                                     "function": {"name": block.get("name", ""), "arguments": ""}}]})]
            if block.get("type") == "text" and block.get("text"):
                return [self._chunk({"content": block["text"]})]
            return []
        if kind == "content_block_delta":
            delta = event.get("delta") or {}
            if delta.get("type") == "text_delta":
                return [self._chunk({"content": delta.get("text", "")})]
            if delta.get("type") == "thinking_delta":
                return [self._chunk({"reasoning_content": delta.get("thinking", "")})]
            if delta.get("type") == "input_json_delta":
                index = self.tool_index.get(event.get("index", 0), 0)
                return [self._chunk({"tool_calls": [{"index": index, "function": {"arguments": delta.get("partial_json", "")}}]})]
            return []
        if kind == "message_delta":
            self.raw_usage.update({k: v for k, v in (event.get("usage") or {}).items() if v is not None})
            reason = (event.get("delta") or {}).get("stop_reason")
            return [self._chunk(finish=FINISH_REASONS.get(reason, "stop"))] if reason else []
        if kind == "message_stop":
            return [{"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                     "choices": [], "usage": usage(self.raw_usage)}]
        if kind == "error":
            err = event.get("error") or {}
            raise StreamError(err.get("message", "the backend sent an error event"), err.get("type"))
        return []  # ping, content_block_stop


class StreamError(Exception):
    def __init__(self, message: str, kind: str | None):
        super().__init__(message)
        self.kind = kind
