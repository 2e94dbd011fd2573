"""The OpenAI Responses API's routes: `POST /v1/responses` (under `/v1/` and
`/s/<session>/v1/`), and `GET` / `DELETE /v1/responses/{id}` for stored responses.

A response is the same turn as a chat completion (`Completions`), decoded and encoded by
`wire/responses*.py`. Stateless use resends the whole history as `input`; stored use
(`store: true`, the API's default) keeps each response's conversation in the store
(`store_responses.py`), and a request naming it as `previous_response_id` continues it, in
its session: a request naming another session is a 409, an unknown (or unseen) id a 404.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import replace
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from molt_proxy import auth
from molt_proxy.completions import OFF_LOOP_BYTES
from molt_proxy.conversation import Conversation
from molt_proxy.errors import Conflict, NotFound
from molt_proxy.proxy import Proxy
from molt_proxy.routes import EventStream, _attempt, _caller, _proxy
from molt_proxy.session import Caller
from molt_proxy.side import side_request
from molt_proxy.store_responses import StoredResponse, StoredResponses
from molt_proxy.types import RecordedReply
from molt_proxy.wire.control import request_body
from molt_proxy.wire.events import Closed, Opened, StreamEvent
from molt_proxy.wire.responses import (
    RESPONSES_SCHEMA,
    ResponsesRequest,
    conversation,
    decode_responses_request,
)
from molt_proxy.wire.responses_reply import (
    ReplyShape,
    encode_response,
    encode_response_stream,
    output_items,
    response_status,
)

router = APIRouter()

Save = Callable[[RecordedReply, str], Awaitable[None]]


async def _stored(proxy: Proxy, response_id: str, principal: auth.Principal) -> StoredResponse:
    """A stored response the caller may see (an unknown id and a hidden one look the same)."""
    stored = await StoredResponses(proxy.store).load(response_id)
    if stored is None or not await proxy.sessions.visible(stored.session_id, principal):
        raise NotFound(f"no stored response {response_id!r}", param="response_id")
    return stored


async def _continued(
    proxy: Proxy, decoded: ResponsesRequest, caller: Caller
) -> tuple[Caller, list[dict[str, Any]]]:
    """The caller in the previous response's session, and that response's history."""
    previous = decoded.previous_response_id
    if previous is None:
        return caller, []
    try:
        stored = await _stored(proxy, previous, caller.principal)
    except NotFound:
        raise NotFound(
            f"previous response {previous!r} not found: it was never stored (store: false), "
            "was deleted, or belongs to no session you may use",
            param="previous_response_id",
        ) from None
    keyed = proxy.sessions.by_key(caller.api_key) if caller.api_key else None
    named = caller.session_id or (keyed.id if keyed is not None else None)
    if named is not None and named != stored.session_id:
        raise Conflict(
            f"previous response {previous!r} belongs to session {stored.session_id!r}, "
            f"not to {named!r}: continue it in its own session",
            param="previous_response_id",
        )
    return replace(caller, session_id=stored.session_id), stored.history


def _saver(proxy: Proxy, decoded: ResponsesRequest, history: list[dict[str, Any]]) -> Save:
    """How a turn's response is kept for `previous_response_id` (nothing with `store: false`)."""
    kept = ReplyShape(decoded, encrypted=True)

    async def save(reply: RecordedReply, session_id: str) -> None:
        if not decoded.store:
            return
        output = output_items(kept, reply.message, reply.completion_id, response_status(reply))
        items = [*history, *decoded.items, *output]
        response = encode_response(ReplyShape(decoded, decoded.include_encrypted), reply, session_id)
        await StoredResponses(proxy.store).save(response, session_id, items)

    return save


async def _saving(events: AsyncGenerator[StreamEvent], save: Save) -> AsyncGenerator[StreamEvent]:
    """A streamed turn's events, its response stored before its last event goes out."""
    session_id = ""
    async with aclosing(events):
        async for event in events:
            if isinstance(event, Opened):
                session_id = event.session_id
            elif isinstance(event, Closed):
                await save(event.reply, session_id)
            yield event


async def _create(request: Request, path_session: str | None) -> dict[str, Any] | StreamingResponse:
    proxy = _proxy(request)
    principal = proxy.principal(request, auth.CHAT)
    body = await request.body()
    decoded = (
        decode_responses_request(body)
        if len(body) < OFF_LOOP_BYTES
        else await asyncio.to_thread(decode_responses_request, body)
    )
    caller = _caller(proxy, request, principal, decoded.session_id, path_session)
    caller, history = await _continued(proxy, decoded, caller)
    turn: Conversation = (
        conversation(decoded, history)
        if len(body) < OFF_LOOP_BYTES
        else await asyncio.to_thread(conversation, decoded, history)
    )
    side = side_request(turn, caller, proxy.settings.side_requests, proxy.close_session)
    shape = ReplyShape(decoded, decoded.include_encrypted)
    save = _saver(proxy, decoded, history)
    attempt = _attempt(request, body)
    if not decoded.stream:
        answer = await proxy.completions.complete(side.caller, turn, body, attempt)
        await save(answer.reply, answer.session_id)
        reply = encode_response(shape, answer.reply, answer.session_id)
        await side.done()
        return reply
    turned = _saving(proxy.completions.stream(side.caller, turn, body, attempt), save)
    events = side.after(encode_response_stream(shape, turned))
    first = await anext(events)  # errors before vLLM answers become plain error responses
    return EventStream(first, events)


@router.post("/v1/responses", response_model=None, openapi_extra=request_body(RESPONSES_SCHEMA))
async def responses(request: Request) -> dict[str, Any] | StreamingResponse:
    return await _create(request, None)


@router.post(
    "/s/{session_id}/v1/responses", response_model=None, openapi_extra=request_body(RESPONSES_SCHEMA)
)
async def session_responses(session_id: str, request: Request) -> dict[str, Any] | StreamingResponse:
    return await _create(request, session_id)


async def _visible(request: Request, response_id: str, path_session: str | None) -> StoredResponse:
    """A stored response the caller may see; under `/s/<session>/v1/`, one of that session."""
    proxy = _proxy(request)
    stored = await _stored(proxy, response_id, proxy.principal(request, auth.CHAT))
    if path_session is not None and stored.session_id != path_session:
        raise NotFound(f"no stored response {response_id!r} in session {path_session!r}", param="response_id")
    return stored


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request) -> dict[str, Any]:
    return (await _visible(request, response_id, None)).response


@router.get("/s/{session_id}/v1/responses/{response_id}")
async def get_session_response(session_id: str, response_id: str, request: Request) -> dict[str, Any]:
    return (await _visible(request, response_id, session_id)).response


async def _delete(request: Request, response_id: str, path_session: str | None) -> dict[str, Any]:
    await _visible(request, response_id, path_session)
    await StoredResponses(_proxy(request).store).delete(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> dict[str, Any]:
    return await _delete(request, response_id, None)


@router.delete("/s/{session_id}/v1/responses/{response_id}")
async def delete_session_response(session_id: str, response_id: str, request: Request) -> dict[str, Any]:
    return await _delete(request, response_id, session_id)
