"""The upstream module: its parsing of vLLM's answers (per-token weight versions), and, through
the session seam against in-process servers, how each way vLLM can fail becomes a domain error."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from bench.mock_upstream import build_app
from molt_proxy.errors import BadRequest, UpstreamError, UpstreamUnavailable
from molt_proxy.launcher import free_port
from molt_proxy.types import Generation
from molt_proxy.upstream import TokenDelta, Upstream, parse_versions
from molt_proxy.wire.generate import parse_tokens

T = TypeVar("T")


def span(version: str, start: int, end: int) -> dict[str, object]:
    return {"version": version, "start": start, "end": end}


def test_spans_expand_to_one_version_per_sampled_token_with_default_as_zero():
    assert parse_versions([span("default", 0, 2), span("3", 2, 5)], 5) == [0, 0, 3, 3, 3]


def test_no_sampled_tokens_need_no_spans():
    assert parse_versions(None, 0) == []


@pytest.mark.parametrize(
    "spans",
    [None, [span("2", 0, 3)], [span("2", 0, 2), span("3", 3, 5)]],
    ids=["no spans", "a tail uncovered", "a gap"],
)
def test_a_sampled_token_without_a_version_is_an_upstream_error_not_version_zero(spans):
    with pytest.raises(UpstreamError, match="no weight version"):
        parse_versions(spans, 5)


def test_a_span_past_the_sampled_tokens_is_an_upstream_error():
    with pytest.raises(UpstreamError, match="outside"):
        parse_versions([span("1", 0, 6)], 5)


def test_a_non_integer_version_label_is_an_upstream_error():
    with pytest.raises(UpstreamError, match="non-integer"):
        parse_versions([span("v2", 0, 5)], 5)


def test_a_stream_takes_every_tokens_version_from_the_spans_of_its_last_chunk():
    """vLLM streams one chunk per id and the spans with the last one only: the chunks before it
    are not gaps."""

    async def stream() -> list[TokenDelta | Generation]:
        async with TestServer(build_app("m", "a b c", [5, 6, 7], 2048)) as server:
            async with Upstream(str(server.make_url("/")).rstrip("/")) as upstream:
                return [event async for event in upstream.stream([1, 2], {})]

    *deltas, generation = asyncio.run(stream())
    assert [delta.token_ids for delta in deltas] == [[5], [6], [7]]
    assert generation.token_ids == [5, 6, 7] and generation.weight_versions == [0, 0, 0]


# -- the transport seam and its error translation, against in-process servers ---------------


async def _with_routes(
    routes: list[web.RouteDef], run: Callable[[Upstream], Awaitable[T]], **kwargs: Any
) -> T:
    """`run` against an `Upstream` of an in-process aiohttp server that has only `routes`."""
    app = web.Application()
    app.add_routes(routes)
    async with TestServer(app) as server:
        async with Upstream(str(server.make_url("")).rstrip("/"), **kwargs) as upstream:
            return await run(upstream)


def _generate(upstream: Upstream) -> Awaitable[Generation]:
    return upstream.generate([1, 2], {})


async def _streamed(upstream: Upstream) -> list[TokenDelta | Generation]:
    return [event async for event in upstream.stream([1, 2], {})]


def _answering(status: int, text: str) -> list[web.RouteDef]:
    async def handler(request: web.Request) -> web.Response:
        return web.Response(status=status, text=text, content_type="application/json")

    return [web.post("/inference/v1/generate", handler)]


@pytest.mark.parametrize(
    ("status", "error"),
    [
        (400, BadRequest),
        (422, BadRequest),
        (404, UpstreamError),
        (500, UpstreamError),
        (503, UpstreamUnavailable),
    ],
)
def test_vllm_error_statuses_become_domain_errors_carrying_vllms_message(status, error):
    body = json.dumps({"error": {"message": "boom", "type": "X", "param": None, "code": status}})
    with pytest.raises(error, match="boom") as raised:
        asyncio.run(_with_routes(_answering(status, body), _generate))
    assert type(raised.value) is error


def test_a_body_that_is_not_json_is_an_upstream_error():
    with pytest.raises(UpstreamError, match="not JSON") as raised:
        asyncio.run(_with_routes(_answering(200, "{not json"), _generate))
    assert type(raised.value) is UpstreamError


def test_an_unreachable_server_is_unavailable_with_aiohttps_error_as_the_cause():
    async def run() -> None:
        async with Upstream(f"http://127.0.0.1:{free_port()}") as upstream:
            await upstream.generate([1], {})

    with pytest.raises(UpstreamUnavailable, match="unreachable") as raised:
        asyncio.run(run())
    assert isinstance(raised.value.__cause__, aiohttp.ClientError)


def test_a_server_slower_than_the_timeout_is_unavailable():
    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(5)
        return web.Response()

    with pytest.raises(UpstreamUnavailable, match="unreachable") as raised:
        asyncio.run(_with_routes([web.post("/inference/v1/generate", slow)], _generate, timeout_s=0.2))
    assert isinstance(raised.value.__cause__, TimeoutError)


def test_an_upstream_that_is_not_open_raises_a_domain_error_not_an_assertion():
    with pytest.raises(UpstreamUnavailable, match="not open"):
        asyncio.run(_generate(Upstream("http://127.0.0.1:1")))


def _streaming(lines: list[bytes], *, cut: bool = False) -> list[web.RouteDef]:
    """A generate route that streams `lines`; `cut`: then drops the connection mid-answer."""

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for line in lines:
            await resp.write(line)
        if cut:
            assert request.transport is not None
            request.transport.close()
            return resp
        await resp.write_eof()
        return resp

    return [web.post("/inference/v1/generate", handler)]


def _chunk(token_id: int, **extra: Any) -> bytes:
    choice = {"token_ids": [token_id], "logprobs": {"content": [{"logprob": -1.0}]}, **extra}
    return b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n"


def test_an_error_chunk_in_a_stream_raises_the_error_for_its_code():
    error = {"error": {"message": "engine dead", "type": "X", "code": 500}}
    lines = [_chunk(5), b"data: " + json.dumps(error).encode() + b"\n\n"]
    with pytest.raises(UpstreamError, match="engine dead"):
        asyncio.run(_with_routes(_streaming(lines), _streamed))


@pytest.mark.parametrize("cut", [False, True], ids=["ended", "connection dropped"])
def test_a_stream_cut_short_is_unavailable_so_the_router_may_fail_over(cut):
    """No finish reason: the server went away. A dropped connection was aiohttp's
    `ClientPayloadError`, which before the translation escaped as a foreign exception."""
    with pytest.raises(UpstreamUnavailable) as raised:
        asyncio.run(_with_routes(_streaming([_chunk(5), _chunk(6)], cut=cut), _streamed))
    assert isinstance(raised.value.__cause__, aiohttp.ClientPayloadError) is cut


@pytest.mark.parametrize(
    "logprobs",
    [[], [{"logprob": None}], [{}], [{"logprob": "-1"}]],
    ids=["missing", "null", "no field", "a string"],
)
def test_a_sampled_token_without_a_numeric_logprob_is_an_upstream_error(logprobs):
    """The record needs a float per sampled token; anything else is vLLM's fault (a 502),
    never an internal error while recording."""
    choice = {"token_ids": [5], "logprobs": {"content": logprobs}, "finish_reason": "stop"}
    with pytest.raises(UpstreamError, match="no logprob for some sampled tokens"):
        parse_tokens(choice)


def test_the_injected_session_factory_is_used_and_closed_with_the_upstream():
    """The seam: whatever client the factory builds carries every request (here, a header the
    server checks), and the `Upstream` owns it."""
    made: list[aiohttp.ClientSession] = []

    def factory() -> aiohttp.ClientSession:
        made.append(aiohttp.ClientSession(headers={"x-test": "seam"}))
        return made[-1]

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=200 if request.headers.get("x-test") == "seam" else 500)

    assert asyncio.run(_with_routes([web.get("/health", health)], Upstream.healthy, session=factory))
    assert len(made) == 1 and made[0].closed
