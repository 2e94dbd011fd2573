"""Edge inputs (issue 26, items 6, 7, 9, 13): hints that once crashed the proxy are read
safely, session and group ids are limited to a charset and a length, log lines cannot be
forged, a token count is refused on a session its key may not use, and Claude Code's probe of
a session base URL is answered.

All against the in-process proxy (real app, Qwen3 tokenizer, SQLite) and the stand-in vLLM.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any
from urllib.parse import unquote

import httpx
import pytest

from molt_proxy import logs
from tests.inprocess import chat_body, inprocess_proxy
from tests.test_hardening import _local_port, assert_refused

ADMIN_KEY = "admin-edge-0123456789abcdef"
AGENT_X = "agent-x-edge-0123456789abcdef"
AGENT_Y = "agent-y-edge-0123456789abcdef"
CLAUDE_CODE_SESSION = "0198c4d5-6e1f-7a2b-9c3d-4e5f6a7b8c9d"
"""A UUID, as Claude Code and Codex name their sessions."""
CODEX_SESSION = "0198c4d5-aaaa-7bbb-8ccc-0123456789ab"


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    """One client, so one keep-alive connection, for the whole module."""
    with inprocess_proxy(tmp_path_factory.mktemp("edge") / "p.db") as url:
        with httpx.Client(base_url=url, timeout=60) as http:
            yield http


def messages_body(content: str = "hi", **fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": content}], **fields}


def assert_anthropic_refused(client: httpx.Client, response: httpx.Response, message: str) -> None:
    """A 400 with exactly Anthropic's error body, and the same connection still serves."""
    assert (response.status_code, response.json()) == (
        400,
        {"type": "error", "error": {"type": "invalid_request_error", "message": message}},
    )
    after = client.post("/v1/messages", json=messages_body("still there?"))
    assert after.status_code == 200, after.text
    assert _local_port(after) == _local_port(response), "the connection was closed after the error"


def _user_id(inner: str) -> bytes:
    """A messages request whose `metadata.user_id` is the JSON text `inner`, as Claude Code
    sends its session: a JSON string inside the JSON body."""
    body = messages_body(metadata={"user_id": "@"})
    return json.dumps(body).encode().replace(b'"@"', json.dumps(inner).encode())


# -- item 6: hints that cannot be read are ignored, never a 500 -------------------------------

UNREADABLE_USER_IDS = {
    "nested 100k deep": '{"session_id": "deep", "a": ' + "[" * 100_000 + "]" * 100_000 + "}",
    "a 5,000-digit int": '{"session_id": "digits", "n": ' + "7" * 5000 + "}",
    "a lone surrogate": '{"session_id": "a\\ud800b"}',
    "a session id with a newline": '{"session_id": "a\\nb"}',
    "an 8 KB session id": json.dumps({"session_id": "x" * 8192}),
    "not JSON": '{"session_id": ',
    "a JSON array": "[1, 2]",
}


@pytest.mark.parametrize("route", ["/v1/messages", "/v1/messages/count_tokens"])
@pytest.mark.parametrize("inner", UNREADABLE_USER_IDS.values(), ids=UNREADABLE_USER_IDS.keys())
def test_a_user_id_hint_that_cannot_be_read_is_ignored(client, route, inner):
    """Anthropic's `user_id` is an opaque string: the proxy reads Claude Code's session out of
    it when it can, and otherwise serves the request as if it named none (inferred)."""
    response = client.post(route, content=_user_id(inner), headers={"content-type": "application/json"})
    assert response.status_code == 200, response.text
    if route == "/v1/messages":
        named = {"deep", "digits", "a\ud800b", "a\nb", "x" * 8192}
        assert response.json()["session_id"] not in named
        assert len(response.json()["session_id"]) == 32  # minted: an inferred session
    else:
        assert set(response.json()) == {"input_tokens"}
    assert _local_port(client.post("/v1/messages", json=messages_body("after"))) == _local_port(response)


def test_a_claude_code_user_id_still_names_its_session(client):
    user_id = json.dumps({"device_id": "d" * 64, "account_uuid": "", "session_id": CLAUDE_CODE_SESSION})
    response = client.post("/v1/messages", json=messages_body(metadata={"user_id": user_id}))
    assert response.status_code == 200, response.text
    assert response.json()["session_id"] == CLAUDE_CODE_SESSION


def test_a_retry_count_past_pythons_int_digit_limit_is_read_as_what_it_says(client):
    """`x-stainless-retry-count` is a hint: 0s alone are a first try, any other digit a retry
    (the recorded reply again), anything but digits is no hint at all."""
    headers = {"x-session-id": "retry-digits"}
    body = chat_body("count me", max_tokens=4)
    first = client.post(
        "/v1/chat/completions", json=body, headers={**headers, "x-stainless-retry-count": "0"}
    )
    assert first.status_code == 200, first.text

    def send(count: str) -> httpx.Response:
        response = client.post(
            "/v1/chat/completions", json=body, headers={**headers, "x-stainless-retry-count": count}
        )
        assert response.status_code == 200, response.text
        assert _local_port(response) == _local_port(first)
        return response

    assert send("0" * 5000 + "1").json()["id"] == first.json()["id"]  # a retry: replayed
    fresh = send("0" * 5000)  # a first try: sampled anew
    assert fresh.json()["id"] != first.json()["id"]
    assert send("9" * 4301).json()["id"] == fresh.json()["id"]
    assert send("x" * 5000).json()["id"] == fresh.json()["id"]  # no hint: the same body retries


# -- item 7: session and group ids are checked -------------------------------------------------


def _session_message(param: str, given: int) -> str:
    return f"'{param}' must be 1 to 128 characters of letters, digits, '.', '_', ':' and '-' ({given} given)"


def _group_message(param: str, given: int) -> str:
    return (
        f"'{param}' must be 1 to 256 characters of letters, digits, '.', '_', ':' and '-' and '/' "
        f"({given} given)"
    )


@pytest.mark.parametrize(
    "session", ["%00", "%20", "a%0AINFO forged", "x" * 8192, "a%2Fb", "caf%C3%A9", "x" * 129]
)
def test_a_session_id_in_the_path_outside_the_charset_or_length_is_400(client, session):
    response = client.post(f"/s/{session}/v1/chat/completions", json=chat_body(max_tokens=4))
    if session == "a%2Fb":  # decoded, it is two path segments: no route
        assert response.status_code == 404
        return
    error = assert_refused(client, response, param="session_id")
    assert error["message"] == _session_message("session_id", len(unquote(session)))


@pytest.mark.parametrize("session", [" ", "a\nb", "x" * 8192, "a/b", "tab\there", "é", ""])
def test_a_metadata_session_id_outside_the_charset_or_length_is_400(client, session):
    response = client.post(
        "/v1/chat/completions", json=chat_body(max_tokens=4, metadata={"session_id": session})
    )
    error = assert_refused(client, response, param="metadata.session_id")
    if session:
        assert error["message"] == _session_message("metadata.session_id", len(session))


def test_a_metadata_session_id_with_a_newline_is_400_in_anthropics_shape(client):
    forged = "a\n2026-12-02 INFO forged"
    response = client.post("/v1/messages", json=messages_body(metadata={"session_id": forged}))
    assert_anthropic_refused(client, response, _session_message("metadata.session_id", len(forged)))
    counted = client.post("/v1/messages/count_tokens", json=messages_body(metadata={"session_id": " "}))
    assert_anthropic_refused(client, counted, _session_message("metadata.session_id", 1))


def test_a_responses_metadata_session_id_is_checked_and_a_codex_hint_ignored(client):
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 4, "store": False}
    refused = client.post("/v1/responses", json={**body, "metadata": {"session_id": "a b"}})
    assert_refused(client, refused, param="metadata.session_id")
    hinted = client.post("/v1/responses", json={**body, "client_metadata": {"session_id": "a\nb"}})
    assert hinted.status_code == 200, hinted.text
    codex = client.post("/v1/responses", json={**body, "client_metadata": {"session_id": CODEX_SESSION}})
    assert codex.status_code == 200, codex.text
    described = client.get(f"/v1/sessions/{CODEX_SESSION}")
    assert described.status_code == 200 and len(described.json()["segments"]) == 1


@pytest.mark.parametrize(
    ("headers", "param", "message"),
    [
        ({"x-session-id": "a b"}, "X-Session-Id", _session_message("X-Session-Id", 3)),
        ({"x-session-id": "x" * 8192}, "X-Session-Id", _session_message("X-Session-Id", 8192)),
        ({"x-session-id": "a/b"}, "X-Session-Id", _session_message("X-Session-Id", 3)),
        ({"x-group-id": "a b"}, "X-Group-Id", _group_message("X-Group-Id", 3)),
        ({"x-group-id": "g" * 257}, "X-Group-Id", _group_message("X-Group-Id", 257)),
    ],
)
def test_a_session_or_group_header_outside_the_charset_or_length_is_400(client, headers, param, message):
    response = client.post("/v1/chat/completions", json=chat_body(max_tokens=4), headers=headers)
    assert assert_refused(client, response, param=param)["message"] == message


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"session_id": "a\nb"}, "session_id", _session_message("session_id", 3)),
        ({"session_id": "x" * 8192}, "session_id", _session_message("session_id", 8192)),
        ({"session_id": " "}, "session_id", _session_message("session_id", 1)),
        ({"group_id": "a\x00b"}, "group_id", _group_message("group_id", 3)),
        ({"group_id": "g" * 257}, "group_id", _group_message("group_id", 257)),
    ],
)
def test_a_created_session_or_group_id_outside_the_charset_or_length_is_400(client, body, param, message):
    assert assert_refused(client, client.post("/v1/sessions", json=body), param=param)["message"] == message


def test_every_id_clients_send_and_the_proxy_mints_is_accepted(client):
    """UUIDs (Claude Code, Codex), the proxy's own `side-<hex>` and `uuid4().hex`, ids at the
    length limit, `eval/<group>` groups, task paths."""
    for session in (CLAUDE_CODE_SESSION, "side-" + "0" * 32, "f" * 32, "a" * 128, "task_1.attempt:2"):
        response = client.post(f"/s/{session}/v1/chat/completions", json=chat_body(max_tokens=4))
        assert (response.status_code, response.json()["session_id"]) == (200, session)
    by_header = client.post(
        "/v1/chat/completions",
        json=chat_body(max_tokens=4),
        headers={"x-session-id": "hdr-" + "0" * 124, "x-group-id": "swe/django-11099:" + "g" * 239},
    )
    assert by_header.status_code == 200, by_header.text
    created = client.post("/v1/sessions", json={"session_id": "made.1", "group_id": "task-0123456789abcdef"})
    assert created.status_code == 201 and created.json()["group_id"] == "task-0123456789abcdef"
    # The proxy's own default groups (`prompt-<hex>`) are well formed, but no client names one.
    reserved = client.post("/v1/sessions", json={"group_id": "prompt-0123456789abcdef"})
    assert reserved.status_code == 400 and reserved.json()["error"]["param"] == "group_id"
    evaluated = client.post("/v1/sessions", json={"group_id": "digits", "train": False})
    assert evaluated.status_code == 201 and evaluated.json()["group_id"] == "eval/digits"
    # A side request's session is minted by the proxy, whatever session the request names.
    title = messages_body(system="Generate a concise, sentence-case title for this conversation.")
    side = client.post("/v1/messages", json=title, headers={"x-session-id": CLAUDE_CODE_SESSION})
    assert side.status_code == 200 and side.json()["session_id"].startswith("side-")


def test_a_text_log_line_escapes_the_control_characters_a_client_sent(client, capsys):
    """A newline in a session id in the path would start a forged line of its own."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    capsys.readouterr()
    root.handlers.clear()  # out of `configure`'s reach: basicConfig(force=True) closes what it removes
    logs.configure("text")
    try:
        response = client.post("/s/a%0A2026-12-02 INFO forged/v1/chat/completions", json=chat_body())
        assert response.status_code == 400
        logging.getLogger("molt_proxy.test").info("a message\r\nwith %s", "lines\x1b[31m")
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    written = capsys.readouterr().err.splitlines()
    [request] = [line for line in written if "molt_proxy.requests" in line]
    assert "session=a\\x0a2026-12-02 INFO forged " in request
    assert not [line for line in written if line.startswith("2026-12-02 INFO forged")]
    [ours] = [line for line in written if "molt_proxy.test" in line]
    assert ours.endswith("INFO molt_proxy.test: a message\\x0d\\x0awith lines\\x1b[31m")


# -- item 13: Claude Code's probe of its base URL ----------------------------------------------


def test_a_session_base_url_answers_head_and_get_as_the_root_does(client):
    root_head, root_get = client.head("/"), client.get("/")
    head, get = client.head(f"/s/{CLAUDE_CODE_SESSION}"), client.get(f"/s/{CLAUDE_CODE_SESSION}")
    assert (root_head.status_code, root_get.status_code, head.status_code, get.status_code) == (200,) * 4
    assert get.json() == root_get.json() == {"status": "ok", "service": "molt-proxy"}
    assert head.content == b"" and head.headers["content-length"] == root_head.headers["content-length"]
    assert assert_refused(client, client.get("/s/a%20b"), param="session_id")


# -- item 9: a token count on another owner's session ------------------------------------------


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    db = tmp_path_factory.mktemp("edge-keys") / "p.db"
    with inprocess_proxy(db, admin_key=ADMIN_KEY, agent_keys=[AGENT_X, AGENT_Y]) as url:
        yield url


def test_count_tokens_on_another_owners_session_is_refused_as_a_turn_on_it_is(keyed):
    x, y = {"x-api-key": AGENT_X}, {"x-api-key": AGENT_Y}
    with httpx.Client(base_url=keyed, timeout=60) as http:
        created = http.post("/v1/sessions", json={}, headers=x)
        sid = created.json()["session_id"]
        assert http.post(f"/s/{sid}/v1/messages", json=messages_body("mine"), headers=x).status_code == 200
        forbidden = {
            "type": "error",
            "error": {"type": "permission_error", "message": f"session {sid!r} belongs to another key"},
        }
        answers = [
            http.post(f"/s/{sid}/v1/messages", json=messages_body("theirs"), headers=y),
            http.post(f"/s/{sid}/v1/messages/count_tokens", json=messages_body("theirs"), headers=y),
            http.post(
                "/v1/messages/count_tokens", json=messages_body("theirs"), headers={**y, "x-session-id": sid}
            ),
            http.post(
                "/v1/messages/count_tokens",
                json=messages_body("theirs", metadata={"session_id": sid}),
                headers=y,
            ),
        ]
        assert [(r.status_code, r.json()) for r in answers] == [(403, forbidden)] * 4
        own = http.post(f"/s/{sid}/v1/messages/count_tokens", json=messages_body("mine"), headers=x)
        assert own.status_code == 200 and own.json()["input_tokens"] > 0
        unknown = http.post("/s/nobody-yet/v1/messages/count_tokens", json=messages_body("new"), headers=y)
        assert unknown.status_code == 200  # counted as a new session would be; nothing created
        assert http.get("/v1/sessions/nobody-yet", headers={"x-api-key": ADMIN_KEY}).status_code == 404
