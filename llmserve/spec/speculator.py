"""Which sequences speculate, how far, and with which proposer; plus the acceptance statistics.

Rationing: a draft position is worth verifying in proportion to its chance of surviving, estimated as
(the request's recent acceptance rate) ** position. Each step, drafts fill the batch only up to
`spec_max_tokens_per_step` tokens in all, best chances first: a lone request gets K drafts, a full batch
(already as many tokens as a step can take for free) gets none, so speculation does not cost throughput
under load. A request whose drafts keep failing stops drafting, and is given another try after a while.
"""

from __future__ import annotations

from llmserve.config import EngineConfig
from llmserve.engine.request import Request
from llmserve.engine.stats import SpecDecodeStats

MIN_SURVIVAL = 0.05  # draft positions less likely than this to be accepted are not worth a slot
EMA = 0.3  # weight of the latest step in a request's acceptance estimate


class Speculator:
    def __init__(self, config: EngineConfig, engine):
        self.k = config.num_speculative_tokens
        self.max_tokens_per_step = config.spec_max_tokens_per_step
        self.method = config.speculative_method
        self.stats = SpecDecodeStats(accepted_per_position=[0] * self.k)
        if self.method == "ngram":
            from llmserve.spec.ngram import NgramProposer

            self.proposer = NgramProposer(config.ngram_min, config.ngram_max)
        elif self.method == "suffix":
            from llmserve.spec.suffix import SuffixProposer

            self.proposer = SuffixProposer()
        else:
            from llmserve.spec.draft import DraftModelProposer

            self.proposer = DraftModelProposer(config, engine)

    def record(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        if num_drafts:
            s = self.stats
            s.num_drafts += 1
            s.num_draft_tokens += num_drafts
            s.num_accepted_tokens += num_accepted
            for j in range(num_accepted):
                s.accepted_per_position[j] += 1
            request.spec_acceptance = (1 - EMA) * request.spec_acceptance + EMA * num_accepted / num_drafts

    def plan(self, decoding: list[Request], max_model_len: int) -> dict[str, int]:
        """Drafts per request for the next step, under the per-step token budget, best survival chances first."""
        budget = self.max_tokens_per_step - len(decoding)
        if budget <= 0:
            return {}
        slots = []
        for r in decoding:
            room = min(self.k, r.params.max_tokens - r.num_output_tokens - 1, max_model_len - r.num_tokens - 1)
            chance = 1.0
            for _ in range(max(room, 0)):
                chance *= r.spec_acceptance
                if chance < MIN_SURVIVAL:
                    break
                slots.append((chance, r.request_id))
            if r.spec_acceptance < MIN_SURVIVAL:  # not drafting now: drift back so it gets another try
                r.spec_acceptance += 0.05 * (0.5 - r.spec_acceptance)
        slots.sort(key=lambda s: -s[0])
        ks: dict[str, int] = {}
        for _, rid in slots[:budget]:
            ks[rid] = ks.get(rid, 0) + 1
        return ks

    def propose(self, decoding: list[Request], max_model_len: int) -> list[Request]:
        """Sets spec_token_ids (and spec_draft_probs) on the requests that will speculate next step; returns them."""
        ks = self.plan(decoding, max_model_len)
        chosen = [r for r in decoding if ks.get(r.request_id)]
        if not chosen:
            return []
        if self.method == "draft":
            for r, (tokens, probs) in zip(chosen, self.proposer.propose_batch(chosen, [ks[r.request_id] for r in chosen])):
                r.spec_token_ids, r.spec_draft_probs = tokens, probs if tokens else None
            return chosen
        for r in chosen:
            if self.method == "ngram":
                r.spec_token_ids = self.proposer.propose(r.all_token_ids, ks[r.request_id])
            else:
                r.spec_token_ids = self.proposer.propose(r.all_token_ids, ks[r.request_id], r.request_id)
            r.spec_draft_probs = None
        return chosen

    def release(self, request: Request) -> None:
        if self.method == "suffix":
            self.proposer.release(request.request_id, request.output_token_ids)
        else:
            self.proposer.release(request.request_id)
