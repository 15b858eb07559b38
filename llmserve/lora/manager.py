"""The worker's adapters: a host-memory LRU of loaded adapters (--max-cpu-loras) and the layers' slots (--max-loras).

An adapter is read from disk (and checked) when a request for it is admitted (`add`), and stays in host memory while
live requests use it (the engine pins it), so a step never waits on disk: before each forward, `prepare_step` copies
the step's adapters from host memory into free or least recently used slots (a memory copy), and sets the segments
every adapted layer reads. Adapters no request uses stay up to --max-cpu-loras; the folder stays the source, and an
evicted adapter is read again when a request for it is admitted.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import torch
from torch import nn

from llmserve.config import ModelConfig
from llmserve.distributed.parallel_state import tp_rank
from llmserve.layers.linear import LinearBase, RowParallelLinear
from llmserve.layers.lora import LoRALayerWeights, LoRAStepState
from llmserve.lora.adapter import NUM_SHARDS, LoRAAdapter, load_adapter
from llmserve.lora.request import LoRARequest

logger = logging.getLogger(__name__)


class LoRAManager:
    def __init__(self, model: nn.Module, model_config: ModelConfig, max_loras: int, max_rank: int, max_cpu_loras: int,
                 dtype: torch.dtype, device: torch.device):
        self.model_config = model_config
        self.max_rank = max_rank
        self.max_cpu_loras = max_cpu_loras
        self.device = device
        self.state = LoRAStepState()
        # (layer index, module name) → the adapted linear layer (its slots: layer.lora)
        self.layers: dict[tuple[int, str], LinearBase] = {}
        for name, module in model.named_modules():
            parts = name.split(".")
            key = ".".join(parts[-2:])
            if isinstance(module, LinearBase) and key in NUM_SHARDS and len(parts) > 2 and parts[-3].isdigit():
                module.lora = LoRALayerWeights(self.state, max_loras, NUM_SHARDS[key] * max_rank, module.in_features,
                                               module.out_features, dtype, device)
                self.layers[(int(parts[-3]), key)] = module
        self.host: OrderedDict[int, LoRAAdapter] = OrderedDict()  # lora_int_id → adapter, least recent first
        self.pinned: set[int] = set()  # adapters of live requests: never evicted from host memory
        self.slots: list[int | None] = [None] * max_loras  # lora_int_id held by each slot
        self._slot_use: OrderedDict[int, None] = OrderedDict((s, None) for s in range(max_loras))  # LRU of slots
        slot_bytes = sum(w.a_t.numel() * w.a_t.element_size() + w.b_t.numel() * w.b_t.element_size()
                         for w in (layer.lora for layer in self.layers.values()))
        logger.info("LoRA: %d slots of rank up to %d in %d layers (%.1f MiB), %d adapters kept in host memory",
                    max_loras, max_rank, len(self.layers), slot_bytes / 2**20, max_cpu_loras)

    # ---- host memory ----------------------------------------------------------------------------
    def add(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter in host memory, read from its folder (and checked) if it is not there."""
        adapter = self.host.get(request.lora_int_id)
        if adapter is not None and adapter.request == request:
            self.host.move_to_end(request.lora_int_id)
            return adapter
        adapter = load_adapter(request, self.model_config, self.max_rank)  # raises before anything is kept
        pinned = request.lora_int_id in self.pinned
        self.remove(request.lora_int_id)  # the same id naming another folder: the new one replaces it everywhere
        if pinned:
            self.pinned.add(request.lora_int_id)
        self.host[request.lora_int_id] = adapter
        self._evict(keep=request.lora_int_id)
        return adapter

    def pin(self, lora_int_id: int, pinned: bool) -> None:
        """A pinned adapter (one that live requests use) stays in host memory whatever --max-cpu-loras says, so that no
        step reads it from disk again, or fails because its folder changed since the request was admitted."""
        if pinned:
            self.pinned.add(lora_int_id)
        else:
            self.pinned.discard(lora_int_id)
            self._evict()

    def _evict(self, keep: int | None = None) -> None:
        """Least recently used first, down to --max-cpu-loras, never a pinned adapter (nor `keep`, just read)."""
        for lora_id in list(self.host):
            if len(self.host) <= self.max_cpu_loras:
                return
            if lora_id != keep and lora_id not in self.pinned:
                del self.host[lora_id]
                logger.info("LoRA adapter %d leaves host memory (--max-cpu-loras %d)", lora_id, self.max_cpu_loras)

    def remove(self, lora_int_id: int) -> None:
        self.host.pop(lora_int_id, None)
        self.pinned.discard(lora_int_id)
        for slot, held in enumerate(self.slots):
            if held == lora_int_id:
                self.slots[slot] = None

    @property
    def host_bytes(self) -> int:
        return sum(a.nbytes for a in self.host.values())

    # ---- slots ------------------------------------------------------------------------------------
    def _slot_for(self, request: LoRARequest, keep: set[int]) -> int:
        lora_id = request.lora_int_id
        if lora_id in self.slots:
            slot = self.slots.index(lora_id)
        else:
            slot = min((s for s, held in enumerate(self.slots) if held is None), default=None)  # low first: ranges
            if slot is None:
                slot = next(s for s in self._slot_use if self.slots[s] not in keep)
            self._load_slot(slot, self.add(request))
        self._slot_use.move_to_end(slot)
        return slot

    def _load_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        for layer in self.layers.values():
            layer.lora.clear(slot)
        r, rank = self.max_rank, tp_rank()
        for (layer_index, module, shard), (a, b) in adapter.weights.items():
            base = self.layers[(layer_index, module)]
            weights = base.lora
            rows = slice(shard * r, shard * r + a.shape[0])
            if isinstance(base, RowParallelLinear):  # this rank's slice of the inputs; B whole
                n = base.in_features
                weights.a_t[slot, :, rows] = a[:, rank * n:(rank + 1) * n].t()
                weights.b_t[slot, rows, :] = b.t()
            else:  # A whole; this rank's slice of this shard's outputs, at the shard's place in the fused layer
                n = base.shard_sizes[shard]
                start = sum(base.shard_sizes[:shard])
                weights.a_t[slot, :, rows] = a.t()
                weights.b_t[slot, rows, start:start + n] = b[rank * n:(rank + 1) * n].t()
        self.slots[slot] = adapter.request.lora_int_id

    def prepare_step(self, rows: list[tuple[LoRARequest | None, int]]) -> list[int]:
        """rows: each flat-batch row group's adapter (None: the base model) and number of tokens. Puts the step's
        adapters in slots, and returns the order to lay the groups out in: base rows first, then by slot, so that each
        adapter's tokens are one segment and the segments' slots ascend (a range the layers can view, not copy)."""
        wanted = {req.lora_int_id: req for req, _ in rows if req is not None}
        if len(wanted) > len(self.slots):
            raise RuntimeError(f"a step with {len(wanted)} adapters, over --max-loras {len(self.slots)}")
        slot_of = {lora_id: self._slot_for(req, set(wanted)) for lora_id, req in wanted.items()}
        order = sorted(range(len(rows)), key=lambda i: -1 if rows[i][0] is None else slot_of[rows[i][0].lora_int_id])
        segments, row = [], 0
        for i in order:
            req, n = rows[i]
            if req is not None:
                slot = slot_of[req.lora_int_id]
                if segments and segments[-1][0] == slot:
                    segments[-1] = (slot, segments[-1][1], row + n)
                else:
                    segments.append((slot, row, row + n))
            row += n
        self.state.plan(segments, self.device)
        return order
