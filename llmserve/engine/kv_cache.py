"""KV block accounting: a pool of fixed-size blocks, reference counts, per-request block tables and the prefix cache.

The tensors live in the model runner; this module decides which block holds which token.

Invariants (checked by `check_integrity`):
- a block is in the free queue iff its ref_cnt is 0, and its ref_cnt is the number of tables holding it;
- a full block may carry a chain hash H(parent hash, its token ids, extra keys) and then sits in
  `cached` under that hash; freed blocks keep their hash and stay findable until the pool needs them;
- the free queue is an LRU: blocks are evicted from its head, and a request frees its blocks tail first,
  so a prefix's last blocks go before its first ones.
Only full blocks of computed (verified) tokens are hashed, and the last prompt token is always computed.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

from llmserve.engine.kv_offload import BlockKey, KVOffload
from llmserve.engine.request import Request
from llmserve.engine.stats import PrefixCacheStats


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def extra_keys_digest(request: Request) -> bytes:
    """What besides the tokens decides a block's content or who may see it: the LoRA adapter and the cache salt."""
    return hashlib.sha256(repr((request.lora_int_id or None, request.cache_salt)).encode()).digest()


def block_hash(parent: bytes, tokens: tuple[int, ...], extra: bytes) -> bytes:
    return hashlib.sha256(parent + np.asarray(tokens, dtype=np.int64).tobytes() + extra).digest()


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 offload: KVOffload | None = None, block_io=None):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.offload = offload
        self.block_io = block_io  # read_block(b) -> tensor, write_block(b, tensor): the runner's KV tensors
        self.free_blocks: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.ref_cnt = [0] * num_blocks
        self.block_tables: dict[str, list[int]] = {}
        self.block_keys: list[BlockKey | None] = [None] * num_blocks
        self.block_hashes: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}
        self.stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    # ---- the pool ----------------------------------------------------------------------------
    def _take_free_block(self) -> int:
        """The least recently freed block; if it still holds a cached prefix, that prefix is evicted (and spilled)."""
        block, _ = self.free_blocks.popitem(last=False)
        digest = self.block_hashes[block]
        if digest is not None:
            if self.offload is not None and self.block_io is not None:
                self.offload.put(digest, self.block_keys[block], self.block_io.read_block(block))
            del self.cached[digest]
            self.block_hashes[block] = self.block_keys[block] = None
        self.ref_cnt[block] = 1
        return block

    def _hold(self, block: int) -> None:
        if self.ref_cnt[block] == 0:
            del self.free_blocks[block]
        self.ref_cnt[block] += 1

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Make room for the request's next `num_new_tokens` tokens; False (and no change) if the pool is short."""
        table = self.block_tables.setdefault(request.request_id, [])
        needed = self.blocks_needed(request.num_computed_tokens + num_new_tokens) - len(table)
        if needed > len(self.free_blocks):
            if not table:
                del self.block_tables[request.request_id]
            return False
        for _ in range(needed):
            table.append(self._take_free_block())
        return True

    def fork(self, parent: Request, child: Request, num_tokens: int) -> tuple[int, int] | None | bool:
        """Give `child` the parent's KV for its first `num_tokens` tokens. Full blocks are shared
        (ref-counted); a partial last block is copied, since both will write different tokens into it.
        Returns the (src, dst) block to copy, None if nothing to copy, False if no block is free."""
        parent_table = self.block_tables[parent.request_id]
        full, rest = divmod(num_tokens, self.block_size)
        if rest and not self.free_blocks:
            return False
        table = self.block_tables.setdefault(child.request_id, [])
        for block in parent_table[:full]:
            self._hold(block)
            table.append(block)
        if not rest:
            return None
        block = self._take_free_block()
        table.append(block)
        return parent_table[full], block

    def trim(self, request: Request, num_tokens: int) -> None:
        """Give back the blocks beyond the first `num_tokens` tokens (rejected drafts' blocks)."""
        table = self.block_tables.get(request.request_id)
        if not table:
            return
        keep = self.blocks_needed(num_tokens)
        while len(table) > keep:
            self._release(table.pop())

    def free(self, request: Request) -> None:
        for block in reversed(self.block_tables.pop(request.request_id, [])):
            self._release(block)

    def _release(self, block: int) -> None:
        self.ref_cnt[block] -= 1
        if self.ref_cnt[block] == 0:
            self.free_blocks[block] = None  # keeps its hash: findable until the pool needs it

    # ---- prefix cache ---------------------------------------------------------------------------
    def _chain(self, request: Request, num_blocks: int) -> list[tuple[bytes, BlockKey]]:
        """Hashes and keys of the request's first `num_blocks` full blocks, computed once and kept on the request."""
        chain = request.block_hashes
        if len(chain) < num_blocks:
            extra = extra_keys_digest(request)
            bs = self.block_size
            parent = chain[-1][0] if chain else b""
            for i in range(len(chain), num_blocks):
                tokens = tuple(request.all_token_ids[i * bs:(i + 1) * bs])
                digest = block_hash(parent, tokens, extra)
                chain.append((digest, (parent, tokens, extra)))
                parent = digest
        return chain[:num_blocks]

    def get_computed_blocks(self, request: Request) -> int:
        """Attach the longest cached prefix of full blocks to a request that has none yet; returns its tokens.

        Blocks found in a spill tier are loaded into free pool blocks. At least the last token is left to
        compute (its logits are needed), and requests that score their prompt (prompt_logprobs) get no hits.
        """
        if not self.enable_prefix_caching or request.prompt_logprobs is not None or request.request_id in self.block_tables:
            return 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        self.stats.queries += request.num_tokens
        table: list[int] = []
        for digest, key in self._chain(request, max_blocks):
            block = self.cached.get(digest)
            if block is not None and self.block_keys[block] == key:
                self._hold(block)
                table.append(block)
                self.stats.hits["device"] += self.block_size
                continue
            found = self.offload.get(digest, key) if self.offload is not None else None
            if found is None or not self.free_blocks:
                break
            tier, data = found
            block = self._take_free_block()
            self.block_io.write_block(block, data)
            self._register(block, digest, key)
            table.append(block)
            self.stats.hits[tier] += self.block_size
        if table:
            self.block_tables[request.request_id] = table
        request.num_cached_blocks = len(table)
        return len(table) * self.block_size

    def num_cached_prefix_tokens(self, request: Request) -> int:
        """How many leading prompt tokens the pool holds in full cached blocks (a look only: nothing is held or
        counted; get_computed_blocks takes them when the request is admitted)."""
        if not self.enable_prefix_caching or request.prompt_logprobs is not None:
            return 0
        found = 0
        for digest, key in self._chain(request, (request.num_tokens - 1) // self.block_size):
            block = self.cached.get(digest)
            if block is None or self.block_keys[block] != key:
                break
            found += 1
        return found * self.block_size

    def _register(self, block: int, digest: bytes, key: BlockKey) -> None:
        if digest in self.cached:  # the same content already cached in another block: keep that one
            return
        self.cached[digest] = block
        self.block_hashes[block], self.block_keys[block] = digest, key

    def cache_blocks(self, request: Request, num_tokens: int | None = None) -> None:
        """Make the request's full blocks findable by later requests: those of its computed tokens, or of its first
        `num_tokens` (async scheduling: those whose KV is written)."""
        if not self.enable_prefix_caching:
            return
        done = request.num_computed_tokens if num_tokens is None else num_tokens
        if done // self.block_size <= request.num_cached_blocks:  # most steps: no block filled up
            return
        table = self.block_tables.get(request.request_id)
        if not table:
            return
        num_full = min(done // self.block_size, len(table))
        if num_full <= request.num_cached_blocks:
            return
        chain = self._chain(request, num_full)
        for i in range(request.num_cached_blocks, num_full):
            if self.block_hashes[table[i]] is None:
                self._register(table[i], *chain[i])
        request.num_cached_blocks = num_full

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix held by a free block, and the spill tiers' blocks (blocks in use keep theirs
        until freed). True when no cached prefix is left (vLLM's answer: False while requests hold some)."""
        for digest, block in list(self.cached.items()):
            if self.ref_cnt[block] == 0:
                del self.cached[digest]
                self.block_hashes[block] = self.block_keys[block] = None
        if self.offload is not None:
            self.offload.clear()
        return not self.cached

    # ---- checks -----------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Cheap enough for idle time and tests: every block accounted for exactly once."""
        counts = [0] * self.num_blocks
        for table in self.block_tables.values():
            for b in table:
                counts[b] += 1
        free = set(self.free_blocks)
        for b in range(self.num_blocks):
            assert self.ref_cnt[b] >= 0, f"block {b}: negative ref_cnt {self.ref_cnt[b]}"
            assert counts[b] == self.ref_cnt[b], f"block {b}: ref_cnt {self.ref_cnt[b]} but {counts[b]} tables"
            assert (b in free) == (counts[b] == 0), f"block {b}: free={b in free} with {counts[b]} holders"
            digest = self.block_hashes[b]
            assert digest is None or self.cached.get(digest) == b, f"block {b}: hash not in the cache map"
        for digest, b in self.cached.items():
            assert self.block_hashes[b] == digest, f"cache map points {digest.hex()[:8]} at block {b} holding another hash"
