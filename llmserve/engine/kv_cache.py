"""KV block accounting: a pool of fixed-size blocks, reference counts and per-request block tables.

The tensors themselves live in the model runner; this module only decides which block holds
which token. Invariant: a block is either in the free list with ref_cnt 0, or referenced by at
least one request's table with ref_cnt equal to the number of tables holding it.
"""

from __future__ import annotations

from collections import deque

from llmserve.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.ref_cnt = [0] * num_blocks
        self.block_tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Make room for the request's next `num_new_tokens` tokens; False (and no change) if the pool is short."""
        table = self.block_tables.setdefault(request.request_id, [])
        needed = self.blocks_needed(request.num_computed_tokens + num_new_tokens) - len(table)
        if needed > len(self.free_blocks):
            if not table:
                del self.block_tables[request.request_id]
            return False
        for _ in range(needed):
            block = self.free_blocks.popleft()
            self.ref_cnt[block] = 1
            table.append(block)
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
            self.ref_cnt[block] += 1
            table.append(block)
        if not rest:
            return None
        block = self.free_blocks.popleft()
        self.ref_cnt[block] = 1
        table.append(block)
        return parent_table[full], block

    def free(self, request: Request) -> None:
        for block in reversed(self.block_tables.pop(request.request_id, [])):
            self.ref_cnt[block] -= 1
            if self.ref_cnt[block] == 0:
                self.free_blocks.append(block)

    def check_integrity(self) -> None:
        """Cheap enough for idle time and tests: every block accounted for exactly once."""
        counts = [0] * self.num_blocks
        for table in self.block_tables.values():
            for b in table:
                counts[b] += 1
        free = set(self.free_blocks)
        assert len(free) == len(self.free_blocks), "a block is in the free list twice"
        for b in range(self.num_blocks):
            assert counts[b] == self.ref_cnt[b], f"block {b}: ref_cnt {self.ref_cnt[b]} but {counts[b]} tables"
            assert (b in free) == (counts[b] == 0), f"block {b}: free={b in free} with {counts[b]} holders"
