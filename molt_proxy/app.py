"""The FastAPI app: thin handlers, wiring, and the single error → OpenAI body mapping."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from molt_proxy.completions import Caller, Completions
from molt_proxy.config import Settings
from molt_proxy.errors import BadRequest, Conflict, MoltError, NotFound, PayloadTooLarge, Unauthorized
from molt_proxy.parsing import ReplyParser
from molt_proxy.replicas import Replicas
from molt_proxy.sessions import Session, Sessions
from molt_proxy.store import Store
from molt_proxy.tokenizer import Tokenizer
from molt_proxy.types import SessionStatus, Trajectory
from molt_proxy.upstream import Upstream
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


def _bearer(request: Request) -> str | None:
    value = request.headers.get("authorization", "")
    return value[7:].strip() if value.lower().startswith("bearer ") else None


class Proxy:
    """Everything a handler needs, built once at startup."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.store = Store(settings.db_path)
        self.tokenizer = Tokenizer.load(settings.model)
        self.replicas = Replicas(
            [Upstream(url, timeout_s=settings.upstream_timeout_s) for url in settings.upstreams],
            health_interval_s=settings.health_interval_s,
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

    def authorize(self, request: Request, session: Session | None = None) -> None:
        """Admin routes: the admin key, or a session's own key for that session."""
        if self.settings.admin_key is None:
            return
        key = _bearer(request)
        if key == self.settings.admin_key or (session is not None and key and key == session.api_key):
            return
        raise Unauthorized("this route needs the admin key (or the session's own key)")


def create_app(settings: Settings) -> FastAPI:
    proxy = Proxy(settings)

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
        body = await request.body()
        call = decode_chat_request(body)
        key = _bearer(request)
        session_id = path_session or request.headers.get("x-session-id")
        if session_id is None and not (key and proxy.sessions.by_key(key)):
            session_id = _metadata_session(call.metadata)
        group_id = request.headers.get("x-group-id") or None
        caller = Caller(session_id, key if session_id is None else None, group_id)
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

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(request: Request) -> dict[str, Any] | StreamingResponse:
        return await chat(request, None)

    @app.post("/s/{session_id}/v1/chat/completions", response_model=None)
    async def session_chat_completions(
        session_id: str, request: Request
    ) -> dict[str, Any] | StreamingResponse:
        return await chat(request, session_id)

    @app.get("/v1/models")
    @app.get("/s/{session_id}/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": await proxy.replicas.models()}

    @app.post("/v1/sessions", status_code=201)
    async def create_session(request: Request) -> dict[str, Any]:
        proxy.authorize(request)
        body = await _json_object(request, allow_empty=True)
        session = await proxy.sessions.create(
            _optional_str(body, "session_id"), _optional_str(body, "group_id"), with_key=True
        )
        base = str(request.base_url).rstrip("/")
        return {
            "session_id": session.id,
            "group_id": session.group_id,
            "api_key": session.api_key,
            "base_url": f"{base}/s/{session.id}/v1",
        }

    @app.get("/v1/sessions/{session_id}")
    async def get_session(session_id: str, request: Request) -> dict[str, Any]:
        session = proxy.sessions.get(session_id)
        proxy.authorize(request, session)
        return session.describe()

    @app.post("/v1/rewards")
    async def post_reward(request: Request) -> dict[str, Any]:
        """`{session_id | completion_id, reward, final = true, info}`: a final reward closes the
        session; `final: false` with a `completion_id` rewards that one turn."""
        body = await _json_object(request)
        session_id = _optional_str(body, "session_id")
        completion_id = _optional_str(body, "completion_id")
        if (session_id is None) == (completion_id is None):
            raise BadRequest("give exactly one of 'session_id' and 'completion_id'", param="session_id")
        reward = body.get("reward")
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise BadRequest("'reward' must be a finite number", param="reward")
        final = body.get("final", True)
        if not isinstance(final, bool):
            raise BadRequest("'final' must be a boolean", param="final")
        info = body.get("info", {})
        if not isinstance(info, dict):
            raise BadRequest("'info' must be an object", param="info")
        if completion_id is not None:
            session_id = await proxy.sessions.of_completion(completion_id)
        proxy.authorize(request, proxy.sessions.find(session_id))
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
        after: int = Query(0, ge=0),
        limit: int = Query(100, ge=1, le=10_000),
    ) -> dict[str, Any] | StreamingResponse:
        proxy.authorize(request)
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

    @app.post("/v1/admin/weights")
    async def refresh_weights(request: Request) -> dict[str, Any]:
        """Load the trainer's new weights into every replica and label them `version`."""
        proxy.authorize(request)
        body = await _json_object(request)
        weights_dir = _optional_str(body, "path")
        version = body.get("version")
        if weights_dir is None:
            raise BadRequest("'path' is required", param="path")
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise BadRequest("'version' must be a non-negative integer", param="version")
        check_weights_dir(weights_dir)
        started = time.monotonic()
        async with proxy.refresh_lock:
            loaded = await proxy.replicas.refresh_weights(weights_dir, version)
            await proxy.store.save_weights(weights_dir, version)
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


def check_weights_dir(path: str) -> None:
    """A failed reload leaves a vLLM engine dead on its next request (DESIGN §5), so refuse
    anything that is not a complete safetensors checkpoint before touching a replica."""
    folder = Path(path)
    if not folder.is_absolute():
        raise BadRequest("'path' must be absolute: vLLM resolves it in its own directory", param="path")
    if not (folder / "config.json").is_file() or not any(folder.glob("*.safetensors")):
        raise BadRequest(f"{path} has no config.json and *.safetensors weights", param="path")


async def _json_object(request: Request, allow_empty: bool = False) -> dict[str, Any]:
    body = await request.body()
    if allow_empty and not body.strip():
        return {}
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise BadRequest("the request body must be a JSON object")
    return data


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
    async def molt_error(_: Request, exc: MoltError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

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
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(MoltError(f"internal error: {exc!r}").body(), status_code=500)
