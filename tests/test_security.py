"""The key model (issue 9, items 1–3; docs/security.md): with an admin key, no route that
writes or reads training data answers without a key; a key acts only where its kind allows;
ids cannot be probed; keys are never stored, and the store is private to its user.

Runs the real app in process in front of the instant stand-in vLLM (`tests/inprocess.py`).
"""

from __future__ import annotations

import hashlib
import os
import sqlite3
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from molt_proxy.auth import load_keys
from molt_proxy.cli import parser
from molt_proxy.config import Settings
from tests.inprocess import chat_body, inprocess_proxy, post

ADMIN_KEY = "admin-0123456789abcdef"
AGENT_X = "agent-x-0123456789abcdef"
AGENT_Y = "agent-y-0123456789abcdef"
CHAT = "/v1/chat/completions"
UNAUTHENTICATED = {
    "error": {
        "message": "this route needs an API key (Authorization: Bearer <key>, x-api-key or x-goog-api-key)",
        "type": "authentication_error",
        "param": None,
        "code": "invalid_api_key",
    }
}


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


ADMIN = bearer(ADMIN_KEY)


def not_found(message: str, param: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "not_found_error", "param": param, "code": None}}


def forbidden(message: str, param: str | None = "session_id") -> dict[str, Any]:
    return {"error": {"message": message, "type": "permission_error", "param": param, "code": None}}


@pytest.fixture(scope="module")
def db_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("security") / "store.db"


@pytest.fixture(scope="module")
def proxy(db_path: Path) -> Iterator[str]:
    with inprocess_proxy(db_path, admin_key=ADMIN_KEY, agent_keys=[AGENT_X, AGENT_Y]) as url:
        yield url


def create(proxy: str, key: str, **body: str) -> dict[str, Any]:
    response = post(proxy, "/v1/sessions", json=body, headers=bearer(key))
    assert response.status_code == 201, response.text
    return response.json()


def turns(proxy: str, session_id: str) -> list[list[str]]:
    response = httpx.get(f"{proxy}/v1/sessions/{session_id}", headers=ADMIN)
    assert response.status_code == 200, response.text
    return [segment["turns"] for segment in response.json()["segments"]]


def reward(proxy: str, key: str, **body: object) -> httpx.Response:
    return post(proxy, "/v1/rewards", json={"reward": 1.0, **body}, headers=bearer(key))


# -- 1. nobody appends to a session that is not theirs ----------------------------------------


def test_anonymous_chat_is_refused_however_it_names_the_session_and_records_nothing(proxy):
    victim = create(proxy, ADMIN_KEY)["session_id"]
    attempts = [
        post(proxy, f"/s/{victim}{CHAT}", json=chat_body()),
        post(proxy, CHAT, json=chat_body(), headers={"x-session-id": victim}),
        post(proxy, CHAT, json=chat_body(metadata={"session_id": victim})),
        post(proxy, CHAT, json=chat_body()),  # inferred: no session at all
        post(proxy, CHAT, json=chat_body(), headers=bearer("not-a-key")),
    ]
    assert [r.status_code for r in attempts] == [401] * 5
    assert [r.json() for r in attempts[:4]] == [UNAUTHENTICATED] * 4
    assert attempts[4].json()["error"]["message"] == (
        "invalid API key (a session's key stops working when it closes)"
    )
    assert turns(proxy, victim) == []


def test_anonymous_caller_cannot_pre_create_a_session_with_a_group_header(proxy):
    refused = post(proxy, CHAT, json=chat_body(), headers={"x-session-id": "task-1", "x-group-id": "evil"})
    assert (refused.status_code, refused.json()) == (401, UNAUTHENTICATED)
    assert post(proxy, "/v1/sessions", json={"session_id": "task-1"}).status_code == 401
    # The real agent then gets its session, in its own group, not a 409.
    owned = post(
        proxy,
        CHAT,
        json=chat_body(),
        headers={**bearer(AGENT_X), "x-session-id": "task-1", "x-group-id": "g"},
    )
    assert owned.status_code == 200, owned.text
    assert owned.json()["session_id"] == "task-1"
    described = httpx.get(f"{proxy}/v1/sessions/task-1", headers=ADMIN).json()
    assert described["group_id"] == "g" and len(described["segments"][0]["turns"]) == 1


def test_a_session_key_chats_on_its_own_session_only(proxy):
    mine, other = create(proxy, ADMIN_KEY), create(proxy, ADMIN_KEY)
    key, theirs = bearer(mine["api_key"]), other["session_id"]
    refused = [
        post(proxy, CHAT, json=chat_body(), headers={**key, "x-session-id": theirs}),
        post(proxy, f"/s/{theirs}{CHAT}", json=chat_body(), headers=key),
        post(proxy, CHAT, json=chat_body(metadata={"session_id": theirs}), headers=key),
        post(proxy, CHAT, json=chat_body(), headers={**key, "x-session-id": "no-such-session"}),
    ]
    expected = forbidden("this session key may only chat on its own session")
    assert [(r.status_code, r.json()) for r in refused] == [(403, expected)] * 4
    assert post(proxy, "/v1/sessions", headers=key).status_code == 403
    assert httpx.get(f"{proxy}/v1/trajectories", headers=key).status_code == 403
    answered = post(proxy, CHAT, json=chat_body(), headers=key)
    assert answered.status_code == 200 and answered.json()["session_id"] == mine["session_id"]
    assert turns(proxy, theirs) == []
    assert turns(proxy, mine["session_id"]) == [[answered.json()["id"]]]
    described = httpx.get(f"{proxy}/v1/sessions/{mine['session_id']}", headers=key)
    assert described.status_code == 200 and described.json()["session_id"] == mine["session_id"]
    closed = reward(proxy, mine["api_key"], session_id=mine["session_id"])
    assert closed.status_code == 200 and closed.json()["status"] == "rewarded"


def test_an_agent_key_cannot_chat_on_or_reward_another_agents_session(proxy):
    session = create(proxy, AGENT_X, group_id="task-7")
    sid = session["session_id"]
    first = post(proxy, f"/s/{sid}{CHAT}", json=chat_body(), headers=bearer(AGENT_X))
    assert first.status_code == 200, first.text
    completion = first.json()["id"]
    expected = forbidden(f"session {sid!r} belongs to another key")
    by_path = post(proxy, f"/s/{sid}{CHAT}", json=chat_body("more"), headers=bearer(AGENT_Y))
    by_header = post(proxy, CHAT, json=chat_body("more"), headers={**bearer(AGENT_Y), "x-session-id": sid})
    by_meta = post(proxy, CHAT, json=chat_body("more", metadata={"session_id": sid}), headers=bearer(AGENT_Y))
    assert [(r.status_code, r.json()) for r in (by_path, by_header, by_meta)] == [(403, expected)] * 3
    by_session = reward(proxy, AGENT_Y, session_id=sid)
    assert (by_session.status_code, by_session.json()) == (
        404,
        not_found(f"no session {sid!r}", "session_id"),
    )
    per_turn = reward(proxy, AGENT_Y, completion_id=completion, final=False)
    assert per_turn.status_code == 404
    assert per_turn.json() == not_found(f"no completion {completion!r}", "completion_id")
    assert httpx.get(f"{proxy}/v1/sessions/{sid}", headers=bearer(AGENT_Y)).status_code == 404
    assert turns(proxy, sid) == [[completion]]
    # Agent keys read no trajectories and load no weights.
    assert httpx.get(f"{proxy}/v1/trajectories", headers=bearer(AGENT_X)).status_code == 403
    weights = post(proxy, "/v1/admin/weights", json={"path": "/x", "version": 1}, headers=bearer(AGENT_X))
    assert weights.status_code == 403
    # The owner may.
    assert httpx.get(f"{proxy}/v1/sessions/{sid}", headers=bearer(AGENT_X)).status_code == 200
    rewarded = reward(proxy, AGENT_X, session_id=sid)
    assert rewarded.status_code == 200 and rewarded.json()["status"] == "rewarded"
    [trajectory] = [
        t
        for t in httpx.get(f"{proxy}/v1/trajectories", headers=ADMIN).json()["data"]
        if t["session_id"] == sid
    ]
    assert trajectory["turns"][0]["completion_id"] == completion and trajectory["group_id"] == "task-7"


def test_an_agents_inferred_session_is_never_joined_by_another_agent(proxy):
    first = post(proxy, CHAT, json=chat_body("inferred-x"), headers=bearer(AGENT_X)).json()
    continued = {
        "model": "tiny",
        "messages": [
            {"role": "user", "content": "inferred-x"},
            {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
            {"role": "user", "content": "and then?"},
        ],
    }
    by_y = post(proxy, CHAT, json=continued, headers=bearer(AGENT_Y)).json()
    assert by_y["session_id"] != first["session_id"]
    by_x = post(proxy, CHAT, json=continued, headers=bearer(AGENT_X)).json()
    assert by_x["session_id"] == first["session_id"]


# -- 3. unknown and forbidden sessions answer alike ---------------------------------------------


def test_unknown_and_forbidden_sessions_answer_alike(proxy):
    hidden = create(proxy, ADMIN_KEY)["session_id"]
    completion = post(proxy, f"/s/{hidden}{CHAT}", json=chat_body(), headers=ADMIN).json()["id"]
    closed = create(proxy, AGENT_X)["session_id"]
    assert reward(proxy, AGENT_X, session_id=closed).status_code == 200
    unknown_completion = "chatcmpl-0123456789abcdef0123456789abcdef"

    # Without a key, everything is 401 before any lookup.
    for path in (f"/v1/sessions/{hidden}", "/v1/sessions/no-such"):
        response = httpx.get(proxy + path)
        assert (response.status_code, response.json()) == (401, UNAUTHENTICATED)
    for body in ({"session_id": hidden}, {"session_id": "no-such"}, {"completion_id": completion}):
        response = post(proxy, "/v1/rewards", json={**body, "reward": 1})
        assert (response.status_code, response.json()) == (401, UNAUTHENTICATED)

    # With another principal's key, a hidden id answers as an unknown one.
    session_key = create(proxy, ADMIN_KEY)["api_key"]
    for key in (AGENT_Y, session_key):
        for sid in (hidden, "no-such"):
            response = httpx.get(f"{proxy}/v1/sessions/{sid}", headers=bearer(key))
            assert (response.status_code, response.json()) == (
                404,
                not_found(f"no open session {sid!r}", "session_id"),
            )
        for sid in (hidden, closed, "no-such"):
            response = reward(proxy, key, session_id=sid)
            assert (response.status_code, response.json()) == (
                404,
                not_found(f"no session {sid!r}", "session_id"),
            )
        for cid in (completion, unknown_completion):
            for final in (True, False):
                response = reward(proxy, key, completion_id=cid, final=final)
                assert (response.status_code, response.json()) == (
                    404,
                    not_found(f"no completion {cid!r}", "completion_id"),
                )
    # The owner sees its closed session as closed.
    assert reward(proxy, AGENT_X, session_id=closed).status_code == 409
    assert turns(proxy, hidden) == [[completion]]


# -- 2. keys: where they come from, how they are sent, how they are kept ------------------------


def test_x_api_key_header_is_accepted(proxy):
    assert httpx.get(f"{proxy}/v1/trajectories", headers={"x-api-key": ADMIN_KEY}).status_code == 200
    minted = post(proxy, "/v1/sessions", headers={"x-api-key": AGENT_X}).json()
    answered = post(proxy, CHAT, json=chat_body(), headers={"x-api-key": minted["api_key"]})
    assert answered.status_code == 200 and answered.json()["session_id"] == minted["session_id"]


def test_open_routes_need_no_key(proxy):
    for path in ("/health", "/v1/models", "/openapi.json", "/docs"):
        assert httpx.get(proxy + path).status_code == 200, path


def test_keys_are_stored_hashed_and_the_store_is_private(proxy, db_path):
    minted = create(proxy, ADMIN_KEY)
    answered = post(proxy, CHAT, json=chat_body(), headers=bearer(minted["api_key"]))
    assert answered.status_code == 200
    by_agent = create(proxy, AGENT_X)
    files = [db_path, Path(f"{db_path}-wal"), Path(f"{db_path}-shm")]
    for file in files:
        assert stat.S_IMODE(file.stat().st_mode) == 0o600, file
        content = file.read_bytes()
        for key in (ADMIN_KEY, AGENT_X, AGENT_Y, minted["api_key"], by_agent["api_key"]):
            assert key.encode() not in content, (file, key)
    db = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    query = "SELECT api_key_hash, owner FROM sessions WHERE id = ?"
    assert db.execute(query, (minted["session_id"],)).fetchone() == (sha256(minted["api_key"]), None)
    assert db.execute(query, (by_agent["session_id"],)).fetchone() == (
        sha256(by_agent["api_key"]),
        sha256(AGENT_X),
    )
    db.close()


def test_a_store_with_plain_session_keys_is_migrated_and_its_keys_still_work(tmp_path):
    path = tmp_path / "old.db"
    old = sqlite3.connect(path)
    old.execute(
        "CREATE TABLE sessions (id TEXT PRIMARY KEY, group_id TEXT, api_key TEXT UNIQUE,"
        " inferred INTEGER NOT NULL, status TEXT NOT NULL, reward REAL,"
        " info TEXT NOT NULL DEFAULT '{}', created REAL NOT NULL, closed REAL)"
    )
    old.execute(
        "INSERT INTO sessions VALUES ('old', 'g', 'mp-sess-oldkey', 0, 'open', NULL, '{}', 1.0, NULL)"
    )
    old.commit()
    old.close()
    os.chmod(path, 0o644)
    with inprocess_proxy(path, admin_key=ADMIN_KEY) as proxy:
        answered = post(proxy, CHAT, json=chat_body(), headers=bearer("mp-sess-oldkey"))
        assert answered.status_code == 200 and answered.json()["session_id"] == "old"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    db = sqlite3.connect(path)
    assert db.execute("SELECT api_key_hash, owner FROM sessions").fetchall() == [
        (sha256("mp-sess-oldkey"), None)
    ]
    db.close()
    assert b"mp-sess-oldkey" not in path.read_bytes()


def test_keys_come_from_flags_files_and_the_environment(tmp_path):
    admin_file, agents_file = tmp_path / "admin", tmp_path / "agents"
    admin_file.write_text(ADMIN_KEY + "\n")
    agents_file.write_text(f"{AGENT_X}\n\n{AGENT_Y}\n")
    args = parser().parse_args(
        ["serve", "--model", "m", "--admin-key-file", str(admin_file), "--agent-key", "flag-agent"]
        + ["--agent-keys-file", str(agents_file)]
    )
    environ = {"MOLT_PROXY_ADMIN_KEY": "from-env", "MOLT_PROXY_AGENT_KEYS": " env-a, env-b ,"}
    admin, agents = load_keys(
        args.admin_key, args.admin_key_file, args.agent_key, args.agent_keys_file, environ
    )
    assert admin == ADMIN_KEY  # the file beats the environment
    assert agents == ["flag-agent", AGENT_X, AGENT_Y, "env-a", "env-b"]
    assert load_keys(None, None, [], None, environ) == ("from-env", ["env-a", "env-b"])
    assert load_keys("flag", None, [], None, environ)[0] == "flag"
    assert load_keys(None, None, [], None, {}) == (None, [])
    with pytest.raises(ValueError, match="not both"):
        load_keys("flag", admin_file, [], None, {})
    with pytest.raises(ValueError, match="exactly one key"):
        load_keys(None, agents_file, [], None, {})
    with pytest.raises(ValueError, match="need an admin key"):
        Settings(model="m", agent_keys=[AGENT_X])
    settings = Settings(model="m", admin_key=admin, agent_keys=agents)
    assert ADMIN_KEY not in repr(settings) and AGENT_X not in repr(settings)

    # The keys so loaded guard a running proxy.
    with inprocess_proxy(tmp_path / "env.db", admin_key=admin, agent_keys=agents) as proxy:
        assert post(proxy, "/v1/sessions").status_code == 401
        assert post(proxy, "/v1/sessions", headers=bearer("env-b")).status_code == 201
        assert httpx.get(f"{proxy}/v1/trajectories", headers=ADMIN).status_code == 200
        assert httpx.get(f"{proxy}/v1/trajectories", headers=bearer("from-env")).status_code == 401


def test_without_an_admin_key_every_route_stays_open(tmp_path):
    with inprocess_proxy(tmp_path / "open.db") as proxy:
        answered = post(proxy, f"/s/open{CHAT}", json=chat_body())
        assert answered.status_code == 200
        assert httpx.get(f"{proxy}/v1/sessions/open").json()["segments"][0]["turns"] == [
            answered.json()["id"]
        ]
        minted = post(proxy, "/v1/sessions").json()
        by_key = post(proxy, CHAT, json=chat_body(), headers=bearer(minted["api_key"]))
        assert by_key.json()["session_id"] == minted["session_id"]
        assert reward(proxy, "anything", session_id="open").status_code == 200
        assert httpx.get(f"{proxy}/v1/trajectories").status_code == 200


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()
