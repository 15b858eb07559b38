"""Exact verification of draft tokens (Leviathan et al., 2023).

The target scored the K+1 positions of every speculating row in one forward pass. Position by position,
each row's target distribution p is built exactly as plain decode would build it (bans, min_tokens, bias,
penalties counting the drafts accepted so far, temperature, min_p, top-k, top-p). A greedy row accepts a
draft while it equals the argmax. A sampled row accepts draft d with probability min(1, p(d) / q(d))
(float64 uniforms); on rejection it draws from normalize(max(p - q, 0)) and stops; if every draft is
accepted it draws a bonus token from p at position K+1. Proposers without a distribution (n-gram,
suffix) have q = one-hot. The tokens emitted are distributed exactly as the target's own samples.
"""

from __future__ import annotations

import torch

from llmserve.engine.step_io import SampledRow
from llmserve.sampling_params import GREEDY_TEMPERATURE


class _AfterTokens:
    """A request seen as if `extra` more output tokens had been appended (min_tokens counts them)."""

    def __init__(self, request, extra: int):
        self._request, self._extra = request, extra

    def __getattr__(self, name):
        return getattr(self._request, name)

    @property
    def num_output_tokens(self) -> int:
        return self._request.num_output_tokens + self._extra

    @property
    def grammar_bitmask(self):
        """A constrained row carries one mask per position ([K + 1, words]); this view is position `extra`."""
        masks = self._request.grammar_bitmask
        return masks[self._extra] if masks is not None else None


def verify(sampler, logits: list[torch.Tensor], requests: list, drafts: list[list[int]],
           draft_probs: list[torch.Tensor | None]) -> list[SampledRow]:
    """logits[i]: [K_i + 1, vocab] target logits of row i; drafts[i]: its K_i draft tokens; draft_probs[i]:
    [K_i, vocab] distributions the drafts were drawn from, or None for deterministic proposals."""
    dev = sampler.device
    rows = [SampledRow([], [], [], 0) for _ in requests]
    active = list(range(len(requests)))
    position = 0
    while active:
        views = [_AfterTokens(requests[i], len(rows[i].token_ids)) for i in active]
        params = [r.params for r in views]
        block = torch.stack([logits[i][position] for i in active])[:, : sampler.vocab_size].float()
        block = sampler.adjust_logits(block, views)
        greedy = torch.tensor([p.temperature < GREEDY_TEMPERATURE for p in params], device=dev)
        temps = torch.tensor([1.0 if g else p.temperature for g, p in zip(greedy.tolist(), params)], device=dev)
        block = block / temps.unsqueeze(1)
        logprob_rows = torch.log_softmax(block, dim=-1) if any(p.logprobs is not None for p in params) else None

        has_draft = [position < len(drafts[i]) for i in active]
        draft_tok = torch.tensor([drafts[i][position] if h else 0 for i, h in zip(active, has_draft)], device=dev)
        has_draft_t = torch.tensor(has_draft, device=dev)
        tokens = block.argmax(dim=-1)
        accepted = has_draft_t & (tokens == draft_tok)  # greedy rows: accept while the argmax agrees

        sampled = [j for j, g in enumerate(greedy.tolist()) if not g]
        if sampled:
            idx = torch.tensor(sampled, device=dev)
            sub_params = [params[j] for j in sampled]
            p = sampler.final_probs(block[idx], sub_params).double()
            q = torch.zeros_like(p)
            for row, j in enumerate(sampled):
                i = active[j]
                if has_draft[j]:
                    dq = draft_probs[i]
                    if dq is None:
                        q[row, drafts[i][position]] = 1.0
                    else:
                        q[row] = dq[position, : sampler.vocab_size].double()
            d = draft_tok[idx]
            u_accept = sampler.uniforms([views[j] for j in sampled], sub_params)
            p_d, q_d = p.gather(1, d.unsqueeze(1)).squeeze(1), q.gather(1, d.unsqueeze(1)).squeeze(1)
            ok = has_draft_t[idx] & (u_accept * q_d < p_d)  # u < p/q without dividing by a zero q
            # rejected rows draw from the residual max(p - q, 0); rows past their drafts draw the bonus from p
            residual = torch.where(has_draft_t[idx].unsqueeze(1), (p - q).clamp(min=0), p)
            empty = residual.sum(dim=-1) <= 0
            residual[empty] = p[empty]  # p == q exactly: any draw from p is right
            need = (~ok).nonzero(as_tuple=True)[0]
            drawn = d.clone()
            if need.numel():
                u_draw = sampler.uniforms([views[sampled[k]] for k in need.tolist()], [sub_params[k] for k in need.tolist()])
                cdf = residual[need].cumsum(dim=-1)
                pick = torch.searchsorted(cdf, (u_draw * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
                drawn[need] = pick.clamp(max=p.shape[1] - 1)
            tokens[idx] = drawn
            accepted[idx] = ok

        sampler.record_sampled(tokens)
        entries, chosen = sampler.logprob_entries(logprob_rows, tokens, params)
        still = []
        for j, i in enumerate(active):
            row = rows[i]
            row.token_ids.append(int(tokens[j]))
            row.logprobs.append(entries[j])
            row.sampled_logprobs.append(chosen[j])
            if bool(accepted[j]):
                row.num_accepted += 1
                still.append(i)
        active = still
        position += 1
    return rows
