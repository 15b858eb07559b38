"""The server's engine thread (server/async_engine.py) hands each step's outputs to the event loop in one call; a
stream whose consumer fell behind gets the outputs that queued up as one (as vLLM's output collector merges them):
same final text, tokens and logprobs, every delta once, in order."""

from __future__ import annotations

import asyncio

import pytest

from llmserve.engine.llm_engine import LLMEngine
from llmserve.config import EngineConfig
from llmserve.sampling_params import SamplingParams
from llmserve.server.async_engine import AsyncEngine


@pytest.fixture(scope="module")
def async_engine(default_files):
    engine = AsyncEngine(LLMEngine(EngineConfig(dtype="float32", kv_cache_memory="128MiB", max_num_seqs=8),
                                   files=default_files))
    yield engine
    engine.shutdown()


async def consume(engine: AsyncEngine, rid: str, params: SamplingParams, lag: float) -> list:
    outs = []
    gen = engine.generate(rid, engine.engine.tokenizer.encode("Once upon a time", add_special_tokens=False), params)
    async for out in gen:
        outs.append(out)
        if lag and len(outs) == 1:
            await asyncio.sleep(lag)  # the engine keeps stepping; its outputs queue up
    return outs


def check_deltas_add_up(outs: list) -> None:
    last = outs[-1].outputs[0]
    assert last.finish_reason == "length" and all(not o.finished for o in outs[:-1])
    assert "".join(o.outputs[0].delta_text for o in outs) == last.text
    assert [t for o in outs for t in o.outputs[0].delta_token_ids] == last.token_ids
    assert len(last.logprobs) == len(last.token_ids)


def test_a_lagging_stream_gets_the_queued_outputs_as_one(async_engine):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1)

    async def both():
        return await asyncio.gather(consume(async_engine, "prompt", params, 0.0),
                                    consume(async_engine, "lagging", params, 1.5))

    prompt, lagging = asyncio.run(both())
    check_deltas_add_up(prompt)
    check_deltas_add_up(lagging)
    # the same request either way; the lagging consumer got its 40 tokens in fewer outputs
    assert lagging[-1].outputs[0].token_ids == prompt[-1].outputs[0].token_ids
    assert lagging[-1].outputs[0].logprobs == prompt[-1].outputs[0].logprobs
    assert len(prompt) >= 39 and len(lagging) < len(prompt) - 5
    kv = async_engine.engine.kv
    assert kv.num_free_blocks == kv.num_blocks
