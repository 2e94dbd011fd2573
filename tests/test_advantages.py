"""The advantages the trainer posts for the viewer (`POST /v1/admin/advantages`,
`trainer/report.py`): stored and read back exactly, bad bodies refused whole with OpenAI-shaped
errors, the admin key's rules, and the trainer's own post of a small hand-computed group.

All in-process: the real app and SQLite in front of the stand-in vLLM, no torch model. The
group: session `a` (two turns) rewarded 1.0 and session `b` (one turn) rewarded 0.25, so
Dr. GRPO's advantages are r - mean = +-0.375; with per-turn credit (gamma 1) turn 0 of both
is +-0.375 and a's turn 1, which no other attempt reached, 0.
"""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path
from typing import Any

import httpx
import pytest

from molt_proxy.launcher import free_port
from molt_proxy.types import Trajectory
from tests.inprocess import chat_body, inprocess_proxy, post
from trainer.advantage import Estimator
from trainer.buffer import Group
from trainer.credit import step_advantages
from trainer.report import AdvantageReport

ADMIN = "admin-advantages-0123456789abcdef"
AGENT = "agent-advantages-0123456789"


def episode(url: str, session: str, turns: int, reward: float) -> None:
    post(url, "/v1/sessions", json={"session_id": session, "group_id": "g"}).raise_for_status()
    messages: list[dict[str, Any]] = []
    for k in range(turns):
        messages.append({"role": "user", "content": f"question {k}"})
        reply = post(url, f"/s/{session}/v1/chat/completions", json=chat_body(messages=messages))
        assert reply.status_code == 200, reply.text
        messages.append(reply.json()["choices"][0]["message"])
    post(url, "/v1/rewards", json={"session_id": session, "reward": reward}).raise_for_status()


def stored(url: str) -> dict[str, dict[str, Any]]:
    return {t["trajectory_id"]: t for t in httpx.get(f"{url}/v1/trajectories").json()["data"]}


def posted(url: str, seq: int) -> dict[str, Any] | None:
    return httpx.get(f"{url}/ui/api/trajectories/{seq}").json()["advantages"]


def error(status: int, message: str, param: str, kind: str = "invalid_request_error") -> tuple:
    return status, {"error": {"message": message, "type": kind, "param": param, "code": None}}


def test_posted_advantages_are_stored_read_back_replaced_and_bad_bodies_refused_whole(tmp_path: Path):
    with inprocess_proxy(tmp_path / "p.db") as url:
        episode(url, "a", 2, 1.0)
        episode(url, "b", 1, 0.25)
        seqs = {tid: t["seq"] for tid, t in stored(url).items()}
        assert seqs == {"a:0": 1, "b:0": 2}
        assert posted(url, 1) is None
        body = {
            "step": 3,
            "version": 3,
            "trajectories": [
                {"trajectory_id": "a:0", "advantage": 0.375},
                {"trajectory_id": "b:0", "turn_advantages": [-0.375]},
            ],
        }
        answer = post(url, "/v1/admin/advantages", json=body)
        assert (answer.status_code, answer.json()) == (200, {"stored": 2, "step": 3, "version": 3})
        a = {"step": 3, "version": 3, "advantage": 0.375, "turn_advantages": None}
        b = {"step": 3, "version": 3, "advantage": None, "turn_advantages": [-0.375]}
        assert (posted(url, 1), posted(url, 2)) == (a, b)

        def refused(trajectories: Any, **fields: Any) -> tuple:
            response = post(
                url,
                "/v1/admin/advantages",
                json={"step": 9, "version": 9, "trajectories": trajectories, **fields},
            )
            return response.status_code, response.json()

        new_a = {"trajectory_id": "a:0", "advantage": -1.0}
        assert refused([new_a, {"trajectory_id": "zz:0", "advantage": 1.0}]) == error(
            404, "no trajectory 'zz:0'", "trajectories.1.trajectory_id", "not_found_error"
        )
        assert refused([new_a, {"trajectory_id": "a:0", "turn_advantages": [1.0]}]) == error(
            400, "trajectory 'a:0' has 2 turns, not 1 turn advantages", "trajectories.1.turn_advantages"
        )
        both = {"trajectory_id": "a:0", "advantage": 1.0, "turn_advantages": [1.0, 2.0]}
        exactly_one = "give exactly one of 'advantage' and 'turn_advantages'"
        assert refused([both]) == error(400, exactly_one, "trajectories.0.advantage")
        assert refused([{"trajectory_id": "a:0"}]) == error(400, exactly_one, "trajectories.0.advantage")
        assert refused([]) == error(
            400,
            "invalid value for 'trajectories': List should have at least 1 item after validation, not 0",
            "trajectories",
        )
        assert refused([{"trajectory_id": "a:0", "advantage": "1"}]) == error(
            400,
            "invalid value for 'trajectories.0.advantage': Input should be a valid number",
            "trajectories.0.advantage",
        )
        assert refused([new_a], step=-1) == error(
            400, "invalid value for 'step': Input should be greater than or equal to 0", "step"
        )
        not_object = post(url, "/v1/admin/advantages", content=b"[1]")
        assert (not_object.status_code, not_object.json()["error"]["message"]) == (
            400,
            "the request body must be a JSON object",
        )
        assert posted(url, 1) == a  # every refused body stored nothing, not even its good entries

        post(url, "/v1/admin/advantages", json={"step": 4, "version": 5, "trajectories": [new_a]})
        assert posted(url, 1) == {"step": 4, "version": 5, "advantage": -1.0, "turn_advantages": None}
    with inprocess_proxy(tmp_path / "p.db") as url:  # durable: a restarted proxy still has them
        assert posted(url, 2) == b
    with sqlite3.connect(tmp_path / "p.db") as db:  # a store from before the table: it gains it
        db.execute("DROP TABLE advantages")
    with inprocess_proxy(tmp_path / "p.db") as url:
        assert posted(url, 2) is None
        post(url, "/v1/admin/advantages", json=body).raise_for_status()
        assert posted(url, 2) == b


def test_only_the_admin_key_may_post_advantages(tmp_path: Path):
    with inprocess_proxy(tmp_path / "p.db", admin_key=ADMIN, agent_keys=[AGENT]) as url:
        body = {"step": 1, "version": 1, "trajectories": [{"trajectory_id": "x:0", "advantage": 1.0}]}
        assert post(url, "/v1/admin/advantages", json=body).status_code == 401
        agent = post(url, "/v1/admin/advantages", json=body, headers={"authorization": f"Bearer {AGENT}"})
        assert (agent.status_code, agent.json()["error"]["type"]) == (403, "permission_error")
        admin = post(url, "/v1/admin/advantages", json=body, headers={"authorization": f"Bearer {ADMIN}"})
        assert admin.status_code == 404  # past the key: no trajectory x:0


def trained_group(url: str) -> list[Trajectory]:
    return [Trajectory.from_json(t) for t in stored(url).values()]


def test_the_trainer_posts_what_it_trained_each_trajectory_with(tmp_path: Path):
    with inprocess_proxy(tmp_path / "p.db") as url:
        episode(url, "a", 2, 1.0)
        episode(url, "b", 1, 0.25)
        trajectories = trained_group(url)
        groups = [Group("g", trajectories)]
        length = max(len(t.token_ids) for t in trajectories)
        report = AdvantageReport([url], admin_key=None)
        for t in trajectories:
            report.taken(0, t.trajectory_id)
        episode_level = step_advantages(groups, Estimator.DR_GRPO, None, None, length)
        report.post(trajectories, episode_level, step=1, version=1)
        assert [posted(url, seq)["advantage"] for seq in (1, 2)] == [0.375, -0.375]
        per_turn = step_advantages(groups, Estimator.DR_GRPO, None, 1.0, length)
        report.post(trajectories, per_turn, step=2, version=2)  # restored: the one proxy is the source
        assert [posted(url, seq) for seq in (1, 2)] == [
            {"step": 2, "version": 2, "advantage": None, "turn_advantages": [0.375, 0.0]},
            {"step": 2, "version": 2, "advantage": None, "turn_advantages": [-0.375]},
        ]
        assert report.failed == 0


def test_each_proxy_gets_its_own_trajectories_and_a_failed_post_is_counted_not_raised(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    with inprocess_proxy(tmp_path / "one.db") as one, inprocess_proxy(tmp_path / "two.db") as two:
        episode(one, "a", 1, 1.0)
        episode(two, "b", 1, 0.0)
        [a], [b] = trained_group(one), trained_group(two)
        gone = f"http://127.0.0.1:{free_port()}"
        report = AdvantageReport([one, two, gone], admin_key=None)
        report.taken(1, "b:0")  # from the second proxy, the other from the first
        report.taken(0, "a:0")
        report.post([a, b], step_advantages([Group("g", [a, b])], Estimator.DR_GRPO, None, None, 9), 1, 1)
        assert (posted(one, 1)["advantage"], posted(two, 1)["advantage"]) == (0.5, -0.5)
        assert report.failed == 0

        ghost = Trajectory.from_json({**a.to_json(), "trajectory_id": "ghost:0"})
        report.taken(2, "a:0")  # a proxy that is gone
        report.taken(0, "ghost:0")  # a trajectory the proxy does not have: 404
        with caplog.at_level(logging.WARNING, logger="trainer.report"):
            report.post(
                [a, ghost], step_advantages([Group("g", [a, ghost])], "reinforce", None, None, 9), 2, 2
            )
        assert report.failed == 2
        warned = [r for r in caplog.records if r.name == "trainer.report"]  # not others' INFO lines
        assert [r.getMessage().split(" (training goes on)")[0] for r in warned] == [
            f"step 2's advantages not posted to {one}/v1/admin/advantages",
            f"step 2's advantages not posted to {gone}/v1/admin/advantages",
        ]
        assert posted(one, 1)["step"] == 1  # the refused post stored nothing
