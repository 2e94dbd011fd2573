"""The real proxy app in this process, for tests of what needs no real sampling: validation,
error bodies, auth, races, storage, fuzzing.

Everything is real except vLLM: the FastAPI app, the real Qwen3 tokenizer and chat template,
real SQLite. vLLM is replaced by the instant stand-in of `bench/mock_upstream.py` (same routes
and body shapes as vLLM 0.32), because these tests send thousands of requests and check what
the proxy does with them, not what a model samples. Tests of sampling, exactness and streaming
from real ids run against a real vLLM (`tests/conftest.py`).

Two ways to run it:
- `app_client`: in memory. The app runs on an event loop of its own thread, driven through
  httpx's `ASGITransport` by a plain (sync) `httpx.Client`; the stand-in runs on the same loop
  and the app reaches it through `Upstream`'s client seam, an aiohttp session whose connector
  hands each connection to the stand-in's server protocol over an in-memory pipe
  (`InMemoryConnector`). No port, no uvicorn, nothing to wait for at shutdown. Responses come
  back whole (`ASGITransport` reads a stream to its end).
- `inprocess_proxy` / `serve_app`: served by uvicorn on a loopback port, the stand-in on a port
  of its own, for what needs a URL: an SDK or CLI pointed at it, a test that scripts the
  stand-in by its URL (`POST /_script`), a connection kept alive or cut mid-stream.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import Coroutine, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from functools import cache
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import httpx
import uvicorn
from aiohttp import web
from aiohttp.client_proto import ResponseHandler
from aiohttp.typedefs import Middleware

from bench import mock_upstream
from bench.mock_upstream import build_app as build_mock_vllm
from devtools import tokenizer_source
from molt_proxy.app import create_app
from molt_proxy.config import Settings
from molt_proxy.launcher import Supervisor, VLLMServer, free_port
from molt_proxy.tokenizer import Tokenizer
from molt_proxy.upstream import Upstream

REPLY_TEXT = "Hello there."
MOCK_MAX_MODEL_LEN = 4096
APP_URL = "http://127.0.0.1:8000"
"""Where an `app_client`'s proxy says it is (its settings' host and port; nothing listens)."""
STAND_IN_URL = "http://stand-in-vllm"
"""The in-memory stand-in's name in the proxy's settings and `/health` (nothing resolves it)."""
T = TypeVar("T")


def qwen3_tokenizer_dir() -> Path:
    folder = tokenizer_source("qwen3")
    if folder is None:
        import pytest

        pytest.skip("the real qwen3 tokenizer is not in ../shared/tokenizers")
    return folder


@cache
def loaded_tokenizer(model_dir: str) -> Tokenizer:
    """`model_dir`'s tokenizer, loaded once per test process and shared by every proxy the
    process starts on that model: loading it (with the vocabulary walk `Proxy` does at start)
    takes 2.5 s of CPU, longer than most tests that start a proxy take to run."""
    tokenizer = Tokenizer.load(model_dir)
    tokenizer.max_token_bytes  # noqa: B018
    return tokenizer


@cache
def mock_reply_ids(model_dir: Path) -> tuple[int, ...]:
    """The ids the stand-in vLLM samples: `REPLY_TEXT` followed by `<|im_end|>`."""
    tokenizer = loaded_tokenizer(str(model_dir))
    return (*tokenizer.encode(REPLY_TEXT), tokenizer.hf.convert_tokens_to_ids("<|im_end|>"))


@contextmanager
def mock_vllm(
    model_dir: Path, max_model_len: int = MOCK_MAX_MODEL_LEN, middlewares: Sequence[Middleware] = ()
) -> Iterator[str]:
    """The stand-in vLLM on a free port, in a thread of its own; yields its base URL. It
    always samples `REPLY_TEXT` followed by `<|im_end|>`. `middlewares` (aiohttp's) wrap its
    routes: a test holds a request there, or fails `/health`."""
    reply_ids = list(mock_reply_ids(model_dir))
    port = free_port()
    loop = asyncio.new_event_loop()
    app = build_mock_vllm("tiny", REPLY_TEXT, reply_ids, max_model_len)
    app.middlewares.extend(middlewares)
    runner = web.AppRunner(app, access_log=None)
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
    thread = threading.Thread(target=loop.run_forever, name="mock-vllm", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


def mock_vllm_process(model_dir: Path, log_path: Path) -> VLLMServer:
    """The stand-in vLLM as a child process of its own, wrapped in a `VLLMServer` and spawned
    (not yet waited for): a server that a test can stop, hang or kill, and a `Supervisor`
    relaunch on its port, like a launched vLLM, but that boots in a second."""
    server = VLLMServer("unused", log_path=log_path)
    server.command = [
        sys.executable, mock_upstream.__file__, "--port", str(server.port),
        "--reply-text", REPLY_TEXT, "--reply-ids", ",".join(map(str, mock_reply_ids(model_dir))),
        "--max-model-len", str(MOCK_MAX_MODEL_LEN),
    ]  # fmt: skip
    return server.spawn()


@contextmanager
def serve_app(settings: Settings, supervisors: Mapping[str, Supervisor] | None = None) -> Iterator[str]:
    """`create_app(settings, supervisors)` served by uvicorn in a thread; yields its base URL.
    `supervisors`: by upstream URL, for upstream processes the app is to supervise as `serve`
    supervises the vLLM servers it launched."""
    port = free_port()
    settings = replace(settings, host="127.0.0.1", port=port)
    app = create_app(settings, supervisors, tokenizer=loaded_tokenizer(settings.model))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="molt-proxy", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the in-process proxy failed to start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@contextmanager
def inprocess_proxy(
    db_path: Path, *, max_model_len: int = MOCK_MAX_MODEL_LEN, **settings: object
) -> Iterator[str]:
    """A proxy (real app, real tokenizer, real SQLite at `db_path`) in front of the stand-in
    vLLM, which reports `max_model_len`; yields the proxy's base URL. `settings` override
    `Settings` fields."""
    model = qwen3_tokenizer_dir()
    with mock_vllm(model, max_model_len) as upstream:
        base = Settings(model=str(model), upstreams=[upstream], db_path=db_path)
        with serve_app(replace(base, **settings)) as url:
            yield url


def chat_body(content: str = "hi", **fields: object) -> dict[str, object]:
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], **fields}


def post(url: str, path: str, **kwargs: object) -> httpx.Response:
    return httpx.post(url + path, timeout=60, **kwargs)


# -- in memory ---------------------------------------------------------------------------------


class _Pipe(asyncio.Transport):
    """One end of an in-memory connection: what is written here reaches the protocol at the
    other end, in order, on the loop's next turns; closing either end closes both."""

    def __init__(self, loop: asyncio.AbstractEventLoop, protocol: asyncio.BaseProtocol):
        super().__init__()
        self._loop, self._protocol = loop, protocol
        self.other: _Pipe | None = None
        self._closing = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if data and not self._closing and self.other is not None:
            self._loop.call_soon(self.other._received, bytes(data))

    def _received(self, data: bytes) -> None:
        if not self._closing:
            self._protocol.data_received(data)  # type: ignore[attr-defined]

    def close(self) -> None:
        if not self._closing:
            self._closing = True
            self._loop.call_soon(self._protocol.connection_lost, None)
            if self.other is not None:
                self._loop.call_soon(self.other.close)

    def abort(self) -> None:
        self.close()

    def is_closing(self) -> bool:
        return self._closing

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 0), "sockname": ("127.0.0.1", 0)}.get(name, default)

    # No flow control: both ends are in this process and every body is small.
    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def is_reading(self) -> bool:
        return not self._closing

    def get_write_buffer_size(self) -> int:
        return 0

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass

    def can_write_eof(self) -> bool:
        return False


class InMemoryConnector(aiohttp.BaseConnector):
    """An aiohttp connector whose every connection is an in-memory pipe to `server` (an aiohttp
    `web.Server`: `AppRunner.server`), on the same event loop: the client side is aiohttp's own
    protocol, as over TCP, so the proxy's `Upstream` runs unchanged. (`_create_connection` is
    the hook aiohttp's own TCP and Unix connectors implement.)"""

    def __init__(self, server: web.Server):
        super().__init__(limit=0)
        self._server = server

    async def _create_connection(self, req: Any, traces: Any, timeout: Any) -> ResponseHandler:
        client, server = self._factory(), self._server()
        client_end, server_end = _Pipe(self._loop, client), _Pipe(self._loop, server)
        client_end.other, server_end.other = server_end, client_end
        server.connection_made(server_end)
        client.connection_made(client_end)
        return client


class _LoopThread:
    """An event loop running in a thread of its own, for sync tests to hand coroutines to."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="molt-proxy-app", daemon=True)
        self._thread.start()

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()


class AppTransport(httpx.BaseTransport):
    """A sync httpx transport into an ASGI app on `loop`'s thread (httpx's `ASGITransport`,
    which is async only, run there): sync tests, and threads racing each other, call the app
    as they would over HTTP."""

    def __init__(self, app: Any, loop: _LoopThread):
        self._asgi = httpx.ASGITransport(app)
        self._loop = loop

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        body = request.read()

        async def call() -> tuple[int, httpx.Headers, bytes]:
            forwarded = httpx.Request(request.method, request.url, headers=request.headers, content=body)
            response = await self._asgi.handle_async_request(forwarded)
            return response.status_code, response.headers, await response.aread()

        status, headers, content = self._loop.run(call())
        return httpx.Response(status, headers=headers, content=content, request=request)


@contextmanager
def app_client(
    db_path: Path, *, max_model_len: int = MOCK_MAX_MODEL_LEN, **settings: object
) -> Iterator[httpx.Client]:
    """`inprocess_proxy`'s proxy in memory (see the module's docstring): a client whose base
    URL is the proxy's (`APP_URL`); any absolute URL it is given (a session's `base_url`) is
    sent to the app too. `settings` override `Settings` fields."""
    model = qwen3_tokenizer_dir()
    base = Settings(model=str(model), upstreams=[STAND_IN_URL], db_path=db_path, host="127.0.0.1", port=8000)
    chosen = replace(base, **settings)
    stand_in = build_mock_vllm("tiny", REPLY_TEXT, list(mock_reply_ids(model)), max_model_len)
    runner = web.AppRunner(stand_in, access_log=None)
    loop = _LoopThread()

    async def start() -> Any:
        await runner.setup()
        upstream = Upstream(
            STAND_IN_URL,
            session=lambda: aiohttp.ClientSession(connector=InMemoryConnector(runner.server)),
            lora_name=chosen.lora_name,
        )
        app = create_app(chosen, upstreams=[upstream], tokenizer=loaded_tokenizer(chosen.model))
        lifespan = app.router.lifespan_context(app)
        await lifespan.__aenter__()
        return app, lifespan

    async def stop(lifespan: Any) -> None:
        try:
            await lifespan.__aexit__(None, None, None)
        finally:
            await runner.cleanup()

    try:
        app, lifespan = loop.run(start())
        try:
            with httpx.Client(base_url=APP_URL, transport=AppTransport(app, loop), timeout=60) as client:
                yield client
        finally:
            loop.run(stop(lifespan))
    finally:
        loop.close()
