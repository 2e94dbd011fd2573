"""What a reward may carry into training (issue 26, items 2–5): rewards bounded at the edge,
groups that belong to an owner, `info` stored once per session and capped, and no client field
that hides an episode from the trainer.

The real app in process in front of the stand-in vLLM (`tests/inprocess.py`), real SQLite.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from molt_proxy.wire.control import MAX_INFO_BYTES, MAX_INFO_DEPTH
from tests.inprocess import chat_body, inprocess_proxy, post

ADMIN_KEY = "admin-0123456789abcdef"
AGENT_A = "agent-a-0123456789abcdef"
AGENT_B = "agent-b-0123456789abcdef"
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
CHAT = "/v1/chat/completions"


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("reward-edge") / "store.db"


@pytest.fixture(scope="module")
def proxy(db: Path) -> Iterator[str]:
    with inprocess_proxy(db, admin_key=ADMIN_KEY, agent_keys=[AGENT_A, AGENT_B]) as url:
        yield url


def trajectories(proxy: str, session_id: str) -> list[dict[str, Any]]:
    data = httpx.get(f"{proxy}/v1/trajectories", params={"limit": 10_000}, headers=ADMIN).json()["data"]
    return [t for t in data if t["session_id"] == session_id]


def streamed(proxy: str) -> list[dict[str, Any]]:
    """Every trajectory the trainer's stream gives, up to its first keep-alive-free pause."""
    last = httpx.get(f"{proxy}/v1/trajectories", params={"limit": 10_000}, headers=ADMIN).json()["last_seq"]
    found = []
    headers = {**ADMIN, "accept": "text/event-stream"}
    with httpx.stream("GET", f"{proxy}/v1/trajectories", headers=headers, timeout=30) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                found.append(json.loads(line[6:]))
                if found[-1]["seq"] == last:
                    break
            elif line.startswith(":"):
                break
    return found


def episode(proxy: str, key: str, content: str = "hi", **headers: str) -> dict[str, Any]:
    answer = post(proxy, CHAT, json=chat_body(content), headers={**bearer(key), **headers})
    assert answer.status_code == 200, answer.text
    return answer.json()


# -- 2. rewards bounded at the edge -------------------------------------------------------------


@pytest.mark.parametrize("reward", [1e308, -1e308, 1e155, 1_000_000.5, -1e7])
def test_a_reward_outside_the_range_is_a_400_naming_reward_and_closes_nothing(proxy, reward):
    session = episode(proxy, ADMIN_KEY)["session_id"]
    refused = post(proxy, "/v1/rewards", json={"session_id": session, "reward": reward}, headers=ADMIN)
    assert refused.status_code == 400
    assert refused.json()["error"] == {
        "message": f"'reward' must be within [-1e+06, 1e+06] (serve --reward-range), not {reward:g}",
        "type": "invalid_request_error",
        "param": "reward",
        "code": None,
    }
    completion = httpx.get(f"{proxy}/v1/sessions/{session}", headers=ADMIN).json()["segments"][0]["turns"][0]
    per_turn = {"completion_id": completion, "reward": reward, "final": False}
    assert post(proxy, "/v1/rewards", json=per_turn, headers=ADMIN).status_code == 400
    assert httpx.get(f"{proxy}/v1/sessions/{session}", headers=ADMIN).json()["status"] == "open"
    edge = post(proxy, "/v1/rewards", json={"session_id": session, "reward": -1e6}, headers=ADMIN)
    assert edge.status_code == 200, edge.text
    assert [t["reward"] for t in trajectories(proxy, session)] == [-1e6]


def test_reward_range_is_a_serve_flag(tmp_path: Path):
    from molt_proxy.cli import parser, settings_from_args

    args = parser().parse_args(["serve", "--model", "m", "--reward-range", "0", "1"])
    assert settings_from_args(args, None, []).reward_range == (0.0, 1.0)
    default = parser().parse_args(["serve", "--model", "m"])
    assert settings_from_args(default, None, []).reward_range == (-1e6, 1e6)
    with pytest.raises(ValueError, match="LOW < HIGH"):
        settings_from_args(
            parser().parse_args(["serve", "--model", "m", "--reward-range", "1", "0"]), None, []
        )
    with inprocess_proxy(tmp_path / "store.db", reward_range=(0.0, 1.0)) as url:
        session = post(url, CHAT, json=chat_body()).json()["session_id"]
        refused = post(url, "/v1/rewards", json={"session_id": session, "reward": 2})
        assert refused.status_code == 400 and refused.json()["error"]["message"].startswith(
            "'reward' must be within [0, 1]"
        )


# -- 3. groups belong to an owner ---------------------------------------------------------------


def test_an_agent_cannot_put_episodes_into_another_agents_group(proxy):
    mine = post(proxy, "/v1/sessions", json={"group_id": "task-b"}, headers=bearer(AGENT_B))
    assert mine.status_code == 201
    forbidden = {
        "message": "group 'task-b' belongs to another key",
        "type": "permission_error",
        "param": "group_id",
        "code": None,
    }
    by_body = post(proxy, "/v1/sessions", json={"group_id": "task-b"}, headers=bearer(AGENT_A))
    assert (by_body.status_code, by_body.json()["error"]) == (403, forbidden)
    by_header = post(proxy, CHAT, json=chat_body(), headers={**bearer(AGENT_A), "x-group-id": "task-b"})
    assert (by_header.status_code, by_header.json()["error"]) == (403, forbidden)
    by_eval = post(
        proxy, "/v1/sessions", json={"group_id": "task-b", "train": False}, headers=bearer(AGENT_B)
    )
    assert by_eval.status_code == 201  # `eval/task-b` is a group of its own, B's now
    assert (
        post(proxy, "/v1/sessions", json={"group_id": "eval/task-b"}, headers=bearer(AGENT_A)).status_code
        == 403
    )
    # The owner joins its group again, by body or header; the admin key joins any group.
    again = post(proxy, CHAT, json=chat_body(), headers={**bearer(AGENT_B), "x-group-id": "task-b"})
    assert again.status_code == 200, again.text
    assert post(proxy, "/v1/sessions", json={"group_id": "task-b"}, headers=ADMIN).status_code == 201
    assert (
        post(proxy, "/v1/sessions", json={"group_id": "task-b"}, headers=bearer(AGENT_B)).status_code == 201
    )


def test_an_admin_group_is_not_an_agents(proxy):
    assert post(proxy, "/v1/sessions", json={"group_id": "admins"}, headers=ADMIN).status_code == 201
    assert (
        post(proxy, "/v1/sessions", json={"group_id": "admins"}, headers=bearer(AGENT_A)).status_code == 403
    )


def test_the_same_first_prompt_groups_an_agents_own_attempts_only(proxy):
    a1, a2 = (episode(proxy, AGENT_A, "the same task")["session_id"] for _ in range(2))
    b1 = episode(proxy, AGENT_B, "the same task")["session_id"]
    admin = episode(proxy, ADMIN_KEY, "the same task")["session_id"]
    for session, key in ((a1, AGENT_A), (a2, AGENT_A), (b1, AGENT_B), (admin, ADMIN_KEY)):
        reward = -100.0 if key == AGENT_A else 1.0
        closed = post(
            proxy, "/v1/rewards", json={"session_id": session, "reward": reward}, headers=bearer(key)
        )
        assert closed.status_code == 200, closed.text
    groups = {s: trajectories(proxy, s)[0]["group_id"] for s in (a1, a2, b1, admin)}
    assert groups[a1] == groups[a2]
    assert len({groups[a1], groups[b1], groups[admin]}) == 3
    assert all(group.startswith("prompt-") for group in groups.values())
    # A default group cannot be named, so nobody joins one by its id either.
    named = post(proxy, "/v1/sessions", json={"group_id": groups[b1]}, headers=bearer(AGENT_A))
    assert named.status_code == 400 and named.json()["error"]["param"] == "group_id"


def test_group_owners_survive_a_restart(tmp_path: Path):
    db = tmp_path / "store.db"
    with inprocess_proxy(db, admin_key=ADMIN_KEY, agent_keys=[AGENT_A, AGENT_B]) as url:
        assert (
            post(url, "/v1/sessions", json={"group_id": "kept"}, headers=bearer(AGENT_B)).status_code == 201
        )
    with inprocess_proxy(db, admin_key=ADMIN_KEY, agent_keys=[AGENT_A, AGENT_B]) as url:
        assert (
            post(url, "/v1/sessions", json={"group_id": "kept"}, headers=bearer(AGENT_A)).status_code == 403
        )
        assert (
            post(url, "/v1/sessions", json={"group_id": "kept"}, headers=bearer(AGENT_B)).status_code == 201
        )


# -- 4. info once per session, capped -----------------------------------------------------------


def test_info_is_stored_once_per_session_and_given_with_every_segment(proxy, db):
    session = post(proxy, "/v1/sessions", json={}, headers=ADMIN).json()["session_id"]
    for n in range(3):  # three unrelated first prompts: three chains
        answer = post(proxy, f"/s/{session}{CHAT}", json=chat_body(f"chain {n}"), headers=ADMIN)
        assert answer.status_code == 200, answer.text
    info = {"log": "x" * (MAX_INFO_BYTES - 100)}
    closed = post(
        proxy, "/v1/rewards", json={"session_id": session, "reward": 1, "info": info}, headers=ADMIN
    )
    assert closed.status_code == 200, closed.text
    got = trajectories(proxy, session)
    assert [t["segment"] for t in got] == [0, 1, 2] and all(t["info"] == info for t in got)
    assert [t["info"] for t in streamed(proxy) if t["session_id"] == session] == [info] * 3
    with sqlite3.connect(db) as conn:
        rows = conn.execute(
            "SELECT length(data) FROM trajectories WHERE session_id = ?", (session,)
        ).fetchall()
        [(kept,)] = conn.execute("SELECT info FROM sessions WHERE id = ?", (session,)).fetchall()
    assert len(rows) == 3 and all(size < 2_000 for (size,) in rows)  # the log is not in them
    assert json.loads(kept) == info


def test_an_info_too_large_or_too_deep_is_a_400_and_closes_nothing(proxy):
    session = episode(proxy, ADMIN_KEY)["session_id"]
    deep: Any = 1
    for _ in range(MAX_INFO_DEPTH):
        deep = [deep]
    for info, message in (
        (
            {"log": "x" * MAX_INFO_BYTES},
            f"info is {MAX_INFO_BYTES + 10} bytes as JSON; at most {MAX_INFO_BYTES}",
        ),
        ({"d": deep}, f"nests deeper than {MAX_INFO_DEPTH} levels"),
    ):
        refused = post(
            proxy, "/v1/rewards", json={"session_id": session, "reward": 1, "info": info}, headers=ADMIN
        )
        assert refused.status_code == 400
        assert refused.json()["error"]["param"] == "info" and message in refused.json()["error"]["message"]
    assert httpx.get(f"{proxy}/v1/sessions/{session}", headers=ADMIN).json()["status"] == "open"
    ok = {"d": deep[0]}  # one level less
    closed = post(proxy, "/v1/rewards", json={"session_id": session, "reward": 1, "info": ok}, headers=ADMIN)
    assert closed.status_code == 200, closed.text


# -- 5. no client field hides an episode from training ------------------------------------------


def test_info_side_true_does_not_hide_an_episode_from_the_trainer(proxy):
    session = episode(proxy, AGENT_A, "hide me")["session_id"]
    info = {"side": True, "rule": "a concise, sentence-case title"}
    closed = post(
        proxy,
        "/v1/rewards",
        json={"session_id": session, "reward": 0.5, "info": info},
        headers=bearer(AGENT_A),
    )
    assert closed.status_code == 200, closed.text
    [trajectory] = [t for t in streamed(proxy) if t["session_id"] == session]
    assert (trajectory["status"], trajectory["reward"], trajectory["info"]) == ("rewarded", 0.5, info)
