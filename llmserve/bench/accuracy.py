"""Accuracy of a precision mode: perplexity on a fixed text and logit distance to a reference engine.

Both read the model through the engine itself (prompt log-probabilities, recorded logits), so they
measure exactly the kernels a served request runs.
"""

from __future__ import annotations

import math

import torch

from llmserve.sampling_params import SamplingParams


def perplexity(engine, token_ids: list[int], request_id: str = "ppl") -> float:
    """exp(mean negative log-likelihood) of tokens 1..n given their prefixes (one prompt, no sampling)."""
    engine.add_request(request_id, token_ids, SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0))
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                final = out
    scored = final.prompt_logprobs[1:]
    nll = -sum(entry[tok] for entry, tok in zip(scored, token_ids[1:]))
    return math.exp(nll / len(scored))


def logit_distance(ours: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """Max absolute logit difference, and how often the two argmaxes agree, over matching rows."""
    ours, ref = ours.float(), ref.float()
    return {"max_abs": (ours - ref).abs().max().item(),
            "top1_agreement": (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()}
