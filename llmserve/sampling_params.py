"""Per-request decoding controls, in vLLM's names, validated at construction."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any

from llmserve.errors import InvalidRequestError

DEFAULT_MAX_LOGPROBS = 20  # vLLM's --max-logprobs default, and OpenAI's limit on top_logprobs
MAX_STOP_SEQUENCES = 32
MAX_N = 128  # OpenAI's limit on choices per request
GREEDY_TEMPERATURE = 1e-5  # below this a row takes the argmax


class RequestOutputKind(enum.Enum):
    """What the engine returns for a request as it runs (vLLM's names)."""

    CUMULATIVE = 0  # every step: the whole text and tokens so far, plus what is new (delta_text, delta_token_ids)
    DELTA = 1  # every step: only what is new (text and token_ids are the delta)
    FINAL_ONLY = 2  # one output, when the request has finished: building none per step is what offline runs want


@dataclass
class StructuredOutputsParams:
    """Constrained decoding, in vLLM's shape: exactly one of a JSON schema (dict or JSON text), any JSON object, a
    regular expression, a list of choices, or a grammar (Lark, or GBNF/EBNF as llama.cpp writes it). Compiled by
    structured/manager.py; the output then always matches it (unless cut short by max_tokens or a stop string)."""

    json: dict | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = True  # JSON with single spaces after ':' and ',' (small models wander otherwise)
    # set by the server for tool calls: a ready llguidance Lark grammar, not a user's
    lark: str | None = field(default=None, repr=False)
    # the compiled grammar, attached where it was compiled (the server's worker thread) so that the engine thread only
    # copies it; not part of the value, and not sent across processes
    compiled: Any = field(default=None, repr=False, compare=False)

    def __getstate__(self):
        return {**self.__dict__, "compiled": None}

    def __post_init__(self):
        given = [k for k in ("json", "json_object", "regex", "choice", "grammar", "lark") if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequestError("structured_outputs takes exactly one of json, json_object, regex, choice, grammar"
                                      + (f"; got {', '.join(given)}" if given else ""), "structured_outputs")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise InvalidRequestError("structured_outputs.choice must be a non-empty list of non-empty strings",
                                      "structured_outputs")
        for k in ("regex", "grammar"):
            v = getattr(self, k)
            if v is not None and (not isinstance(v, str) or not v.strip()):
                raise InvalidRequestError(f"structured_outputs.{k} must be a non-empty string", "structured_outputs")

    def key(self) -> tuple[str, Any]:
        """What the compiled grammar depends on (the cache key)."""
        import json as _json

        kind = next(k for k in ("json", "json_object", "regex", "choice", "grammar", "lark") if getattr(self, k) not in (None, False))
        value = getattr(self, kind)
        if isinstance(value, (dict, list)):
            value = _json.dumps(value, sort_keys=True)
        return kind, value, self.disable_any_whitespace


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    bad_words_ids: list[int] | None = None  # banned token ids
    allowed_token_ids: list[int] | None = None
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self):
        def bad(param, message):
            raise InvalidRequestError(f"{param} {message}", param)

        def number(param, kind=(int, float)):
            v = getattr(self, param)
            if isinstance(v, bool) or not isinstance(v, kind) or (isinstance(v, float) and not math.isfinite(v)):
                bad(param, f"must be a {'integer' if kind is int else 'finite number'}, got {v!r}")
            return v

        if not 1 <= number("n", int) <= MAX_N:
            bad("n", f"must be in [1, {MAX_N}], got {self.n}")
        if number("temperature") < 0:
            bad("temperature", f"must be non-negative, got {self.temperature}")
        if not 0 < number("top_p") <= 1:
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if number("top_k", int) < -1:
            bad("top_k", f"must be -1 or 0 (off) or a positive integer, got {self.top_k}")
        if not 0 <= number("min_p") <= 1:
            bad("min_p", f"must be in [0, 1], got {self.min_p}")
        for p in ("presence_penalty", "frequency_penalty"):
            if not -2 <= number(p) <= 2:
                bad(p, f"must be in [-2, 2], got {getattr(self, p)}")
        if number("repetition_penalty") <= 0:
            bad("repetition_penalty", f"must be greater than 0, got {self.repetition_penalty}")
        if number("max_tokens", int) < 1:
            bad("max_tokens", f"must be at least 1, got {self.max_tokens}")
        if not 0 <= number("min_tokens", int) <= self.max_tokens:
            bad("min_tokens", f"must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if self.seed is not None and not -2**63 <= number("seed", int) < 2**64:
            bad("seed", f"must fit in 64 bits, got {self.seed}")
        for p in ("logprobs", "prompt_logprobs"):  # the most a request may ask for is the engine's (validate_for_model)
            v = getattr(self, p)
            if v is not None and number(p, int) < 0:
                bad(p, f"must not be negative, got {v}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if len(self.stop) > MAX_STOP_SEQUENCES:
            bad("stop", f"allows at most {MAX_STOP_SEQUENCES} sequences, got {len(self.stop)}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "must be non-empty strings")
        self.stop_token_ids = [int(t) for t in self.stop_token_ids or []]
        if self.logit_bias:
            # OpenAI clamps biases to [-100, 100]; keys may arrive as strings from JSON.
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError):
                bad("logit_bias", "must map token ids to numbers")
            if not all(math.isfinite(v) for v in self.logit_bias.values()):
                bad("logit_bias", "values must be finite numbers")
            self.logit_bias = {k: max(-100.0, min(100.0, v)) for k, v in self.logit_bias.items()}
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            bad("allowed_token_ids", "must not be empty")
        if not isinstance(self.output_kind, RequestOutputKind):
            bad("output_kind", f"must be a RequestOutputKind, got {self.output_kind!r}")
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def edits_logits(self) -> bool:
        """Whether any logits processor may change this row (bans, allowed ids, min_tokens, bias, penalties)."""
        return bool(self.bad_words_ids or self.allowed_token_ids is not None or self.min_tokens or self.logit_bias
                    or self.repetition_penalty != 1.0 or self.frequency_penalty or self.presence_penalty)

    @property
    def max_stop_str_len(self) -> int:
        return max((len(s) for s in self.stop), default=0)

    def validate_for_model(self, vocab_size: int, max_logprobs: int = DEFAULT_MAX_LOGPROBS) -> None:
        """What depends on the engine: token ids inside the vocabulary, and at most its --max-logprobs logprobs
        (vLLM's message)."""
        for param, kind in (("logprobs", "sample"), ("prompt_logprobs", "prompt")):
            asked = getattr(self, param)
            if asked is not None and asked > max_logprobs:
                raise InvalidRequestError(f"Requested {kind} logprobs of {asked}, which is greater than max allowed: "
                                          f"{max_logprobs} (the engine's max_logprobs, --max-logprobs)", param)
        for param in ("logit_bias", "bad_words_ids", "allowed_token_ids", "stop_token_ids"):
            ids = getattr(self, param) or []
            bad_ids = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size]
            if bad_ids:
                raise InvalidRequestError(f"{param} has token id {bad_ids[0]} outside the vocabulary [0, {vocab_size})", param)
