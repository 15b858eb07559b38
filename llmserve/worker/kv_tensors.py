"""The KV cache's tensors on this worker: sizing, allocation, and block copies for copy-on-write and the spill tiers.

Per layer one preallocated K and one V tensor in the attention backend's layout (`[slots, kv_heads, head_dim]`, slots
in blocks of block_size), holding this rank's KV heads. The engine's KVCacheManager decides which block holds which
token; this module only owns the memory.
"""

from __future__ import annotations

import torch

from llmserve.attention.backend import AttentionBackend
from llmserve.config import EngineConfig, ModelConfig
from llmserve.distributed.parallel_state import max_kv_heads_per_rank
from llmserve.errors import InvalidRequestError
from llmserve.layers.attention import PagedAttention


def num_kv_blocks(config: EngineConfig, model_config: ModelConfig, kv_dtype: torch.dtype, budget_bytes: int) -> int:
    """Blocks that fit the budget, never more than max_num_seqs full contexts (memory beyond that cannot be used)."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    # this rank's share, sized for the rank with the most KV heads so that every rank holds the same blocks
    kv_heads = model_config.num_key_value_heads
    per_block = model_config.kv_bytes_per_token(kv_dtype) * max_kv_heads_per_rank(kv_heads) // kv_heads * config.block_size
    cap = config.max_num_seqs * -(-model_config.max_position_embeddings // config.block_size)
    num = min(budget_bytes // per_block, cap)
    if num < 1:
        raise InvalidRequestError(f"KV cache memory {budget_bytes} bytes holds no block of {per_block} bytes",
                                  "kv_cache_memory")
    return int(num)


class KVTensors:
    def __init__(self, model: torch.nn.Module, backend: AttentionBackend, num_blocks: int):
        self.num_blocks = num_blocks
        self.block_size = backend.block_size
        self.dtype = backend.kv_dtype
        self.layers = [m for m in model.modules() if isinstance(m, PagedAttention)]
        # One block more than the pool, which the scheduler never hands out: padding rows of a CUDA graph's decode
        # step write their K/V into its first slot (graphs/cuda_graphs.py).
        self.scratch_slot = num_blocks * self.block_size
        shape = backend.kv_cache_shape(num_blocks + 1)
        for m in self.layers:
            m.k_cache = torch.zeros(shape, dtype=self.dtype, device=backend.device)
            m.v_cache = torch.zeros_like(m.k_cache)
            m.block_size = self.block_size
        # the pool's bytes (what holds tokens), without the scratch block
        self.nbytes = 2 * len(self.layers) * (self.layers[0].k_cache[: self.scratch_slot].numel() * self.dtype.itemsize
                                              if self.layers else 0)

    def _slots(self, block: int) -> slice:
        return slice(block * self.block_size, (block + 1) * self.block_size)

    def read_block(self, block: int) -> torch.Tensor:
        """One block's K and V from every layer, [layers, 2, block_size, kv_heads, head_dim]: what a spill tier
        stores."""
        s = self._slots(block)
        return torch.stack([torch.stack((m.k_cache[s], m.v_cache[s])) for m in self.layers])

    def write_block(self, block: int, data: torch.Tensor) -> None:
        s = self._slots(block)
        data = data.to(device=self.layers[0].k_cache.device, dtype=self.dtype, non_blocking=True)
        for i, m in enumerate(self.layers):
            m.k_cache[s] = data[i, 0]
            m.v_cache[s] = data[i, 1]

    def copy_block(self, src: int, dst: int) -> None:
        for m in self.layers:
            m.k_cache[self._slots(dst)] = m.k_cache[self._slots(src)]
            m.v_cache[self._slots(dst)] = m.v_cache[self._slots(src)]
