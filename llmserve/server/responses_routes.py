"""The Responses API's routes (OpenAI's /v1/responses): create (plain, streamed or in the background), retrieve,
delete, list input items, cancel. A request runs as a chat request (responses_api.py reads one into the other); the
stored responses are in responses_store.py."""

from __future__ import annotations

import asyncio
import itertools
from collections import OrderedDict
from typing import Literal

from fastapi import Depends, FastAPI, Query, Request
from fastapi.responses import StreamingResponse

from llmserve.errors import LLMServeError
from llmserve.server import responses_api
from llmserve.server.chat_output import ChatOutputParser
from llmserve.server.errors import APIError, from_exception
from llmserve.server.pages import cursor_page
from llmserve.server.protocol import ResponsesRequest
from llmserve.server.request_streams import collect_finals
from llmserve.server.responses import ResponseFormatter
from llmserve.server.responses_store import RUNNING, LocalResponses, SharedResponses, StoredResponse


class EventLog:
    """A background response's stream events as they happen, kept so that a client can follow them from the start
    or, after a dropped connection, from the event after the last it saw (OpenAI's starting_after)."""

    def __init__(self):
        self.events: list[str] = []
        self.done = False
        self._changed = asyncio.Event()

    def add(self, event: dict) -> None:
        self.events.append(responses_api.sse_event(event, len(self.events)))
        self._wake()

    def close(self) -> None:
        self.done = True
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def follow(self, after: int):
        """The events numbered after `after`, then each new one until the response ends."""
        i = after + 1
        while True:
            changed = self._changed  # taken before looking: an event added after this wakes it
            while i < len(self.events):
                yield self.events[i]
                i += 1
            if self.done:
                return
            await changed.wait()


def install_responses_routes(app: FastAPI, engine, cfg, formatter: ResponseFormatter,
                             check_auth, admitted, chat_inputs, request_outputs) -> None:
    """OpenAI's Responses API over the chat path (responses_api.py): create (plain, streamed or in the background),
    retrieve, delete, list input items, cancel."""
    store = (SharedResponses(engine, cfg.max_stored_responses) if cfg.api_server_count > 1
             else LocalResponses(cfg.max_stored_responses))
    running: set[asyncio.Task] = set()  # background responses (a task without a reference may be collected)
    # background responses' events (this process's), the newest kept as many as the store keeps responses
    logs: OrderedDict[str, EventLog] = OrderedDict()

    async def stored(response_id: str) -> StoredResponse:
        entry = await store.get(response_id) if store.enabled else None
        if entry is None:
            raise APIError(404, f"Response with id '{response_id}' not found.", param="response_id",
                           code="response_not_found")
        return entry

    async def prepare(req: ResponsesRequest, raw: Request, conversation: list[dict]):
        """The chat request and its inputs. With truncation "auto", the oldest turns go until the prompt fits."""
        while True:
            chat_req = responses_api.chat_request(req, conversation)
            try:
                return chat_req, await chat_inputs(chat_req, raw), conversation
            except (APIError, LLMServeError) as error:
                e = responses_api.in_responses_terms(from_exception(error))
                if req.truncation != "auto" or e.code != "context_length_exceeded" or len(conversation) < 2:
                    raise e from None
                conversation = conversation[1:]
                while len(conversation) > 1 and conversation[0]["role"] in ("tool", "assistant"):
                    conversation = conversation[1:]  # a turn starts at a user (or system) message

    @app.post("/v1/responses", dependencies=[Depends(check_auth)])
    async def create_response(req: ResponsesRequest, raw: Request):
        for field, instead in (("conversation", "previous_response_id"), ("prompt", "input and instructions")):
            if (req.model_extra or {}).get(field) is not None:  # ignoring it would answer another question
                raise APIError(400, f"{field} is not supported here; use {instead}", param=field)
        if req.background:
            if not (req.store and store.enabled):
                why = "set store to true" if store.enabled else "this server stores none (--max-stored-responses 0)"
                raise APIError(400, f"background responses must be stored: {why}", param="background")
        history: list[dict] = []
        if req.previous_response_id is not None:
            previous = await store.get(req.previous_response_id) if store.enabled else None
            if previous is None:
                raise APIError(404, f"Previous response with id '{req.previous_response_id}' not found.",
                               param="previous_response_id", code="previous_response_not_found")
            if previous.response["status"] in RUNNING:
                raise APIError(400, f"Previous response with id '{req.previous_response_id}' is still in progress.",
                               param="previous_response_id")
            history = previous.conversation
        new_messages, input_items = responses_api.input_messages(req.input)
        if not new_messages and not history:
            raise APIError(400, "input has no message for the model to answer", param="input")
        async with admitted(req) as (slot, adapter):
            chat_req, prep, conversation = await prepare(req, raw, history + new_messages)
            slot.add_tokens(len(prep.ids))
        rid = responses_api.new_id("resp")
        keep = req.store and store.enabled
        parser = ChatOutputParser(cfg.reasoning_parser, prep.tool_format, prep.forced_function)
        assembler = responses_api.ResponseAssembler(req, rid, adapter.lora_name if adapter else cfg.served_model_name,
                                                    prep.params, keep, parser, formatter, prep.top_logprobs,
                                                    len(prep.ids))
        agen = request_outputs(chat_req, [prep.ids], prep.params, rid, slot, prep.salt, adapter)

        def entry(response: dict) -> StoredResponse:
            return StoredResponse(response, input_items, conversation + responses_api.output_messages(response["output"]))

        if req.background:
            log = EventLog()
            logs[rid] = log
            while len(logs) > max(1, cfg.max_stored_responses):
                logs.popitem(last=False)

            async def run() -> None:
                final, started = None, False
                log.add({"type": "response.created", "response": assembler.response("queued")})
                try:
                    async for _, out in agen:
                        if not started:  # the engine has taken it up
                            started = True
                            log.add({"type": "response.in_progress", "response": assembler.response("in_progress")})
                        for event in assembler.feed(out):
                            log.add(event)
                        final = out if out.finished else final
                    response, closing = assembler.finish(final)
                    for event in closing:
                        log.add(event)
                except Exception as e:  # noqa: BLE001 - the stored response says what went wrong
                    err = from_exception(e)
                    response = assembler.response("failed", error={"code": err.code or "server_error",
                                                                   "message": err.message})
                finally:
                    await agen.aclose()
                await store.finish(entry(response))
                now = await store.get(rid)
                if now is None or now.response["status"] != "cancelled":  # a cancelled one's stream just ends
                    kind = {"failed": "response.failed", "incomplete": "response.incomplete"}.get(
                        response["status"], "response.completed")
                    log.add({"type": kind, "response": response})
                log.close()

            queued = StoredResponse(assembler.response("queued"), input_items, conversation, f"{rid}-0")
            await store.put(queued)
            task = asyncio.create_task(run())
            running.add(task)
            task.add_done_callback(running.discard)
            if req.stream:  # the events as they come; the response goes on if this connection drops
                return StreamingResponse(log.follow(-1), media_type="text/event-stream")
            return queued.response

        if req.stream:
            async def events():
                sequence = itertools.count()
                final = None
                try:
                    for kind in ("response.created", "response.in_progress"):
                        yield responses_api.sse_event({"type": kind, "response": assembler.response("in_progress")},
                                                      next(sequence))
                    async for _, out in agen:
                        for event in assembler.feed(out):
                            yield responses_api.sse_event(event, next(sequence))
                        final = out if out.finished else final
                    response, closing = assembler.finish(final)
                    for event in closing:
                        yield responses_api.sse_event(event, next(sequence))
                    if keep:
                        await store.put(entry(response))
                    kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
                    yield responses_api.sse_event({"type": kind, "response": response}, next(sequence))
                except (asyncio.CancelledError, GeneratorExit):
                    raise
                except BaseException as e:  # noqa: BLE001 - after the first byte, an error is the stream's last event
                    err = from_exception(e)
                    failed = assembler.response("failed", error={"code": err.code or "server_error", "message": err.message})
                    yield responses_api.sse_event({"type": "response.failed", "response": failed}, next(sequence))
                finally:
                    await agen.aclose()
            return StreamingResponse(events(), media_type="text/event-stream")

        finals = await collect_finals(raw, agen)
        assembler.feed(finals[0])
        response, _ = assembler.finish(finals[0])
        if keep:
            await store.put(entry(response))
        return response

    @app.get("/v1/responses/{response_id}", dependencies=[Depends(check_auth)])
    async def retrieve_response(response_id: str, stream: bool = False,
                                starting_after: int = Query(-1, ge=-1)):
        """The stored response; with stream=true, a background response's events from the one after
        starting_after (all of them by default), following it live until it ends."""
        entry = await stored(response_id)
        if not stream:
            return entry.response
        if not entry.response.get("background"):
            raise APIError(400, "only a background response can be streamed again; GET it without stream",
                           param="stream")
        log = logs.get(response_id)
        if log is None:
            raise APIError(400, "this response's events are not kept here (the oldest go first, and with several "
                                "API server processes each keeps those of the responses it runs); GET it without "
                                "stream", param="stream")
        return StreamingResponse(log.follow(starting_after), media_type="text/event-stream")

    @app.delete("/v1/responses/{response_id}", dependencies=[Depends(check_auth)])
    async def delete_response(response_id: str):
        if not (store.enabled and await store.delete(response_id)):
            raise APIError(404, f"Response with id '{response_id}' not found.", param="response_id",
                           code="response_not_found")
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    @app.get("/v1/responses/{response_id}/input_items", dependencies=[Depends(check_auth)])
    async def list_input_items(response_id: str, limit: int = Query(20, ge=1, le=100),
                               order: Literal["asc", "desc"] = "desc", after: str | None = None):
        items = (await stored(response_id)).input_items
        return cursor_page(items if order == "asc" else items[::-1], limit, after, "input item in this response")

    @app.post("/v1/responses/{response_id}/cancel", dependencies=[Depends(check_auth)])
    async def cancel_response(response_id: str):
        entry = await stored(response_id)
        if not entry.response.get("background"):
            raise APIError(400, "Cannot cancel a synchronous response.", param="response_id")
        entry = await store.cancel(response_id)
        if entry is not None and entry.engine_request_id is not None and entry.response["status"] == "cancelled":
            engine.abort(entry.engine_request_id)  # its KV blocks are freed; its task then ends
        return entry.response if entry is not None else (await stored(response_id)).response

