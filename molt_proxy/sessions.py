"""Sessions: identification, per-session locks, segments, rewards (DESIGN §3).

A session is one agent episode. It holds its segments (chains: a request continues the one
its render extends, `stitching.py`), a lock that serialises its turns (all chains' turns
alike: which chain a request continues is known only once it plans under the lock), and the
requests it answered (for idempotent retries). The registry is in memory and mirrored in the
store; `recover` rebuilds it after a restart.
A turn runs in `async with sessions.turn(...)`, which holds the session's lock until it ends.

A request without a session id joins the inferred session one of whose chains its render
(its echoes restored: `returned_to`, `echo.py`) continues furthest, or starts a new one. Sessions
whose histories render alike (N attempts at one task, sampled alike) are told apart by the
tool-call ids the proxy minted for their replies, which the agent echoes but the template may
not print; failing that, a request takes an idle one, so each attempt keeps a session of its
own (truly identical histories are interchangeable: same tokens, same record).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from molt_proxy.auth import OPEN, SESSION_KEY_PREFIX, Principal, key_id, may_use
from molt_proxy.echo import Find, Returned
from molt_proxy.errors import Conflict, Forbidden, NotFound, Unauthorized
from molt_proxy.session import Attempt, Caller, OpenTurn, Session
from molt_proxy.stitching import PromptPlan, TokenText, commit_to, continued, segment_index
from molt_proxy.store import Store
from molt_proxy.types import (
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


def request_hash(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


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
            return await self._create(session_id, group_id, key_hash, owner, inferred)
        finally:
            del self._creating[session_id]
            created.set()

    async def _create(
        self, session_id: str, group_id: str | None, key_hash: str | None, owner: str | None, inferred: bool
    ) -> Session:
        status = await self.store.session_status(session_id)
        if status is not None:
            closed = "" if status is SessionStatus.OPEN else " and is closed"
            raise Conflict(f"session {session_id!r} already exists{closed}", param="session_id")
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
        await self.store.create_session(
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
        self._register(session)
        return session

    @asynccontextmanager
    async def turn(
        self, caller: Caller, rendered: bytes, call_ids: frozenset[str], attempt: Attempt
    ) -> AsyncIterator[OpenTurn]:
        """The session `caller` names (or `rendered` continues), locked for one turn and
        released when the turn ends, however it ends."""
        session = await self._acquire(caller, rendered, call_ids)
        try:
            yield OpenTurn(self, session, attempt)
        finally:
            session.lock.release()

    async def _acquire(self, caller: Caller, rendered: bytes, call_ids: frozenset[str]) -> Session:
        """The session a chat request belongs to, locked for the turn: by id (path, header or
        metadata; created on first use), by a session-scoped key, or inferred from `rendered`
        and the tool-call ids its messages echo, among the sessions of the same owner. A
        session its principal may not use is refused. Only `turn` calls it: it releases the lock."""
        group_id, principal = caller.group_id, caller.principal
        session_id = self._named(caller)
        if session_id is None and caller.api_key and caller.api_key.startswith(SESSION_KEY_PREFIX):
            raise Unauthorized("unknown or closed session key")
        if session_id is None:
            session = await self._continued(rendered, call_ids, principal.owner)
            if session is None:
                session = await self.create(group_id=group_id, owner=principal.owner, inferred=True)
                await session.lock.acquire()
        else:
            session = await self._open_or_create(session_id, group_id, principal.owner)
            await session.lock.acquire()
        if not may_use(principal, session.id, session.owner):
            session.lock.release()  # checked under the lock: a racing creator may own it
            raise Forbidden(f"session {session.id!r} belongs to another key", param="session_id")
        if session.closed or (group_id is not None and group_id != session.group_id):
            session.lock.release()
            if session.closed:
                raise Conflict(f"session {session.id!r} is closed", param="session_id")
            raise Conflict(
                f"session {session.id!r} is in group {session.group_id!r}, not {group_id!r}",
                param="X-Group-Id",
            )
        return session

    def _named(self, caller: Caller) -> str | None:
        """The session id a request names (path, header or metadata) or its session key stands
        for; None: neither (an unknown session key included)."""
        if caller.session_id is None and caller.api_key and caller.api_key.startswith(SESSION_KEY_PREFIX):
            return self._by_key.get(key_id(caller.api_key))
        return caller.session_id

    def returned_to(self, caller: Caller) -> Find:
        """Where the echoes in `caller`'s request are looked up (`echo.restore`): the session it
        names, else the inferred sessions of its owner, which it may join."""
        named = self._named(caller)
        if named is not None:
            return self.returned.of_session(named)
        owner = caller.principal.owner

        def joinable(session_id: str) -> bool:
            session = self._open.get(session_id)
            return session is not None and session.inferred and session.owner == owner

        return self.returned.among(joinable)

    async def _open_or_create(self, session_id: str, group_id: str | None, owner: str | None) -> Session:
        """The open session `session_id`, created if it is new. Concurrent first requests that
        name one new id all get the one session: the first creates it, the others wait for that
        and look again (if it failed, for a reason such as a closed session, they fail alike)."""
        while (session := self._open.get(session_id)) is None:
            creating = self._creating.get(session_id)
            if creating is None:
                return await self.create(session_id, group_id, owner=owner)
            await creating.wait()
        return session

    async def _continued(
        self, rendered: bytes, call_ids: frozenset[str], owner: str | None
    ) -> Session | None:
        """The inferred session one of whose chains `rendered` continues furthest, locked;
        None if none does. Among equal candidates the one whose tool calls the request echoes
        wins, then an idle one; if the best are all busy, wait for one to finish its turn and
        look again, since that turn changes its history. Only `owner`'s sessions are candidates:
        one agent key's conversation never joins another's."""
        while True:
            candidates: list[Session] = []
            longest = 0
            for session in self._open.values():
                if not session.inferred or session.owner != owner:
                    continue
                chains = continued(session.segments, rendered)
                matched = chains[0][0] if chains else None
                if matched is not None and matched >= longest:
                    if matched > longest:
                        candidates, longest = [], matched
                    candidates.append(session)
            if not candidates:
                return None
            echoed = max(len(s.call_ids & call_ids) for s in candidates)
            candidates = [s for s in candidates if len(s.call_ids & call_ids) == echoed]
            idle = next((s for s in candidates if not s.lock.locked()), None)
            if idle is not None:
                await idle.lock.acquire()  # free: returns without yielding to other requests
                return idle
            async with candidates[0].lock:
                pass

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
        return [s.id for s in self._open.values() if s.last_active < cutoff and not s.lock.locked()]

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
        echo: bytes | None = None,
    ) -> None:
        """Persist a turn, then commit it to the session in memory. `sampling`: what vLLM
        sampled it with, recorded on the turn for the trainer. Its retries are known by
        `request_hash` and `idempotency_key` (`Attempt`). `echo`: the reply's echo view.

        Store first: if the write fails, memory is untouched and the request fails whole.
        """
        index = segment_index(session.segments, plan)
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
        async with session.lock:
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
