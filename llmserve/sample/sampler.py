"""Batched sampler: logits → next tokens (+ logprobs), rows with different parameters side by side.

Order of operations (as vLLM's sampler):
  1. allowed_token_ids / bad_words_ids         → banned logits set to -inf
  2. min_tokens (EOS and stop ids masked), logit_bias added
  3. penalties: repetition, frequency, presence
  4. greedy rows (temperature < 1e-5) take the argmax here
  5. temperature
  6. logprobs are taken here: log-softmax of the logits after steps 1-5 (greedy rows at temperature 1),
     before the min_p / top-k / top-p filters
  7. min_p, then top-k and top-p
  8. sample: argmax(p / q) with q ~ Exp(1) (an exact draw from p); a seeded row draws q from its own
     generator, so its tokens do not depend on its neighbours or the batch size.
All steps are tensor operations over the batch; the per-row Python is only collecting parameters
(and the sparse ones: biases, bans) and the seeded rows' draws.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmserve.sample.penalties import PenaltyState, apply_penalties
from llmserve.sampling_params import GREEDY_TEMPERATURE


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]  # sampled token and the top `logprobs` tokens, per row
    sampled_logprobs: list[float | None]


def apply_top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
    """Keep each row's k largest logits (ties with the k-th kept) and its smallest top set of mass ≥ p."""
    sorted_logits, order = logits.sort(dim=-1)  # ascending
    if k is not None:
        kth = sorted_logits.gather(1, (logits.shape[1] - k).clamp(min=0).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if p is not None:
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= (1 - p).unsqueeze(1)
        drop[:, -1] = False  # the most likely token always stays
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device, seed: int = 0):
        self.vocab_size = vocab_size
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.seeded: dict[str, torch.Generator] = {}
        self.penalties = PenaltyState(vocab_size, device)

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

    def sample(self, logits: torch.Tensor, requests: list) -> SamplerOutput:
        if not requests:
            return SamplerOutput([], [], [])
        logits = logits[:, : self.vocab_size].float()
        params = [r.params for r in requests]
        dev = self.device
        B = len(requests)

        # 1-2. Sparse edits: bans, allowed sets, min_tokens, biases.
        ban_rows, ban_ids, bias_rows, bias_ids, bias_vals = [], [], [], [], []
        allowed_rows = []
        for i, (r, p) in enumerate(zip(requests, params)):
            if p.bad_words_ids:
                ban_rows += [i] * len(p.bad_words_ids)
                ban_ids += p.bad_words_ids
            if r.num_output_tokens < p.min_tokens:
                stops = list(r.eos_token_ids) + p.stop_token_ids
                ban_rows += [i] * len(stops)
                ban_ids += stops
            if p.logit_bias:
                bias_rows += [i] * len(p.logit_bias)
                bias_ids += list(p.logit_bias)
                bias_vals += list(p.logit_bias.values())
            if p.allowed_token_ids is not None:
                allowed_rows.append(i)
        if allowed_rows:
            keep = torch.zeros_like(logits, dtype=torch.bool)
            for i in allowed_rows:
                keep[i, params[i].allowed_token_ids] = True
            keep[[i for i in range(B) if i not in set(allowed_rows)]] = True
            logits = logits.masked_fill(~keep, float("-inf"))
        if bias_rows:
            logits = logits.index_put((torch.tensor(bias_rows, device=dev), torch.tensor(bias_ids, device=dev)),
                                      torch.tensor(bias_vals, device=dev, dtype=logits.dtype), accumulate=True)
        if ban_rows:
            logits = logits.index_put((torch.tensor(ban_rows, device=dev), torch.tensor(ban_ids, device=dev)),
                                      torch.tensor(float("-inf"), device=dev))

        # 3. Penalties, only on the rows that ask for them.
        pen_idx = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty]
        pen_rows = None
        if pen_idx:
            idx = torch.tensor(pen_idx, device=dev)
            pen_rows = self.penalties.rows_for([requests[i] for i in pen_idx])
            sub = [params[i] for i in pen_idx]
            logits[idx] = apply_penalties(
                logits[idx], self.penalties.counts[pen_rows], self.penalties.in_prompt[pen_rows],
                torch.tensor([p.repetition_penalty for p in sub], device=dev),
                torch.tensor([p.frequency_penalty for p in sub], device=dev),
                torch.tensor([p.presence_penalty for p in sub], device=dev),
            )

        # 4. Greedy.
        greedy = [p.temperature < GREEDY_TEMPERATURE for p in params]
        want_logprobs = [p.logprobs is not None for p in params]
        tokens = logits.argmax(dim=-1)
        logprob_rows = None
        if not all(greedy) or any(want_logprobs):
            # 5. Temperature (greedy rows at 1 so that their logprobs are defined).
            temps = torch.tensor([1.0 if g else p.temperature for g, p in zip(greedy, params)], device=dev)
            logits = logits / temps.unsqueeze(1)
            if any(want_logprobs):
                logprob_rows = torch.log_softmax(logits, dim=-1)
            if not all(greedy):
                tokens = torch.where(torch.tensor(greedy, device=dev), tokens, self._draw(logits, requests, params))

        if pen_rows is not None:
            self.penalties.record(pen_rows, tokens[torch.tensor(pen_idx, device=dev)])
        token_list = tokens.tolist()
        logprobs, sampled_lp = [None] * B, [None] * B
        if logprob_rows is not None:
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
        return SamplerOutput(token_list, logprobs, sampled_lp)

    def _draw(self, logits: torch.Tensor, requests: list, params: list) -> torch.Tensor:
        dev = self.device
        # 7. Filters, each skipped when no row uses it.
        if any(p.min_p > 0 for p in params):
            logits = apply_min_p(logits, torch.tensor([p.min_p for p in params], device=dev))
        use_k = any(p.top_k > 0 for p in params)
        use_p = any(p.top_p < 1.0 for p in params)
        if use_k or use_p:
            V = logits.shape[1]
            k = torch.tensor([min(p.top_k, V) if p.top_k > 0 else V for p in params], device=dev) if use_k else None
            top_p = torch.tensor([p.top_p for p in params], device=dev) if use_p else None
            logits = apply_top_k_top_p(logits, k, top_p)
        # 8. Exponential race: argmax(p / q), q ~ Exp(1), is an exact sample from p.
        probs = logits.softmax(dim=-1)
        q = torch.empty_like(probs).exponential_(generator=self.generator)
        for i, r in enumerate(requests):
            if r.params.seed is not None:
                q[i].exponential_(generator=self._generator(r))
        return (probs / q).argmax(dim=-1)
