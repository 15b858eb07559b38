"""Incremental detokenization and stop strings.

Byte-level BPE tokens can end in the middle of a UTF-8 character; the tokenizers library's DecodeStream buffers
such tokens until their text is whole (one Rust call per token, where decoding a window of recent tokens twice per
token cost ~5 us a row per step), so no broken character is ever emitted. Stop
strings are searched in the text as it grows, so they match across token boundaries; while a
request runs, the last (longest stop − 1) characters are held back from the stream because they
might be the start of a stop string.
"""

from __future__ import annotations

from llmserve.engine.request import Request


class IncrementalDetokenizer:
    def __init__(self, tokenizer, request: Request):
        self.tokenizer = tokenizer
        self.params = request.params
        self.stream = tokenizer.decode_stream(request.params.skip_special_tokens)
        self.backend = tokenizer.tokenizer
        self.stop = request.params.stop
        self.text = ""
        self.emitted = 0  # characters of text already streamed
        self.stop_reason: str | None = None
        # characters held back while running: they might be the start of a stop string
        self.hold = max(request.params.max_stop_str_len - 1, 0)

    def update(self, token_id: int, finished: bool, textless: bool = False) -> tuple[str, bool]:
        """Feed one token; returns (text to stream now, whether a stop string ended the request). textless: the token
        adds no text (a stop token that ends the request), but what was held back is released."""
        stopped = False
        delta = None if textless else self._step(token_id)
        if delta:
            self.text += delta
            if self.stop and self._check_stop_strings(len(delta)):
                stopped = True
        hold = 0 if finished or stopped else self.hold
        end = max(len(self.text) - hold, self.emitted)
        out = self.text[self.emitted:end]
        self.emitted = end
        return out, stopped

    def _step(self, token_id: int) -> str | None:
        try:
            return self.stream.step(self.backend, token_id)
        except Exception as e:  # noqa: BLE001 - the library raises a bare Exception
            if "Invalid prefix encountered" not in str(e):
                raise
            # A byte-fallback vocabulary's text can shrink as tokens arrive (a lone byte decodes to U+FFFD, then
            # joins the next one), which DecodeStream cannot follow: start a new stream at this token (vLLM does
            # the same).
            self.stream = self.tokenizer.decode_stream(self.params.skip_special_tokens)
            return self.stream.step(self.backend, token_id)

    def _check_stop_strings(self, delta_len: int) -> bool:
        for stop in self.stop:
            start = max(0, len(self.text) - delta_len - len(stop) + 1)
            idx = self.text.find(stop, start)
            if idx != -1:
                self.stop_reason = stop
                self.text = self.text[: idx + len(stop)] if self.params.include_stop_str_in_output else self.text[:idx]
                return True
        return False
