"""What llmserve's HTTP clients (the gateway's upstreams, `llmserve bench`) share: aiohttp's transport errors, and
reading a server-sent-events stream."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp

TRANSPORT_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError)  # what a request can fail with


async def sse_data(content: aiohttp.StreamReader) -> AsyncIterator[bytes]:
    """The payload of each `data:` line (stripped; `[DONE]` included), whatever the network's reads cut: one read
    may hold many events under load, or part of one. Other fields (event:, id:, comments) are skipped. aiohttp
    rather than httpx: its reads cost a fraction of httpx's CPU (docs/benchmarks.md, "The benchmark's client")."""
    pending = b""
    async for piece in content.iter_any():
        pending += piece
        *lines, pending = pending.split(b"\n")
        for line in lines:
            if line.startswith(b"data:"):
                yield line[5:].strip()
    # a last line without its newline is an event cut off (a stream ends after a blank line): dropped, as the
    # SSE spec says, so that the caller sees a stream that ended early rather than half an event


async def sse_events(content: aiohttp.StreamReader) -> AsyncIterator[tuple[str | None, bytes]]:
    """Each event of a stream as (its `event:` name or None, its `data:` payload): for the APIs whose events are
    named (OpenAI's Responses, Anthropic's Messages). An event ends at a blank line."""
    pending, name, data = b"", None, []
    async for piece in content.iter_any():
        pending += piece
        *lines, pending = pending.split(b"\n")
        for line in lines:
            line = line.rstrip(b"\r")
            if not line:
                if data:
                    yield name, b"\n".join(data)
                name, data = None, []
            elif line.startswith(b"event:"):
                name = line[6:].strip().decode()
            elif line.startswith(b"data:"):
                data.append(line[5:].strip())
