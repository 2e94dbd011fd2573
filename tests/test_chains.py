"""Chains (`molt_proxy/stitching.py`): a session holds several open segments, and a request
continues the one its render extends. A sub-agent with a system prompt of its own, its turns
interleaved with its parent's, gets a segment of its own, continued over its exact ids, and
records what it would record alone; a restart rebuilds every chain and continues the right one.

In process: the real app with the real Qwen3 tokenizer and template in front of the stand-in
vLLM answering the ids each test scripts (`POST /_script`). Exactness against a real vLLM is
`tests/test_exactness.py::test_interleaved_sub_agent_is_a_second_exact_segment`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from molt_proxy.config import Settings
from molt_proxy.tokenizer import Tokenizer
from molt_proxy.types import Trajectory
from tests.helpers import trajectories
from tests.inprocess import loaded_tokenizer, mock_vllm, qwen3_tokenizer_dir, serve_app
from trainer.buffer import GroupBuffer

PARENT = "You are the lead agent. Plan the trip."
SUB = "You are a flight-search sub-agent. Answer with one flight."
OTHER = "You summarise conversations."


@dataclass
class Agent:
    """One conversation: its system prompt, its history and the replies it got."""

    system: str
    history: list[dict[str, Any]] = field(default_factory=list)
    replies: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.history = [{"role": "system", "content": self.system}]

    @property
    def ids(self) -> list[str]:
        return [r["id"] for r in self.replies]


@dataclass
class Served:
    url: str
    upstream: str
    tokenizer: Tokenizer

    def turn(self, agent: Agent, question: str, reply: str, session: str | None) -> dict[str, Any]:
        """`agent` asks `question` (after echoing its last reply) and the stand-in samples `reply`."""
        if agent.replies:
            content = agent.replies[-1]["choices"][0]["message"]["content"]
            agent.history.append({"role": "assistant", "content": content})
        agent.history.append({"role": "user", "content": question})
        ids = self.tokenizer.encode(reply) + [self.tokenizer.eos_token_id]
        script = [{"token_ids": ids, "finish_reason": "stop"}]
        httpx.post(f"{self.upstream}/_script", json=script, timeout=10).raise_for_status()
        base = f"{self.url}/s/{session}/v1" if session else f"{self.url}/v1"
        body = {"model": "m", "messages": agent.history}
        response = httpx.post(f"{base}/chat/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        agent.replies.append(response.json())
        return response.json()

    def segments(self, session: str) -> list[list[str]]:
        described = httpx.get(f"{self.url}/v1/sessions/{session}", timeout=10).json()
        assert "segments" in described, described
        return [segment["turns"] for segment in described["segments"]]

    def close(self, session: str, reward: float) -> list[dict[str, Any]]:
        body = {"session_id": session, "reward": reward}
        httpx.post(f"{self.url}/v1/rewards", json=body, timeout=10).raise_for_status()
        return [t for t in trajectories(self.url) if t["session_id"] == session]


@contextmanager
def upstream() -> Iterator[tuple[str, Tokenizer, Path]]:
    model = qwen3_tokenizer_dir()
    with mock_vllm(model) as url:
        yield url, loaded_tokenizer(str(model)), model


@contextmanager
def proxy(vllm: str, tokenizer: Tokenizer, model: Path, db: Path) -> Iterator[Served]:
    with serve_app(Settings(model=str(model), upstreams=[vllm], db_path=db)) as url:
        yield Served(url, vllm, tokenizer)


@pytest.fixture(scope="module")
def vllm() -> Iterator[tuple[str, Tokenizer, Path]]:
    with upstream() as served:
        yield served


PARENT_TURNS = [("Where to?", "Lisbon."), ("When?", "In May."), ("Budget?", "900 euros.")]
SUB_TURNS = [("Flights to Lisbon in May?", "TP 1234 at 9:10."), ("Cheaper?", "FR 88 at 6:00.")]


def _play(served: Served, session: str | None, order: str) -> tuple[Agent, Agent]:
    """The parent's and the sub-agent's turns, in `order` ("p": the parent's next, "s": the
    sub-agent's next)."""
    parent, sub = Agent(PARENT), Agent(SUB)
    turns = {"p": (parent, iter(PARENT_TURNS)), "s": (sub, iter(SUB_TURNS))}
    for who in order:
        agent, left = turns[who]
        served.turn(agent, *next(left), session)
    return parent, sub


def _record(trajectory: dict[str, Any]) -> tuple[Any, ...]:
    """What a trajectory records of its conversation, whichever session it was in."""
    turns = [(t["prompt_start"], t["completion_start"], t["completion_end"]) for t in trajectory["turns"]]
    return trajectory["token_ids"], trajectory["loss_mask"], trajectory["logprobs"], turns


def test_an_interleaved_sub_agent_is_a_chain_of_its_own(vllm, tmp_path):
    with proxy(*vllm, tmp_path / "chains.db") as served:
        parent, sub = _play(served, "episode", "pspsp")
        assert served.segments("episode") == [parent.ids, sub.ids]
        # Another system prompt opens a third chain; the others stay open and continue.
        other = Agent(OTHER)
        served.turn(other, "Summarise.", "A trip.", "episode")
        served.turn(parent, "Book it?", "Booked.", "episode")
        assert served.segments("episode") == [parent.ids, sub.ids, other.ids]
        # A retry of the sub-agent's last request, after other chains' turns: its reply again.
        retried = httpx.post(
            f"{served.url}/s/episode/v1/chat/completions",
            json={"model": "m", "messages": sub.history},
            headers={"x-stainless-retry-count": "1"},
            timeout=60,
        )
        assert retried.json() == sub.replies[-1]
        records = served.close("episode", 0.25)
        # Each conversation alone, for comparison.
        alone_parent, _ = _play(served, "parent-alone", "ppp")
        served.turn(alone_parent, "Book it?", "Booked.", "parent-alone")
        _play(served, "sub-alone", "ss")
        [alone_p] = served.close("parent-alone", 1)
        [alone_s] = served.close("sub-alone", 1)
    assert [(r["segment"], r["num_segments"], r["reward"]) for r in records] == [
        (0, 3, 0.25),
        (1, 3, 0.25),
        (2, 3, 0.25),
    ]
    assert [[t["completion_id"] for t in r["turns"]] for r in records] == [parent.ids, sub.ids, other.ids]
    assert _record(records[0]) == _record(alone_p) and _record(records[1]) == _record(alone_s)
    tokenizer = vllm[1]
    other_prompt = tokenizer.encode(tokenizer.render(other.history, None, {}))
    assert records[2]["token_ids"] == other_prompt + tokenizer.encode("A trip.") + [tokenizer.eos_token_id]
    # The trainer counts the session only once every chain has arrived.
    buffer = GroupBuffer(group_size=1, timeout_s=0)
    for record in records[:2]:
        buffer.add(Trajectory.from_json(record))
    assert buffer.pop_ready() == []
    buffer.add(Trajectory.from_json(records[2]))
    [group] = buffer.pop_ready()
    assert [t.segment for t in group.trajectories] == [0, 1, 2] and group.sessions == ["episode"]


def test_a_restart_rebuilds_every_chain_and_continues_the_right_one(vllm, tmp_path):
    db = tmp_path / "restarted.db"
    with proxy(*vllm, db) as served:
        parent, sub = Agent(PARENT), Agent(SUB)
        served.turn(parent, *PARENT_TURNS[0], "episode")
        served.turn(sub, *SUB_TURNS[0], "episode")
        served.turn(parent, *PARENT_TURNS[1], "episode")
    with proxy(*vllm, db) as served:
        assert served.segments("episode") == [parent.ids, sub.ids]
        served.turn(sub, *SUB_TURNS[1], "episode")
        served.turn(parent, *PARENT_TURNS[2], "episode")
        assert served.segments("episode") == [parent.ids, sub.ids]
        records = served.close("episode", 1)
        _play(served, "alone", "ppp")
        [alone] = served.close("alone", 1)
    assert [(r["segment"], r["num_segments"]) for r in records] == [(0, 2), (1, 2)]
    assert _record(records[0]) == _record(alone)


def test_without_session_ids_each_interleaved_conversation_keeps_one_session(vllm, tmp_path):
    """Zero-config: nothing in a sub-agent's first request ties it to its parent, so it starts
    a session of its own; every later turn of each joins its own, one chain each."""
    with proxy(*vllm, tmp_path / "zero.db") as served:
        parent, sub = _play(served, None, "pspsp")
        [parent_session] = {r["session_id"] for r in parent.replies}
        [sub_session] = {r["session_id"] for r in sub.replies}
        assert parent_session != sub_session
        assert served.segments(parent_session) == [parent.ids]
        assert served.segments(sub_session) == [sub.ids]
