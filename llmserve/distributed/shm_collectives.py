"""All-reduce and all-gather through shared memory, for tensor-parallel ranks on one CPU machine.

gloo moves every collective through a loopback TCP socket: about 0.4 ms each, even for one row, and a decode step of
the default model has 60 of them (two per layer), so gloo alone costs more than the step's arithmetic. Here the
ranks share one mapped file: each rank copies its tensor into its own slot, publishes a sequence number, waits
(spinning: a rank has its own core) until every rank has published, then reads all slots and sums them in rank
order, so every rank computes the same bits. Two sets of slots alternate between calls: a rank can only start
writing a set again once every rank has published the call after the one that last read it.

Only where it is safe and useful: the ranks that the engine spawns on an x86-64 machine (whose stores are seen in
order by other cores, so a published sequence number means the data before it is visible), for CPU tensors that fit
a slot; larger tensors and torchrun's ranks (possibly on other machines) keep gloo. A waiting rank checks its peers
every few milliseconds (`peers_alive`), so a rank that died fails the step instead of hanging it.
"""

from __future__ import annotations

import os
import platform
import tempfile
import time
import uuid

import torch

SLOT_BYTES = 16 << 20  # per rank and set: a 2048-token prefill chunk of a 2048-wide float32 model
CACHE_LINE = 64


def supported() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64") and os.environ.get("LLMSERVE_TP_SHM", "1") != "0"


def segment_path() -> str:
    folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(folder, f"llmserve-tp-{os.getpid()}-{uuid.uuid4().hex[:8]}")


class SharedMemoryCollectives:
    def __init__(self, path: str, rank: int, size: int, peers_alive, timeout_s: float, create: bool):
        self.rank, self.size, self.peers_alive, self.timeout_s = rank, size, peers_alive, timeout_s
        header = CACHE_LINE * size  # each rank's sequence number on its own cache line
        total = header + 2 * size * SLOT_BYTES
        if create:
            # Reserve every page now: on a full tmpfs (a container's 64 MiB /dev/shm, say) this fails here, and the
            # executor keeps gloo, instead of a SIGBUS at the first write past the space there is.
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.posix_fallocate(fd, 0, total)
            except OSError:
                os.unlink(path)
                raise
            finally:
                os.close(fd)
        self.mapping = torch.from_file(path, shared=True, size=total, dtype=torch.uint8)
        self.sequence_numbers = self.mapping[:header].view(torch.int64).numpy()[:: CACHE_LINE // 8]
        self.slots = self.mapping[header:].view(2, size, SLOT_BYTES)
        self.calls = 0

    def fits(self, x: torch.Tensor) -> bool:
        return x.device.type == "cpu" and x.numel() * x.element_size() <= SLOT_BYTES

    def _publish(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Copies x into this rank's slot, waits for every rank's, and returns the slots as tensors like x."""
        self.calls += 1
        slots = self.slots[self.calls % 2]
        nbytes = x.numel() * x.element_size()
        views = [slots[r, :nbytes].view(x.dtype).view(x.shape) for r in range(self.size)]
        views[self.rank].copy_(x)
        self.sequence_numbers[self.rank] = self.calls
        self._wait(self.calls)
        return views

    def _wait(self, call: int) -> None:
        numbers = self.sequence_numbers
        spins = 0
        started = None
        while numbers.min() < call:
            spins += 1
            if spins % 4096 == 0:  # every few milliseconds: is every peer still there?
                now = time.monotonic()
                started = started or now
                if not self.peers_alive():
                    raise RuntimeError("a tensor-parallel rank stopped answering (its process is gone)")
                if now - started > self.timeout_s:
                    raise RuntimeError(f"a tensor-parallel rank did not reach the all-reduce within "
                                       f"{self.timeout_s:.0f} s")
                if spins % (4096 * 64) == 0:
                    time.sleep(0)  # a long wait (a much slower peer): let other threads of this process run

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        views = self._publish(x)
        torch.add(views[0], views[1], out=x)
        for view in views[2:]:
            x.add_(view)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat(self._publish(x.contiguous()), dim=-1)
