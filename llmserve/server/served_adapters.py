"""The LoRA adapters a server serves by name: those of --lora-modules, and those loaded at run time through
/v1/load_lora_adapter (--allow-runtime-lora-updating). The names live here; the weights live in the engine.

With one server process the names are that process's own (ServedAdapters). With several (--api-server-count), a
client that loads an adapter through one process may send its next request to another, so the engine process keeps
the names for all of them (LoRACatalogue, run in its loop's thread like the engine's own calls): it gives each adapter
its id, loads and unloads it, and sends every change to every server process. Each keeps a copy (SharedServedAdapters)
so that a request naming an adapter costs no round trip. A name missing from a copy is asked for once (the change may
still be on its way), and the engine process refuses a request whose adapter was unloaded meanwhile (404), so a copy
that is a moment late never brings an unloaded adapter back.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

from llmserve.errors import LLMServeError
from llmserve.lora.registry import LoRAExistsError, LoRARegistry, ModelNotFoundError
from llmserve.lora.request import LoRARequest


class ServedAdapters:
    """The names of one server process, which alone serves them."""

    def __init__(self, engine, allowed_dirs: list[str]):
        self.engine = engine
        self.registry = LoRARegistry(allowed_dirs)
        self._lock = asyncio.Lock()  # one load or unload at a time: a name is checked and registered without a gap

    def confine(self, path: str) -> str:
        return self.registry.confine(path)

    def load_at_start(self, name: str, path: str) -> None:
        """An adapter of --lora-modules, read and checked now: a bad one stops the start-up."""
        adapter = self.registry.new_request(name, path)
        self.engine.call("add_lora", adapter).result()
        self.registry.register(adapter)

    async def find(self, name: str) -> LoRARequest | None:
        return self.registry.get(name)

    async def served(self) -> list[LoRARequest]:
        return list(self.registry.adapters.values())

    async def load(self, name: str, path: str) -> tuple[LoRARequest, int]:
        """Loads the adapter in the folder `path` (already confined) under `name`: it and its size in host memory."""
        async with self._lock:
            if self.registry.get(name) is not None:
                raise LoRAExistsError(name)
            adapter = self.registry.new_request(name, path)
            size = await asyncio.wrap_future(self.engine.call("add_lora", adapter))
            self.registry.register(adapter)
        return adapter, size

    async def unload(self, name: str) -> LoRARequest:
        """New requests naming it get 404 from now on; running ones finish with it (the engine drops it after them)."""
        async with self._lock:
            adapter = self.registry.unregister(name)
            await asyncio.wrap_future(self.engine.call("remove_lora", adapter.lora_int_id))
        return adapter


class SharedServedAdapters(ServedAdapters):
    """One API-server process's copy of the engine process's names (LoRACatalogue)."""

    def __init__(self, engine, allowed_dirs: list[str]):
        super().__init__(engine, allowed_dirs)
        self._version, self._served = -1, {}
        self._update_lock = threading.Lock()  # the engine's reader thread and the event loop both update the copy
        engine.on_served_loras = self._update  # every change, from the engine's reader thread

    def _update(self, version: int, served: dict[str, LoRARequest]) -> None:
        with self._update_lock:
            if version > self._version:  # a reply read before a later change may be applied after it
                self._version, self._served = version, served

    async def _call(self, method: str, *args):
        return await asyncio.wrap_future(self.engine.call(method, *args))

    def load_at_start(self, name: str, path: str) -> None:
        # every process asks for its --lora-modules: the first loads each, the others find it loaded from that path
        self._update(*self.engine.call("load_served_lora", name, path, True).result()[2:])

    async def find(self, name: str) -> LoRARequest | None:
        adapter = self._served.get(name)
        if adapter is None:  # perhaps loaded through another process a moment ago, the change still on its way
            self._update(*await self._call("served_loras"))
            adapter = self._served.get(name)
        return adapter

    async def served(self) -> list[LoRARequest]:
        self._update(*await self._call("served_loras"))
        return list(self._served.values())

    async def load(self, name: str, path: str) -> tuple[LoRARequest, int]:
        adapter, size, version, served = await self._call("load_served_lora", name, path, False)
        self._update(version, served)
        return adapter, size

    async def unload(self, name: str) -> LoRARequest:
        adapter, version, served = await self._call("unload_served_lora", name)
        self._update(version, served)
        return adapter


class LoRACatalogue:
    """In the engine process, with several API-server processes: the adapters served by name, for all of them. Its
    methods run in the engine loop's thread, between steps, as the engine's calls do; `announce(version, served)`
    sends a change to every server process."""

    def __init__(self, engine, announce: Callable[[int, dict], None]):
        self.engine = engine
        self.announce = announce
        self.registry = LoRARegistry()  # the names, and the one counter of ids
        self.version = 0

    def calls(self) -> dict[str, Callable]:
        """The calls the server processes make of it, by name."""
        return {"served_loras": self.served_loras, "load_served_lora": self.load_served_lora,
                "unload_served_lora": self.unload_served_lora}

    def served_loras(self) -> tuple[int, dict]:
        return self.version, dict(self.registry.adapters)

    def _changed(self) -> tuple[int, dict]:
        self.version += 1
        self.announce(*self.served_loras())  # before the caller's reply: then no process can hear of it first
        return self.served_loras()

    def load_served_lora(self, name: str, path: str, at_start: bool):
        existing = self.registry.get(name)
        if existing is not None:
            if at_start and existing.lora_path == path:
                return (existing, 0, *self.served_loras())
            raise LoRAExistsError(name)
        adapter = self.registry.new_request(name, path)
        size = self.engine.add_lora(adapter)  # a bad adapter raises here, and is not registered
        self.registry.register(adapter)
        return (adapter, size, *self._changed())

    def unload_served_lora(self, name: str):
        adapter = self.registry.unregister(name)
        self.engine.remove_lora(adapter.lora_int_id)
        return (adapter, *self._changed())

    def admit(self, add) -> LLMServeError | None:
        """A request about to join the engine: refused if the adapter it names is no longer served (a server
        process's copy was a moment late)."""
        lora = add.lora_request
        if lora is not None and self.registry.get(lora.lora_name) != lora:
            return ModelNotFoundError(lora.lora_name)
        return None
