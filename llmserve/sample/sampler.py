"""Batched sampler: logits → next tokens (+ logprobs), rows with different parameters side by side.

Order of operations (as vLLM's sampler):
  1-3. the logits processors (sample/logits_processors.py): grammar bitmask, allowed_token_ids, bad_words_ids,
     min_tokens (EOS and stop ids masked), logit_bias, then the penalties (repetition, frequency, presence)
  4. greedy rows (temperature < 1e-5) take the argmax here
  5. temperature
  6. logprobs are taken here: log-softmax of the logits after steps 1-5 (greedy rows at temperature 1),
     before the min_p / top-k / top-p filters
  7. min_p, then top-k, then top-p (on the distribution top-k left); only on the sampled rows
  8. sample: inverse-CDF draw with one uniform per row; a seeded row draws from its own generator, so its tokens do not
     depend on its neighbours or the batch size.
Ties: tokens tied with the top-k or top-p cut-off token are kept.
All steps are tensor operations over the batch; the per-row Python is only collecting parameters
(and the sparse ones: biases, bans) and the seeded rows' draws.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from llmserve.sample.device_copy import on_device
from llmserve.sample.logits_processors import (AllowedTokenIds, BannedTokenIds, GrammarBitmask, LogitBias,
                                               LogitsProcessor, Penalties)
from llmserve.sample.penalties import PenaltyState
from llmserve.sampling_params import GREEDY_TEMPERATURE


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]  # sampled token and the top `logprobs` tokens, per row
    sampled_logprobs: list[float | None]


HEAD = 512  # candidates kept for filtered rows: holds the top-p cut-off of almost every real distribution


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    # p_i < min_p * p_max  ⟺  logit_i < max_logit + log(min_p): no softmax needed.
    threshold = logits.amax(dim=-1, keepdim=True) + torch.log(min_p).unsqueeze(1)
    return logits.masked_fill(logits < threshold, float("-inf"))


def filter_head(logits: torch.Tensor, top_k: list[int], top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k then top-p, computed on each row's `HEAD` (or k) most likely tokens instead of a full sort.

    top_k: per row (0 = off), top_p: [R] (1 = off). Returns (probs over the candidates, their token ids,
    rows whose top-p set does not fit in the head: the caller samples those over the full vocabulary).
    Ties with the k-th token, or with the last token of the top-p set, are kept."""
    V = logits.shape[1]
    K = min(V, max(HEAD, max(top_k)))
    vals, ids = logits.topk(K, dim=-1)  # descending
    k = on_device(top_k, logits.device)
    has_k = k > 0
    kth = vals.gather(1, (k.clamp(min=1, max=K) - 1).unsqueeze(1))
    vals = torch.where(has_k.unsqueeze(1) & (vals < kth), float("-inf"), vals)
    # top-k rows renormalise over their k tokens; the others keep the full-vocabulary normaliser
    norm = torch.logsumexp(vals, dim=-1)
    if not all(top_k):
        no_k = ~has_k
        norm[no_k] = torch.logsumexp(logits[no_k], dim=-1)
    probs = torch.exp(vals - norm.unsqueeze(1))
    cum = probs.cumsum(dim=-1)
    spill = ~has_k & (cum[:, -1] < top_p)
    n_keep = (cum < top_p.unsqueeze(1)).sum(dim=-1, keepdim=True).clamp(max=K - 1)
    threshold = probs.gather(1, n_keep)
    probs = probs.masked_fill((probs < threshold) & (top_p < 1).unsqueeze(1), 0.0)
    return probs, ids, spill


def top_p_full(probs: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Top-p by a full sort: the rare rows whose top-p set is larger than the head."""
    values = probs.sort(dim=-1, descending=True).values
    cum = values.cumsum(dim=-1)
    n_keep = (cum < p.unsqueeze(1) * cum[:, -1:]).sum(dim=-1, keepdim=True).clamp(max=values.shape[1] - 1)
    return probs.masked_fill(probs < values.gather(1, n_keep), 0.0)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Column index drawn from each row of unnormalised `probs` with its uniform `u` (float64 sums)."""
    cdf = probs.double().cumsum_(dim=-1)
    col = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
    return col.clamp_(max=probs.shape[1] - 1)


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device, seed: int = 0, argmax=None, sort_top_p: bool | None = None):
        self.vocab_size = vocab_size
        # How a top-p row without top-k is filtered. On a CPU: over its head of likely tokens, falling back to a full
        # sort for the rare row whose top-p set exceeds the head; finding those rows reads a flag back from the
        # device. On a GPU that read waits for the whole step, which stalls async output processing and async
        # scheduling, so there (None: off the CPU) such rows are sorted at once, as vLLM does. A top-k row's set
        # always fits in its head: its route reads nothing back either way.
        self.sort_top_p = device.type != "cpu" if sort_top_p is None else sort_top_p
        # each row's first maximal index; the platform may give a faster one than torch's max().indices
        self._argmax = argmax or (lambda logits: logits.max(dim=-1).indices)
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.seeded: dict[str, torch.Generator] = {}
        self.last_tokens: torch.Tensor | None = None
        self.penalties = PenaltyState(vocab_size, device)
        self.penalty_processor = Penalties(self.penalties)
        self.logits_processors: list[LogitsProcessor] = [GrammarBitmask(), AllowedTokenIds(), BannedTokenIds(),
                                                         LogitBias(), self.penalty_processor]

    def release(self, request_id: str) -> None:
        self.seeded.pop(request_id, None)
        self.penalties.release(request_id)

    def _generator(self, req) -> torch.Generator:
        g = self.seeded.get(req.request_id)
        if g is None:
            g = torch.Generator(device=self.device)
            g.manual_seed(req.params.seed)
            self.seeded[req.request_id] = g
        return g

    def adjust_logits(self, logits: torch.Tensor, rows: list) -> torch.Tensor:
        """Steps 1-3: the logits processors, in order, in place where possible. One pass over the rows first: most
        steps have no row that any processor would change, and then none of them loops over the batch."""
        if not any(r.grammar_bitmask is not None or r.params.edits_logits for r in rows):
            self.penalty_processor.clear()
            return logits
        for processor in self.logits_processors:
            logits = processor.apply(logits, rows)
        return logits

    def record_sampled(self, tokens: torch.Tensor) -> None:
        """The tokens sampled from the rows of the last adjust_logits (penalties count them)."""
        self.penalty_processor.record(tokens)

    def sample(self, logits: torch.Tensor, requests: list) -> SamplerOutput:
        return self.sample_deferred(logits, requests)()

    def sample_deferred(self, logits: torch.Tensor, requests: list) -> Callable[[], SamplerOutput]:
        """Queues the sampling on the logits' device and returns what brings the tokens to the host (the call that
        waits for the device): on a GPU the host can do other work in between. Call it before the next forward."""
        if not requests:
            return lambda: SamplerOutput([], [], [])
        logits = logits[:, : self.vocab_size].float()
        params = [r.params for r in requests]
        dev = self.device
        B = len(requests)
        logits = self.adjust_logits(logits, requests)

        # 4. Greedy.
        greedy = [p.temperature < GREEDY_TEMPERATURE for p in params]
        want_logprobs = [p.logprobs is not None for p in params]
        logprob_rows = None
        if all(greedy) or not any(greedy):
            tokens = self.argmax(logits) if all(greedy) else torch.empty(B, dtype=torch.long, device=dev)
        else:
            tokens = torch.empty(B, dtype=torch.long, device=dev)
            g_idx = on_device([i for i, g in enumerate(greedy) if g], dev)
            tokens[g_idx] = self.argmax(logits[g_idx])
        if not all(greedy) or any(want_logprobs):
            # 5. Temperature (greedy rows at 1 so that their logprobs are defined).
            temps = on_device([1.0 if g else p.temperature for g, p in zip(greedy, params)], dev)
            logits = logits.div_(temps.unsqueeze(1))
            if any(want_logprobs):
                logprob_rows = torch.log_softmax(logits, dim=-1)
            sampled = [i for i, g in enumerate(greedy) if not g]
            if sampled:
                idx = on_device(sampled, dev)
                tokens[idx] = self._draw(logits[idx], [requests[i] for i in sampled], [params[i] for i in sampled])

        self.record_sampled(tokens)
        self.last_tokens = tokens  # on the device: async scheduling's next step reads them there

        def to_host() -> SamplerOutput:
            token_list = tokens.tolist()
            logprobs, sampled_lp = self.logprob_entries(logprob_rows, tokens, params)
            return SamplerOutput(token_list, logprobs, sampled_lp)

        return to_host

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's first maximal index (its first NaN, if any), as torch.max(dim=-1).indices gives it."""
        return self._argmax(logits)

    @staticmethod
    def logprob_entries(logprob_rows: torch.Tensor | None, tokens: torch.Tensor, params: list):
        """Per row: {chosen token: logprob, top-k tokens: logprobs} and the chosen token's logprob (None if not asked)."""
        B = len(params)
        logprobs, sampled_lp = [None] * B, [None] * B
        if logprob_rows is None:
            return logprobs, sampled_lp
        token_list = tokens.tolist()
        k = max(p.logprobs or 0 for p in params)
        top_vals, top_ids = logprob_rows.topk(k, dim=-1) if k else (None, None)
        chosen = logprob_rows.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
        for i, p in enumerate(params):
            if p.logprobs is None:
                continue
            entry = {token_list[i]: chosen[i]}
            if p.logprobs:
                entry.update(zip(top_ids[i, : p.logprobs].tolist(), top_vals[i, : p.logprobs].tolist()))
            logprobs[i], sampled_lp[i] = entry, chosen[i]
        return logprobs, sampled_lp

    def uniforms(self, requests: list, params: list) -> torch.Tensor:
        """One float64 uniform per row: from the engine's generator, or a seeded row's own."""
        u = torch.rand(len(params), dtype=torch.float64, generator=self.generator, device=self.device)
        for i, p in enumerate(params):
            if p.seed is not None:
                u[i] = torch.rand(1, dtype=torch.float64, generator=self._generator(requests[i]), device=self.device)[0]
        return u

    def final_probs(self, logits: torch.Tensor, params: list) -> torch.Tensor:
        """The normalised distribution a sampled row draws from (logits after temperature; min_p, top-k, top-p
        applied), over the full vocabulary: what rejection sampling compares the drafts against."""
        dev = self.device
        if any(p.min_p > 0 for p in params):
            logits = apply_min_p(logits, on_device([p.min_p for p in params], dev))
        V = logits.shape[1]
        probs = logits.softmax(dim=-1)
        by_head, by_sort, _ = self.filter_routes(params, V)
        if by_head:
            idx = on_device(by_head, dev)
            top_k = [params[i].top_k if 0 < params[i].top_k < V else 0 for i in by_head]
            top_p = on_device([params[i].top_p for i in by_head], dev)
            head, ids, spill = filter_head(logits[idx], top_k, top_p)
            rows = torch.zeros(len(by_head), V, device=dev, dtype=probs.dtype).scatter_(1, ids, head)
            if not all(top_k) and spill.any():  # only rows without top-k can spill
                rows[spill] = top_p_full(logits[idx[spill]].softmax(dim=-1), top_p[spill])
            probs[idx] = rows
        if by_sort:
            idx = on_device(by_sort, dev)
            probs[idx] = top_p_full(probs[idx], on_device([params[i].top_p for i in by_sort], dev))
        return probs / probs.sum(dim=-1, keepdim=True)

    def filter_routes(self, params: list, V: int) -> tuple[list[int], list[int], list[int]]:
        """The rows by route: filtered over their head of likely tokens (top-k, or top-p), by a full sort (top-p
        without top-k, where self.sort_top_p), or not filtered. Decided on the host from the parameters: nothing read
        back."""
        by_head, by_sort, unfiltered = [], [], []
        for i, p in enumerate(params):
            if 0 < p.top_k < V:
                by_head.append(i)
            elif p.top_p < 1.0:
                (by_sort if self.sort_top_p else by_head).append(i)
            else:
                unfiltered.append(i)
        return by_head, by_sort, unfiltered

    def _draw(self, logits: torch.Tensor, requests: list, params: list) -> torch.Tensor:
        """Sample the non-greedy rows (logits already divided by temperature)."""
        dev = self.device
        u = self.uniforms(requests, params)
        # 7. Filters, each skipped when no row uses it.
        if any(p.min_p > 0 for p in params):
            logits = apply_min_p(logits, on_device([p.min_p for p in params], dev))
        tokens = torch.empty(len(params), dtype=torch.long, device=dev)
        V = logits.shape[1]
        by_head, by_sort, full = self.filter_routes(params, V)
        if by_head:
            idx = on_device(by_head, dev)
            top_k = [params[i].top_k if 0 < params[i].top_k < V else 0 for i in by_head]
            top_p = on_device([params[i].top_p for i in by_head], dev)
            probs, ids, spill = filter_head(logits[idx], top_k, top_p)
            tokens[idx] = ids.gather(1, inverse_cdf(probs, u[idx]).unsqueeze(1)).squeeze(1)
            if not all(top_k) and spill.any():  # only rows without top-k can spill
                rows = idx[spill]
                probs = top_p_full(logits[rows].softmax(dim=-1), top_p[spill])
                tokens[rows] = inverse_cdf(probs, u[rows])
        if by_sort:
            idx = on_device(by_sort, dev)
            probs = top_p_full(logits[idx].softmax(dim=-1), on_device([params[i].top_p for i in by_sort], dev))
            tokens[idx] = inverse_cdf(probs, u[idx])
        if full:
            idx = on_device(full, dev)
            tokens[idx] = inverse_cdf(logits[idx].softmax(dim=-1), u[idx])
        return tokens
