"""The SSE reader that llmserve's clients share (`llmserve bench`, the gateway), against a real aiohttp server on
127.0.0.1 whose writes cut events anywhere."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from llmserve.http_client import sse_data

PIECES = [b'data: {"a"', b': 1}\n\ndata: {"b": 2}\n\nda', b"ta:[DONE]\n\n: a comment\nevent: x\nid: 7\n",
          b"data: cut off"]  # the last event never ends: dropped


def test_events_cut_across_reads_and_packed_into_one_read():
    async def handler(request):
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for piece in PIECES:
            await response.write(piece)
            await asyncio.sleep(0.02)  # separate reads on the client's side
        return response

    async def main():
        app = web.Application()
        app.router.add_get("/", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            async with aiohttp.ClientSession() as session, session.get(f"http://127.0.0.1:{port}/") as r:
                return [data async for data in sse_data(r.content)]
        finally:
            await runner.cleanup()

    assert asyncio.run(main()) == [b'{"a": 1}', b'{"b": 2}', b"[DONE]"]
