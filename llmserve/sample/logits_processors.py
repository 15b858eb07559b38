"""Logits processors: each edits a batch of logits rows for the rows that ask for it, in one batched operation where
it can, and leaves the others alone. The sampler applies them in vLLM's order:

  grammar bitmask → allowed token ids → banned ids (bad_words_ids, EOS and stop ids under min_tokens) → logit_bias
  → penalties (repetition, frequency, presence)

The grammar bitmask is the structured-output slot: a row's packed int32 words, bit j of word w allowing token
32 * w + j (the layout grammar engines such as xgrammar fill), handed in with the step input.
"""

from __future__ import annotations

import torch

from llmserve.sample.device_copy import on_device
from llmserve.sample.penalties import PenaltyState, apply_penalties


class LogitsProcessor:
    def apply(self, logits: torch.Tensor, rows: list) -> torch.Tensor:
        """rows: per logits row, an object with request_id, params, num_output_tokens, eos_token_ids,
        grammar_bitmask (and prompt/output token ids for penalties). Returns the edited logits."""
        raise NotImplementedError


_BYTE_BITS: dict[torch.device, torch.Tensor] = {}


def unpack_bitmask(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[..., ceil(V / 32)] int32 words → [..., V] bool, True where the token is allowed. Read as bytes through a
    256 x 8 table (little-endian: byte k of word w holds tokens 32w + 8k … 32w + 8k + 7), 1.7x faster than shifts."""
    table = _BYTE_BITS.get(words.device)
    if table is None:
        table = _BYTE_BITS[words.device] = ((torch.arange(256, device=words.device).unsqueeze(1)
                                             >> torch.arange(8, device=words.device)) & 1).bool()
    as_bytes = words.contiguous().view(torch.uint8).long()
    return table[as_bytes].flatten(-2)[..., :vocab_size]


def pack_bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """[..., V] bool → [..., ceil(V / 32)] int32 words (the inverse of unpack_bitmask)."""
    V = allowed.shape[-1]
    padded = torch.nn.functional.pad(allowed.to(torch.int64), (0, -V % 32)).view(*allowed.shape[:-1], -1, 32)
    words = (padded << torch.arange(32, device=allowed.device)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


class GrammarBitmask(LogitsProcessor):
    def apply(self, logits, rows):
        masked = [i for i, r in enumerate(rows) if r.grammar_bitmask is not None]
        if masked:
            idx = on_device(masked, logits.device)
            words = on_device(torch.stack([rows[i].grammar_bitmask for i in masked]), logits.device)
            allowed = unpack_bitmask(words, logits.shape[1])
            if len(masked) == logits.shape[0]:
                logits.masked_fill_(~allowed, float("-inf"))
            else:
                logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))
        return logits


class AllowedTokenIds(LogitsProcessor):
    def apply(self, logits, rows):
        for i, r in enumerate(rows):  # rare: a Python loop over only the rows that set it
            if r.params.allowed_token_ids is not None:
                keep = torch.zeros(logits.shape[1], dtype=torch.bool, device=logits.device)
                keep[on_device(r.params.allowed_token_ids, logits.device)] = True
                logits[i].masked_fill_(~keep, float("-inf"))
        return logits


class BannedTokenIds(LogitsProcessor):
    """bad_words_ids (single tokens), and EOS and stop ids while a row is under its min_tokens (unless a grammar
    constrains the row: at the grammar's end EOS is the only token left, and banning it would leave none)."""

    def apply(self, logits, rows):
        ban_rows, ban_ids = [], []
        for i, r in enumerate(rows):
            p = r.params
            if p.bad_words_ids:
                ban_rows += [i] * len(p.bad_words_ids)
                ban_ids += p.bad_words_ids
            if r.num_output_tokens < p.min_tokens and r.grammar_bitmask is None:  # a grammar decides its own end
                stops = list(r.eos_token_ids) + p.stop_token_ids
                ban_rows += [i] * len(stops)
                ban_ids += stops
        if ban_rows:
            dev = logits.device
            logits = logits.index_put((on_device(ban_rows, dev), on_device(ban_ids, dev)),
                                      on_device(float("-inf"), dev, logits.dtype))
        return logits


class LogitBias(LogitsProcessor):
    def apply(self, logits, rows):
        bias_rows, bias_ids, bias_vals = [], [], []
        for i, r in enumerate(rows):
            if r.params.logit_bias:
                bias_rows += [i] * len(r.params.logit_bias)
                bias_ids += list(r.params.logit_bias)
                bias_vals += list(r.params.logit_bias.values())
        if bias_rows:
            dev = logits.device
            logits = logits.index_put((on_device(bias_rows, dev), on_device(bias_ids, dev)),
                                      on_device(bias_vals, dev, logits.dtype), accumulate=True)
        return logits


class Penalties(LogitsProcessor):
    """Repetition, frequency and presence penalties over each request's persistent token counts. `apply` remembers
    which rows it penalized, so that `record` adds the tokens then sampled to their counts."""

    def __init__(self, state: PenaltyState):
        self.state = state
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None

    def apply(self, logits, rows):
        self._pending = None
        idx = [i for i, r in enumerate(rows)
               if r.params.repetition_penalty != 1.0 or r.params.frequency_penalty or r.params.presence_penalty]
        if not idx:
            return logits
        dev = logits.device
        index = on_device(idx, dev)
        table_rows = self.state.rows_for([rows[i] for i in idx])
        params = [rows[i].params for i in idx]
        logits[index] = apply_penalties(
            logits[index], self.state.counts[table_rows], self.state.in_prompt[table_rows],
            on_device([p.repetition_penalty for p in params], dev),
            on_device([p.frequency_penalty for p in params], dev),
            on_device([p.presence_penalty for p in params], dev),
        )
        self._pending = (index, table_rows)
        return logits

    def clear(self) -> None:
        """No row was penalized this time (the sampler skipped the processors)."""
        self._pending = None

    def record(self, tokens: torch.Tensor) -> None:
        """The tokens just sampled for the rows of the last `apply` (all of them, in order)."""
        if self._pending is not None:
            index, table_rows = self._pending
            self.state.record(table_rows, tokens[index])
            self._pending = None
