"""The FastAPI app: thin handlers, wiring, and the single error → OpenAI body mapping."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from molt_proxy import auth
from molt_proxy.completions import OFF_LOOP_BYTES, Caller, Completions
from molt_proxy.config import Settings
from molt_proxy.errors import BadRequest, Conflict, MoltError, NotFound, PayloadTooLarge, UpstreamUnavailable
from molt_proxy.parsing import ReplyParser
from molt_proxy.replicas import Replicas, Supervision
from molt_proxy.sessions import Sessions, unknown_session
from molt_proxy.store import Store
from molt_proxy.tokenizer import Tokenizer
from molt_proxy.types import SessionStatus, Trajectory
from molt_proxy.upstream import Upstream
from molt_proxy.weights import check_version, check_weights_dir
from molt_proxy.wire.control import CHAT_SCHEMA, SESSION_SCHEMA, WEIGHTS_SCHEMA, RewardBody, request_body
from molt_proxy.wire.jsonbody import INT64_MAX, decode_json_object
from molt_proxy.wire.openai import decode_chat_request

log = logging.getLogger(__name__)

_STREAM_KEEPALIVE_S = 15.0


class BodyLimit:
    """Reject request bodies over `limit` bytes with 413, before they are buffered whole."""

    def __init__(self, app: ASGIApp, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await _send_error(send, PayloadTooLarge(f"the request body is over {self.limit} bytes"))
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise PayloadTooLarge(f"the request body is over {self.limit} bytes")
            return message

        await self.app(scope, limited, send)


async def _send_error(send: Send, error: MoltError) -> None:
    payload = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


class Proxy:
    """Everything a handler needs, built once at startup."""

    def __init__(self, settings: Settings, supervisors: Mapping[str, Supervision] | None = None):
        self.settings = settings
        self.keys = auth.Keys(settings.admin_key, settings.agent_keys)
        self.store = Store(settings.db_path)
        self.tokenizer = Tokenizer.load(settings.model)
        self.replicas = Replicas(
            [Upstream(url, timeout_s=settings.upstream_timeout_s) for url in settings.upstreams],
            health_interval_s=settings.health_interval_s,
            health_timeout_s=settings.health_timeout_s,
            supervisors=supervisors,  # the vLLM servers `serve` launched: the watcher relaunches them
        )
        self.finalized = asyncio.Condition()
        self.refresh_lock = asyncio.Lock()
        self.sessions: Sessions
        self.completions: Completions

    async def start(self) -> None:
        await self.store.open()
        await self.replicas.start(await self._loadable_weights())
        self.sessions = Sessions(self.store, self.tokenizer, self.settings.model)
        await self.sessions.recover()
        self.completions = Completions(
            self.sessions,
            self.tokenizer,
            ReplyParser(self.tokenizer, self.settings.tool_call_parser, self.settings.reasoning_parser),
            self.replicas,
            verify_prompt_ids=self.settings.verify_prompt_ids,
            sampling_pins=self.settings.sampling,
        )

    async def _loadable_weights(self) -> tuple[str, int] | None:
        """The last weights loaded, if their folder is still whole (the trainer prunes old ones,
        and a replica must not be held back waiting for weights that are gone)."""
        weights = await self.store.last_weights()
        if weights is None:
            return None
        try:
            check_weights_dir(weights[0])
        except BadRequest:
            log.warning("the last weights loaded (%s, version %d) are gone; not reloading them", *weights)
            return None
        return weights

    async def close_session(
        self, session_id: str, reward: float | None, info: dict[str, Any], status: SessionStatus
    ) -> list[Trajectory]:
        trajectories = await self.sessions.close(session_id, reward, info, status)
        self.replicas.release(session_id)
        async with self.finalized:
            self.finalized.notify_all()
        return trajectories

    async def expire_idle_sessions(self) -> None:
        """Close sessions without a turn for `session_ttl_s` as unrewarded: kept, marked, and
        skipped by the trainer, so an agent that crashed does not hold its group forever."""
        ttl = self.settings.session_ttl_s
        while True:
            await asyncio.sleep(min(ttl / 4, 60.0))
            for session_id in self.sessions.idle_since(time.time() - ttl):
                info = {"closed_by": "ttl", "ttl_s": ttl}
                try:
                    await self.close_session(session_id, None, info, SessionStatus.UNREWARDED)
                except (NotFound, Conflict):
                    pass  # rewarded meanwhile
                except Exception:  # the sweep must outlive one failed close; it retries next time
                    log.exception("closing idle session %s failed", session_id)

    async def stop(self) -> None:
        await self.replicas.stop()
        await self.store.close()

    def principal(self, request: Request, allowed: frozenset[auth.Role]) -> auth.Principal:
        """Who the caller's key says it is, if it may use a route of kind `allowed`; the first
        thing a guarded handler does."""

        def session_of(key_hash: str) -> str | None:
            session = self.sessions.by_key_id(key_hash)
            return session.id if session is not None else None

        return self.keys.principal(request.headers, allowed, session_of)


def create_app(settings: Settings, supervisors: Mapping[str, Supervision] | None = None) -> FastAPI:
    """`supervisors`: by URL, for the vLLM servers `serve` launched (`launcher.Supervisor`)."""
    proxy = Proxy(settings, supervisors)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await proxy.start()
        expiry = asyncio.create_task(proxy.expire_idle_sessions())
        try:
            yield
        finally:
            expiry.cancel()
            await proxy.stop()

    app = FastAPI(title="molt-proxy", lifespan=lifespan)
    app.state.proxy = proxy
    _install_error_handlers(app)
    app.add_middleware(BodyLimit, limit=settings.max_request_bytes)

    async def chat(request: Request, path_session: str | None) -> dict[str, Any] | StreamingResponse:
        principal = proxy.principal(request, auth.CHAT)
        body = await request.body()
        # A large body decodes in a worker thread, as it renders and tokenizes there (completions.py).
        call = (
            decode_chat_request(body)
            if len(body) < OFF_LOOP_BYTES
            else await asyncio.to_thread(decode_chat_request, body)
        )
        key = auth.presented_key(request.headers)
        session_id = path_session or request.headers.get("x-session-id")
        if session_id is None and not (principal is auth.OPEN and key and proxy.sessions.by_key(key)):
            session_id = _metadata_session(call.metadata)
        session_id = auth.chat_session(principal, session_id)
        group_id = request.headers.get("x-group-id") or None
        # Only an open proxy looks a session key up at the turn; with keys on, `principal` has.
        open_key = key if session_id is None and principal is auth.OPEN else None
        caller = Caller(session_id, open_key, group_id, principal)
        if not call.request.stream:
            return await proxy.completions.complete(caller, call, body)
        events = proxy.completions.stream(caller, call, body)
        first = await anext(events)  # errors before vLLM answers become plain error responses

        async def all_events() -> AsyncIterator[str]:
            yield first
            async for event in events:
                yield event
                # Reading ids vLLM already sent and writing to the client need not suspend, so
                # without this a fast vLLM keeps the loop from ever seeing that the client
                # left (Starlette learns it in a task of its own) and the turn runs to its end.
                await asyncio.sleep(0)

        return StreamingResponse(all_events(), media_type="text/event-stream")

    @app.post("/v1/chat/completions", response_model=None, openapi_extra=request_body(CHAT_SCHEMA))
    async def chat_completions(request: Request) -> dict[str, Any] | StreamingResponse:
        return await chat(request, None)

    @app.post(
        "/s/{session_id}/v1/chat/completions", response_model=None, openapi_extra=request_body(CHAT_SCHEMA)
    )
    async def session_chat_completions(
        session_id: str, request: Request
    ) -> dict[str, Any] | StreamingResponse:
        return await chat(request, session_id)

    @app.get("/v1/models")
    @app.get("/s/{session_id}/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": await proxy.replicas.models()}

    @app.post("/v1/sessions", status_code=201, openapi_extra=request_body(SESSION_SCHEMA, required=False))
    async def create_session(request: Request) -> dict[str, Any]:
        principal = proxy.principal(request, auth.CREATE)
        body = await _json_object(request, allow_empty=True)
        key = auth.new_session_key()
        session = await proxy.sessions.create(
            _optional_str(body, "session_id"),
            _optional_str(body, "group_id"),
            key_hash=auth.key_id(key),
            owner=principal.owner,
        )
        base = str(request.base_url).rstrip("/")
        return {
            "session_id": session.id,
            "group_id": session.group_id,
            "api_key": key,  # shown once: the proxy keeps only its hash
            "base_url": f"{base}/s/{session.id}/v1",
        }

    @app.get("/v1/sessions/{session_id}")
    async def get_session(session_id: str, request: Request) -> dict[str, Any]:
        principal = proxy.principal(request, auth.CHAT)
        return proxy.sessions.get(session_id, principal).describe()

    @app.post("/v1/rewards", openapi_extra=request_body(RewardBody.model_json_schema()))
    async def post_reward(request: Request) -> dict[str, Any]:
        """`{session_id | completion_id, reward, final = true, info}`: a final reward closes the
        session; `final: false` with a `completion_id` rewards that one turn."""
        principal = proxy.principal(request, auth.CHAT)
        body = RewardBody.decode(await request.body())
        session_id, completion_id = body.session_id, body.completion_id
        reward, final, info = body.reward, body.final, body.info
        if completion_id is not None:
            session_id = await proxy.sessions.of_completion(completion_id, principal)
        elif not await proxy.sessions.visible(session_id, principal):
            raise unknown_session(session_id)  # as for an id that does not exist: no probing
        if not final:
            if completion_id is None:
                raise BadRequest("a per-turn reward ('final': false) needs a 'completion_id'", param="final")
            await proxy.sessions.reward_turn(completion_id, float(reward))
            return {"session_id": session_id, "completion_id": completion_id, "status": "open"}
        trajectories = await proxy.close_session(session_id, float(reward), info, SessionStatus.REWARDED)
        return {
            "session_id": session_id,
            "status": SessionStatus.REWARDED.value,
            "trajectories": [{"seq": t.seq, "trajectory_id": t.trajectory_id} for t in trajectories],
        }

    @app.get("/v1/trajectories", response_model=None)
    async def trajectories(
        request: Request,
        after: int = Query(0, ge=0, le=INT64_MAX),
        limit: int = Query(100, ge=1, le=10_000),
    ) -> dict[str, Any] | StreamingResponse:
        proxy.principal(request, auth.ADMIN_ONLY)
        if "text/event-stream" in request.headers.get("accept", ""):
            return StreamingResponse(_stream(after, limit), media_type="text/event-stream")
        data = await proxy.store.trajectories_after(after, limit)
        return {"object": "list", "data": data, "last_seq": data[-1]["seq"] if data else after}

    async def _stream(after: int, limit: int) -> AsyncIterator[str]:
        cursor = after
        while True:
            batch = await proxy.store.trajectories_after(cursor, limit)
            for trajectory in batch:
                cursor = trajectory["seq"]
                yield f"id: {cursor}\nevent: trajectory\ndata: {json.dumps(trajectory)}\n\n"
            if batch:
                continue
            async with proxy.finalized:
                try:
                    await asyncio.wait_for(proxy.finalized.wait(), _STREAM_KEEPALIVE_S)
                except TimeoutError:
                    yield ": keepalive\n\n"

    @app.post("/v1/admin/weights", openapi_extra=request_body(WEIGHTS_SCHEMA))
    async def refresh_weights(request: Request) -> dict[str, Any]:
        """Load the trainer's new weights into every replica and label them `version`."""
        proxy.principal(request, auth.ADMIN_ONLY)
        body = await _json_object(request)
        weights_dir = _optional_str(body, "path")
        version = body.get("version")
        if weights_dir is None:
            raise BadRequest("'path' is required", param="path")
        # Everything is checked before any replica is paused (`weights.py` has the rules).
        folder = await asyncio.to_thread(check_weights_dir, weights_dir)
        started = time.monotonic()
        async with proxy.refresh_lock:
            version = check_version(version, folder, await proxy.store.last_weights())
            loaded = await proxy.replicas.refresh_weights(folder, version)
            await proxy.store.save_weights(folder, version)
        return {"version": version, "seconds": time.monotonic() - started, "replicas": loaded}

    @app.get("/health")
    async def health() -> dict[str, Any]:
        """200 while the proxy runs (it still answers sessions, rewards and trajectories);
        `status` says whether vLLM replicas can take requests: ok, degraded (some) or down."""
        replicas = proxy.replicas.describe()
        up = sum(r["healthy"] for r in replicas)
        status = "ok" if up == len(replicas) else "degraded" if up else "down"
        return {"status": status, "replicas": replicas}

    return app


async def _json_object(request: Request, allow_empty: bool = False) -> dict[str, Any]:
    return decode_json_object(await request.body(), allow_empty=allow_empty)


def _metadata_session(metadata: dict[str, Any]) -> str | None:
    value = metadata.get("session_id")
    if value is not None and (not isinstance(value, str) or not value):
        raise BadRequest("'metadata.session_id' must be a non-empty string", param="metadata.session_id")
    return value


def _optional_str(body: dict[str, Any], key: str) -> str | None:
    value = body.get(key)
    if value is not None and (not isinstance(value, str) or not value):
        raise BadRequest(f"'{key}' must be a non-empty string", param=key)
    return value


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(MoltError)
    async def molt_error(request: Request, exc: MoltError) -> JSONResponse:
        headers = None
        if isinstance(exc, UpstreamUnavailable):  # no replica up: the next probe may bring one back
            headers = {"Retry-After": str(int(request.app.state.proxy.settings.health_interval_s) + 1)}
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        error = exc.errors()[0]
        param = ".".join(str(p) for p in error["loc"][1:]) or None
        return JSONResponse(
            BadRequest(f"invalid '{param}': {error['msg']}", param=param).body(), status_code=400
        )

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        body = {"error": {"message": str(exc.detail), "type": kind, "param": None, "code": None}}
        return JSONResponse(body, status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        # A bug, not the caller's fault: the details go to the log, never to the client (an
        # exception's repr may quote a whole prompt).
        log.error("internal error on %s %s", request.method, request.url.path, exc_info=exc)
        return JSONResponse(MoltError("internal error").body(), status_code=500)
