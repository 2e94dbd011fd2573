"""The FastAPI app: the proxy (`proxy.py`) and its routes (`routes.py`) put together, the
request body limit, and the single error → body mapping: OpenAI's, Anthropic's on the
Anthropic routes (`/v1/messages...`) and Google's on the Gemini routes (`/v1beta/...`), where
those clients read errors."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from molt_proxy.advantages import router as advantages_router
from molt_proxy.browsers import BrowserGuard, BrowserPolicy
from molt_proxy.config import Settings
from molt_proxy.errors import BadRequest, MoltError, NotFound, PayloadTooLarge, UpstreamUnavailable
from molt_proxy.proxy import Proxy
from molt_proxy.replicas import Supervision, UpstreamClient
from molt_proxy.routes import router
from molt_proxy.routes_gemini import router as gemini_router
from molt_proxy.routes_responses import router as responses_router
from molt_proxy.telemetry import Instrument
from molt_proxy.telemetry import router as telemetry_router
from molt_proxy.tokenizer import Tokenizer
from molt_proxy.transfer import router as transfer_router
from molt_proxy.viewer import install_docs
from molt_proxy.viewer import router as viewer_router
from molt_proxy.wire.anthropic_reply import error_body as anthropic_error_body
from molt_proxy.wire.gemini_reply import error_body as gemini_error_body
from molt_proxy.wire.gemini_reply import error_status as gemini_error_status
from molt_proxy.wire.gemini_reply import http_error_body as gemini_http_error_body

log = logging.getLogger(__name__)


class BodyLimit:
    """Reject request bodies over `limit` bytes with 413, before they are buffered whole."""

    def __init__(self, app: ASGIApp, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            error = PayloadTooLarge(f"the request body is over {self.limit} bytes")
            return await _send_error(send, error, scope["path"])
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise PayloadTooLarge(f"the request body is over {self.limit} bytes")
            return message

        await self.app(scope, limited, send)


async def _send_error(send: Send, error: MoltError, path: str) -> None:
    status, body = _error(error, path)
    payload = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


def create_app(
    settings: Settings,
    supervisors: Mapping[str, Supervision] | None = None,
    upstreams: Sequence[UpstreamClient] = (),
    tokenizer: Tokenizer | None = None,
) -> FastAPI:
    """`supervisors`: by URL, for the vLLM servers `serve` launched (`launcher.Supervisor`);
    `upstreams`: replicas built by `serve` itself (Ray actors), else one per settings URL;
    `tokenizer`: `settings.model`'s, if the caller has it loaded already."""
    proxy = Proxy(settings, supervisors, upstreams, tokenizer)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with proxy.running():
            yield

    # /docs from local files (`viewer.py`); ReDoc would need a CDN.
    app = FastAPI(title="molt-proxy", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.proxy = proxy
    _install_error_handlers(app)
    app.add_middleware(BodyLimit, limit=settings.max_request_bytes)
    policy = BrowserPolicy(settings.host, settings.allowed_origins, settings.allowed_hosts)
    app.add_middleware(BrowserGuard, policy=policy, refuse=_send_error)
    app.add_middleware(Instrument, telemetry=proxy.telemetry)  # outermost: it sees BodyLimit's 413s
    app.include_router(router)
    app.include_router(responses_router)
    app.include_router(gemini_router)
    app.include_router(telemetry_router)
    app.include_router(transfer_router)
    app.include_router(viewer_router)
    app.include_router(advantages_router)
    install_docs(app)
    return app


def _error(error: MoltError, path: str) -> tuple[int, dict[str, Any]]:
    """The status and body of an error on `path`: Anthropic's shape on its routes, Google's on
    the Gemini routes."""
    if "/v1/messages" in path:
        return error.anthropic_status or error.status, anthropic_error_body(error)
    if _gemini(path):
        return gemini_error_status(error), gemini_error_body(error)
    return error.status, error.body()


def _gemini(path: str) -> bool:
    return path.startswith("/v1beta/") or (path.startswith("/s/") and "/v1beta/" in path)


def _respond(request: Request, error: MoltError, headers: dict[str, str] | None = None) -> JSONResponse:
    status, body = _error(error, request.url.path)
    return JSONResponse(body, status_code=status, headers=headers)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(MoltError)
    async def molt_error(request: Request, exc: MoltError) -> JSONResponse:
        headers = None
        if isinstance(exc, UpstreamUnavailable):  # no replica up: the next probe may bring one back
            headers = {"Retry-After": str(int(request.app.state.proxy.settings.health_interval_s) + 1)}
        return _respond(request, exc, headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        error = exc.errors()[0]
        param = ".".join(str(p) for p in error["loc"][1:]) or None
        return _respond(request, BadRequest(f"invalid '{param}': {error['msg']}", param=param))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        if exc.status_code == 404 and request.scope.get("endpoint") is None:  # no route matched
            return _respond(request, _unserved(request))
        if exc.status_code == 405 and _gemini(request.url.path):  # Google's: no such method
            return _respond(request, _unserved(request))
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        if "/v1/messages" in request.url.path:
            error = {"type": "error", "error": {"type": kind, "message": str(exc.detail)}}
            return JSONResponse(error, status_code=exc.status_code)
        if _gemini(request.url.path):
            return JSONResponse(
                gemini_http_error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code
            )
        body = {"error": {"message": str(exc.detail), "type": kind, "param": None, "code": None}}
        return JSONResponse(body, status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        # A bug, not the caller's fault: the details go to the log, never to the client (an
        # exception's repr may quote a whole prompt).
        log.error("internal error on %s %s", request.method, request.url.path, exc_info=exc)
        return _respond(request, MoltError("internal error"))


def _unserved(request: Request) -> NotFound:
    """A request for a route the proxy does not serve (an API it has not built, such as
    `/v1/embeddings`): the answer names the routes it does serve, so a client pointed at the
    wrong API learns what to call instead of a bare "Not Found"."""
    served = ", ".join(
        f"{method} {route.path}"
        for route in request.app.routes
        if isinstance(route, APIRoute)
        for method in sorted(route.methods)
    )
    asked = f"{request.method} {request.url.path}"[:200]
    return NotFound(f"molt-proxy does not serve {asked}; it serves {served}")
