"""The outputs of one HTTP request's prompts: merged into one stream, or collected to the end."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from fastapi import Request

from llmserve.beam_search import BeamSearch, beam_search_from, shown_logprobs
from llmserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
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


async def beam_search_outputs(engine: AsyncEngine, prompts: list[list[int]], params: SamplingParams,
                              length_penalty: float, rid: str, slot: Slot, priority: int, timeout: float | None,
                              salt: str | None, lora_request=None) -> AsyncIterator[tuple[int, RequestOutput]]:
    """A use_beam_search request's outputs: (prompt index, RequestOutput) once per prompt, at the end, with its n
    best beams as the n choices (best first). Every step asks the engine for one token of each live beam of every
    prompt (beam_search.py); the request's timeout covers all the steps."""
    beam, processors = beam_search_from(params, length_penalty)
    step = beam.step_params(engine.max_logprobs, **processors)
    searches = [BeamSearch(ids, beam, engine.model_config.eos_token_ids, engine.max_model_len) for ids in prompts]
    deadline = None if timeout is None else time.monotonic() + timeout
    cached = [0] * len(prompts)
    compute = [[0.0, 0.0] for _ in prompts]  # prefill and decode seconds of every step's requests (GPU-time cost)
    started, first_token, ended_by = time.monotonic(), None, "length"
    for n in range(beam.max_tokens):
        growing = [(i, s) for i, s in enumerate(searches) if not s.finished]
        if not growing:
            break
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            ended_by = "timeout"
            break
        owners = [i for i, s in growing for _ in s.live]
        steps = merged_outputs(engine, [b.tokens for _, s in growing for b in s.live], step, f"{rid}-{n}", slot,
                               priority, left, salt, lora_request)
        finals: dict[int, RequestOutput] = {}
        try:
            async for k, out in steps:
                if out.finished:
                    finals[k] = out
        finally:
            await steps.aclose()
        reasons = {c.finish_reason for out in finals.values() for c in out.outputs} - {"stop", "length"}
        if reasons or len(finals) < len(owners):
            ended_by = next(iter(reasons), "abort")  # a timeout or an abort ends the search with what it has
            break
        first_token = first_token or time.monotonic()
        for k, i in enumerate(owners):
            out = finals[k]
            if n == 0:
                cached[i] = out.num_cached_tokens
            if out.metrics is not None:
                compute[i][0] += out.metrics.prefill_compute_seconds
                compute[i][1] += out.metrics.decode_compute_seconds
        k = 0
        for i, s in growing:
            width = len(s.live)
            s.extend([finals[k + j].outputs[0].logprobs[0] for j in range(width)])
            k += width
    for i, s in enumerate(searches):
        plen = len(prompts[i])
        result = s.result(engine.tokenizer, ended_by)
        outputs = []
        for j, seq in enumerate(result.sequences):
            ids = seq.tokens[plen:]
            outputs.append(CompletionOutput(
                index=j, text=seq.text, token_ids=ids, finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
                cumulative_logprob=seq.cum_logprob, logprobs=shown_logprobs(seq, plen, params.logprobs),
                delta_text=seq.text, delta_token_ids=list(ids)))
        now = time.monotonic()
        metrics = RequestMetrics(started, started, first_token, now, now, prefill_compute_seconds=compute[i][0],
                                 decode_compute_seconds=compute[i][1])
        yield i, RequestOutput(f"{rid}-{i}", None, prompts[i], outputs, True, metrics, num_cached_tokens=cached[i])


async def collect_finals(raw: Request, agen: AsyncIterator[tuple[int, object]]) -> dict[int, object]:
    """Non-streaming: runs to the end and returns each prompt's final output, aborting if the client goes away."""
    finals: dict[int, object] = {}

    async def consume():
        async for i, out in agen:
            if out.finished:
                finals[i] = out

    async def stop() -> None:
        # let the consumer unwind first: closing the generator while it still runs it is what raised
        # "aclose(): asynchronous generator is already running"; its own cleanup aborts the request
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        await agen.aclose()

    task = asyncio.create_task(consume())
    while not task.done():
        try:
            done, _ = await asyncio.wait({task}, timeout=0.5)
        except asyncio.CancelledError:  # the caller gave up (a cancelled batch): the engine's requests end too
            await stop()
            raise
        if not done and await raw.is_disconnected():
            await stop()
            raise APIError(499, "client disconnected")
    task.result()
    return finals
