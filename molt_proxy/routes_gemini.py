"""The Gemini API's routes: `POST /v1beta/models/{model}:generateContent`,
`:streamGenerateContent` and `:countTokens` (under `/v1beta/` and `/s/<session>/v1beta/`), and
`GET /v1beta/models` and `/v1beta/models/{model}`.

A `generateContent` is the same turn as a chat completion (`completions.Turn`), decoded and
encoded by `wire/gemini*.py`. Google's clients send their key as `x-goog-api-key` (read as any
key is, `auth.presented_key`) or as `?key=`, which is read here as the header it stands for.
`streamGenerateContent?alt=sse` streams `data:` chunks; without `alt=sse` the same chunks go
out as the elements of one JSON array, streamed, as Google's API sends them.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

from fastapi import APIRouter, Request, Response

from molt_proxy.errors import NotFound
from molt_proxy.routes import _json, _proxy, asked, chat_route, streamed
from molt_proxy.wire.gemini import GENERATE_SCHEMA, decode_count_request, decode_generate_request
from molt_proxy.wire.gemini_reply import count_body, encode_response, encode_stream, model_body

router = APIRouter()


def _query_key(request: Request) -> None:
    """`?key=` as the `x-goog-api-key` header it stands for, unless the request sends a key
    header."""
    key = request.query_params.get("key")
    names = {name for name, _ in request.scope["headers"]}
    if key and not names & {b"x-goog-api-key", b"x-api-key", b"authorization"}:
        request.scope["headers"] = [*request.scope["headers"], (b"x-goog-api-key", key.encode())]
        vars(request).pop("_headers", None)  # Starlette's cached reading of the old ones


async def _array(lines: AsyncGenerator[str]) -> AsyncGenerator[str]:
    """`data:` chunks as the elements of one JSON array (a stream without `alt=sse`)."""
    first = True
    async with aclosing(lines):
        async for line in lines:
            yield ("[" if first else ",\r\n") + line.removeprefix("data: ").rstrip("\n")
            first = False
    yield "]" if not first else "[]"


async def _generate(request: Request, model: str, path_session: str | None, stream: bool) -> Response:
    """`generateContent` / `streamGenerateContent`: the turn, in Google's shapes."""
    _query_key(request)
    chat = await asked(request)
    call = await chat.work.run(decode_generate_request, chat.body, model)
    turn = chat.turn(chat.caller(None, path_session), call.conversation)
    tokenizer = chat.proxy.tokenizer

    def count(text: str) -> int:
        return len(tokenizer.encode(text))

    if not stream:
        answer = await turn.whole()
        return _json(encode_response(answer.reply, call.include_thoughts, count))
    lines = encode_stream(turn.stream(), call.include_thoughts, count)
    if request.query_params.get("alt") == "sse":
        return await streamed(lines)
    return await streamed(_array(lines), media_type="application/json")


async def _count(request: Request, model: str, path_session: str | None) -> Response:
    """`countTokens`: the exact number of prompt ids the proxy would send."""
    _query_key(request)
    chat = await asked(request)
    conversation = await chat.work.run(decode_count_request, chat.body, model)
    turn = chat.turn(chat.caller(None, path_session), conversation)
    return _json(count_body(await turn.count()))


@chat_route(router, "/v1beta/models/{model}:generateContent", GENERATE_SCHEMA)
async def generate_content(model: str, request: Request) -> Response:
    return await _generate(request, model, None, stream=False)


@chat_route(router, "/s/{session_id}/v1beta/models/{model}:generateContent", GENERATE_SCHEMA)
async def session_generate_content(session_id: str, model: str, request: Request) -> Response:
    return await _generate(request, model, session_id, stream=False)


@chat_route(router, "/v1beta/models/{model}:streamGenerateContent", GENERATE_SCHEMA)
async def stream_generate_content(model: str, request: Request) -> Response:
    return await _generate(request, model, None, stream=True)


@chat_route(router, "/s/{session_id}/v1beta/models/{model}:streamGenerateContent", GENERATE_SCHEMA)
async def session_stream_generate_content(session_id: str, model: str, request: Request) -> Response:
    return await _generate(request, model, session_id, stream=True)


@chat_route(router, "/v1beta/models/{model}:countTokens", GENERATE_SCHEMA)
async def count_tokens(model: str, request: Request) -> Response:
    return await _count(request, model, None)


@chat_route(router, "/s/{session_id}/v1beta/models/{model}:countTokens", GENERATE_SCHEMA)
async def session_count_tokens(session_id: str, model: str, request: Request) -> Response:
    return await _count(request, model, session_id)


async def _models(request: Request) -> list[dict[str, Any]]:
    return [model_body(m["id"], m.get("max_model_len")) for m in await _proxy(request).models()]


@router.get("/v1beta/models")
@router.get("/s/{session_id}/v1beta/models")
async def models(request: Request) -> dict[str, Any]:
    return {"models": await _models(request)}


@router.get("/v1beta/models/{model}")
@router.get("/s/{session_id}/v1beta/models/{model}")
async def model(model: str, request: Request) -> dict[str, Any]:
    for described in await _models(request):
        if described["name"] == f"models/{model.removeprefix('models/')}":
            return described
    raise NotFound(f"model {model[:200]!r} is not served here", param="model")
