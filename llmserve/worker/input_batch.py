"""What the worker keeps between steps: each live request's state (sent once, in a NewRequestData) and fixed input
buffers that every step writes into, so that a captured graph can replay on the same memory."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from llmserve.attention.backend import SeqSpan
from llmserve.engine.step_io import NewRequestData
from llmserve.lora.request import LoRARequest
from llmserve.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: set[int]
    output_token_ids: list[int]  # as sent: penalties count from them when a request is first seen
    lora_request: LoRARequest | None = None


@dataclass(slots=True)
class SamplingRow:
    """What the sampler reads of one request for one step."""

    request_id: str
    params: SamplingParams
    eos_token_ids: set[int]
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    num_output_tokens: int
    grammar_bitmask: torch.Tensor | None = None


class ForwardItem(NamedTuple):
    """`token_ids` computed from position `start` on, K/V written through `block_table`."""

    token_ids: list[int]
    start: int
    block_table: list[int]


class StepTensors(NamedTuple):
    input_ids: torch.Tensor
    positions: torch.Tensor
    positions_np: np.ndarray
    slot_mapping: torch.Tensor
    spans: list[SeqSpan]


class InputBatch:
    def __init__(self, capacity: int, block_size: int, device: torch.device, device_is_host: bool):
        self.block_size = block_size
        self.device = device
        self.device_is_host = device_is_host  # the CPU: the device buffers are the host ones
        self.requests: dict[str, CachedRequestState] = {}
        # Async scheduling: the previous step's sampled tokens, on the device; a token -(i + 1) in a step's inputs is
        # row i of them (the engine did not have it yet when it built the step)
        self.previous_tokens: torch.Tensor | None = None
        self._allocate(capacity)

    def _allocate(self, capacity: int) -> None:
        self.capacity = capacity
        self.ids_np = np.zeros(capacity, dtype=np.int64)
        self.positions_np = np.zeros(capacity, dtype=np.int64)
        self.slots_np = np.zeros(capacity, dtype=np.int64)
        # Inference tensors, as every step runs in inference mode (a compiled graph's guards tell the two kinds apart).
        # On the CPU the tensors share the numpy buffers; elsewhere they are device buffers filled by one copy each.
        with torch.inference_mode():
            self.host = [torch.from_numpy(a) for a in (self.ids_np, self.positions_np, self.slots_np)]
            self.device_buffers = self.host if self.device_is_host else [t.to(self.device) for t in self.host]

    # ---- per-request state -------------------------------------------------------------------
    def add(self, new: NewRequestData) -> None:
        self.requests[new.request_id] = CachedRequestState(new.request_id, new.prompt_token_ids, new.params,
                                                           new.eos_token_ids, new.output_token_ids,
                                                           new.lora_request)

    def remove(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def sampling_row(self, request_id: str, num_output_tokens: int,
                     grammar_bitmask: torch.Tensor | None = None) -> SamplingRow:
        s = self.requests[request_id]
        return SamplingRow(request_id, s.params, s.eos_token_ids, s.prompt_token_ids, s.output_token_ids,
                           num_output_tokens, grammar_bitmask)

    # ---- one forward's inputs --------------------------------------------------------------------
    def prepare(self, items: list[ForwardItem]) -> StepTensors:
        total = sum(len(t) for t, _, _ in items)
        if total > self.capacity:
            self._allocate(max(total, 2 * self.capacity))
        if total == len(items):
            spans = self._write_decode_rows(items)
        else:
            spans = self._write_rows(items)
        ids, positions, slots = self.device_buffers
        if ids is not self.host[0]:
            for dev, host in zip(self.device_buffers, self.host):
                dev[:total].copy_(host[:total], non_blocking=True)
        self.fill_placeholders(self.ids_np[:total], ids[:total])
        return StepTensors(ids[:total], positions[:total], self.positions_np[:total], slots[:total], spans)

    def fill_placeholders(self, host_ids: np.ndarray, device_ids: torch.Tensor) -> None:
        """Async scheduling: the tokens -(i + 1) written into `host_ids` (and copied to `device_ids`) replaced on the
        device by row i of the previous step's sampled tokens, without waiting for that step."""
        if self.previous_tokens is None:
            return
        dst = np.flatnonzero(host_ids < 0)
        if len(dst):
            src = torch.from_numpy(-host_ids[dst] - 1).to(self.device, non_blocking=True)
            device_ids[torch.from_numpy(dst).to(self.device, non_blocking=True)] = self.previous_tokens[src]

    def _write_rows(self, items: list[ForwardItem]) -> list[SeqSpan]:
        bs = self.block_size
        spans, offset = [], 0
        for tokens, start, block_table in items:
            n = len(tokens)
            end = offset + n
            pos = np.arange(start, start + n)
            table = np.asarray(block_table)
            self.ids_np[offset:end] = tokens
            self.positions_np[offset:end] = pos
            self.slots_np[offset:end] = table[pos // bs] * bs + pos % bs
            spans.append(SeqSpan(offset, n, start + n, table))
            offset = end
        return spans

    def _write_decode_rows(self, items: list[ForwardItem]) -> list[SeqSpan]:
        """One token per item (decode steps): one numpy write per buffer."""
        n = len(items)
        ids, positions, slots = decode_row_inputs(items, self.block_size)
        self.ids_np[:n], self.positions_np[:n], self.slots_np[:n] = ids, positions, slots
        return [SeqSpan(i, 1, p + 1, table) for i, ((_, _, table), p) in enumerate(zip(items, positions))]


def decode_row_inputs(items: list[ForwardItem], block_size: int) -> tuple[list[int], list[int], list[int]]:
    """The token ids, positions and KV slots of one-token items (decode rows), as plain lists: one numpy write each
    then, where the general path makes several small numpy calls per row (docs/benchmarks.md, "Host time per decode
    step")."""
    positions = [start for _, start, _ in items]
    ids = [tokens[0] for tokens, _, _ in items]
    slots = [table[p // block_size] * block_size + p % block_size for (_, _, table), p in zip(items, positions)]
    return ids, positions, slots
