"""The KV link: a two-rank torch.distributed group between a prefill instance (rank 0) and a decode instance (rank 1),
over which the prefill side sends each request's KV blocks.

The prefill side serves the rendezvous (a TCPStore at `--kv-link HOST:PORT`); the decode side connects to it. Both
build their own process group object (not torch's default group, which tensor parallelism may hold), gloo for
headers and, on CUDA, NCCL for the blocks themselves. One thread per side uses the group, so sends and receives
stay in one order:

- prefill: `send(transfer_id, payload)` queues a transfer; the sender thread sends a header (id, blocks, bytes,
  CRC-32 of the payload on CPU) and then the payload, and reports the id as sent;
- decode: the receiver thread takes header then payload, checks the CRC and hands (id, payload or None, seconds)
  to a callback. A payload whose CRC does not match is handed over as None: the decode side recomputes, never uses
  damaged KV.

At connect time the two sides compare their KV layout (model shape, block size, dtype) and time one 32 MiB send,
which gives the link's measured bandwidth for the bypass threshold (kv_transfer/connector.py).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import zlib
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from llmserve.errors import InvalidRequestError

logger = logging.getLogger(__name__)

HEADER_FIELDS = 5  # transfer id, status, number of blocks, payload bytes, CRC-32
STATUS_OK, STATUS_FAILED = 0, 1
CONNECT_TIMEOUT_S = 300.0
PROBE_BYTES = 32 << 20


@dataclass(frozen=True)
class KVLayout:
    """The shape of one block's KV on both sides: [layers, 2, block_size, kv_heads, head_dim] of dtype."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str

    @property
    def block_shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def block_bytes(self) -> int:
        return int(np.prod(self.block_shape)) * self.torch_dtype.itemsize


def parse_address(address: str, what: str = "kv_link") -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidRequestError(f"{what} must be HOST:PORT, got {address!r}", what)
    return host, int(port)


def payload_crc(payload: torch.Tensor) -> int:
    return zlib.crc32(payload.contiguous().view(torch.uint8).numpy())


class KVLink:
    def __init__(self, role: str, address: str, layout: KVLayout, device: torch.device):
        self.role, self.layout, self.device = role, layout, device
        self.rank = 0 if role == "prefill" else 1
        host, port = parse_address(address)
        timeout = timedelta(seconds=CONNECT_TIMEOUT_S)
        self.store = dist.TCPStore(host, port, world_size=2, is_master=self.rank == 0, timeout=timeout,
                                   wait_for_workers=False)
        self.group = dist.ProcessGroupGloo(self.store, self.rank, 2, timeout)
        self.data_group = self.group
        if device.type == "cuda":  # the blocks themselves GPU to GPU
            self.data_group = dist.ProcessGroupNCCL(dist.PrefixStore("nccl", self.store), self.rank, 2)
        self._check_layout()
        self.bandwidth_bytes_per_s = self._probe()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self.error: str | None = None  # set when the link broke (the peer died): transfers fall back to recompute

    # ---- connect -----------------------------------------------------------------------------------
    def _check_layout(self) -> None:
        mine = torch.tensor([self.layout.num_layers, self.layout.block_size, self.layout.num_kv_heads,
                             self.layout.head_dim, self.layout.torch_dtype.itemsize], dtype=torch.int64)
        theirs = torch.empty_like(mine)
        other = 1 - self.rank
        if self.rank == 0:
            self.group.send([mine], other, 1).wait()
            self.group.recv([theirs], other, 1).wait()
        else:
            self.group.recv([theirs], other, 1).wait()
            self.group.send([mine], other, 1).wait()
        if not torch.equal(mine, theirs):
            names = ("layers", "block size", "KV heads", "head dim", "bytes per element")
            diff = ", ".join(f"{n} {a} here, {b} there" for n, a, b in zip(names, mine.tolist(), theirs.tolist()) if a != b)
            raise InvalidRequestError(f"the prefill and decode instances hold different KV layouts ({diff}): they "
                                      "must serve the same model with the same --block-size and KV dtype", "kv_link")

    def _probe(self) -> float:
        """Bytes per second of one send of PROBE_BYTES (the second of two: the first sets up buffers). The receiver
        takes each into a newly allocated tensor, as it does every transfer: in host memory its pages are faulted in
        as the bytes land, which here costs about 40 % of the rate into a buffer already touched."""
        data = torch.zeros(PROBE_BYTES, dtype=torch.uint8, device=self.device)
        seconds = 0.0
        for _ in range(2):
            t = time.perf_counter()
            if self.rank == 0:
                self.data_group.send([data], 1, 2).wait()
            else:
                data = torch.empty(PROBE_BYTES, dtype=torch.uint8, device=self.device)
                self.data_group.recv([data], 0, 2).wait()
            seconds = time.perf_counter() - t
        rate = torch.tensor([PROBE_BYTES / max(seconds, 1e-9)], dtype=torch.float64)
        # the receiver's clock is the one that saw the bytes arrive: both sides use its figure
        if self.rank == 1:
            self.group.send([rate], 0, 3).wait()
        else:
            self.group.recv([rate], 1, 3).wait()
        return float(rate.item())

    # ---- prefill side ----------------------------------------------------------------------------------
    def start_sender(self, on_sent) -> None:
        """on_sent(transfer_id, nbytes, seconds) after each transfer left (or failed to: seconds None)."""
        threading.Thread(target=self._send_loop, args=(on_sent,), name="llmserve-kv-send", daemon=True).start()

    def send(self, transfer_id: int, read_payload) -> None:
        """Queues a transfer; `read_payload()` gives the [blocks, layers, 2, block_size, kv_heads, head_dim] tensor
        (or raises), called on the sender thread while the blocks are held."""
        self._queue.put((transfer_id, read_payload))

    def _send_loop(self, on_sent) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            transfer_id, read_payload = item
            t = time.perf_counter()
            try:
                payload = read_payload().contiguous()
                status = STATUS_OK
            except Exception as e:  # noqa: BLE001 - the decode side is told, and recomputes
                logger.error("KV transfer %d: reading the blocks failed: %s", transfer_id, e)
                payload, status = None, STATUS_FAILED
            try:
                nbytes = payload.numel() * payload.element_size() if payload is not None else 0
                crc = payload_crc(payload) if payload is not None and payload.device.type == "cpu" else 0
                header = torch.tensor([transfer_id, status, payload.shape[0] if payload is not None else 0, nbytes,
                                       crc], dtype=torch.int64)
                self.group.send([header], 1, 4).wait()
                if payload is not None:
                    self.data_group.send([payload], 1, 5).wait()
            except RuntimeError as e:  # the decode side went away
                self.error = f"the KV link to the decode instance broke: {e}"
                logger.error("%s", self.error)
                on_sent(transfer_id, 0, None)
                continue
            on_sent(transfer_id, nbytes, time.perf_counter() - t if status == STATUS_OK else None)

    # ---- decode side ------------------------------------------------------------------------------------
    def start_receiver(self, on_received) -> None:
        """on_received(transfer_id, payload or None, nbytes, seconds) for each transfer that arrives."""
        threading.Thread(target=self._receive_loop, args=(on_received,), name="llmserve-kv-recv", daemon=True).start()

    def _receive_loop(self, on_received) -> None:
        header = torch.empty(HEADER_FIELDS, dtype=torch.int64)
        while not self._closed:
            try:
                self.group.recv([header], 0, 4).wait()
                transfer_id, status, num_blocks, nbytes, crc = header.tolist()
                if status != STATUS_OK:
                    on_received(transfer_id, None, 0, 0.0)
                    continue
                t = time.perf_counter()
                payload = torch.empty((num_blocks, *self.layout.block_shape), dtype=self.layout.torch_dtype,
                                      device=self.device)
                self.data_group.recv([payload], 0, 5).wait()
                seconds = time.perf_counter() - t
            except RuntimeError as e:
                if not self._closed:
                    self.error = f"the KV link to the prefill instance broke: {e}"
                    logger.error("%s", self.error)
                return
            if payload.device.type == "cpu" and payload_crc(payload) != crc:
                logger.error("KV transfer %d: checksum mismatch (%d bytes); the decode side recomputes", transfer_id,
                             nbytes)
                on_received(transfer_id, None, nbytes, seconds)
                continue
            on_received(transfer_id, payload, nbytes, seconds)

    def close(self) -> None:
        self._closed = True
        self._queue.put(None)
