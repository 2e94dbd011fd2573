"""Turns on different chains of one session run at once; turns on one chain, one after the
other (`molt_proxy/turns.py`).

Each test drives the real admission (`Turns`), registry (`Sessions`) and SQLite store with
the real Qwen3 tokenizer and chat template, holding a turn in flight between its admission and
its record as a slow vLLM would, and checks which other turns are admitted meanwhile. The
sampling itself is not what is tested here: a reply is the template's own text, recorded as
the proxy records a generation (the HTTP path of chains is `tests/test_chains.py`).
"""

from __future__ import annotations

import asyncio
import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from molt_proxy.auth import OPEN
from molt_proxy.errors import Conflict
from molt_proxy.session import Attempt, Caller
from molt_proxy.sessions import Sessions
from molt_proxy.stitching import plan_match
from molt_proxy.store import Store
from molt_proxy.tokenizer import Tokenizer
from molt_proxy.turns import Turns
from molt_proxy.types import Generation, ParsedReply, RecordedReply, SessionStatus
from tests.inprocess import loaded_tokenizer, qwen3_tokenizer_dir

CALLER = Caller("episode", None, None, OPEN)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return loaded_tokenizer(str(qwen3_tokenizer_dir()))


@dataclass
class Agent:
    """One conversation of the episode: its messages so far."""

    messages: list[dict[str, Any]]

    def ask(self, content: str) -> Agent:
        self.messages.append({"role": "user", "content": content})
        return self


@dataclass
class Episode:
    tokenizer: Tokenizer
    sessions: Sessions
    turns: Turns
    admitted: dict[str, asyncio.Event] = field(default_factory=dict)

    async def turn(
        self,
        agent: Agent,
        reply: str,
        name: str,
        *,
        hold: asyncio.Event | None = None,
        body: str | None = None,
    ) -> RecordedReply:
        """`agent`'s next turn, answered `reply`; `hold` keeps it in flight between admission
        and record. `body` names the request bytes (a retry sends the same): its hash."""
        admitted = self.admission(name)
        rendered = self.tokenizer.render(agent.messages, None, {})
        attempt = Attempt(request_hash=body or name)
        async with self.turns.open(CALLER, rendered.encode(), frozenset(), attempt) as turn:
            admitted.set()
            if turn.replay is not None:
                return turn.replay
            plan = plan_match(turn.match, rendered, self.tokenizer)
            if hold is not None:
                await hold.wait()
            sampled = [*self.tokenizer.encode(reply), self.tokenizer.hf.convert_tokens_to_ids("<|im_end|>")]
            generation = Generation(sampled, [-0.5] * len(sampled), [0] * len(sampled), "stop")
            recorded = RecordedReply(name, 0, "tiny", ParsedReply(reply), "stop", len(plan.ids), len(sampled))
            await self.sessions.record(turn.session, plan, generation, attempt.request_hash, recorded)
        agent.messages.append({"role": "assistant", "content": reply})
        return recorded

    def admission(self, name: str) -> asyncio.Event:
        """Set once the turn `name` is admitted (its claim made)."""
        return self.admitted.setdefault(name, asyncio.Event())

    def chains(self) -> list[list[str]]:
        """The completion ids of each chain of the session, in chain order."""
        session = self.sessions.get("episode")
        return [[t.completion_id for t in segment.turns] for segment in session.segments]


async def _episode(tmp_path: Path, tokenizer: Tokenizer) -> tuple[Episode, Agent, Agent]:
    """A session with two chains: a parent (chain 0) and its sub-agent (chain 1), one turn each."""
    store = Store(tmp_path / "p.db")
    await store.open()
    sessions = Sessions(store, tokenizer, "tiny")
    episode = Episode(tokenizer, sessions, Turns(sessions))
    parent = Agent([{"role": "system", "content": "You are the lead agent."}]).ask("Plan a trip.")
    sub = Agent([{"role": "system", "content": "You search flights."}]).ask("Find a flight.")
    await episode.turn(parent, "I will ask for flights.", "p1")
    await episode.turn(sub, "Flight AF1.", "s1")
    return episode, parent, sub


async def _pending(task: asyncio.Task[Any]) -> bool:
    """Whether `task` is still waiting after everything runnable has run."""
    for _ in range(20):
        await asyncio.sleep(0)
    return not task.done()


def test_a_sub_agent_samples_while_its_parent_does_and_one_chain_waits_for_its_turn(tmp_path, tokenizer):
    async def scenario() -> None:
        episode, parent, sub = await _episode(tmp_path, tokenizer)
        hold = asyncio.Event()
        twin = Agent(copy.deepcopy(parent.messages)).ask("Book it.")
        parent_turn = asyncio.create_task(episode.turn(parent.ask("Book it."), "Booked.", "p2", hold=hold))
        await episode.admission("p2").wait()

        # The sub-agent's chain is free: its turn runs to the end while the parent's is in flight.
        await asyncio.wait_for(episode.turn(sub.ask("Cheaper?"), "Flight AF2.", "s2"), timeout=10)
        assert not parent_turn.done()

        # The same parent history again must wait: the turn in flight changes its chain.
        again = asyncio.create_task(episode.turn(twin, "Booked twice.", "p2-again"))
        assert await _pending(again) and not episode.admission("p2-again").is_set()

        hold.set()
        await parent_turn
        await again
        # One after the other, as if sent so: the twin no longer continues the parent's chain
        # (it now ends with "Booked."), so it opens a chain of its own from its full render.
        assert episode.chains() == [["p1", "p2"], ["s1", "s2"], ["p2-again"]]
        await episode.sessions.store.close()

    asyncio.run(scenario())


def test_a_retry_of_a_request_in_flight_waits_and_gets_its_reply(tmp_path, tokenizer):
    async def scenario() -> None:
        episode, parent, _ = await _episode(tmp_path, tokenizer)
        hold = asyncio.Event()
        retried = Agent(copy.deepcopy(parent.messages)).ask("Book it.")
        first = asyncio.create_task(
            episode.turn(parent.ask("Book it."), "Booked.", "p2", hold=hold, body="B")
        )
        await episode.admission("p2").wait()
        retry = asyncio.create_task(episode.turn(retried, "never sampled", "p2-retry", body="B"))
        assert await _pending(retry)
        hold.set()
        assert await retry == await first  # the recorded reply, not a second sample
        assert episode.chains() == [["p1", "p2"], ["s1"]]
        await episode.sessions.store.close()

    asyncio.run(scenario())


def test_closing_waits_for_the_turns_in_flight_and_refuses_a_turn_sent_meanwhile(tmp_path, tokenizer):
    async def scenario() -> None:
        episode, parent, sub = await _episode(tmp_path, tokenizer)
        hold = asyncio.Event()
        in_flight = asyncio.create_task(episode.turn(sub.ask("Cheaper?"), "Flight AF2.", "s2", hold=hold))
        await episode.admission("s2").wait()
        closing = asyncio.create_task(episode.sessions.close("episode", 1.0, {}, SessionStatus.REWARDED))
        assert await _pending(closing)
        late = asyncio.create_task(episode.turn(parent.ask("Book it."), "Booked.", "p2"))
        assert await _pending(late)

        hold.set()
        await in_flight
        trajectories = await closing
        assert [[t.completion_id for t in tr.turns] for tr in trajectories] == [["p1"], ["s1", "s2"]]
        with pytest.raises(Conflict, match="is closed"):
            await late
        await episode.sessions.store.close()

    asyncio.run(scenario())
