"""A sparse mixture-of-experts MLP (Mixtral's, Qwen3-MoE's): a router scores the experts for each token, the
top-k are picked, and the token's output is the sum of those experts' MLPs weighted by their (renormalized)
softmax scores.

Each expert is an ordinary SwiGLU MLP of linear layers, so everything a linear layer gets (tensor-parallel splits,
low-bit codes, the batch-invariant kernels) each expert gets too. A step runs each expert that some token picked,
once, on the rows of the tokens that picked it; a token's experts are added in ascending expert order, whatever
else is in the batch (as transformers adds them). The router is a linear layer kept float (low_bit=False): its scores pick the
experts, where low-bit rounding would flip near-ties; in the deterministic mode it multiplies batch-invariantly as
every float layer does."""

from __future__ import annotations

import torch
from torch import nn

from llmserve.distributed.parallel_state import all_reduce, tp_size
from llmserve.layers.linear import ReplicatedLinear
from llmserve.layers.mlp import SwiGLUMLP


class SparseMoeBlock(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, norm_topk_prob: bool,
                 shared_intermediate_size: int = 0):
        """shared_intermediate_size > 0: a shared expert that every token runs, weighted by the sigmoid of its own gate
        (Qwen2-MoE), added after the picked experts."""
        super().__init__()
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.gate = ReplicatedLinear(hidden_size, num_experts, low_bit=False)
        self.experts = nn.ModuleList(SwiGLUMLP(hidden_size, intermediate_size) for _ in range(num_experts))
        self.shared_expert = SwiGLUMLP(hidden_size, shared_intermediate_size) if shared_intermediate_size else None
        self.shared_expert_gate = (ReplicatedLinear(hidden_size, 1, low_bit=False) if shared_intermediate_size
                                   else None)
        for expert in [*self.experts, *([self.shared_expert] if self.shared_expert else [])]:
            expert.down_proj.reduce_results = False  # one all-reduce of the sum rather than one per expert
        self.reduce_results = tp_size() > 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, chosen = scores.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        if torch.compiler.is_compiling() or (x.is_cuda and torch.cuda.is_current_stream_capturing()):
            # graphs cannot hold a data-dependent set of experts: every expert over every row, weighted 0 where
            # not picked (adding those zeros leaves each sum as the sparse path makes it)
            for e, expert in enumerate(self.experts):
                out += expert(x) * (weights * (chosen == e)).sum(dim=-1, keepdim=True)
        else:
            for e in chosen.unique().tolist():
                rows, slots = (chosen == e).nonzero(as_tuple=True)
                out.index_add_(0, rows, self.experts[e](x[rows]) * weights[rows, slots, None])
        if self.shared_expert is not None:  # (each rank's part of it, summed with the experts' by the all-reduce)
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return all_reduce(out) if self.reduce_results else out
