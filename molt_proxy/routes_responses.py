"""The OpenAI Responses API's routes: `POST /v1/responses` (under `/v1/` and
`/s/<session>/v1/`), and `GET` / `DELETE /v1/responses/{id}` for stored responses.

A response is the same turn as a chat completion (`completions.Turn`), decoded and encoded by
`wire/responses*.py`. Stateless use resends the whole history as `input`; stored use
(`store: true`, the API's default) keeps each response's conversation in the store
(`store_responses.py`), and a request naming it as `previous_response_id` continues it, in
its session: a request naming another session is a 409, an unknown (or unseen) id a 404.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request, Response

from molt_proxy import auth
from molt_proxy.errors import NotFound
from molt_proxy.proxy import Proxy
from molt_proxy.routes import _json, _proxy, asked, chat_route, streamed
from molt_proxy.store_responses import StoredResponse, StoredResponses
from molt_proxy.types import RecordedReply
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


async def _stored(proxy: Proxy, response_id: str, principal: auth.Principal) -> StoredResponse:
    """A stored response the caller may see (an unknown id and a hidden one look the same)."""
    stored = await StoredResponses(proxy.store).load(response_id)
    if stored is None or not await proxy.sessions.visible(stored.session_id, principal):
        raise NotFound(f"no stored response {response_id!r}", param="response_id")
    return stored


@dataclass(slots=True)
class _Kept:
    """How a turn's response is kept for `previous_response_id` (`store: true`): every item of
    its conversation, reasoning with `encrypted_content` so that it renders exactly as sampled,
    and the response as returned (`Keep`), which the whole reply then is: encoded once."""

    proxy: Proxy
    decoded: ResponsesRequest
    history: list[dict[str, Any]]
    response: dict[str, Any] | None = None

    async def __call__(self, reply: RecordedReply, session_id: str) -> None:
        decoded = self.decoded
        output = output_items(
            ReplyShape(decoded, encrypted=True), reply.message, reply.completion_id, response_status(reply)
        )
        items = [*self.history, *decoded.items, *output]
        self.response = encode_response(ReplyShape(decoded, decoded.include_encrypted), reply, session_id)
        await StoredResponses(self.proxy.store).save(self.response, session_id, items)


async def _create(request: Request, path_session: str | None) -> Response:
    """`POST /v1/responses`: the same turn as a chat completion, in the Responses API's shapes.
    A request naming `previous_response_id` continues that response's conversation, in its
    session (`Turns.continuing`)."""
    chat = await asked(request)
    proxy = chat.proxy
    decoded = await chat.work.run(decode_responses_request, chat.body)
    caller = chat.caller(decoded.session_id, path_session)
    history: list[dict[str, Any]] = []
    previous = decoded.previous_response_id
    if previous is not None:
        try:
            stored = await _stored(proxy, previous, caller.principal)
        except NotFound:
            raise NotFound(
                f"previous response {previous!r} not found: it was never stored (store: false), "
                "was deleted, or belongs to no session you may use",
                param="previous_response_id",
            ) from None
        caller = proxy.completions.admission.continuing(caller, stored.session_id, previous)
        history = stored.history
    kept = _Kept(proxy, decoded, history) if decoded.store else None
    turn = chat.turn(caller, await chat.work.run(conversation, decoded, history), kept)
    shape = ReplyShape(decoded, decoded.include_encrypted)
    if not decoded.stream:
        answer = await turn.whole()
        if kept is not None and kept.response is not None:
            return _json(kept.response)
        return _json(encode_response(shape, answer.reply, answer.session_id))
    return await streamed(encode_response_stream(shape, turn.stream()))


@chat_route(router, "/v1/responses", RESPONSES_SCHEMA)
async def responses(request: Request) -> Response:
    return await _create(request, None)


@chat_route(router, "/s/{session_id}/v1/responses", RESPONSES_SCHEMA)
async def session_responses(session_id: str, request: Request) -> Response:
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
