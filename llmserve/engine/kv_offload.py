"""Spill tiers for prefix-cache blocks evicted from the KV pool: host memory, then disk.

A block is stored under its chain hash with the key that produced it (parent hash, token ids, a digest of
the extra keys), and a lookup must present the same key: a hash collision or a stale file is a miss,
never another prefix's KV. Disk blocks are safetensors files carrying a SHA-256 of their tensor bytes;
a missing, truncated or corrupt file is a miss and is deleted.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections import OrderedDict
from dataclasses import dataclass

import torch
from safetensors import safe_open
from safetensors.torch import save_file

logger = logging.getLogger(__name__)

BlockKey = tuple  # (parent hash bytes, tuple of token ids, extra-keys digest bytes)


def _checksum(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


@dataclass
class TierStats:
    hits: int = 0  # blocks found
    stored: int = 0  # blocks written
    bytes: int = 0  # bytes held now


class HostTier:
    """An LRU of block tensors in (pinned, on a GPU) host memory, within a byte budget."""

    name = "host"

    def __init__(self, budget_bytes: int, pin: bool):
        self.budget = budget_bytes
        self.pin = pin
        self.blocks: OrderedDict[bytes, tuple[BlockKey, torch.Tensor]] = OrderedDict()
        self.stats = TierStats()

    def put(self, digest: bytes, key: BlockKey, data: torch.Tensor) -> list[tuple[bytes, BlockKey, torch.Tensor]]:
        """Stores a block; returns the blocks pushed out to make room (oldest first)."""
        size = data.numel() * data.element_size()
        if size > self.budget:
            return [(digest, key, data)]
        if digest in self.blocks:
            self.blocks.move_to_end(digest)
            return []
        copy = torch.empty(data.shape, dtype=data.dtype, pin_memory=self.pin)
        copy.copy_(data)
        self.blocks[digest] = (key, copy)
        self.stats.bytes += size
        self.stats.stored += 1
        pushed = []
        while self.stats.bytes > self.budget:
            old, (old_key, old_data) = self.blocks.popitem(last=False)
            self.stats.bytes -= old_data.numel() * old_data.element_size()
            pushed.append((old, old_key, old_data))
        return pushed

    def clear(self) -> None:
        self.blocks.clear()
        self.stats.bytes = 0

    def get(self, digest: bytes, key: BlockKey) -> torch.Tensor | None:
        entry = self.blocks.get(digest)
        if entry is None or entry[0] != key:
            return None
        self.blocks.move_to_end(digest)
        self.stats.hits += 1
        return entry[1]


class DiskTier:
    """Block files under a folder, LRU within a byte budget. Files already there (an earlier run) are reused."""

    name = "disk"

    def __init__(self, folder: str, budget_bytes: int, layout: str):
        self.folder = folder
        self.budget = budget_bytes
        self.layout = layout  # model and dtype: a file of another model or dtype is never read
        os.makedirs(folder, exist_ok=True)
        self.files: OrderedDict[str, int] = OrderedDict()
        self.stats = TierStats()
        found = []
        for name in os.listdir(folder):
            if name.endswith(".safetensors"):
                path = os.path.join(folder, name)
                found.append((os.path.getmtime(path), name[: -len(".safetensors")], os.path.getsize(path)))
        for _, hexd, size in sorted(found):
            self.files[hexd] = size
            self.stats.bytes += size
        self._trim()

    def _path(self, hexd: str) -> str:
        return os.path.join(self.folder, hexd + ".safetensors")

    def _trim(self) -> None:
        while self.stats.bytes > self.budget and self.files:
            hexd, size = self.files.popitem(last=False)
            self.stats.bytes -= size
            try:
                os.remove(self._path(hexd))
            except OSError:
                pass

    def clear(self) -> None:
        for hexd in list(self.files):
            self._drop(hexd)

    def _drop(self, hexd: str) -> None:
        size = self.files.pop(hexd, None)
        if size is not None:
            self.stats.bytes -= size
        try:
            os.remove(self._path(hexd))
        except OSError:
            pass

    def put(self, digest: bytes, key: BlockKey, data: torch.Tensor) -> None:
        hexd = digest.hex()
        if hexd in self.files:
            self.files.move_to_end(hexd)
            return
        parent, tokens, extra = key
        data = data.contiguous().cpu()  # a GPU pool's block, or an unpinned host copy: the file is written from host memory
        meta = {"parent": parent.hex(), "tokens": json.dumps(list(tokens)), "extra": extra.hex(),
                "layout": self.layout, "sha256": _checksum(data)}
        path = self._path(hexd)
        tmp = path + ".tmp"
        try:
            save_file({"kv": data}, tmp, metadata=meta)
            os.replace(tmp, path)  # readers never see a half-written file
        except OSError as e:
            logger.warning("KV disk tier: cannot write %s: %s", path, e)
            return
        size = os.path.getsize(path)
        self.files[hexd] = size
        self.stats.bytes += size
        self.stats.stored += 1
        self._trim()

    def get(self, digest: bytes, key: BlockKey) -> torch.Tensor | None:
        hexd = digest.hex()
        if hexd not in self.files:
            return None
        parent, tokens, extra = key
        try:
            with safe_open(self._path(hexd), framework="pt") as f:
                meta = f.metadata() or {}
                data = f.get_tensor("kv")
        except Exception as e:  # noqa: BLE001 - missing, truncated or foreign file: a miss, not a crash
            logger.warning("KV disk tier: dropping unreadable block %s (%s)", hexd[:16], type(e).__name__)
            self._drop(hexd)
            return None
        if (meta.get("parent") != parent.hex() or meta.get("tokens") != json.dumps(list(tokens)) or meta.get("extra") != extra.hex()
                or meta.get("layout") != self.layout):
            return None  # another prefix under the same name: leave it, do not use it
        if meta.get("sha256") != _checksum(data):
            logger.warning("KV disk tier: checksum mismatch in block %s; recomputing", hexd[:16])
            self._drop(hexd)
            return None
        self.files.move_to_end(hexd)
        self.stats.hits += 1
        return data


class KVOffload:
    """Host tier, then disk tier. Blocks pushed out of the host tier go to disk; lookups try both in order."""

    def __init__(self, host: HostTier | None, disk: DiskTier | None):
        self.tiers = [t for t in (host, disk) if t is not None]
        self.host, self.disk = host, disk

    def clear(self) -> None:
        """Forget every stored block (the disk tier's files are deleted)."""
        if self.host:
            self.host.clear()
        if self.disk:
            self.disk.clear()

    def put(self, digest: bytes, key: BlockKey, data: torch.Tensor) -> None:
        pushed = self.host.put(digest, key, data) if self.host else [(digest, key, data)]
        if self.disk:
            for d, k, t in pushed:
                self.disk.put(d, k, t)

    def get(self, digest: bytes, key: BlockKey) -> tuple[str, torch.Tensor] | None:
        for tier in self.tiers:
            data = tier.get(digest, key)
            if data is not None:
                return tier.name, data
        return None
