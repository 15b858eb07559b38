"""The outputs of one HTTP request's prompts: merged into one stream, or collected to the end."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from fastapi import Request

from llmserve.sampling_params import SamplingParams
from llmserve.server.admission import Slot
from llmserve.server.async_engine import AsyncEngine
from llmserve.server.errors import APIError


async def merged_outputs(engine: AsyncEngine, prompts: list[list[int]], params: SamplingParams, rid: str, slot: Slot,
                         priority: int, timeout: float | None, salt: str | None,
                         lora_request=None, kv_transfer_params: dict | None = None) -> AsyncIterator[tuple[int, object]]:
    """Yields (prompt index, RequestOutput) from all prompts of one HTTP request, merged; the request leaves the
    admission queue at its first output."""
    gens = [engine.generate(f"{rid}-{i}", ids, params, priority=priority, timeout=timeout, cache_salt=salt,
                            lora_request=lora_request, kv_transfer_params=kv_transfer_params)
            for i, ids in enumerate(prompts)]
    if len(gens) == 1:
        try:
            async for out in gens[0]:
                slot.release()
                yield 0, out
        finally:
            slot.release()
            await gens[0].aclose()
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i, g):
        try:
            async for out in g:
                await q.put((i, out))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            await q.put((i, e))
        finally:
            await q.put((i, None))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    remaining = len(gens)
    try:
        while remaining:
            i, item = await q.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                slot.release()
                yield i, item
    finally:
        slot.release()
        for t in tasks:
            t.cancel()


async def collect_finals(raw: Request, agen: AsyncIterator[tuple[int, object]]) -> dict[int, object]:
    """Non-streaming: runs to the end and returns each prompt's final output, aborting if the client goes away."""
    finals: dict[int, object] = {}

    async def consume():
        async for i, out in agen:
            if out.finished:
                finals[i] = out

    task = asyncio.create_task(consume())
    while not task.done():
        done, _ = await asyncio.wait({task}, timeout=0.5)
        if not done and await raw.is_disconnected():
            # let the consumer unwind first: closing the generator while it still runs it is what raised
            # "aclose(): asynchronous generator is already running"; its own cleanup aborts the request
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            await agen.aclose()
            raise APIError(499, "client disconnected")
    task.result()
    return finals
