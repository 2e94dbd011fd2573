"""The upstream module's parsing of vLLM's answers: per-token weight versions."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp.test_utils import TestServer

from bench.mock_upstream import build_app
from molt_proxy.errors import UpstreamError
from molt_proxy.types import Generation
from molt_proxy.upstream import TokenDelta, Upstream, parse_versions


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
