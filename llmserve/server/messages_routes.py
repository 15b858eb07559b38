"""Anthropic's Messages API routes: POST /v1/messages (plain or streamed) and POST /v1/messages/count_tokens. A request
runs as a chat request (messages_api.py reads one into the other); errors are Anthropic's error object (errors.py)."""

from __future__ import annotations

import asyncio
import json

from fastapi import Depends, FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import ValidationError

from llmserve.server import messages_api, tool_calls
from llmserve.server.chat_output import ChatOutputParser
from llmserve.server.errors import anthropic_error_body, from_exception, from_validation_error
from llmserve.server.protocol import ChatCompletionRequest, CountTokensRequest, MessagesRequest
from llmserve.server.request_streams import collect_finals


def _sse(event: dict) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


def install_messages_routes(app: FastAPI, engine, cfg, check_auth, check_model, admitted, chat_inputs,
                            render_chat, request_outputs) -> None:
    @app.post("/v1/messages", dependencies=[Depends(check_auth)])
    async def create_message(req: MessagesRequest, raw: Request):
        async with admitted(req) as (slot, adapter):
            chat_req = messages_api.chat_request(req)
            prep = await chat_inputs(chat_req, raw)
            slot.add_tokens(len(prep.ids))
        mid = messages_api.new_message_id()
        model = adapter.lora_name if adapter else cfg.served_model_name
        parser = ChatOutputParser(cfg.reasoning_parser, prep.tool_format, prep.forced_function)
        blocks = messages_api.ContentBlocks()
        agen = request_outputs(chat_req, [prep.ids], prep.params, mid, slot, prep.salt, adapter)
        sent_chars = 0

        def feed(out) -> list[dict]:
            nonlocal sent_chars
            c = out.outputs[0]
            delta = parser.delta(c.text, c.text[sent_chars:], c.finish_reason is not None)
            sent_chars = len(c.text)
            return blocks.feed(delta)

        def ending(out) -> tuple[dict, dict]:
            """(stop_reason and stop_sequence, usage) of the finished request."""
            c = out.outputs[0]
            reason, sequence = messages_api.stop_reason(c.finish_reason, c.stop_reason, blocks.has_calls)
            usage = messages_api.usage_object(len(prep.ids), out.num_cached_tokens, len(c.token_ids))
            return {"stop_reason": reason, "stop_sequence": sequence}, usage

        def message(content: list[dict], stop: dict, usage: dict) -> dict:
            return {"id": mid, "type": "message", "role": "assistant", "model": model, "content": content, **stop,
                    "usage": usage}

        if req.stream:
            async def events():
                try:
                    start = message([], {"stop_reason": None, "stop_sequence": None},
                                    messages_api.usage_object(len(prep.ids), 0, 0))
                    yield _sse({"type": "message_start", "message": start})
                    yield _sse({"type": "ping"})
                    final = None
                    async for _, out in agen:
                        for event in feed(out):
                            yield _sse(event)
                        final = out if out.finished else final
                    for event in blocks.close():
                        yield _sse(event)
                    if final is None:  # aborted before it finished: nothing more to say
                        return
                    stop, usage = ending(final)
                    yield _sse({"type": "message_delta", "delta": stop, "usage": usage})
                    yield _sse({"type": "message_stop"})
                except (asyncio.CancelledError, GeneratorExit):
                    raise
                except BaseException as e:  # noqa: BLE001 - after the first byte, an error is the stream's last event
                    err = from_exception(e)
                    yield _sse(anthropic_error_body(err.status, err.message))
                finally:
                    await agen.aclose()
            return StreamingResponse(events(), media_type="text/event-stream")

        final = (await collect_finals(raw, agen))[0]
        feed(final)
        blocks.close()
        stop, usage = ending(final)
        return message(blocks.blocks, stop, usage)

    @app.post("/v1/messages/count_tokens", dependencies=[Depends(check_auth)])
    async def count_tokens(req: CountTokensRequest):
        await check_model(req.model)
        tools, tool_choice, _ = messages_api.chat_tools(req)
        if tools:
            tool_calls.validate_tools(tools, tool_choice)
        try:
            chat_req = ChatCompletionRequest(messages=messages_api.chat_messages(req), tools=tools,
                                             tool_choice=tool_choice)
        except ValidationError as e:
            raise from_validation_error(e, "messages") from None
        return {"input_tokens": len(render_chat(chat_req))}
