"""Poison and crash inputs, and liveness (issue 9, items 4, 5, 6, 8): every bad input is a 400
with the OpenAI error body on a connection that stays open, nothing non-finite reaches the
store, and a large request neither stalls other clients nor gets tokenized when it cannot fit.

All against the in-process proxy (real app, Qwen3 tokenizer, SQLite) and the stand-in vLLM.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from starlette.requests import ClientDisconnect

from molt_proxy import advantages
from molt_proxy.completions import OFF_LOOP_BYTES
from molt_proxy.routes import EventStream
from molt_proxy.tokenizer import Tokenizer
from tests.inprocess import (
    MOCK_MAX_MODEL_LEN,
    chat_body,
    inprocess_proxy,
    loaded_tokenizer,
    qwen3_tokenizer_dir,
)

USER = [{"role": "user", "content": "hi"}]
DEEP = 5000


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    """One client, so one keep-alive connection, for the whole module."""
    with inprocess_proxy(tmp_path_factory.mktemp("hardening") / "p.db") as url:
        with httpx.Client(base_url=url, timeout=60) as http:
            yield http


def _strict_json(text: str) -> Any:
    def refuse(name: str) -> None:
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


def _local_port(response: httpx.Response) -> int:
    return response.extensions["network_stream"].get_extra_info("client_addr")[1]


def assert_refused(
    client: httpx.Client, response: httpx.Response, *, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """A 400 with exactly the OpenAI error body, and the same connection still serves."""
    assert response.status_code == 400, response.text
    body = _strict_json(response.text)
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    error = body["error"]
    assert error["type"] == "invalid_request_error" and isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    after = client.post("/v1/chat/completions", json=chat_body("still there?", max_tokens=4))
    assert after.status_code == 200, after.text
    assert _local_port(after) == _local_port(response), "the connection was closed after the error"
    return error


def _raw(client: httpx.Client, path: str, body: bytes) -> httpx.Response:
    return client.post(path, content=body, headers={"content-type": "application/json"})


def _nested(depth: int) -> bytes:
    return b'{"a":' * depth + b"1" + b"}" * depth


# -- item 4: nothing non-finite reaches the store ----------------------------------------------


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b'{"session_id": "poison", "reward": 1, "info": {"score": NaN}}', "info.score"),
        (b'{"session_id": "poison", "reward": 1, "info": {"s": [Infinity]}}', "info.s.0"),
        (b'{"session_id": "poison", "reward": NaN}', "reward"),
        (b'{"session_id": "poison", "reward": -Infinity}', "reward"),
        (b'{"session_id": "poison", "reward": 1e400}', "reward"),
        (b'{"session_id": "poison", "reward": 1' + b"0" * 400 + b"}", "reward"),
        (b'{"session_id": "poison", "reward": ' + b"7" * 5000 + b"}", "reward"),
        (b'{"session_id": "poison", "reward": 1, "info": ' + _nested(DEEP) + b"}", None),
        (b'{"session_id": "poison", "reward": 1, "info": {"k": "a\\ud800b"}}', "info.k"),
        (b'{"session_id": "poison", "reward": true}', "reward"),
        (b'{"session_id": "poison", "reward": 1, "info": [1]}', "info"),
    ],
)
def test_a_poisoned_reward_is_refused(client, body, param):
    # An open session, so that only the body can be the reason for a refusal.
    client.post("/s/poison/v1/chat/completions", json=chat_body(max_tokens=4)).raise_for_status()
    assert_refused(client, _raw(client, "/v1/rewards", body), param=param)


def test_after_refused_non_finite_rewards_the_trajectory_stream_stays_valid_json(client):
    client.post("/s/poisoned/v1/chat/completions", json=chat_body(max_tokens=4)).raise_for_status()
    for body in (
        b'{"session_id": "poisoned", "reward": 1, "info": {"x": NaN}}',
        b'{"session_id": "poisoned", "reward": Infinity}',
    ):
        assert_refused(client, _raw(client, "/v1/rewards", body))
    client.post(
        "/v1/rewards", json={"session_id": "poisoned", "reward": 0.5, "info": {"x": 1.5}}
    ).raise_for_status()

    listed = client.get("/v1/trajectories")
    assert listed.status_code == 200
    records = _strict_json(listed.text)["data"]
    mine = [r for r in records if r["session_id"] == "poisoned"]
    assert [(r["reward"], r["info"]) for r in mine] == [(0.5, {"x": 1.5})]

    with client.stream("GET", "/v1/trajectories", headers={"accept": "text/event-stream"}) as stream:
        assert stream.status_code == 200
        seen = 0
        for line in stream.iter_lines():
            if line.startswith("data: "):
                _strict_json(line[len("data: ") :])
                seen += 1
                if seen == len(records):
                    break


# -- item 5: vLLM's own validation, malformed shapes, huge numbers, depth, surrogates ----------


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ],
)
def test_vllm_validation_errors_are_400(client, fields, param):
    assert_refused(client, client.post("/v1/chat/completions", json=chat_body(**fields)), param=param)


def test_tool_calls_that_are_not_an_array_are_400(client):
    messages = [*USER, {"role": "assistant", "content": None, "tool_calls": 5}]
    response = client.post("/v1/chat/completions", json={"model": "m", "messages": messages})
    assert_refused(client, response, param="messages.1.tool_calls")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": ' + b"9" * 5000 + b"}",
            "max_tokens",
        ),
        (b'{"messages": [{"role": "user", "content": "hi"}], "seed": 9223372036854775808}', "seed"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', "temperature"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "top_p": 1e400}', "top_p"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "metadata": ' + _nested(DEEP) + b"}", None),
        (b'{"messages": [{"role": "user", "content": ' + b"[" * DEEP + b"]" * DEEP + b"}]}", None),
        (b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages.0.content"),
        (b'{"messages": [{"role": "user", "content": "hi", "\\udc00": 1}]}', "messages.0"),
    ],
)
def test_malformed_numbers_depth_and_surrogates_in_a_chat_request_are_400(client, body, param):
    assert_refused(client, _raw(client, "/v1/chat/completions", body), param=param)


def test_a_refused_surrogate_never_echoes_the_prompt(client):
    secret = "SECRET-PROMPT-TEXT " * 20
    body = json.dumps({"messages": [{"role": "user", "content": secret + "\ud800"}]}).encode()
    error = assert_refused(client, _raw(client, "/v1/chat/completions", body))
    assert "SECRET" not in error["message"]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/sessions", b'{"session_id": "a", "group_id": ' + _nested(DEEP) + b"}"),
        ("/v1/sessions", b'{"session_id": "a\\udfffb"}'),
        ("/v1/admin/weights", b'{"path": "/w", "version": ' + b"1" * 5000 + b"}"),
        ("/v1/admin/weights", b'{"path": "/w", "version": NaN}'),
    ],
)
def test_every_json_route_uses_the_same_decoder(client, path, body):
    assert_refused(client, _raw(client, path, body))


def test_a_cursor_beyond_int64_is_400(client):
    assert_refused(client, client.get("/v1/trajectories", params={"after": 2**63}), param="after")
    assert client.get("/v1/trajectories", params={"after": 2**63 - 1}).status_code == 200


def test_an_internal_error_never_leaks_the_exception_text(client, monkeypatch):
    def broken(self: Tokenizer, text: str) -> list[int]:
        raise UnicodeEncodeError("utf-8", "SECRET rendered prompt", 0, 1, "surrogates not allowed")

    monkeypatch.setattr(Tokenizer, "encode", broken)
    # A client of its own: after a 500 uvicorn closes the connection.
    response = httpx.post(f"{client.base_url}/v1/chat/completions", json=chat_body("fresh"), timeout=60)
    assert response.status_code == 500
    assert response.json() == {
        "error": {"message": "internal error", "type": "internal_error", "param": None, "code": None}
    }


# -- item 6: sampling values in vLLM's ranges ----------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_completion_tokens": -5}, "max_completion_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -5}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_tokens": 8, "max_tokens": 4}, "min_tokens"),
        ({"stop": [""]}, "stop"),
        ({"seed": -(2**63) - 1}, "seed"),
    ],
)
def test_sampling_values_outside_vllms_ranges_are_400(client, fields, param):
    assert_refused(client, client.post("/v1/chat/completions", json=chat_body(**fields)), param=param)


@pytest.mark.parametrize(
    "fields",
    [{"top_k": -1}, {"top_k": 0}, {"temperature": 0}, {"temperature": 2}, {"top_p": 1}, {"seed": 2**63 - 1}],
)
def test_sampling_values_vllm_accepts_pass(client, fields):
    assert client.post("/v1/chat/completions", json=chat_body(max_tokens=4, **fields)).status_code == 200


# -- item 8: liveness ------------------------------------------------------------------------------

# Over the off-loop threshold, but ~550 tokens: 128 spaces are one Qwen3 token.
LARGE_CONTENT = "x" + " " * 70_000 + "y"


@pytest.mark.parametrize("stage", ["render", "encode"])
def test_a_small_request_completes_while_a_large_one_renders_or_tokenizes(client, monkeypatch, stage):
    """The large request is held inside the chat template (or the tokenizer) until the small
    one has its reply. On the event loop that would deadlock until the hold times out."""
    held, release = threading.Event(), threading.Event()
    original = getattr(Tokenizer, stage)

    def holding(self: Tokenizer, *args: Any, **kwargs: Any) -> Any:
        if len(json.dumps(args)) > 70_000:
            held.set()
            release.wait(timeout=120)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Tokenizer, stage, holding)
    large: dict[str, httpx.Response] = {}

    def send_large() -> None:
        with httpx.Client(base_url=str(client.base_url), timeout=180) as other:
            large["response"] = other.post(
                f"/s/large-{stage}/v1/chat/completions", json=chat_body(LARGE_CONTENT, max_tokens=4)
            )

    sender = threading.Thread(target=send_large)
    sender.start()
    try:
        assert held.wait(timeout=60), "the large request never reached the " + stage
        small = client.post("/v1/chat/completions", json=chat_body(f"small during {stage}", max_tokens=4))
        assert small.status_code == 200
        assert not release.is_set() and sender.is_alive()  # the large one was still held
    finally:
        release.set()
        sender.join(timeout=120)
    assert large["response"].status_code == 200, large["response"].text


def test_health_answers_while_a_large_advantages_post_is_validated(client, monkeypatch):
    """A trainer step's post (87k entries, 4 MB) is validated in a worker thread: held there,
    `/health` still answers. On the event loop the hold would block `/health` until it ends."""
    held, release = threading.Event(), threading.Event()
    original = advantages._entries

    def holding(items: list[Any], start: int) -> list[advantages.Entry]:
        held.set()
        release.wait(timeout=120)
        return original(items, start)

    monkeypatch.setattr(advantages, "_entries", holding)
    entries = [{"trajectory_id": f"nowhere{i}:0", "advantage": 0.5} for i in range(2000)]
    body = json.dumps({"step": 1, "version": 1, "trajectories": entries}).encode()
    assert len(body) >= OFF_LOOP_BYTES
    posted: dict[str, httpx.Response] = {}

    def send() -> None:
        with httpx.Client(base_url=str(client.base_url), timeout=180) as other:
            posted["response"] = _raw(other, "/v1/admin/advantages", body)

    sender = threading.Thread(target=send)
    sender.start()
    try:
        assert held.wait(timeout=60), "the post never reached validation"
        health = httpx.get(f"{client.base_url}/health", timeout=30)
        assert health.status_code == 200
        assert not release.is_set() and sender.is_alive()  # the post was still held
    finally:
        release.set()
        sender.join(timeout=120)
    response = posted["response"]
    assert (response.status_code, response.json()) == (
        404,
        {
            "error": {
                "message": "no trajectory 'nowhere0:0'",
                "type": "not_found_error",
                "param": "trajectories.0.trajectory_id",
                "code": None,
            }
        },
    )


def test_a_large_request_records_the_exact_ids_of_its_render(client):
    session = "large-exact"
    response = client.post(f"/s/{session}/v1/chat/completions", json=chat_body(LARGE_CONTENT, max_tokens=4))
    assert response.status_code == 200, response.text
    client.post("/v1/rewards", json={"session_id": session, "reward": 1.0}).raise_for_status()
    record = next(r for r in client.get("/v1/trajectories").json()["data"] if r["session_id"] == session)
    tokenizer = loaded_tokenizer(str(qwen3_tokenizer_dir()))
    prompt = tokenizer.encode(tokenizer.render([{"role": "user", "content": LARGE_CONTENT}], None, {}))
    assert record["token_ids"][: len(prompt)] == prompt
    assert response.json()["usage"]["prompt_tokens"] == len(prompt)


def test_a_prompt_that_cannot_fit_the_context_is_refused_before_tokenizing(client, monkeypatch):
    tokenized: list[int] = []
    original = Tokenizer.encode

    def counting(self: Tokenizer, text: str) -> list[int]:
        tokenized.append(len(text))
        return original(self, text)

    monkeypatch.setattr(Tokenizer, "encode", counting)
    # 128 bytes is the most one Qwen3 id covers, so this many bytes are more tokens than fit.
    content = "word " * (MOCK_MAX_MODEL_LEN * 128 // 5 + 1)
    response = client.post("/s/too-long/v1/chat/completions", json=chat_body(content))
    assert_refused(client, response, param="messages", code="context_length_exceeded")
    assert not [n for n in tokenized if n >= len(content)]


def test_the_token_lower_bound_never_exceeds_the_real_count():
    tokenizer = loaded_tokenizer(str(qwen3_tokenizer_dir()))
    for text in ["", "hi", " " * 1000, "héllo wörld " * 50, "日本語のテキスト" * 30, "<|im_end|>" * 5]:
        assert tokenizer.min_tokens(text) <= len(tokenizer.encode(text))
    assert tokenizer.min_tokens("e\u0301" * 100) == 0  # not NFC: the normalizer may shrink it


def test_a_streamed_turn_whose_client_left_is_closed_at_once_not_at_garbage_collection():
    """A turn's events hold its session's lock; Starlette leaves an unfinished body iterator to
    the garbage collector, so the response itself must close them when the client is gone."""
    closed: list[bool] = []

    async def events() -> AsyncIterator[str]:
        try:
            yield "data: 1\n\n"
            yield "data: 2\n\n"
            yield "data: 3\n\n"
        finally:
            closed.append(True)

    async def scenario() -> None:
        turn = events()
        response = EventStream(await anext(turn), turn)
        sent: list[bytes] = []

        async def receive() -> dict[str, Any]:
            return {"type": "http.request"}

        async def send(message: dict[str, Any]) -> None:
            if message.get("body"):
                if sent:
                    raise OSError("the client is gone")
                sent.append(message["body"])

        with pytest.raises(ClientDisconnect):
            await response({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send)
        assert sent == [b"data: 1\n\n"] and closed == [True]

    asyncio.run(scenario())
