"""`--verify-prompt-ids` (issue 26, item 14): every turn, whole or streamed, is recorded only
on the prompt ids vLLM says it read, and a turn whose echo differs fails as a 502 before
anything is recorded or streamed.

Real parts: the proxy (`serve`'s flags, in process) and a real vLLM on CPU. Between them, on
the one test's say-so, a relay changes one prompt id in the generate requests it forwards,
as a faulty hop between the proxy and vLLM would: vLLM then samples from, and echoes, ids
other than the ones the proxy sent. With the fault off the relay forwards bytes untouched.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import aiohttp
import httpx
from aiohttp import web

from molt_proxy.launcher import free_port

GENERATE = "/inference/v1/generate"
MISMATCH = {
    "error": {
        "message": "vLLM reports prompt ids that differ from the ids the proxy sent",
        "type": "upstream_error",
        "param": None,
        "code": None,
    }
}


class Relay:
    """Forwards every request to `target`; while `corrupt` is set, a generate request's last
    prompt id is replaced by its first. Keeps the generate bodies it forwarded."""

    def __init__(self, target: str):
        self.target = target
        self.corrupt = False
        self.generated: list[dict[str, Any]] = []

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if request.path == GENERATE:
            sent = json.loads(body)
            self.generated.append(sent)
            if self.corrupt:
                ids = sent["token_ids"]
                body = json.dumps({**sent, "token_ids": [*ids[:-1], ids[0]]}).encode()
        headers = {"content-type": request.headers.get("content-type", "application/json")}
        async with aiohttp.ClientSession() as session:
            async with session.request(
                request.method, self.target + request.path_qs, data=body or None, headers=headers
            ) as upstream:
                reply = web.StreamResponse(
                    status=upstream.status,
                    headers={"content-type": upstream.headers.get("content-type", "text/plain")},
                )
                await reply.prepare(request)
                async for piece in upstream.content.iter_any():
                    await reply.write(piece)
                await reply.write_eof()
                return reply


@contextmanager
def relay(target: str) -> Iterator[tuple[Relay, str]]:
    """The relay on a free port, in a thread of its own; yields it and its base URL."""
    port, loop = free_port(), asyncio.new_event_loop()
    forwarding = Relay(target)
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", forwarding.handle)
    runner = web.AppRunner(app, access_log=None)
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
    thread = threading.Thread(target=loop.run_forever, name="relay", daemon=True)
    thread.start()
    try:
        yield forwarding, f"http://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


def _chat(url: str, session: str, content: str, *, stream: bool) -> httpx.Response:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 6,
        "stream": stream,
    }
    return httpx.post(f"{url}/s/{session}/v1/chat/completions", json=body, timeout=120)


def _turns(url: str, session: str) -> list[list[str]]:
    described = httpx.get(f"{url}/v1/sessions/{session}", timeout=30)
    assert described.status_code == 200, described.text
    return [segment["turns"] for segment in described.json()["segments"]]


def test_a_streamed_turn_is_verified_and_a_mismatch_fails_it_as_a_whole_turn_does(
    qwen3_model, qwen3_vllm, start_proxy
):
    with relay(qwen3_vllm.url) as (forwarding, url):
        proxy = start_proxy(qwen3_model, [url])  # with --verify-prompt-ids (conftest)
        streamed = _chat(proxy.url, "verified", "Say hi.", stream=True)
        assert streamed.status_code == 200, streamed.text
        assert streamed.text.rstrip().endswith("data: [DONE]")
        # The streamed generate request asked vLLM to echo its prompt ids, as a whole one does.
        assert [(g["stream"], g["return_token_ids"]) for g in forwarding.generated] == [(True, True)]
        first = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
        assert _turns(proxy.url, "verified") == [[first[0]["id"]]]

        forwarding.corrupt = True
        refused_stream = _chat(proxy.url, "verified", "And again.", stream=True)
        refused_whole = _chat(proxy.url, "verified", "And again.", stream=False)
        anthropic = httpx.post(
            f"{proxy.url}/s/verified/v1/messages",
            json={
                "model": "tiny",
                "max_tokens": 6,
                "stream": True,
                "messages": [{"role": "user", "content": "Hi."}],
            },
            timeout=120,
        )
        assert (refused_stream.status_code, refused_stream.json()) == (502, MISMATCH)
        assert (refused_whole.status_code, refused_whole.json()) == (502, MISMATCH)
        assert (anthropic.status_code, anthropic.json()) == (
            502,
            {"type": "error", "error": {"type": "api_error", "message": MISMATCH["error"]["message"]}},
        )
        assert _turns(proxy.url, "verified") == [[first[0]["id"]]]  # nothing recorded

        forwarding.corrupt = False
        again = _chat(proxy.url, "verified", "And again.", stream=True)
        assert again.status_code == 200, again.text
        assert sum(len(turns) for turns in _turns(proxy.url, "verified")) == 2
