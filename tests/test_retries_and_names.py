"""Issue 11, items 5 and 6: a retry gets the recorded reply byte for byte, told from a repeated
request by the headers the SDKs send; replies carry `--served-model-name`; a route the proxy
does not serve answers 404 with an OpenAI error body that names the routes it does.

All of it is the proxy's own bookkeeping, so it runs in process in front of the stand-in vLLM
(`tests/inprocess.py`), with the real `openai` SDK where its retries matter.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import httpx
import httpx2
import pytest
from openai import OpenAI

from molt_proxy import store
from molt_proxy.cli import parser, settings_from_args
from molt_proxy.session import Attempt
from molt_proxy.sessions import Sessions
from molt_proxy.store import Store
from molt_proxy.types import ParsedReply, RecordedReply
from tests.helpers import write_old_store
from tests.inprocess import chat_body, inprocess_proxy, loaded_tokenizer, qwen3_tokenizer_dir

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def proxy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with inprocess_proxy(tmp_path_factory.mktemp("retries") / "p.db") as url:
        yield url


def send(url: str, session: str, body: dict, **headers: str) -> httpx.Response:
    """One chat request on `session`; `headers` spelled with underscores for dashes."""
    sent = {"x-session-id": session, **{k.replace("_", "-"): v for k, v in headers.items()}}
    response = httpx.post(url + CHAT, json=body, headers=sent, timeout=60)
    assert response.status_code == 200, response.text
    return response


def turns(url: str, session: str) -> list[str]:
    segments = httpx.get(f"{url}/v1/sessions/{session}").json()["segments"]
    return [completion for segment in segments for completion in segment["turns"]]


# -- retries (item 5) ------------------------------------------------------------------------


def test_the_same_idempotency_key_replays_its_reply_and_another_key_samples_anew(proxy):
    body = chat_body("idempotent")
    first = send(proxy, "idem", body, idempotency_key="k1")
    assert send(proxy, "idem", body, idempotency_key="k1").content == first.content
    fresh = send(proxy, "idem", body, idempotency_key="k2")
    assert fresh.json()["id"] != first.json()["id"]
    # A key names its request, not only the last one.
    assert send(proxy, "idem", body, idempotency_key="k1").content == first.content
    assert turns(proxy, "idem") == [first.json()["id"], fresh.json()["id"]]


def test_an_idempotency_key_reused_for_another_body_is_refused(proxy):
    send(proxy, "idem-clash", chat_body("one"), idempotency_key="k")
    response = httpx.post(
        proxy + CHAT,
        json=chat_body("two"),
        headers={"x-session-id": "idem-clash", "idempotency-key": "k"},
        timeout=60,
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "Idempotency-Key"
    assert len(turns(proxy, "idem-clash")) == 1


def test_a_first_try_that_repeats_the_last_request_samples_anew(proxy):
    body = chat_body("sample me again")
    first = send(proxy, "resample", body, x_stainless_retry_count="0")
    again = send(proxy, "resample", body, x_stainless_retry_count="0")
    assert again.json()["id"] != first.json()["id"]
    segments = httpx.get(f"{proxy}/v1/sessions/resample").json()["segments"]
    # The same history again does not extend the first reply: a segment of its own.
    assert [s["turns"] for s in segments] == [[first.json()["id"]], [again.json()["id"]]]


def test_a_retry_count_above_zero_replays_the_last_reply_byte_for_byte(proxy):
    body = chat_body("retry me")
    first = send(proxy, "retried", body, x_stainless_retry_count="0")
    assert send(proxy, "retried", body, x_stainless_retry_count="1").content == first.content
    assert send(proxy, "retried", body, x_stainless_retry_count="2").content == first.content
    other = send(proxy, "retried", chat_body("something else"), x_stainless_retry_count="1")
    assert other.json()["id"] != first.json()["id"]  # a retry of a request never answered
    assert turns(proxy, "retried") == [first.json()["id"], other.json()["id"]]


def test_without_retry_headers_an_identical_body_is_a_retry(proxy):
    body = chat_body("no headers")
    first = send(proxy, "plain", body)
    assert send(proxy, "plain", body).content == first.content
    assert turns(proxy, "plain") == [first.json()["id"]]


def test_a_streamed_retry_replays_the_recorded_reply(proxy):
    body = chat_body("stream", stream=True)
    headers = {"x-session-id": "streamed", "x-stainless-retry-count": "0"}
    first = httpx.post(proxy + CHAT, json=body, headers=headers, timeout=60).text
    headers["x-stainless-retry-count"] = "1"
    retried = httpx.post(proxy + CHAT, json=body, headers=headers, timeout=60).text
    [completion] = turns(proxy, "streamed")
    assert _stream_ids(first) == _stream_ids(retried) == {completion}


def _stream_ids(events: str) -> set[str]:
    chunks = [line.removeprefix("data: ") for line in events.splitlines() if line.startswith("data: {")]
    return {json.loads(chunk)["id"] for chunk in chunks}


class LoseFirstAnswer(httpx2.HTTPTransport):
    """Delivers every request but loses the answer to the first, as a flaky network does: the
    proxy has recorded the turn, the client sees a timeout and retries."""

    def __init__(self) -> None:
        super().__init__()
        self.retry_counts: list[str | None] = []
        self.lost: bytes = b""
        """The answer the client never saw."""

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        response = super().handle_request(request)
        self.retry_counts.append(request.headers.get("x-stainless-retry-count"))
        if len(self.retry_counts) == 1:
            self.lost = response.read()
            response.close()
            raise httpx2.ReadTimeout("the answer was lost", request=request)
        return response


def test_the_openai_sdk_retry_after_a_lost_answer_gets_the_recorded_reply(proxy):
    transport = LoseFirstAnswer()
    client = OpenAI(
        base_url=f"{proxy}/s/sdk/v1",
        api_key="unused",
        max_retries=1,
        http_client=httpx2.Client(transport=transport),
    )
    messages = [{"role": "user", "content": "through the sdk"}]
    reply = client.chat.completions.create(model="tiny", messages=messages)
    assert transport.retry_counts == ["0", "1"]
    assert turns(proxy, "sdk") == [reply.id]
    # The agent asks the same again on purpose: a first try, so a new sample.
    again = client.chat.completions.create(model="tiny", messages=messages)
    assert transport.retry_counts[-1] == "0"
    assert again.id != reply.id and turns(proxy, "sdk") == [reply.id, again.id]


def test_without_a_session_id_the_sdk_retry_after_a_lost_answer_joins_its_session_and_replays(proxy):
    """Zero-config: the retried request's history no longer continues the chain its first try
    extended, so only the retry count tells it from a new conversation."""
    transport = LoseFirstAnswer()
    client = OpenAI(
        base_url=f"{proxy}/v1",
        api_key="unused",
        max_retries=1,
        http_client=httpx2.Client(transport=transport),
    )
    messages = [{"role": "user", "content": "zero-config, lost once"}]
    reply = client.chat.completions.create(model="tiny", messages=messages)
    assert transport.retry_counts == ["0", "1"]
    assert reply.id == json.loads(transport.lost)["id"]  # the first try's reply, not a second sample
    assert turns(proxy, reply.model_extra["session_id"]) == [reply.id]


def test_without_a_session_id_a_retry_is_told_from_another_attempt_by_its_headers(proxy):
    body = chat_body("zero-config: the same first request")

    def zero_config(**headers: str) -> dict:
        sent = {k.replace("_", "-"): v for k, v in headers.items()}
        response = httpx.post(proxy + CHAT, json=body, headers=sent, timeout=60)
        assert response.status_code == 200, response.text
        return response.json()

    first = zero_config(x_stainless_retry_count="0", idempotency_key="zk")
    assert zero_config(x_stainless_retry_count="1") == first
    assert zero_config(idempotency_key="zk") == first
    # Identical first requests of other attempts at the task (no retry said): new sessions.
    for other in (zero_config(x_stainless_retry_count="0"), zero_config()):
        assert other["session_id"] != first["session_id"] and other["id"] != first["id"]
    assert turns(proxy, first["session_id"]) == [first["id"]]


def test_a_restarted_proxy_still_replays_by_key_and_by_retry_count(tmp_path: Path):
    db = tmp_path / "p.db"
    body = chat_body("before the restart")
    with inprocess_proxy(db) as url:
        keyed = send(url, "restart", body, idempotency_key="k", x_stainless_retry_count="0")
        last = send(url, "restart", body, x_stainless_retry_count="0")
    with inprocess_proxy(db) as url:
        assert send(url, "restart", body, idempotency_key="k").content == keyed.content
        assert send(url, "restart", body, x_stainless_retry_count="1").content == last.content
        assert turns(url, "restart") == [keyed.json()["id"], last.json()["id"]]


def test_a_store_from_before_idempotency_keys_opens_and_replays_its_turns_by_hash(tmp_path: Path):
    db_path = tmp_path / "old.db"
    reply = RecordedReply("chatcmpl-old", 5, "tiny", ParsedReply("ok"), "stop", 2, 1)
    schema = store._SCHEMA.replace(",\n    idempotency_key TEXT", "")
    write_old_store(db_path, schema, json.dumps(reply.to_json()))
    with sqlite3.connect(db_path) as db:
        assert "idempotency_key" not in [row[1] for row in db.execute("PRAGMA table_info(turns)")]

    async def reopen() -> Sessions:
        opened = Store(db_path)
        await opened.open()
        sessions = Sessions(opened, loaded_tokenizer(str(qwen3_tokenizer_dir())), "tiny")
        await sessions.recover()
        await opened.close()
        return sessions

    session = asyncio.run(reopen()).get("s")
    assert session.replay(Attempt("h", retry=True)) == reply
    assert session.replay(Attempt("h", idempotency_key="k")) is None and session.keyed == {}


# -- names and messages users see (item 6) ---------------------------------------------------


def test_replies_and_models_carry_the_served_model_name(tmp_path: Path):
    with inprocess_proxy(tmp_path / "p.db", served_model_name=["my-policy", "alias"]) as url:
        whole = httpx.post(url + CHAT, json=chat_body("named"), timeout=60).json()
        assert whole["model"] == "my-policy"
        streamed = httpx.post(url + CHAT, json=chat_body("named", stream=True), timeout=60).text
        chunks = [line[6:] for line in streamed.splitlines() if line.startswith("data: {")]
        assert chunks and {json.loads(chunk)["model"] for chunk in chunks} == {"my-policy"}
        models = httpx.get(url + "/v1/models").json()["data"]
        assert [m["id"] for m in models] == ["my-policy", "alias"]
        assert all(m["max_model_len"] == models[0]["max_model_len"] for m in models)
        client = OpenAI(base_url=url + "/v1", api_key="-")  # as an agent's SDK sees them
        assert [m.id for m in client.models.list()] == ["my-policy", "alias"]
        created = client.chat.completions.create(
            model="my-policy", messages=[{"role": "user", "content": "sdk"}]
        )
        assert created.model == "my-policy"


def test_without_a_served_model_name_replies_carry_the_name_vllm_serves(proxy):
    assert httpx.post(proxy + CHAT, json=chat_body("unnamed"), timeout=60).json()["model"] == "tiny"
    assert [m["id"] for m in httpx.get(proxy + "/v1/models").json()["data"]] == ["tiny"]


def test_served_model_name_flag_takes_names_as_vllm_serve_does():
    args = parser().parse_args(["serve", "--model", "/m", "--served-model-name", "a", "b"])
    assert settings_from_args(args, admin_key=None, agent_keys=[]).served_model_name == ["a", "b"]


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/v1/embeddings"),
        ("POST", "/v1/completions"),
        ("GET", "/v1/responses/resp_1/input_items"),
        ("POST", "/s/some-session/v1/embeddings"),
        ("GET", "/nowhere"),
    ],
)
def test_a_route_the_proxy_does_not_serve_is_a_404_naming_the_routes_it_serves(proxy, method, path):
    response = httpx.request(method, proxy + path, json={"model": "tiny", "input": "x"}, timeout=60)
    assert response.status_code == 404
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "not_found_error"
    assert f"does not serve {method} {path}" in error["message"]
    assert "POST /v1/chat/completions" in error["message"] and "GET /v1/models" in error["message"]
    assert "POST /v1/messages" in error["message"] and "POST /v1/responses" in error["message"]


def test_an_unknown_session_is_still_its_own_404(proxy):
    response = httpx.get(proxy + "/v1/sessions/no-such-session")
    assert response.status_code == 404 and "no open session" in response.json()["error"]["message"]
