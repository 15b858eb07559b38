"""Stored responses of the Responses API (`store`, on by default as OpenAI's): what GET /v1/responses/{id} returns,
what `previous_response_id` continues, and what cancelling a background response stops.

They live in memory, the oldest forgotten beyond --max-stored-responses; a restart forgets them all. With one server
process the store is that process's own (LocalResponses). With several (--api-server-count), a client's next request
may reach another process, so the engine process keeps the one store and each server process asks it
(SharedResponses), as it does for the adapters' names.
"""

from __future__ import annotations

import asyncio
import copy
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

RUNNING = ("queued", "in_progress")


@dataclass
class StoredResponse:
    response: dict  # the Response object, as GET returns it
    input_items: list[dict] = field(default_factory=list)  # this request's input items, each with its id
    # every turn up to and including this response's output, as chat messages (instructions not included: OpenAI
    # does not carry them over to the next response)
    conversation: list[dict] = field(default_factory=list)
    engine_request_id: str | None = None  # while a background response runs: what cancelling it aborts


class ResponseStore:
    """The stored responses by id; thread-safe (the engine process's loop and a server's event loop call it)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def calls(self) -> dict:
        """The calls server processes make of the engine process's store, by name."""
        return {"responses_put": self.put, "responses_get": self.get, "responses_delete": self.delete,
                "responses_finish": self.finish, "responses_cancel": self.cancel}

    def put(self, entry: StoredResponse) -> None:
        with self._lock:
            self._entries[entry.response["id"]] = entry
            self._entries.move_to_end(entry.response["id"])
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            entry = self._entries.get(response_id)
            return copy.deepcopy(entry)  # a caller's edits never reach the stored one

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._entries.pop(response_id, None) is not None

    def finish(self, entry: StoredResponse) -> None:
        """A background response's end; one cancelled meanwhile (or deleted) stays so."""
        with self._lock:
            current = self._entries.get(entry.response["id"])
            if current is None or current.response["status"] not in RUNNING:
                return
            self._entries[entry.response["id"]] = entry

    def cancel(self, response_id: str) -> StoredResponse | None:
        """Marks a running background response cancelled; returns it as it now is (None if not stored)."""
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is None:
                return None
            if entry.response["status"] in RUNNING:
                entry.response["status"] = "cancelled"
            return copy.deepcopy(entry)


class LocalResponses:
    """The store of a server that is the only one: in its own process."""

    def __init__(self, capacity: int):
        self.enabled = capacity > 0
        self._store = ResponseStore(capacity)

    async def put(self, entry: StoredResponse) -> None:
        self._store.put(entry)

    async def get(self, response_id: str) -> StoredResponse | None:
        return self._store.get(response_id)

    async def delete(self, response_id: str) -> bool:
        return self._store.delete(response_id)

    async def finish(self, entry: StoredResponse) -> None:
        self._store.finish(entry)

    async def cancel(self, response_id: str) -> StoredResponse | None:
        return self._store.cancel(response_id)


class SharedResponses:
    """One server process's way to the engine process's store (several API-server processes)."""

    def __init__(self, engine, capacity: int):
        self.engine, self.enabled = engine, capacity > 0

    async def _call(self, method: str, *args):
        return await asyncio.wrap_future(self.engine.call(method, *args))

    async def put(self, entry: StoredResponse) -> None:
        await self._call("responses_put", entry)

    async def get(self, response_id: str) -> StoredResponse | None:
        return await self._call("responses_get", response_id)

    async def delete(self, response_id: str) -> bool:
        return await self._call("responses_delete", response_id)

    async def finish(self, entry: StoredResponse) -> None:
        await self._call("responses_finish", entry)

    async def cancel(self, response_id: str) -> StoredResponse | None:
        return await self._call("responses_cancel", response_id)
