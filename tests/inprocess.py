"""The real proxy app in this process, for tests of what needs no real sampling: validation,
error bodies, auth, races, storage, fuzzing.

Everything is real except vLLM: the FastAPI app served by uvicorn on a loopback port, the real
Qwen3 tokenizer and chat template, real SQLite. vLLM is replaced by the instant stand-in of
`bench/mock_upstream.py` (same routes and body shapes as vLLM 0.32), because these tests send
thousands of requests and check what the proxy does with them, not what a model samples.
Tests of sampling, exactness and streaming from real ids run against a real vLLM
(`tests/conftest.py`).
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from functools import cache
from pathlib import Path

import httpx
import uvicorn
from aiohttp import web
from aiohttp.typedefs import Middleware

from bench import mock_upstream
from bench.mock_upstream import build_app as build_mock_vllm
from devtools import tokenizer_source
from molt_proxy.app import create_app
from molt_proxy.config import Settings
from molt_proxy.launcher import Supervisor, VLLMServer, free_port
from molt_proxy.tokenizer import Tokenizer

REPLY_TEXT = "Hello there."
MOCK_MAX_MODEL_LEN = 4096


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
