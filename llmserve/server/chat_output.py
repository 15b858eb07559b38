"""One chat choice's text as the OpenAI message: `reasoning_content`, `content` and `tool_calls`, streamed as deltas
or whole. Without a reasoning parser or tools the text is the content, unchanged."""

from __future__ import annotations

from llmserve.server import reasoning, tool_calls
from llmserve.server.tool_calls import ToolFormat


class ChatOutputParser:
    def __init__(self, reasoning_parser: str | None, tool_format: ToolFormat | None, forced_function: bool):
        self.reasoning = reasoning.ReasoningStream(reasoning_parser) if reasoning_parser else None
        self.tools = tool_calls.ToolCallStream(tool_format) if tool_format else None
        self.forced_function = forced_function  # tool_choice named a function: OpenAI then says finish_reason "stop"
        self.reasoning_parser, self.tool_format = reasoning_parser, tool_format

    @property
    def active(self) -> bool:
        return self.reasoning is not None or self.tools is not None

    def finish_reason(self, reason: str | None, has_calls: bool) -> str | None:
        if reason == "stop" and has_calls and not self.forced_function:
            return "tool_calls"
        return reason

    def delta(self, text: str, delta_text: str, final: bool) -> dict:
        """The delta for this chunk, from the choice's whole text so far."""
        if not self.active:
            return {"content": delta_text}
        out = {}
        answer_delta, answer = delta_text, text
        if self.reasoning is not None:
            thinking, answer_delta, answer = self.reasoning.update(text, final)
            if thinking:
                out["reasoning_content"] = thinking
        if self.tools is not None:
            content, calls = self.tools.update(answer, final)
            if content:
                out["content"] = content
            if calls:
                out["tool_calls"] = calls
        elif answer_delta:
            out["content"] = answer_delta
        return out

    @property
    def sent_calls(self) -> bool:
        return bool(self.tools and self.tools.ids)

    def message(self, text: str) -> tuple[dict, bool]:
        """The non-streamed message, and whether it has tool calls."""
        msg = {"role": "assistant", "content": text, "refusal": None}
        if not self.active:
            return msg, False
        answer = text
        if self.reasoning_parser:
            thought, answer = reasoning.split(self.reasoning_parser, text, final=True)
            msg["reasoning_content"] = thought or None
        msg["content"] = answer
        calls = []
        if self.tool_format is not None:
            msg["content"], calls = tool_calls.message_tool_calls(self.tool_format, answer)
            if calls:
                msg["tool_calls"] = calls
        return msg, bool(calls)
