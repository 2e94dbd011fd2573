"""A recording tap between a front-end and vLLM: the ground truth of what vLLM saw and sampled.

`bench/peers.py` puts one in front of the real vLLM and every system it compares behind it,
so that each system's record is checked against the same witness: for every generation call,
the prompt ids vLLM was given and the ids and logprobs it returned. It relays every route
unchanged except:

- `POST /v1/chat/completions` (the peers, LiteLLM): it asks vLLM for `return_token_ids` and
  `logprobs` too, and takes out of the reply whatever of them the front-end did not ask for,
  so the front-end sees the reply it would have got without the tap (sampling is unchanged:
  neither field touches it);
- `POST /inference/v1/generate` (molt-proxy): the ids are the request's own `token_ids`, the
  reply's `token_ids` and `logprobs`, relayed as they are.

Streamed replies are relayed chunk by chunk and recorded once the stream ends.
`GET /_tap` lists the calls recorded (`{"route", "prompt_ids", "sampled_ids", "logprobs"}`),
in the order they finished; `POST /_tap/clear` forgets them.

    python -m bench.tap --port 8102 --upstream http://127.0.0.1:8101
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import aiohttp
from aiohttp import web

SKIP_HEADERS = {"host", "content-length", "transfer-encoding", "connection", "content-encoding"}


def logprob_values(choice: dict[str, Any]) -> list[float]:
    """The sampled tokens' logprobs of one choice (chunk), in vLLM's `logprobs.content` shape."""
    content = (choice.get("logprobs") or {}).get("content") or []
    return [float(entry["logprob"]) for entry in content]


def strip_chat(body: dict[str, Any], ids: bool, logprobs: bool) -> dict[str, Any]:
    """The chat reply (or chunk) without the fields the tap asked for on the front-end's behalf."""
    if ids:
        body.pop("prompt_token_ids", None)
        for choice in body.get("choices") or []:
            choice.pop("token_ids", None)
    if logprobs:
        for choice in body.get("choices") or []:
            if "logprobs" in choice:
                choice["logprobs"] = None
    return body


def build_app(upstream: str) -> web.Application:
    calls: list[dict[str, Any]] = []
    state: dict[str, aiohttp.ClientSession] = {}

    async def client() -> aiohttp.ClientSession:
        if "session" not in state:
            state["session"] = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        return state["session"]

    async def relay(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in SKIP_HEADERS}
        route = {"/v1/chat/completions": "chat", "/inference/v1/generate": "generate"}.get(request.path)
        body: dict[str, Any] | None = None
        added_ids = added_logprobs = False
        if route and request.method == "POST":
            body = json.loads(raw)
            if route == "chat":
                added_ids = not body.get("return_token_ids")
                added_logprobs = not body.get("logprobs")
                body["return_token_ids"] = True
                body["logprobs"] = True
                raw = json.dumps(body).encode()
        session = await client()
        url = upstream + request.path_qs
        async with session.request(request.method, url, data=raw, headers=headers) as upstream_reply:
            kind = upstream_reply.headers.get("content-type", "")
            if body is None or upstream_reply.status != 200:
                data = await upstream_reply.read()
                return web.Response(body=data, status=upstream_reply.status, content_type=kind.split(";")[0])
            assert route is not None
            call: dict[str, Any] = {"route": route, "prompt_ids": [], "sampled_ids": [], "logprobs": []}
            if route == "generate":
                call["prompt_ids"] = list(body["token_ids"])
            if "text/event-stream" not in kind:
                reply = await upstream_reply.json()
                record(call, reply)
                calls.append(call)
                if route == "chat":
                    reply = strip_chat(reply, added_ids, added_logprobs)
                return web.json_response(reply, status=upstream_reply.status)
            response = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await response.prepare(request)
            buffer = b""
            async for piece in upstream_reply.content.iter_any():
                buffer += piece
                while b"\n\n" in buffer:
                    event, buffer = buffer.split(b"\n\n", 1)
                    line = event.strip()
                    if line.startswith(b"data: ") and line != b"data: [DONE]":
                        chunk = json.loads(line[6:])
                        record(call, chunk)
                        if route == "chat":
                            chunk = strip_chat(chunk, added_ids, added_logprobs)
                        event = b"data: " + json.dumps(chunk).encode()
                    await response.write(event + b"\n\n")
            if buffer:
                await response.write(buffer)
            calls.append(call)
            await response.write_eof()
            return response

    def record(call: dict[str, Any], reply: dict[str, Any]) -> None:
        """Add one reply (or chunk) to the call: prompt ids (chat: the first that has them), sampled
        ids and logprobs of choice 0."""
        if reply.get("prompt_token_ids") and not call["prompt_ids"]:
            call["prompt_ids"] = list(reply["prompt_token_ids"])
        for choice in reply.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            call["sampled_ids"] += list(choice.get("token_ids") or [])
            call["logprobs"] += logprob_values(choice)

    async def list_calls(_: web.Request) -> web.Response:
        return web.json_response(calls)

    async def clear(_: web.Request) -> web.Response:
        calls.clear()
        return web.json_response({})

    async def close(_: web.Application) -> None:
        if "session" in state:
            await state["session"].close()

    app = web.Application(client_max_size=2**30)
    app.router.add_get("/_tap", list_calls)
    app.router.add_post("/_tap/clear", clear)
    app.router.add_route("*", "/{tail:.*}", relay)
    app.on_cleanup.append(close)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True)
    args = parser.parse_args()
    web.run_app(
        build_app(args.upstream.rstrip("/")), host="127.0.0.1", port=args.port, access_log=None, print=None
    )


if __name__ == "__main__":
    main()
