"""Tensor-parallel rank and size, and the collectives the parallel layers use.

One process (rank 0 of 1) unless a multi-process executor initializes torch.distributed (gloo on CPU, NCCL on CUDA)
and calls set_tensor_parallel(). With size 1 every collective is the identity, so the same layers serve both.
"""

from __future__ import annotations

import torch

_tp_rank, _tp_size, _tp_group = 0, 1, None


def set_tensor_parallel(rank: int, size: int, group=None) -> None:
    global _tp_rank, _tp_size, _tp_group
    _tp_rank, _tp_size, _tp_group = rank, size, group


def tp_rank() -> int:
    return _tp_rank


def tp_size() -> int:
    return _tp_size


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _tp_size == 1:
        return x
    torch.distributed.all_reduce(x, group=_tp_group)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Each rank's slice of the last dimension, concatenated in rank order (the LM head's vocabulary shards)."""
    if _tp_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_tp_size)]
    torch.distributed.all_gather(parts, x.contiguous(), group=_tp_group)
    return torch.cat(parts, dim=-1)


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by the tensor-parallel size ({denominator})")
    return numerator // denominator
