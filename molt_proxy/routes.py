"""The HTTP routes: thin handlers that decode a request at the edge (`wire/`), call the
proxy's parts (`proxy.py`) and encode the answer. Errors are raised as domain errors and
mapped to HTTP once, in `app.py`.

A chat route of any API format is decode → `Turn` → encode: `asked` reads the request,
`Asked.turn` opens its turn (`completions.py`), which answers whole or streamed (`streamed`).
A new API format is one decoder and encoder under `wire/` and one route here.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import orjson
from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import StreamingResponse
from fastapi.routing import APIRoute
from starlette.types import Receive, Scope, Send

from molt_proxy import auth
from molt_proxy.completions import Keep, Turn, Work
from molt_proxy.conversation import Conversation
from molt_proxy.errors import BadRequest
from molt_proxy.ids import check_group_id, check_session_id
from molt_proxy.proxy import Proxy
from molt_proxy.session import Attempt, Caller
from molt_proxy.sessions import unknown_session
from molt_proxy.side import is_side
from molt_proxy.types import SessionStatus
from molt_proxy.weights import check_version
from molt_proxy.wire.anthropic import (
    COUNT_SCHEMA,
    MESSAGES_SCHEMA,
    decode_messages_request,
    recorded_completion_id,
)
from molt_proxy.wire.anthropic_reply import encode_message, encode_message_stream
from molt_proxy.wire.control import (
    CHAT_SCHEMA,
    SESSION_SCHEMA,
    WEIGHTS_SCHEMA,
    CloseBody,
    RewardBody,
    decode_session_body,
    decode_weights_body,
    request_body,
)
from molt_proxy.wire.jsonbody import INT64_MAX
from molt_proxy.wire.openai import decode_chat_request, encode_reply, encode_stream
from molt_proxy.wire.responses_items import recorded_completion_id as responses_completion_id
from molt_proxy.wire.sse import KEEPALIVE, trajectory_event

STREAM_KEEPALIVE_S = 15.0

router = APIRouter()


Endpoint = Callable[..., Awaitable[Response]]


class RequestRoute(APIRoute):
    """A route whose endpoint reads the request itself (its body is decoded under `wire/`)
    and returns a `Response`: it is called with the request and its path's parameters, as
    strings, by name. FastAPI's handler would solve the endpoint's dependencies on every
    request (query string, headers, cookies: 11 µs of its 31 here) only to hand it the
    request; its OpenAPI entry and error handling are FastAPI's, as for any route."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        endpoint = self.endpoint

        async def handle(request: Request) -> Response:
            return await endpoint(request=request, **request.path_params)

        return handle


def chat_route(router: APIRouter, path: str, schema: dict[str, Any]) -> Callable[[Endpoint], Endpoint]:
    """`@router.post(path)` for a chat route (`RequestRoute`), its body documented by `schema`."""

    def add(endpoint: Endpoint) -> Endpoint:
        router.add_api_route(
            path,
            endpoint,
            methods=["POST"],
            response_model=None,
            openapi_extra=request_body(schema),
            route_class_override=RequestRoute,
        )
        return endpoint

    return add


def _proxy(request: Request) -> Proxy:
    return request.app.state.proxy


def _json(body: dict[str, Any]) -> Response:
    """A reply encoded once, by orjson (a returned dict is walked by FastAPI's
    `jsonable_encoder`, then encoded by `json`: a tenth of a turn's CPU on the hot path)."""
    return Response(orjson.dumps(body), media_type="application/json")


# -- chat ------------------------------------------------------------------------------------


class EventStream(StreamingResponse):
    """A streamed turn's events, closed when the response ends, however it ends. Starlette
    leaves an unfinished body iterator to the garbage collector, and a turn's events hold its
    claim on its session: a client that left must not keep its chain busy until a collection."""

    def __init__(self, first: str, events: AsyncGenerator[str], media_type: str = "text/event-stream"):
        super().__init__(_relay(first, events), media_type=media_type)
        self.events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with aclosing(self.events):
            await super().__call__(scope, receive, send)


async def _relay(first: str, events: AsyncIterator[str]) -> AsyncIterator[str]:
    yield first
    async for event in events:
        yield event
        # Reading ids vLLM already sent and writing to the client need not suspend, so
        # without this a fast vLLM keeps the loop from ever seeing that the client
        # left (Starlette learns it in a task of its own) and the turn runs to its end.
        await asyncio.sleep(0)


@dataclass(slots=True, frozen=True)
class Asked:
    """A chat request as it arrived, in any API format: who its key says it is, its body, and
    where its work runs (`Work`, decided here once from the body's size)."""

    proxy: Proxy
    request: Request
    principal: auth.Principal
    body: bytes
    work: Work

    def caller(self, body_session: str | None, path_session: str | None) -> Caller:
        """The session hints of the request: path, header, body (`Conversation.session_id`),
        key, group. Every id named is checked (`ids.py`), the ones a nearer hint overrides too:
        a malformed id is the client's mistake wherever it is. An empty header is no header."""
        headers, principal = self.request.headers, self.principal
        key = auth.presented_key(headers)
        header = check_session_id(headers.get("x-session-id") or None, "X-Session-Id")
        check_session_id(body_session, "metadata.session_id")
        session_id = check_session_id(path_session, "session_id") or header
        if session_id is None and not (principal is auth.OPEN and key and self.proxy.sessions.by_key(key)):
            session_id = body_session
        session_id = auth.chat_session(principal, session_id)
        group_id = check_group_id(headers.get("x-group-id") or None, "X-Group-Id")
        # Only an open proxy looks a session key up at the turn; with keys on, `principal` has.
        open_key = key if session_id is None and principal is auth.OPEN else None
        return Caller(session_id, open_key, group_id, principal)

    def attempt(self) -> Attempt:
        """Whether the request says it retries one: its `Idempotency-Key`, and the retry count
        the OpenAI and Anthropic SDKs send on every request (`x-stainless-retry-count`, 0 on the
        first try, 1 on the first retry). Any API format's route reads them here.

        The count is a hint: one that is not a decimal number is ignored (None: the client does
        not say). A number is a retry when any of its digits is not 0, read without `int()`,
        which refuses more than 4,300 digits: an SDK's count never has many, and nothing here
        needs its value."""
        headers = self.request.headers
        count = headers.get("x-stainless-retry-count", "")
        retry = count.lstrip("0") != "" if count.isascii() and count.isdigit() else None
        hashed = hashlib.sha256(self.body).hexdigest()
        return Attempt(hashed, headers.get("idempotency-key") or None, retry)

    def turn(self, caller: Caller, conversation: Conversation, keep: Keep | None = None) -> Turn:
        """The request's turn (`completions.py`), as `caller`."""
        return self.proxy.completions.turn(caller, conversation, self.attempt(), self.work, keep)


async def asked(request: Request) -> Asked:
    """A chat route's first steps: the key checked, then the body read."""
    proxy = _proxy(request)
    principal = proxy.principal(request, auth.CHAT)
    body = await request.body()
    return Asked(proxy, request, principal, body, Work.of(body))


async def streamed(lines: AsyncGenerator[str], media_type: str = "text/event-stream") -> EventStream:
    """A streamed turn's response. Its first line is awaited here: a turn that fails before vLLM
    answers (the render, the session, the context) fails with a plain error response."""
    first = await anext(lines)
    return EventStream(first, lines, media_type)


async def _chat(request: Request, path_session: str | None) -> Response:
    """`POST /v1/chat/completions`: OpenAI's request decoded, the turn, OpenAI's reply."""
    chat = await asked(request)
    call = await chat.work.run(decode_chat_request, chat.body)
    conversation = call.conversation
    turn = chat.turn(chat.caller(conversation.session_id, path_session), conversation)
    token_bytes = chat.proxy.tokenizer.token_bytes
    if not call.stream:
        answer = await turn.whole()
        return _json(encode_reply(answer.reply, answer.session_id, token_bytes))
    return await streamed(encode_stream(turn.stream(), call.include_usage, token_bytes))


@chat_route(router, "/v1/chat/completions", CHAT_SCHEMA)
async def chat_completions(request: Request) -> Response:
    return await _chat(request, None)


@chat_route(router, "/s/{session_id}/v1/chat/completions", CHAT_SCHEMA)
async def session_chat_completions(session_id: str, request: Request) -> Response:
    return await _chat(request, session_id)


# -- Anthropic messages ----------------------------------------------------------------------


async def _messages(request: Request, path_session: str | None) -> Response:
    """`POST /v1/messages`: the same turn as a chat completion, in Anthropic's shapes."""
    chat = await asked(request)
    call = await chat.work.run(decode_messages_request, chat.body, count=False)
    conversation = call.conversation
    turn = chat.turn(chat.caller(conversation.session_id, path_session), conversation)
    if not call.stream:
        answer = await turn.whole()
        return _json(encode_message(answer.reply, answer.session_id, answer.stop_sequence, call.max_tokens))
    return await streamed(encode_message_stream(turn.stream(), call.max_tokens))


async def _count_tokens(request: Request, path_session: str | None) -> dict[str, Any]:
    """`POST /v1/messages/count_tokens`: the exact number of prompt ids the proxy would send."""
    chat = await asked(request)
    conversation = (await chat.work.run(decode_messages_request, chat.body, count=True)).conversation
    turn = chat.turn(chat.caller(conversation.session_id, path_session), conversation)
    return {"input_tokens": await turn.count()}


@chat_route(router, "/v1/messages", MESSAGES_SCHEMA)
async def messages(request: Request) -> Response:
    return await _messages(request, None)


@chat_route(router, "/s/{session_id}/v1/messages", MESSAGES_SCHEMA)
async def session_messages(session_id: str, request: Request) -> Response:
    return await _messages(request, session_id)


@router.post("/v1/messages/count_tokens", openapi_extra=request_body(COUNT_SCHEMA))
async def count_tokens(request: Request) -> dict[str, Any]:
    return await _count_tokens(request, None)


@router.post("/s/{session_id}/v1/messages/count_tokens", openapi_extra=request_body(COUNT_SCHEMA))
async def session_count_tokens(session_id: str, request: Request) -> dict[str, Any]:
    return await _count_tokens(request, session_id)


@router.get("/", include_in_schema=False)
@router.head("/", include_in_schema=False)
async def root() -> dict[str, Any]:
    """Claude Code probes its base URL before its first request."""
    return {"status": "ok", "service": "molt-proxy"}


@router.get("/s/{session_id}", include_in_schema=False)
@router.head("/s/{session_id}", include_in_schema=False)
async def session_root(session_id: str) -> dict[str, Any]:
    """Claude Code probes its base URL on every run, and with a session in its path
    (`ANTHROPIC_BASE_URL=http://proxy/s/<id>`) that is `/s/<id>`: answered as `/` is."""
    check_session_id(session_id, "session_id")
    return await root()


@router.get("/v1/models")
@router.get("/s/{session_id}/v1/models")
async def models(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": await _proxy(request).models()}


# -- sessions and rewards --------------------------------------------------------------------


@router.post("/v1/sessions", status_code=201, openapi_extra=request_body(SESSION_SCHEMA, required=False))
async def create_session(request: Request) -> dict[str, Any]:
    proxy = _proxy(request)
    principal = proxy.principal(request, auth.CREATE)
    session_id, group_id = decode_session_body(await request.body())
    check_session_id(session_id, "session_id")
    check_group_id(group_id, "group_id")
    key = auth.new_session_key()
    session = await proxy.sessions.create(
        session_id, group_id, key_hash=auth.key_id(key), owner=principal.owner
    )
    base = str(request.base_url).rstrip("/")
    return {
        "session_id": session.id,
        "group_id": session.group_id,
        "api_key": key,  # shown once: the proxy keeps only its hash
        "base_url": f"{base}/s/{session.id}/v1",
    }


@router.get("/v1/sessions/{session_id}")
async def get_session(session_id: str, request: Request) -> dict[str, Any]:
    proxy = _proxy(request)
    principal = proxy.principal(request, auth.CHAT)
    return proxy.sessions.get(session_id, principal).describe()


@router.post("/v1/rewards", openapi_extra=request_body(RewardBody.model_json_schema()))
async def post_reward(request: Request) -> dict[str, Any]:
    """`{session_id | completion_id, reward, final = true, info}`: a final reward closes the
    session; `final: false` with a `completion_id` rewards that one turn."""
    proxy = _proxy(request)
    principal = proxy.principal(request, auth.CHAT)
    body = RewardBody.decode(await request.body(), proxy.settings.reward_range)
    session_id = body.session_id or ""  # given whenever completion_id is not (`RewardBody.decode`)
    completion_id = body.completion_id and recorded_completion_id(responses_completion_id(body.completion_id))
    if completion_id is not None:
        session_id = await proxy.sessions.of_completion(completion_id, principal)
    elif not await proxy.sessions.visible(session_id, principal):
        raise unknown_session(session_id)  # as for an id that does not exist: no probing
    if not body.final:
        if completion_id is None:
            raise BadRequest("a per-turn reward ('final': false) needs a 'completion_id'", param="final")
        await proxy.sessions.reward_turn(completion_id, float(body.reward))
        return {"session_id": session_id, "completion_id": completion_id, "status": "open"}
    trajectories = await proxy.close_session(
        session_id, float(body.reward), body.info, SessionStatus.REWARDED
    )
    return {
        "session_id": session_id,
        "status": SessionStatus.REWARDED.value,
        "trajectories": [{"seq": t.seq, "trajectory_id": t.trajectory_id} for t in trajectories],
    }


@router.post(
    "/v1/sessions/{session_id}/close",
    openapi_extra=request_body(CloseBody.model_json_schema(), required=False),
)
async def close_session(session_id: str, request: Request) -> dict[str, Any]:
    """`{info}`: close a session unrewarded, e.g. because its harness crashed or timed out (a
    runner says why in `info`); its trajectories are kept, marked, and not trained on. Who may
    reward a session may close it; a closed one answers 409."""
    proxy = _proxy(request)
    principal = proxy.principal(request, auth.CHAT)
    check_session_id(session_id, "session_id")
    body = CloseBody.decode(await request.body())
    if not await proxy.sessions.visible(session_id, principal):
        raise unknown_session(session_id)  # as for an id that does not exist: no probing
    trajectories = await proxy.close_session(session_id, None, body.info, SessionStatus.UNREWARDED)
    return {
        "session_id": session_id,
        "status": SessionStatus.UNREWARDED.value,
        "trajectories": [{"seq": t.seq, "trajectory_id": t.trajectory_id} for t in trajectories],
    }


# -- the trainer's side ----------------------------------------------------------------------


@router.get("/v1/trajectories", response_model=None)
async def trajectories(
    request: Request,
    after: int = Query(0, ge=0, le=INT64_MAX),
    limit: int = Query(100, ge=1, le=10_000),
) -> dict[str, Any] | StreamingResponse:
    proxy = _proxy(request)
    proxy.principal(request, auth.ADMIN_ONLY)
    if "text/event-stream" in request.headers.get("accept", ""):
        return StreamingResponse(_follow(proxy, after, limit), media_type="text/event-stream")
    data = await proxy.store.trajectories_after(after, limit)
    return {"object": "list", "data": data, "last_seq": data[-1]["seq"] if data else after}


async def _follow(proxy: Proxy, after: int, limit: int) -> AsyncIterator[str]:
    """Every trajectory after `after`, then each new one as its session closes, for ever; side
    requests' trajectories are skipped (the trainer reads this stream)."""
    cursor = after
    while True:
        batch = await proxy.store.trajectories_after(cursor, limit)
        for trajectory in batch:
            cursor = trajectory["seq"]
            if not is_side(trajectory):  # kept out of training (`side.py`)
                yield trajectory_event(trajectory)
        if batch:
            continue
        async with proxy.finalized:
            try:
                await asyncio.wait_for(proxy.finalized.wait(), STREAM_KEEPALIVE_S)
            except TimeoutError:
                yield KEEPALIVE


@router.post("/v1/admin/weights", openapi_extra=request_body(WEIGHTS_SCHEMA))
async def refresh_weights(request: Request) -> dict[str, Any]:
    """Load the trainer's new weights (with `--lora-name`, its new adapter) into every
    replica and label them `version`."""
    proxy = _proxy(request)
    proxy.principal(request, auth.ADMIN_ONLY)
    weights_dir, version = decode_weights_body(await request.body())
    # Everything is checked before any replica is paused (`weights.py` has the rules).
    folder = await asyncio.to_thread(proxy.check_weights, weights_dir)
    started = time.monotonic()
    async with proxy.refresh_lock:
        checked = check_version(version, folder, await proxy.store.last_weights())
        loaded = await proxy.replicas.refresh_weights(folder, checked)
        await proxy.store.save_weights(folder, checked)
    seconds = time.monotonic() - started
    proxy.telemetry.refreshed(seconds)
    return {"version": checked, "seconds": seconds, "replicas": loaded}


@router.get("/health")
async def health(request: Request) -> dict[str, Any]:
    """200 while the proxy runs (it still answers sessions, rewards and trajectories);
    `status` says whether vLLM replicas can take requests: ok, degraded (some) or down."""
    replicas = _proxy(request).replicas.describe()
    up = sum(r["healthy"] for r in replicas)
    status = "ok" if up == len(replicas) else "degraded" if up else "down"
    return {"status": status, "replicas": replicas}
