"""One session in memory: its segments (chains, all open), the turns in flight on them
(`Claim`), the replies a retry gets, and the hints a request names it by. State only; the
registry that creates, finds and closes sessions is `sessions.py`, which session and chain a
request joins is `turns.py`, and a turn itself is `completions.py`'s."""

from __future__ import annotations

import asyncio
import hashlib
from array import array
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from molt_proxy.auth import Principal
from molt_proxy.errors import BadRequest
from molt_proxy.types import RecordedReply, Segment, SessionStatus, Trajectory


@dataclass(slots=True, frozen=True)
class Caller:
    """Who sent a request, whatever its wire format: the session id and key it named, if any,
    its group header, and who its key says it is (`auth.py`)."""

    session_id: str | None
    api_key: str | None
    group_id: str | None
    principal: Principal


@dataclass(slots=True, frozen=True)
class Attempt:
    """One try at a request, whatever its wire format: what tells a retry (its client lost the
    answer, so it gets the recorded reply again) from a new request that happens to repeat the
    last one (an agent may resend a history to sample again). The route reads the headers the
    OpenAI and Anthropic SDKs send."""

    request_hash: str
    """SHA-256 of the request body: a retry sends the same bytes."""
    idempotency_key: str | None = None
    """`Idempotency-Key`: the client's name for the request, kept with its turn; the same key is
    the same request, whatever else is said."""
    retry: bool | None = None
    """`x-stainless-retry-count` above 0 (True) or 0 (False); None: the client does not say,
    and a body identical to the last request's is taken for a retry."""


@dataclass(slots=True, eq=False)
class Claim:
    """A turn in flight on its session: the chains its render continues (it appends to one of
    them) and the render itself. A request that could continue one of those chains, or whose
    render extends this one, must wait for it (`Session.blocking`), because the turn changes
    what that request continues: a retry then finds its reply, and the same history sent twice
    forks a chain exactly as it would sent one after the other."""

    chains: frozenset[int]
    rendered: bytes
    done: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass(slots=True)
class Session:
    id: str
    group_id: str | None
    """Given at creation; otherwise derived from the first prompt when the session closes."""
    created: float
    api_key_hash: str | None = None
    """SHA-256 of the session's own key (`auth.key_id`), if it was minted one."""
    owner: str | None = None
    """The id of the agent key that created it (`auth.Principal.owner`)."""
    inferred: bool = False
    last_active: float = 0.0
    call_ids: set[str] = field(default_factory=set)
    """Ids of the tool calls in this session's replies: an echoed history names them."""
    segments: list[Segment] = field(default_factory=list)
    """Its chains, in the order they opened (`Segment.index`); every one may still be continued
    (`stitching.plan_prompt`)."""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    """Held while a turn is stored and committed, a reward set or the session closed: short
    sections, never a generation (turns in flight are `in_flight`)."""
    in_flight: list[Claim] = field(default_factory=list)
    last: dict[int, tuple[str, RecordedReply | None]] = field(default_factory=dict)
    """Segment index → the hash of the last request its chain answered and its reply, the
    chain answered last last: a byte-identical retry gets the latest such reply (a chain's
    last request, as other chains' turns may have come in between)."""
    keyed: dict[str, tuple[str, RecordedReply]] = field(default_factory=dict)
    """Idempotency key → the request hash and reply of the turn recorded under it."""
    closed: bool = False

    def blocking(self, rendered: bytes, chains: frozenset[int]) -> Claim | None:
        """A turn in flight that a request continuing `chains` with `rendered` must wait for."""
        return next((c for c in self.in_flight if c.chains & chains or rendered.startswith(c.rendered)), None)

    def claim(self, rendered: bytes, chains: frozenset[int]) -> Claim:
        claim = Claim(chains, rendered)
        self.in_flight.append(claim)
        return claim

    def release(self, claim: Claim) -> None:
        self.in_flight.remove(claim)
        claim.done.set()

    @asynccontextmanager
    async def alone(self) -> AsyncIterator[None]:
        """No turn in flight until the block ends (closing the session): the turns in flight
        end first, and requests that arrive meanwhile wait, since every render extends the
        empty one this claims."""
        earlier = list(self.in_flight)
        claim = self.claim(b"", frozenset())
        try:
            for turn in earlier:
                await turn.done.wait()
            yield
        finally:
            self.release(claim)

    def answered(
        self, segment: int, request_hash: str, idempotency_key: str | None, reply: RecordedReply | None
    ) -> None:
        """Remember the reply of a turn recorded on chain `segment` for the retries of its
        request (`Attempt`); None: a row whose reply this version cannot read, never replayed."""
        self.last.pop(segment, None)  # the latest answered last: a retry gets the latest reply
        self.last[segment] = (request_hash, reply)
        if idempotency_key is not None and reply is not None:
            self.keyed[idempotency_key] = (request_hash, reply)

    def replay(self, attempt: Attempt) -> RecordedReply | None:
        """The reply to give again when `attempt` retries a request this session answered;
        None: sample a new one. A key names its request, so one reused for another body is
        refused rather than answered with a reply to something else."""
        if attempt.idempotency_key is not None:
            known = self.keyed.get(attempt.idempotency_key)
            if known is not None and known[0] != attempt.request_hash:
                raise BadRequest(
                    "this Idempotency-Key was used for a different request in this session",
                    param="Idempotency-Key",
                )
            return known[1] if known is not None else None
        if attempt.retry is False:
            return None
        answered = reversed(self.last.values())
        return next((reply for hashed, reply in answered if hashed == attempt.request_hash), None)

    def answered_retry(self, attempt: Attempt) -> bool:
        """Whether `attempt` says it retries a request (`Idempotency-Key`, or a retry count above
        0) that this session answered: how a retry without a session id finds its session,
        since its history no longer continues the chain its first try extended. A request that
        does not say so is never taken for another session's retry (N attempts at one task
        send identical first requests)."""
        if attempt.idempotency_key is not None:
            return attempt.idempotency_key in self.keyed
        return attempt.retry is True and any(
            hashed == attempt.request_hash for hashed, _ in self.last.values()
        )

    def describe(self) -> dict[str, Any]:
        return {
            "session_id": self.id,
            "group_id": self.group_id or default_group(self),
            "status": "closed" if self.closed else "open",
            "segments": [
                {
                    "segment": s.index,
                    "num_tokens": len(s.token_ids),
                    "num_sampled": sum(t.completion_end - t.completion_start for t in s.turns),
                    "turns": [t.completion_id for t in s.turns],
                }
                for s in self.segments
            ],
        }

    def trajectories(
        self, reward: float | None, info: dict[str, Any], status: SessionStatus, model: str, now: float
    ) -> list[Trajectory]:
        """Every segment as a trajectory carrying the session's reward and group (`seq` is set
        when the store appends them)."""
        group_id = self.group_id or default_group(self)
        return [
            Trajectory(
                seq=0,
                trajectory_id=f"{self.id}:{segment.index}",
                session_id=self.id,
                segment=segment.index,
                num_segments=len(self.segments),
                group_id=group_id,
                token_ids=segment.token_ids.tolist(),
                loss_mask=segment.loss_mask,
                logprobs=segment.logprobs,
                weight_versions=segment.weight_versions,
                turns=segment.turns,
                reward=reward,
                info=info,
                status=status,
                model=model,
                created=now,
            )
            for segment in self.segments
        ]


DEFAULT_GROUP_PREFIX = "prompt-"


def default_group(session: Session) -> str:
    """A hash of the session's first rendered prompt: N attempts at one task group themselves
    (DESIGN §3). A session an agent key created hashes its owner too: another key's attempts at
    the same prompt are not its group (groups belong to an owner, `Sessions._join_group`). A
    session without turns is its own group."""
    if not session.segments or not session.segments[0].turns:
        return session.id
    first = session.segments[0]
    digest = hashlib.sha256(array("i", first.token_ids[: first.turns[0].completion_start]).tobytes())
    if session.owner is not None:
        digest.update(b"\0owner " + session.owner.encode())
    return DEFAULT_GROUP_PREFIX + digest.hexdigest()[:16]
