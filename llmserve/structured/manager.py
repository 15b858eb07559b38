"""Structured output: grammars compiled once per schema, a matcher per request, a token bitmask per step.

The engine is llguidance (chosen by measurement: benchmarks/grammar_engines.py and docs/structured-output.md). A
request's StructuredOutputsParams becomes an llguidance grammar (JSON schema, regex, choice, Lark, or GBNF converted
to Lark); `compile` validates it under resource limits and keeps a ready matcher per grammar in an LRU cache, so a
repeated schema costs a deep copy. The server compiles in a worker thread under a timeout before a request reaches
the engine; the engine's own `matcher()` then finds the grammar cached.

Per step the engine asks `fill_bitmasks` for the rows that sample: one packed int32 row per sampled position
(bit j of word w allows token 32 * w + j), with the positions of a speculating request's drafts filled as if the
drafts had been accepted (llguidance walks them and rolls back). The matcher advances by each token the request
keeps (Request.append_output_token), and a matcher that has seen the end of its grammar finishes the request.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING

from llmserve.errors import InvalidRequestError
from llmserve.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:  # the engine's steps need torch; checking a grammar (the CLI, before the model loads) does not
    import torch

logger = logging.getLogger(__name__)

# What one request may ask for. The grammar size bounds llguidance's work up front; its lexer and parser fuel bound
# each construction and mask step, so a pathological schema fails (400) instead of stalling the engine's step.
MAX_SPEC_BYTES = 64 * 1024
CACHE_SIZE = 256


def _limits():
    import llguidance

    return llguidance.LLParserLimits(max_grammar_size=200_000, max_lexer_states=50_000, initial_lexer_fuel=1_000_000,
                                     step_lexer_fuel=200_000)


class GrammarMatcher:
    """One request's position in its grammar."""

    def __init__(self, matcher):
        self._m = matcher

    def accept(self, token: int) -> None:
        # A token the mask allowed is always accepted; EOS after the end of the grammar stops the matcher.
        self._m.consume_token(token)

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of these draft tokens the grammar would take, without taking them."""
        return self._m.validate_tokens(tokens) if tokens else 0

    @property
    def is_finished(self) -> bool:
        """The grammar has ended (its EOS was taken, or nothing may follow): the request stops."""
        return self._m.is_stopped()

    @property
    def llmatcher(self):
        return self._m


class StructuredOutputManager:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]):
        self._hf_tokenizer = tokenizer.tokenizer if tokenizer is not None else None
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._ll_tokenizer = None
        self._cache: OrderedDict[tuple, object] = OrderedDict()
        self._lock = threading.Lock()
        self._executor = None
        self.words = (vocab_size + 31) // 32

    # ---- compile (server threads and the engine thread) ---------------------------------------------------------
    def _tokenizer(self):
        if self._ll_tokenizer is None:
            import llguidance

            if self._hf_tokenizer is None:
                raise InvalidRequestError("structured output needs the model's tokenizer", "structured_outputs")
            # ~0.5 s once: llguidance indexes every token's bytes
            self._ll_tokenizer = llguidance.LLTokenizer(self._hf_tokenizer.to_str(), n_vocab=self.vocab_size,
                                                        eos_token=self.eos_token_ids or None)
        return self._ll_tokenizer

    def warm_up(self) -> None:
        """Index the tokenizer for grammars now rather than at the first structured request. The index takes ~0.4 s,
        about half of it in one stretch holding the GIL (benchmarks/grammar_engines.py), which in a running server
        would stall every stream; a server does it while it starts."""
        if self._hf_tokenizer is None:
            return
        try:
            with self._lock:
                self._tokenizer()
        except Exception as e:  # noqa: BLE001 - the server still starts; the first grammar then fails with the reason
            logger.warning("structured output: indexing the tokenizer failed (%s: %s)", type(e).__name__, e)

    def compile(self, spec: StructuredOutputsParams, param: str = "structured_outputs"):
        """Validate and build the grammar (cached by what it depends on, and attached to the spec); a bad one raises
        400 naming `param`."""
        if spec.compiled is not None:
            return spec.compiled
        spec.compiled = self._compile(spec, param)
        return spec.compiled

    def _compile(self, spec: StructuredOutputsParams, param: str):
        key = spec.key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
            tokenizer = self._tokenizer()
        import llguidance

        grammar = grammar_text(spec, param)
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=_limits())
        if matcher.is_error():
            raise InvalidRequestError(f"{param}: {_first_line(matcher.get_error())}", param)
        with self._lock:
            self._cache[key] = matcher
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return matcher

    def matcher(self, spec: StructuredOutputsParams, param: str = "structured_outputs") -> GrammarMatcher:
        return GrammarMatcher(self.compile(spec, param).deep_copy())

    # ---- per step (engine thread) -------------------------------------------------------------------------------
    def fill_bitmasks(self, rows: list[tuple[GrammarMatcher, list[int]]]) -> list[torch.Tensor]:
        """For each (matcher, drafts): a [1 + len(drafts), words] int32 mask, position i as if drafts[:i] were taken."""
        import llguidance
        from llguidance.torch import fill_next_token_bitmask_par, fill_next_token_bitmask_par_with_draft_tokens

        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        total = sum(1 + len(d) for _, d in rows)
        import torch

        masks = torch.full((total, self.words), -1, dtype=torch.int32)
        plain, drafting, at = [], [], 0
        for m, drafts in rows:
            if drafts:
                drafting.append((m.llmatcher, at, list(drafts)))
            else:
                plain.append((m.llmatcher, at))
            at += 1 + len(drafts)
        # both fill rows in parallel threads outside the GIL
        if plain:
            fill_next_token_bitmask_par(self._executor, plain, masks)
        if drafting:
            fill_next_token_bitmask_par_with_draft_tokens(self._executor, drafting, masks)
        out, at = [], 0
        for _, drafts in rows:
            out.append(masks[at: at + 1 + len(drafts)])
            at += 1 + len(drafts)
        return out


def grammar_text(spec: StructuredOutputsParams, param: str) -> str:
    """The spec as one llguidance grammar (JSON schema, regex, choice, Lark or GBNF); a malformed one raises 400."""
    import llguidance

    LL = llguidance.LLMatcher
    size = len(json.dumps(spec.key()[1]))
    if size > MAX_SPEC_BYTES:
        raise InvalidRequestError(f"{param}: the schema or grammar is {size} bytes; the limit is {MAX_SPEC_BYTES}", param)
    if spec.json is not None or spec.json_object:
        schema = {"type": "object"} if spec.json_object else spec.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise InvalidRequestError(f"{param}: the JSON schema is not valid JSON ({e})", param) from None
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequestError(f"{param}: a JSON schema must be an object", param)
        options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "} \
            if spec.disable_any_whitespace else None
        try:
            return LL.grammar_from_json_schema(schema, overrides=options)
        except ValueError as e:
            raise InvalidRequestError(f"{param}: {_first_line(str(e))}", param) from None
    if spec.regex is not None:
        return LL.grammar_from_regex(spec.regex)
    if spec.choice is not None:
        return LL.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
    if spec.lark is not None:
        return LL.grammar_from_lark(spec.lark)
    from llguidance.gbnf_to_lark import gbnf_to_lark

    text = spec.grammar
    if _looks_like_gbnf(text):
        try:
            text = gbnf_to_lark(text)
        except Exception as e:  # the converter raises plain exceptions for malformed GBNF
            raise InvalidRequestError(f"{param}: cannot read the GBNF grammar ({_first_line(str(e))})", param) from None
    return LL.grammar_from_lark(text)


def check_grammar(spec: StructuredOutputsParams, param: str = "structured_outputs") -> None:
    """A grammar's syntax checked without a tokenizer (llguidance reads it alone): the CLI refuses a bad one before it
    loads the model. What only the vocabulary can tell is still checked where it is compiled."""
    import llguidance

    error = llguidance.LLMatcher.validate_grammar(grammar_text(spec, param))
    if error:
        raise InvalidRequestError(f"{param}: {_first_line(error)}", param)


def _looks_like_gbnf(text: str) -> bool:
    """llama.cpp's GBNF writes rules as `name ::= …`; Lark as `name: …`."""
    return "::=" in text


def _first_line(message: str) -> str:
    """llguidance's messages span lines (with a caret under the place); one line, bounded, for an API error."""
    message = " ".join(line.strip() for line in message.strip().splitlines() if line.strip() and line.strip() != "^")
    return (message[:400] + "…" if len(message) > 400 else message) or "invalid grammar"
