"""`POST /v1/sessions/{id}/close`: a session ended without a reward (its harness crashed or timed
out) is closed unrewarded with the reason in `info`, kept and streamed, under the same keys and
visibility as a reward; `MoltSession.close` calls it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from integrations.session import create_session
from tests.helpers import trajectories
from tests.inprocess import chat_body, inprocess_proxy, post

ADMIN_KEY = "admin-0123456789abcdef"
AGENT_X = "agent-x-0123456789abcdef"
AGENT_Y = "agent-y-0123456789abcdef"


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("close")


@pytest.fixture(scope="module")
def proxy(tmp: Path) -> Iterator[str]:
    with inprocess_proxy(tmp / "open.db") as url:
        yield url


@pytest.fixture(scope="module")
def keyed(tmp: Path) -> Iterator[str]:
    with inprocess_proxy(tmp / "keyed.db", admin_key=ADMIN_KEY, agent_keys=[AGENT_X, AGENT_Y]) as url:
        yield url


def test_a_closed_session_is_kept_unrewarded_with_its_reason(proxy: str) -> None:
    session = create_session(proxy, group_id="task-1")
    session.client.chat.completions.create(**chat_body())
    answer = session.close({"reason": "timed out after 5s", "exit_code": None})
    assert answer["session_id"] == session.session_id and answer["status"] == "unrewarded"
    assert [t["trajectory_id"] for t in answer["trajectories"]] == [f"{session.session_id}:0"]
    (record,) = [t for t in trajectories(proxy) if t["session_id"] == session.session_id]
    assert (record["status"], record["reward"], record["group_id"]) == ("unrewarded", None, "task-1")
    assert record["info"] == {"reason": "timed out after 5s", "exit_code": None}
    assert record["seq"] == answer["trajectories"][0]["seq"]


def test_an_empty_body_closes_with_empty_info_and_a_session_without_turns_leaves_no_trajectory(
    proxy: str,
) -> None:
    session = create_session(proxy)
    response = post(proxy, f"/v1/sessions/{session.session_id}/close")
    assert response.status_code == 200, response.text
    assert response.json() == {"session_id": session.session_id, "status": "unrewarded", "trajectories": []}


def test_closing_twice_or_after_a_reward_is_a_conflict_and_an_unknown_session_is_not_found(
    proxy: str,
) -> None:
    closed, rewarded = create_session(proxy), create_session(proxy)
    closed.close()
    rewarded.reward(1.0)
    for session in (closed, rewarded):
        response = post(proxy, f"/v1/sessions/{session.session_id}/close", json={})
        assert response.status_code == 409
        assert response.json()["error"]["message"] == f"session {session.session_id!r} is already closed"
        assert response.json()["error"]["type"] == "conflict_error"
    response = post(proxy, "/v1/sessions/nobody/close", json={})
    assert response.status_code == 404
    assert response.json()["error"]["message"] == "no session 'nobody'"
    with pytest.raises(httpx.HTTPStatusError):
        closed.close()


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"info": "crashed"}, "invalid value for 'info': Input should be a valid dictionary"),
        ([1], "the request body must be a JSON object"),
    ],
)
def test_a_bad_body_is_refused_and_leaves_the_session_open(proxy: str, body: object, message: str) -> None:
    session = create_session(proxy)
    response = post(proxy, f"/v1/sessions/{session.session_id}/close", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith(message)
    assert httpx.get(f"{proxy}/v1/sessions/{session.session_id}").json()["status"] == "open"


def test_with_keys_the_session_key_its_owner_and_the_admin_may_close_and_nobody_else(keyed: str) -> None:
    mine = create_session(keyed, admin_key=AGENT_X)
    theirs = create_session(keyed, admin_key=AGENT_Y)
    path = f"/v1/sessions/{theirs.session_id}/close"
    assert post(keyed, path, json={}).status_code == 401
    for key in (mine.api_key, AGENT_X):  # another session's key, another agent's key
        response = post(keyed, path, json={}, headers=bearer(key))
        assert response.status_code == 404
        assert response.json()["error"]["message"] == f"no session {theirs.session_id!r}"
    assert theirs.close({"reason": "crashed"})["status"] == "unrewarded"  # its own session key
    owned = create_session(keyed, admin_key=AGENT_X)
    assert post(keyed, f"/v1/sessions/{owned.session_id}/close", json={}, headers=bearer(AGENT_X)).is_success
    other = create_session(keyed, admin_key=AGENT_Y)
    assert post(
        keyed, f"/v1/sessions/{other.session_id}/close", json={}, headers=bearer(ADMIN_KEY)
    ).is_success
