"""Reasoning output: models that think in `<think>…</think>` before answering (Qwen3, DeepSeek-R1 style) get the
thinking in `reasoning_content` and the answer in `content`, whole or as streamed deltas.

--reasoning-parser qwen3: thinking only if the output opens with `<think>`; deepseek_r1: the template already opened
it, so the output is thinking until `</think>`. Like the tool-call parser, `split(text, final)` re-reads the text so far
and only ever grows what it returns, so streamed deltas reassemble to the non-streamed message.
"""

from __future__ import annotations

PARSERS = ("qwen3", "deepseek_r1")
START, END = "<think>", "</think>"


def _held(text: str, marker: str) -> int:
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def split(parser: str, text: str, final: bool) -> tuple[str, str]:
    """(reasoning, answer) of the output so far; text that may still become a marker is held back unless final."""
    s = text.lstrip()
    if s.startswith(START):
        s = s[len(START):]
    elif parser == "qwen3":
        if not final and START.startswith(s):
            return "", ""  # may be the start of <think>
        return "", text
    end = s.find(END)
    if end < 0:
        thinking = s if final else s[: len(s) - _held(s, END)]
        return thinking.strip(), ""
    return s[:end].strip(), s[end + len(END):].lstrip()


class ReasoningStream:
    def __init__(self, parser: str):
        self.parser = parser
        self.sent_reasoning = 0
        self.sent_answer = 0

    def update(self, text: str, final: bool) -> tuple[str, str, str]:
        """(reasoning delta, answer delta, the answer so far): the answer goes on to the tool-call parser."""
        reasoning, answer = split(self.parser, text, final)
        r, a = reasoning[self.sent_reasoning:], answer[self.sent_answer:]
        self.sent_reasoning, self.sent_answer = max(self.sent_reasoning, len(reasoning)), max(self.sent_answer, len(answer))
        return r, a, answer
