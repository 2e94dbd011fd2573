"""Issue 11, item 4: `logprobs` / `top_logprobs` for agents, in OpenAI's shape, from vLLM's own
output, without changing the record.

Validation, shaping, streaming chunks and replays run in process in front of the stand-in vLLM
(`tests/inprocess.py`), whose top logprobs follow vLLM's order (`bench.mock_upstream.top_logprobs`:
the sampled id first, ranked 1, 2, 3 in turn, so it is sometimes outside the top k). What needs
real sampling (the floats equal the record's, the bytes join to the sampled bytes, the SDK parses
them) runs against the session's real vLLM.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI

from devtools import weather_episode
from molt_proxy.tokenizer import Tokenizer
from molt_proxy.types import TokenLogprobs
from molt_proxy.wire.logprobs import encode_logprobs
from tests.helpers import assert_exact, trajectories
from tests.inprocess import chat_body, inprocess_proxy, loaded_tokenizer, mock_reply_ids, qwen3_tokenizer_dir

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return loaded_tokenizer(str(qwen3_tokenizer_dir()))


@pytest.fixture(scope="module")
def proxy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with inprocess_proxy(tmp_path_factory.mktemp("logprobs") / "p.db") as url:
        yield url


def send(url: str, session: str, body: dict[str, Any], **headers: str) -> httpx.Response:
    return httpx.post(url + CHAT, json=body, headers={"x-session-id": session, **headers}, timeout=60)


def events(response: httpx.Response) -> list[dict[str, Any]]:
    """The JSON chunks of a streamed reply, `[DONE]` checked and left out."""
    lines = [line[len("data: ") :] for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def last_vllm_logprobs(url: str) -> int:
    """What the proxy asked the stand-in vLLM for as `sampling_params.logprobs` last."""
    upstream = httpx.get(f"{url}/health").json()["replicas"][0]["url"]
    return httpx.get(f"{upstream}/_generated").json()[-1]["sampling_params"]["logprobs"]


def entry(tokenizer: Tokenizer, token_id: int, logprob: float) -> dict[str, Any]:
    raw = tokenizer.token_bytes(token_id)
    return {"token": raw.decode(), "logprob": logprob, "bytes": list(raw)}


# -- validation ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({"logprobs": "true"}, "logprobs", "'logprobs' must be a boolean"),
        ({"logprobs": 1}, "logprobs", "'logprobs' must be a boolean"),
        ({"logprobs": True, "top_logprobs": "3"}, "top_logprobs", "'top_logprobs' must be an integer"),
        ({"logprobs": True, "top_logprobs": 2.0}, "top_logprobs", "'top_logprobs' must be an integer"),
        ({"logprobs": True, "top_logprobs": True}, "top_logprobs", "'top_logprobs' must be an integer"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "'top_logprobs' must be in [0, 20], got 21"),
        ({"logprobs": True, "top_logprobs": -1}, "top_logprobs", "'top_logprobs' must be in [0, 20], got -1"),
        ({"top_logprobs": 3}, "top_logprobs", "'top_logprobs' needs 'logprobs': true"),
        ({"logprobs": False, "top_logprobs": 1}, "top_logprobs", "'top_logprobs' needs 'logprobs': true"),
        (
            {"prompt_logprobs": 1},
            "prompt_logprobs",
            "'prompt_logprobs' is not supported; use 'logprobs' and 'top_logprobs'",
        ),
        (
            {"logprobs": True, "logprob_token_ids": [5]},
            "logprob_token_ids",
            "'logprob_token_ids' is not supported; use 'logprobs' and 'top_logprobs'",
        ),
    ],
)
def test_bad_logprobs_fields_are_400_with_param_and_record_nothing(proxy, fields, param, message):
    session = f"bad-{param}-{abs(hash(json.dumps(fields)))}"
    response = send(proxy, session, chat_body(**fields))
    assert response.status_code == 400
    assert response.json() == {
        "error": {"message": message, "type": "invalid_request_error", "param": param, "code": None}
    }
    assert httpx.get(f"{proxy}/v1/sessions/{session}").status_code == 404


def test_without_logprobs_replies_and_chunks_carry_null_and_vllm_is_asked_for_none(proxy):
    for fields in ({}, {"logprobs": False}, {"logprobs": None, "top_logprobs": 0}):
        reply = send(proxy, "plain", chat_body("plain", **fields))
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["logprobs"] is None
        assert last_vllm_logprobs(proxy) == 0
        chunks = events(send(proxy, "plain", chat_body("plain stream", stream=True, **fields)))
        assert [c["choices"][0]["logprobs"] for c in chunks] == [None] * len(chunks)
        # no chunk for the held-back end-of-turn id: role, three words, the finish
        assert len(chunks) == 5


# -- shaping ---------------------------------------------------------------------------------


def test_logprobs_list_every_sampled_token_with_its_exact_bytes(proxy, tokenizer):
    reply = send(proxy, "whole", chat_body("whole", logprobs=True))
    assert reply.status_code == 200, reply.text
    body = reply.json()
    ids = list(mock_reply_ids(qwen3_tokenizer_dir()))
    # the end-of-turn id too: every sampled id, as vLLM's own server and the record have them
    assert body["choices"][0]["logprobs"] == {
        "content": [{**entry(tokenizer, i, -0.5), "top_logprobs": []} for i in ids],
        "refusal": None,
    }
    assert body["usage"]["completion_tokens"] == len(ids)
    assert last_vllm_logprobs(proxy) == 0
    content = body["choices"][0]["logprobs"]["content"]
    assert b"".join(bytes(e["bytes"]) for e in content) == b"Hello there.<|im_end|>"


def _expected_top(tokenizer: Tokenizer, k: int) -> list[list[dict[str, Any]]]:
    """The stand-in's distribution (`bench.mock_upstream.top_logprobs`), written out for k 1
    and 2: at position n the sampled id (-0.5) ranks 1 + n % 3 among ids 1000, 1001, ..."""
    ids = mock_reply_ids(qwen3_tokenizer_dir())
    ranked = {
        1: lambda s: [(s, -0.5), (1000, -0.625)],
        2: lambda s: [(1000, -0.375), (s, -0.5)],
        3: lambda s: [(1000, -0.25), (1001, -0.375)],
    }
    return [
        [entry(tokenizer, token_id, lp) for token_id, lp in ranked[1 + n % 3](sampled)[:k]]
        for n, sampled in enumerate(ids)
    ]


@pytest.mark.parametrize("k", [1, 2])
def test_top_logprobs_are_the_k_most_likely_sorted_even_when_the_sampled_token_ranks_lower(
    proxy, tokenizer, k
):
    """vLLM lists the sampled id first and cuts at the count asked; the proxy asks for k + 1,
    so a sampled id ranked k + 1 or lower does not push the k-th most likely out."""
    reply = send(proxy, f"top{k}", chat_body("top", logprobs=True, top_logprobs=k))
    assert reply.status_code == 200, reply.text
    assert last_vllm_logprobs(proxy) == k + 1
    content = reply.json()["choices"][0]["logprobs"]["content"]
    assert [e["top_logprobs"] for e in content] == _expected_top(tokenizer, k)
    assert [e["logprob"] for e in content] == [-0.5] * len(content)


def test_streamed_chunks_carry_the_logprobs_of_the_tokens_they_deliver(proxy, tokenizer):
    whole = send(proxy, "s-whole", chat_body("same", logprobs=True, top_logprobs=2)).json()
    chunks = events(send(proxy, "s-stream", chat_body("same", logprobs=True, top_logprobs=2, stream=True)))
    choices = [c["choices"][0] for c in chunks]
    # role; "Hello", " there", "." each with its token; the end-of-turn id, whose text the
    # parser holds back, in an empty delta with its logprob; the finish, with none
    assert [c["delta"] for c in choices] == [
        {"role": "assistant", "content": ""},
        {"content": "Hello"},
        {"content": " there"},
        {"content": "."},
        {},
        {},
    ]
    assert [c["finish_reason"] for c in choices] == [None] * 5 + ["stop"]
    assert choices[0]["logprobs"] is None and choices[-1]["logprobs"] is None
    streamed = [e for c in choices[1:-1] for e in c["logprobs"]["content"]]
    assert [len(c["logprobs"]["content"]) for c in choices[1:-1]] == [1, 1, 1, 1]
    assert streamed == whole["choices"][0]["logprobs"]["content"]
    assert {c["logprobs"]["refusal"] for c in choices[1:-1]} == {None}


def test_a_replayed_reply_shows_the_same_logprobs_whole_streamed_and_after_a_restart(tmp_path):
    body = chat_body("again", logprobs=True, top_logprobs=2)
    streamed = {**body, "stream": True}
    retry = {"x-stainless-retry-count": "1"}
    with inprocess_proxy(tmp_path / "p.db") as url:
        first = send(url, "r", body)
        assert send(url, "r", body, **retry).content == first.content
        first_chunks = events(send(url, "r-stream", streamed))
        replayed_chunks = events(send(url, "r-stream", streamed, **retry))
    with inprocess_proxy(tmp_path / "p.db") as url:  # the reply read back from the store
        assert send(url, "r", body, **retry).content == first.content
        assert events(send(url, "r-stream", streamed, **retry)) == replayed_chunks
    # a streamed replay sends the reply whole: every token's logprobs in its one delta
    whole_delta = replayed_chunks[0]["choices"][0]
    assert whole_delta["logprobs"]["content"] == [
        e for c in first_chunks for e in (c["choices"][0]["logprobs"] or {"content": []})["content"]
    ]
    assert whole_delta["logprobs"]["content"] == first.json()["choices"][0]["logprobs"]["content"]


def test_a_token_holding_part_of_a_character_shows_its_bytes_escaped_and_exact(tokenizer):
    """OpenAI's convention: `bytes` are exact (joined they give the character), `token` is
    their text with the bytes of an unfinished character as `\\xNN`."""
    parrot = tokenizer.encode("🦜 é")
    assert parrot == [123918, 250, 3958]
    encoded = encode_logprobs([TokenLogprobs(i, -1.0, [(i, -1.0)]) for i in parrot], tokenizer.token_bytes)
    assert encoded is not None
    content = encoded["content"]
    assert [(e["token"], e["bytes"]) for e in content] == [
        ("\\xf0\\x9f\\xa6", [0xF0, 0x9F, 0xA6]),
        ("\\x9c", [0x9C]),
        (" é", [0x20, 0xC3, 0xA9]),
    ]
    assert [e["top_logprobs"] for e in content] == [
        [{"token": e["token"], "logprob": -1.0, "bytes": e["bytes"]}] for e in content
    ]
    assert bytes(b for e in content for b in e["bytes"]).decode() == "🦜 é"


# -- real vLLM: the floats are the record's ------------------------------------------------------


def _sampled(proxy, session: str) -> tuple[list[int], list[float]]:
    """The sampled ids and recorded logprobs of the session's one turn."""
    httpx.post(f"{proxy.url}/v1/rewards", json={"session_id": session, "reward": 1.0}).raise_for_status()
    [trajectory] = [t for t in trajectories(proxy.url) if t["session_id"] == session]
    [turn] = trajectory["turns"]
    span = slice(turn["completion_start"], turn["completion_end"])
    return trajectory["token_ids"][span], trajectory["logprobs"][span]


def _assert_shows_the_record(content: list[Any], ids: list[int], logprobs: list[float], tokenizer, k: int):
    """`content` (the SDK's `ChatCompletionTokenLogprob`s) is the record: the same floats, the
    bytes of the sampled ids, and k alternatives, most likely first, with the sampled id among
    them whenever it is in the top k."""
    assert [e.logprob for e in content] == logprobs
    assert [bytes(e.bytes) for e in content] == [tokenizer.token_bytes(i) for i in ids]
    assert b"".join(bytes(e.bytes) for e in content) == tokenizer.ids_bytes(ids)
    for e in content:
        top = [t.logprob for t in e.top_logprobs]
        assert len(top) == k and top == sorted(top, reverse=True)
        if e.logprob > top[-1]:  # strictly in the top k
            assert (e.bytes, e.logprob) in [(t.bytes, t.logprob) for t in e.top_logprobs]


def _first_request(**fields: Any) -> dict[str, Any]:
    episode = weather_episode("hermes")
    return {
        "model": "tiny",
        "messages": episode["messages"][:2],
        "tools": episode["tools"],
        "max_tokens": 60,
        "seed": 11,
        **fields,
    }


def test_a_replys_logprobs_are_the_records_through_the_openai_sdk(
    qwen3_model: Path, qwen3_vllm, start_proxy, tokenizer
):
    """A tool-calling turn: `content` covers every sampled id, the tool-call markup and the
    end-of-turn id included, while the message holds only the parsed call."""
    proxy = start_proxy(qwen3_model, qwen3_vllm, "--tool-call-parser", "hermes")
    client = OpenAI(base_url=proxy.base_url("sdk"), api_key="-")
    reply = client.chat.completions.create(**_first_request(logprobs=True, top_logprobs=3))
    choice = reply.choices[0]
    assert choice.message.tool_calls and choice.finish_reason == "tool_calls"
    assert choice.logprobs is not None and choice.logprobs.refusal is None
    ids, logprobs = _sampled(proxy, "sdk")
    assert len(choice.logprobs.content) == reply.usage.completion_tokens == len(ids)
    _assert_shows_the_record(choice.logprobs.content, ids, logprobs, tokenizer, 3)
    [record] = [t for t in trajectories(proxy.url) if t["session_id"] == "sdk"]
    assert_exact(record, qwen3_model)  # asking for logprobs leaves the record the model's own


def test_streamed_chunks_add_up_to_the_records_logprobs(
    qwen3_model: Path, qwen3_vllm, start_proxy, tokenizer
):
    proxy = start_proxy(qwen3_model, qwen3_vllm, "--tool-call-parser", "hermes")
    client = OpenAI(base_url=proxy.base_url("streamed"), api_key="-")
    chunks = list(
        client.chat.completions.create(
            **_first_request(logprobs=True, top_logprobs=2, temperature=1.0),
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    content = [
        e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content
    ]
    ids, logprobs = _sampled(proxy, "streamed")
    assert len(content) == chunks[-1].usage.completion_tokens == len(ids)
    _assert_shows_the_record(content, ids, logprobs, tokenizer, 2)
