"""Beam search, as vLLM runs it: over the engine rather than inside it. Each step asks the engine for one token of
every live beam (a request whose prompt is the beam so far, with the top 2 x beam_width logprobs); prefix caching
makes that a computation of the beams' last tokens, not of their whole text. The candidates are scored, the best
beam_width stay, those that end with EOS are set aside; at the end the best beam_width of all are the answer.

A beam's score is its cumulative logprob over its length (prompt included, a final EOS not) to the power
length_penalty: vLLM's rule, so that the same request ranks its answers the same way on both."""

from __future__ import annotations

from dataclasses import dataclass, field

from llmserve.errors import InvalidRequestError
from llmserve.sampling_params import SamplingParams


@dataclass
class BeamSearchParams:
    """vLLM's BeamSearchParams: beam_width answers, each at most max_tokens long. Beams are ranked by the model's own
    logprobs whatever the temperature (as vLLM's, whose logprobs are the raw model's): temperature is taken for
    vLLM's signature."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False  # vLLM's field; a beam stops only at EOS, whose text is never shown

    def __post_init__(self):
        for name, low in (("beam_width", 1), ("max_tokens", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise InvalidRequestError(f"{name} must be an integer of at least {low}, got {value!r}", name)
        if not isinstance(self.length_penalty, (int, float)) or isinstance(self.length_penalty, bool):
            raise InvalidRequestError(f"length_penalty must be a number, got {self.length_penalty!r}", "length_penalty")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise InvalidRequestError(f"temperature must be a number of at least 0, got {self.temperature!r}",
                                      "temperature")

    def step_params(self, max_logprobs: int, **processors) -> SamplingParams:
        """One step of every beam: one token, and the 2 x beam_width most likely (vLLM keeps twice the width so that
        beams which end with EOS leave enough to go on with). processors: stateless logits processors
        (logit_bias, allowed_token_ids, bad_words_ids) applied at every step."""
        k = 2 * self.beam_width
        if max_logprobs != -1 and k > max_logprobs:
            raise InvalidRequestError(f"beam search of width {self.beam_width} reads the top {k} logprobs at each step; "
                                      f"the server allows {max_logprobs} (--max-logprobs): use a width of at most "
                                      f"{max_logprobs // 2}", "n")
        return SamplingParams(max_tokens=1, temperature=0.0, logprobs=k, ignore_eos=True,
                              skip_special_tokens=False, **processors)


@dataclass
class BeamSearchSequence:
    """One beam: its tokens (the prompt's first), each generated token's logprobs, their sum; once finished, its
    text and why it ended ("stop": EOS, "length": max_tokens or the context)."""

    tokens: list[int]
    logprobs: list[dict[int, float]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | None = None


@dataclass
class BeamSearchOutput:
    """vLLM's: the best beam_width sequences of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def beam_score(beam: BeamSearchSequence, eos_token_ids: set[int], length_penalty: float) -> float:
    length = len(beam.tokens) - (1 if beam.tokens[-1] in eos_token_ids else 0)
    return beam.cum_logprob / (length ** length_penalty)


class BeamSearch:
    """One prompt's search. `live` are the beams to extend; `extend` takes each one's next-token logprobs (the
    engine's, in the order of `live`); `finished` says when to stop; `result` is the answer."""

    def __init__(self, prompt_token_ids: list[int], params: BeamSearchParams, eos_token_ids: list[int],
                 max_model_len: int):
        self.params = params
        self.prompt_len = len(prompt_token_ids)
        self.eos = set(eos_token_ids)
        # a beam may grow to max_tokens, and never past the context
        self.max_steps = min(params.max_tokens, max_model_len - self.prompt_len)
        if self.max_steps < 1:
            raise InvalidRequestError(f"This model's maximum context length is {max_model_len} tokens. However, your "
                                      f"prompt has {self.prompt_len} tokens, which leaves no room for the completion.",
                                      "prompt")
        self.live = [BeamSearchSequence(list(prompt_token_ids))]
        self.completed: list[BeamSearchSequence] = []
        self.steps = 0

    @property
    def finished(self) -> bool:
        return not self.live or self.steps >= self.max_steps

    def _score(self, beam: BeamSearchSequence) -> float:
        return beam_score(beam, self.eos, self.params.length_penalty)

    def extend(self, next_logprobs: list[dict[int, float]]) -> None:
        candidates = []
        for beam, logprobs in zip(self.live, next_logprobs, strict=True):
            for token, logprob in logprobs.items():
                grown = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [logprobs],
                                           beam.cum_logprob + logprob)
                if token in self.eos and not self.params.ignore_eos:
                    grown.finish_reason, grown.stop_reason = "stop", token
                    self.completed.append(grown)
                else:
                    candidates.append(grown)
        candidates.sort(key=self._score, reverse=True)  # stable: ties keep the engine's order
        self.live = candidates[: self.params.beam_width]
        self.steps += 1

    def result(self, tokenizer, live_reason: str = "length") -> BeamSearchOutput:
        """The best beam_width beams, ended or not; live_reason: why the live ones stopped (max_tokens, or the
        request's timeout or abort)."""
        for beam in self.live:
            beam.finish_reason = live_reason
        best = sorted(self.completed + self.live, key=self._score, reverse=True)[: self.params.beam_width]
        for beam in best:  # (no tokenizer: skip_tokenizer_init, token ids alone)
            beam.text = tokenizer.decode(beam.tokens[self.prompt_len:], skip_special_tokens=True) if tokenizer else ""
        return BeamSearchOutput(best)


# what a text request may carry with use_beam_search: the stateless logits processors travel to every step; what
# needs a sequence's history or a sampler's state is refused by name (left at its default, it is fine)
BEAM_STEP_FIELDS = ("logit_bias", "allowed_token_ids", "bad_words_ids")
# (top_p, top_k and min_p act after the logprobs are read, on sampling alone: nothing to do with beams)
BEAM_REFUSED_FIELDS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "stop",
                       "stop_token_ids", "structured_outputs", "prompt_logprobs")


def beam_search_from(params: SamplingParams, length_penalty: float) -> tuple[BeamSearchParams, dict]:
    """A text request's SamplingParams (with use_beam_search: n is the width) as BeamSearchParams, and the logits
    processors every step applies. What beam search cannot honour is a 400 naming it."""
    default = SamplingParams()
    for name in BEAM_REFUSED_FIELDS:
        if getattr(params, name) not in (getattr(default, name), None, [], ()):
            raise InvalidRequestError(f"use_beam_search does not take {name}: beams are ranked by their logprobs "
                                      f"alone (n, max_tokens, ignore_eos, length_penalty, logprobs, logit_bias, "
                                      f"allowed_token_ids and bad_words apply)", name)
    beam = BeamSearchParams(beam_width=params.n, max_tokens=params.max_tokens, ignore_eos=params.ignore_eos,
                            temperature=params.temperature, length_penalty=length_penalty,
                            include_stop_str_in_output=params.include_stop_str_in_output)
    return beam, {name: getattr(params, name) for name in BEAM_STEP_FIELDS if getattr(params, name) is not None}


def shown_logprobs(beam: BeamSearchSequence, prompt_len: int, k: int | None) -> list[dict[int, float]] | None:
    """A beam's logprobs as a response shows them: per token, its own and the top k (None: not asked for)."""
    if k is None:
        return None
    out = []
    for token, logprobs in zip(beam.tokens[prompt_len:], beam.logprobs):
        top = dict(sorted(logprobs.items(), key=lambda kv: -kv[1])[:k])
        top[token] = logprobs[token]
        out.append(top)
    return out

