"""Which session and chain a request's turn joins, and when it may run (DESIGN §3).

A request names its session (path, header or metadata; created on first use; a Responses
request by the stored response it continues, `continuing`) or stands for one by its session
key. Naming none, it joins the inferred session of its owner one of whose chains its render
(its echoes restored: `returned_to`, `echo.py`) continues furthest, or starts a new one.
Sessions whose histories render alike (N attempts at one task, sampled alike) are told apart
by the tool-call ids the proxy minted for their replies, which the agent echoes but the
template may not print; failing that, a request takes an idle one, so each attempt keeps a
session of its own (truly identical histories are interchangeable: same tokens, same record).

Turns on different chains of one session run concurrently (a sub-agent beside its parent);
turns on one chain run one after the other. A turn in flight holds a `Claim` (`session.py`)
on the chains its render continues and on the render itself; a request it blocks waits for it
to end and looks again, since the turn changes what that request continues. The chains a
render continues are matched once (`stitching.Match`) and the turn plans on that match: its
claim keeps those chains as they are, and no other chain can come to be continued meanwhile
(chains only grow, and a chain opened by a turn whose render this one extends was waited for).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace

from molt_proxy.auth import SESSION_KEY_PREFIX, Principal, key_id, may_use
from molt_proxy.echo import Find
from molt_proxy.errors import Conflict, Forbidden, Unauthorized
from molt_proxy.session import Attempt, Caller, Claim, Session
from molt_proxy.sessions import Sessions
from molt_proxy.stitching import Match, match
from molt_proxy.types import RecordedReply


@dataclass(slots=True, frozen=True)
class Admitted:
    """A turn admitted to its session, holding its claim until it ends (`Turns.open`)."""

    session: Session
    match: Match
    """The chains the turn's render continues, matched when it was admitted: it plans on
    these (`stitching.plan_match`)."""
    replay: RecordedReply | None
    """The reply to give again when the request retries one the session answered (its client
    lost the answer); None: sample a new one (`Session.replay`)."""


def _check_use(principal: Principal, session: Session) -> None:
    """Forbidden if `principal` may not chat on `session`: a turn and a token count alike."""
    if not may_use(principal, session.id, session.owner):
        raise Forbidden(f"session {session.id!r} belongs to another key", param="session_id")


class Turns:
    """Admits turns to the sessions of a registry."""

    def __init__(self, sessions: Sessions):
        self.sessions = sessions

    @asynccontextmanager
    async def open(
        self, caller: Caller, rendered: bytes, call_ids: frozenset[str], attempt: Attempt
    ) -> AsyncIterator[Admitted]:
        """A turn on the session `caller` names (or `rendered` continues), admitted once no
        turn it must wait for is in flight; its claim is released when the turn ends, however
        it ends."""
        session, matched, claim = await self._join(caller, rendered, call_ids, attempt)
        try:
            yield Admitted(session, matched, session.replay(attempt))
        finally:
            session.release(claim)

    async def _join(
        self, caller: Caller, rendered: bytes, call_ids: frozenset[str], attempt: Attempt
    ) -> tuple[Session, Match, Claim]:
        """The session a chat request belongs to, the chains it continues there and its claim:
        by id (path, header or metadata; created on first use), by a session-scoped key, or
        inferred (`_inferred`) among the sessions of the same owner. A session its principal
        may not use, or a closed one, is refused."""
        group_id, principal = caller.group_id, caller.principal
        session_id = self.named(caller)
        if session_id is None and caller.api_key and caller.api_key.startswith(SESSION_KEY_PREFIX):
            raise Unauthorized("unknown or closed session key")
        matched: Match | None = None
        if session_id is None:
            found = await self._inferred(rendered, call_ids, attempt, principal.owner)
            if found is None:
                session = await self.sessions.create(group_id=group_id, owner=principal.owner, inferred=True)
            else:
                session, matched = found
        else:
            session = await self.sessions.open_or_create(session_id, group_id, principal.owner)
        _check_use(principal, session)
        if group_id is not None and group_id != session.group_id:
            raise Conflict(
                f"session {session.id!r} is in group {session.group_id!r}, not {group_id!r}",
                param="X-Group-Id",
            )
        return session, *await self._claim(session, rendered, matched)

    async def _claim(self, session: Session, rendered: bytes, matched: Match | None) -> tuple[Match, Claim]:
        """Wait for every turn in flight that `rendered` must wait for (`Session.blocking`),
        then claim the chains it continues (`matched`, if the session was just matched); a
        session closed meanwhile is refused. A turn waited for changes the chains: they are
        matched again."""
        while True:
            if session.closed:
                raise Conflict(f"session {session.id!r} is closed", param="session_id")
            if matched is None:
                matched = match(session.segments, rendered)
            blocking = session.blocking(rendered, matched.indices)
            if blocking is None:
                return matched, session.claim(rendered, matched.indices)
            await blocking.done.wait()
            matched = None

    def named(self, caller: Caller) -> str | None:
        """The session id a request names (path, header or metadata) or its session key stands
        for; None: neither (an unknown session key included)."""
        if caller.session_id is None and caller.api_key and caller.api_key.startswith(SESSION_KEY_PREFIX):
            keyed = self.sessions.by_key_id(key_id(caller.api_key))
            return keyed.id if keyed is not None else None
        return caller.session_id

    def continuing(self, caller: Caller, session_id: str, response_id: str) -> Caller:
        """`caller` in `session_id`, the session of the stored response `response_id` its
        request continues (the Responses API's `previous_response_id`): a request naming
        another session (path, header, metadata or key) is refused."""
        named = self.named(caller)
        if named is not None and named != session_id:
            raise Conflict(
                f"previous response {response_id!r} belongs to session {session_id!r}, "
                f"not to {named!r}: continue it in its own session",
                param="previous_response_id",
            )
        return replace(caller, session_id=session_id)

    def returned_to(self, caller: Caller) -> Find:
        """Where the echoes in `caller`'s request are looked up (`echo.restore`): the session it
        names, else the inferred sessions of its owner, which it may join."""
        named = self.named(caller)
        returned = self.sessions.returned
        if named is not None:
            return returned.of_session(named)
        owner = caller.principal.owner

        def joinable(session_id: str) -> bool:
            session = self.sessions.find(session_id)
            return session is not None and session.inferred and session.owner == owner

        return returned.among(joinable)

    async def _inferred(
        self, rendered: bytes, call_ids: frozenset[str], attempt: Attempt, owner: str | None
    ) -> tuple[Session, Match | None] | None:
        """The inferred session a request without a session id joins, with the chains its
        render continues there if they were matched: the one that answered the request it
        says it retries (`Session.answered_retry`; while that first try is still in flight,
        wait for it), else the one one of whose chains `rendered` continues furthest, with no
        turn in flight that the request must wait for (`_claim` then claims it at once); None:
        a new session. Among equal candidates the one whose tool calls the request echoes
        wins, then a free one; if the best must all wait, wait for one such turn to end and
        look again, since it changes that history. Only `owner`'s sessions are candidates: one
        agent key's conversation never joins another's."""
        says_retry = attempt.retry is True or attempt.idempotency_key is not None
        while True:
            owned = self._owned(owner)
            retried = next((s for s in owned if s.answered_retry(attempt)), None)
            if retried is not None:
                return retried, None
            first_try = next((c for s in owned for c in s.in_flight if c.rendered == rendered), None)
            if says_retry and first_try is not None:
                await first_try.done.wait()
                continue
            candidates = self._furthest(rendered, owned)
            if not candidates:
                return None
            echoed = max(len(s.call_ids & call_ids) for s, _ in candidates)
            candidates = [(s, m) for s, m in candidates if len(s.call_ids & call_ids) == echoed]
            blocking: Claim | None = None
            for session, matched in candidates:
                blocking = session.blocking(rendered, matched.indices)
                if blocking is None:
                    return session, matched
            assert blocking is not None
            await blocking.done.wait()

    def _owned(self, owner: str | None) -> list[Session]:
        """The inferred sessions of `owner` (an agent key's id; None: no keys)."""
        return [s for s in self.sessions.open_sessions() if s.inferred and s.owner == owner]

    def _furthest(self, rendered: bytes, owned: list[Session]) -> list[tuple[Session, Match]]:
        """The sessions of `owned` one of whose chains `rendered` continues furthest, each with
        the chains it continues there."""
        candidates: list[tuple[Session, Match]] = []
        longest = 0
        for session in owned:
            matched = match(session.segments, rendered)
            if matched.furthest is not None and matched.furthest >= longest:
                if matched.furthest > longest:
                    candidates, longest = [], matched.furthest
                candidates.append((session, matched))
        return candidates

    def joined(self, caller: Caller, rendered: bytes) -> Match:
        """The chains `rendered` continues in the session a turn for `caller` would join, read
        without waiting, claiming or creating anything (a token count): the named session's
        (or its key's), else the inferred session of its owner one of whose chains `rendered`
        continues furthest. No chain: a new session. A session `caller` may not use is refused
        as a turn on it is (403), not counted as a new one: the count would read its history."""
        named = self.named(caller)
        if named is not None:
            session = self.sessions.find(named)
            if session is None:
                return match([], rendered)
            _check_use(caller.principal, session)  # refused as a turn on it would be
            return match(session.segments, rendered)
        candidates = self._furthest(rendered, self._owned(caller.principal.owner))
        return candidates[0][1] if candidates else match([], rendered)
