"""Sessions: the registry of open sessions, their turns' records, rewards and closing (DESIGN §3).

A session is one agent episode. It holds its segments (chains: a request continues the one
its render extends, `stitching.py`), the turns in flight on them and the requests it answered
(for idempotent retries). The registry is in memory and mirrored in the store; `recover`
rebuilds it after a restart. Which session and chain a request joins, and when its turn may
run, is `turns.py`.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from molt_proxy import telemetry
from molt_proxy.auth import OPEN, Principal, key_id, may_use
from molt_proxy.echo import Returned
from molt_proxy.errors import BadRequest, Conflict, Forbidden, NotFound
from molt_proxy.session import DEFAULT_GROUP_PREFIX, Session
from molt_proxy.stitching import PromptPlan, TokenText, commit_to, segment_index
from molt_proxy.store import Store
from molt_proxy.types import (
    EchoView,
    Generation,
    RecordedReply,
    Sampling,
    SessionStatus,
    StoredSession,
    StoredTurn,
    Trajectory,
)


def unknown_session(session_id: str) -> NotFound:
    return NotFound(f"no session {session_id!r}", param="session_id")


class Sessions:
    """The registry of open sessions."""

    def __init__(self, store: Store, tokenizer: TokenText, model: str):
        self.store = store
        self.tokenizer = tokenizer
        self.model = model
        self._open: dict[str, Session] = {}
        self._by_key: dict[str, str] = {}
        self._by_completion: dict[str, str] = {}
        """Completion id → open session id: rewards may name any reply the agent received."""
        self._creating: dict[str, asyncio.Event] = {}
        """Ids being created (set when done): a session is reserved before its first await."""
        self._group_owners: dict[str, str | None] = {}
        """Group id → the owner of the first session that named it (`_join_group`)."""
        self.returned = Returned()
        """What each open session's turns returned, for echo restoration (`echo.py`)."""

    async def recover(self) -> int:
        """Rebuild every open session from the store; returns how many."""
        for stored, turns in await self.store.open_sessions():
            session = Session(
                stored.id,
                stored.group_id,
                stored.created,
                api_key_hash=stored.api_key_hash,
                owner=stored.owner,
                inferred=stored.inferred,
                last_active=stored.created,
            )
            for turn in turns:
                replayed = commit_to(
                    session.segments,
                    turn.segment,
                    turn.new_ids,
                    self.tokenizer.ids_bytes(turn.new_ids),
                    turn.generation,
                    turn.completion_id,
                    self.tokenizer,
                    turn.sampling,
                    turn.echo,
                )
                replayed.created, replayed.reward = turn.created, turn.reward
                session.answered(turn.segment, turn.request_hash, turn.idempotency_key, turn.reply)
                session.last_active = turn.created
                if turn.reply is not None:
                    session.call_ids |= turn.reply.call_ids
                    self.returned.add(session.id, turn.reply.message)
            self._register(session)
        return len(self._open)

    def _register(self, session: Session) -> None:
        self._open[session.id] = session
        if session.api_key_hash:
            self._by_key[session.api_key_hash] = session.id
        for segment in session.segments:
            for turn in segment.turns:
                self._by_completion[turn.completion_id] = session.id

    async def create(
        self,
        session_id: str | None = None,
        group_id: str | None = None,
        *,
        key_hash: str | None = None,
        owner: str | None = None,
        inferred: bool = False,
    ) -> Session:
        session_id = session_id or uuid.uuid4().hex
        # Check and reserve the id before the first await (one event loop: nothing runs in
        # between), or two requests naming one new id both pass the check and both insert.
        if session_id in self._open or session_id in self._creating:
            raise Conflict(f"session {session_id!r} already exists", param="session_id")
        self._creating[session_id] = created = asyncio.Event()
        try:
            if group_id is not None:
                await self._join_group(group_id, owner)
            return await self._create(session_id, group_id, key_hash, owner, inferred)
        finally:
            del self._creating[session_id]
            created.set()

    async def _join_group(self, group_id: str, owner: str | None) -> None:
        """Groups belong to an owner as sessions do (DESIGN §8): the first session that names a
        group makes its owner the group's, and an agent key (`owner` set) may then name only its
        own groups: another key's episodes must not sit in its baselines. Admin (and open)
        sessions join any group. The proxy's own default groups (`prompt-…`, derived from the
        first prompt and the owner, `session.default_group`) cannot be named."""
        if group_id.startswith(DEFAULT_GROUP_PREFIX):
            raise BadRequest(
                f"group ids starting with {DEFAULT_GROUP_PREFIX!r} are the proxy's own (a session"
                " without a group is grouped by its first prompt)",
                param="group_id",
            )
        if group_id not in self._group_owners:
            named, first_owner = await self.store.group_owner(group_id)
            # Looked up again after the await: a session created meanwhile may have claimed it.
            self._group_owners.setdefault(group_id, first_owner if named else owner)
        if owner is not None and self._group_owners[group_id] != owner:
            raise Forbidden(f"group {group_id!r} belongs to another key", param="group_id")

    async def _create(
        self, session_id: str, group_id: str | None, key_hash: str | None, owner: str | None, inferred: bool
    ) -> Session:
        now = time.time()
        session = Session(
            id=session_id,
            group_id=group_id,
            created=now,
            api_key_hash=key_hash,
            owner=owner,
            inferred=inferred,
            last_active=now,
        )
        status = await self.store.create_session(
            StoredSession(
                session.id,
                session.group_id,
                key_hash,
                owner,
                inferred,
                SessionStatus.OPEN,
                session.created,
            )
        )
        if status is not None:
            closed = "" if status is SessionStatus.OPEN else " and is closed"
            raise Conflict(f"session {session_id!r} already exists{closed}", param="session_id")
        self._register(session)
        return session

    async def open_or_create(self, session_id: str, group_id: str | None, owner: str | None) -> Session:
        """The open session `session_id`, created if it is new. Concurrent first requests that
        name one new id all get the one session: the first creates it, the others wait for that
        and look again (if it failed, for a reason such as a closed session, they fail alike)."""
        while (session := self._open.get(session_id)) is None:
            creating = self._creating.get(session_id)
            if creating is None:
                return await self.create(session_id, group_id, owner=owner)
            await creating.wait()
        return session

    def find(self, session_id: str) -> Session | None:
        return self._open.get(session_id)

    def open_sessions(self) -> list[Session]:
        return list(self._open.values())

    def get(self, session_id: str, principal: Principal = OPEN) -> Session:
        """An open session `principal` may see; any other id answers alike (no probing)."""
        session = self._open.get(session_id)
        if session is None or not may_use(principal, session.id, session.owner):
            raise NotFound(f"no open session {session_id!r}", param="session_id")
        return session

    def by_key(self, api_key: str) -> Session | None:
        return self.by_key_id(key_id(api_key))

    def by_key_id(self, api_key_hash: str) -> Session | None:
        session_id = self._by_key.get(api_key_hash)
        return self._open.get(session_id) if session_id else None

    async def owner(self, session_id: str) -> str | None:
        """The agent key id that created a session, open or closed (None: none, or no session)."""
        session = self._open.get(session_id)
        return session.owner if session is not None else await self.store.session_owner(session_id)

    async def of_completion(self, completion_id: str, principal: Principal = OPEN) -> str:
        """The id of the session a reply belongs to (open or closed), if `principal` may see
        it; an unknown and a hidden completion answer alike (no probing)."""
        session_id = self._by_completion.get(completion_id) or await self.store.session_of_completion(
            completion_id
        )
        if session_id is None or not await self.visible(session_id, principal):
            raise NotFound(f"no completion {completion_id!r}", param="completion_id")
        return session_id

    async def visible(self, session_id: str, principal: Principal) -> bool:
        """Whether `principal` may see the session, open or closed (False if there is none
        and a key is needed: an unknown id and a hidden one must look the same)."""
        return may_use(principal, session_id, await self.owner(session_id))

    async def reward_turn(self, completion_id: str, reward: float) -> str:
        """Attach a per-turn reward to one completion of an open session; returns the session id."""
        session_id = await self.of_completion(completion_id)
        session = self._open.get(session_id)
        if session is None:
            raise Conflict(f"session {session_id!r} is already closed", param="completion_id")
        async with session.lock:
            if session.closed:
                raise Conflict(f"session {session_id!r} is already closed", param="completion_id")
            turn = next(t for s in session.segments for t in s.turns if t.completion_id == completion_id)
            await self.store.set_turn_reward(completion_id, reward)
            turn.reward = reward
        return session_id

    def idle_since(self, cutoff: float) -> list[str]:
        """Open sessions with no turn since `cutoff` (for the TTL)."""
        return [s.id for s in self._open.values() if s.last_active < cutoff and not s.in_flight]

    async def record(
        self,
        session: Session,
        plan: PromptPlan,
        generation: Generation,
        request_hash: str,
        reply: RecordedReply,
        *,
        sampling: Sampling | None = None,
        idempotency_key: str | None = None,
        echo: EchoView | None = None,
    ) -> None:
        """Persist a turn, then commit it to the session in memory. `sampling`: what vLLM
        sampled it with, recorded on the turn for the trainer. Its retries are known by
        `request_hash` and `idempotency_key` (`Attempt`). `echo`: the reply's echo view.

        Store first: if the write fails, memory is untouched and the request fails whole.
        """
        async with session.lock:  # one turn at a time: a new chain takes the next index
            index = segment_index(session.segments, plan)
            opened = telemetry.opened_reason(session.segments, plan)
            stored = StoredTurn(
                reply.completion_id,
                index,
                plan.new_ids,
                generation,
                time.time(),
                request_hash,
                reply,
                sampling=sampling,
                idempotency_key=idempotency_key,
                echo=echo,
            )
            await self.store.record_turn(session.id, stored)
            turn = commit_to(
                session.segments,
                index,
                plan.new_ids,
                plan.new_text,
                generation,
                reply.completion_id,
                self.tokenizer,
                sampling,
                echo,
            )
            position = len(session.segments[index].turns) - 1
        telemetry.turn_recorded(session.id, index, position, len(plan.ids), len(generation.token_ids), opened)
        turn.created = stored.created
        session.answered(index, request_hash, idempotency_key, reply)
        session.last_active = stored.created
        session.call_ids |= reply.call_ids
        self.returned.add(session.id, reply.message)
        self._by_completion[reply.completion_id] = session.id

    async def close(
        self, session_id: str, reward: float | None, info: dict[str, Any], status: SessionStatus
    ) -> list[Trajectory]:
        """Finalize: every segment becomes a trajectory carrying the session's reward."""
        session = self._open.get(session_id)
        if session is None:
            known = await self.store.session_status(session_id)
            if known is None:
                raise unknown_session(session_id)
            raise Conflict(f"session {session_id!r} is already closed", param="session_id")
        async with session.alone(), session.lock:
            if session.closed:
                raise Conflict(f"session {session_id!r} is already closed", param="session_id")
            now = time.time()
            trajectories = session.trajectories(reward, info, status, self.model, now)
            stored = await self.store.close_session(session.id, status, reward, info, now, trajectories)
            session.closed = True
            del self._open[session.id]
            self.returned.forget(session.id)
            if session.api_key_hash:
                self._by_key.pop(session.api_key_hash, None)
            for segment in session.segments:
                for turn in segment.turns:
                    self._by_completion.pop(turn.completion_id, None)
        return stored
