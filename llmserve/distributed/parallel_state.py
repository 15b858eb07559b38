"""Tensor-parallel rank and size, and the collectives the parallel layers use.

One process (rank 0 of 1) unless a multi-process executor (executor/multiproc.py) initializes torch.distributed
(gloo on CPU, NCCL on CUDA) through init_tensor_parallel(). With size 1 every collective is the identity, so the same
layers serve both. Layers read the size when they are built, so a model built inside single_rank() (a draft model
beside a split target) runs whole in the process that holds it.
"""

from __future__ import annotations

import datetime
from contextlib import contextmanager

import torch

_tp_rank, _tp_size, _tp_group = 0, 1, None
_control_group = None  # gloo group for step inputs and other Python objects (NCCL moves only device tensors)
_shared_memory = None  # SharedMemoryCollectives: ranks on one CPU machine (distributed/shm_collectives.py)


def set_tensor_parallel(rank: int, size: int, group=None) -> None:
    global _tp_rank, _tp_size, _tp_group
    _tp_rank, _tp_size, _tp_group = rank, size, group


def timedelta_s(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def init_tensor_parallel(rank: int, size: int, backend: str, timeout_s: float, init_method: str | None = None,
                         store=None) -> None:
    """Joins this process to the ranks' process group (through `store`, or `init_method` such as "env://").
    `timeout_s` bounds how long a collective waits for a peer (a rank that died is noticed at once, by its closed
    socket; the timeout is the backstop for one that hangs)."""
    global _control_group
    torch.distributed.init_process_group(backend, init_method=init_method, store=store, rank=rank, world_size=size,
                                         timeout=timedelta_s(timeout_s))
    _control_group = None if backend == "gloo" else torch.distributed.new_group(backend="gloo",
                                                                                 timeout=timedelta_s(timeout_s))
    set_tensor_parallel(rank, size, None)


def use_shared_memory(collectives) -> None:
    """All-reduces and all-gathers that fit go through shared memory from now on (on every rank alike)."""
    global _shared_memory
    _shared_memory = collectives


def destroy_tensor_parallel() -> None:
    global _control_group, _shared_memory
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    _control_group = _shared_memory = None
    set_tensor_parallel(0, 1, None)


@contextmanager
def single_rank():
    """Layers built inside are whole (rank 0 of 1), whatever this process's rank."""
    saved = _tp_rank, _tp_size, _tp_group
    set_tensor_parallel(0, 1, None)
    try:
        yield
    finally:
        set_tensor_parallel(*saved)


def tp_rank() -> int:
    return _tp_rank


def tp_size() -> int:
    return _tp_size


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _tp_size == 1:
        return x
    if _shared_memory is not None and _shared_memory.fits(x):
        return _shared_memory.all_reduce(x)
    torch.distributed.all_reduce(x, group=_tp_group)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Each rank's slice of the last dimension, concatenated in rank order (the LM head's vocabulary shards)."""
    if _tp_size == 1:
        return x
    if _shared_memory is not None and _shared_memory.fits(x):
        return _shared_memory.all_gather_last_dim(x)
    parts = [torch.empty_like(x) for _ in range(_tp_size)]
    torch.distributed.all_gather(parts, x.contiguous(), group=_tp_group)
    return torch.cat(parts, dim=-1)


def min_over_ranks(value: int) -> int:
    """The smallest of every rank's `value` (on every rank)."""
    if _tp_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=_control_group)
    return int(t.item())


def broadcast_object(obj=None):
    """Rank 0's `obj` on every rank (pickled over the gloo control group)."""
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0, group=_control_group)
    return box[0]


def gather_objects(obj) -> list | None:
    """Every rank's `obj`, in rank order, on rank 0 (None elsewhere)."""
    out = [None] * _tp_size if _tp_rank == 0 else None
    torch.distributed.gather_object(obj, out, dst=0, group=_control_group)
    return out


def scatter_objects(objs: list | None):
    """Rank r receives objs[r] from rank 0."""
    box = [None]
    torch.distributed.scatter_object_list(box, objs, src=0, group=_control_group)
    return box[0]


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by the tensor-parallel size ({denominator})")
    return numerator // denominator


def even_range(n: int, what: str) -> range:
    """This rank's 1/size of n units (an error naming `what` if they do not divide)."""
    per_rank = divide(n, _tp_size, what)
    return range(_tp_rank * per_rank, (_tp_rank + 1) * per_rank)


def balanced_range(n: int, what: str) -> range:
    """This rank's share of n whole units, as even as they go (sizes differ by at most one, larger shares first)."""
    if n < _tp_size:
        raise ValueError(f"{what} ({n}) is smaller than the tensor-parallel size ({_tp_size}): every rank needs one")
    base, extra = divmod(n, _tp_size)
    start = _tp_rank * base + min(_tp_rank, extra)
    return range(start, start + base + (_tp_rank < extra))


def head_ranges(num_heads: int, num_kv_heads: int) -> tuple[range, range]:
    """This rank's query heads and KV heads. A KV head stays with the query heads that read it (its GQA group), so
    ranks take whole groups; where the groups do not divide evenly (the default model: 3 KV heads on 2 ranks) the
    first ranks take one more, and the others wait for them at each all-reduce."""
    kv = balanced_range(num_kv_heads, "the number of KV heads")
    group = num_heads // num_kv_heads  # the model's config checks that KV heads divide the heads
    return range(kv.start * group, kv.stop * group), kv


def max_kv_heads_per_rank(num_kv_heads: int) -> int:
    """The largest rank's KV heads: every rank sizes its pool for this, so that all hold the same number of blocks."""
    return -(-num_kv_heads // _tp_size)
