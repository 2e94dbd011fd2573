"""Side requests: what a harness asks the model besides its episode (Claude Code's title for
the conversation, sent before the first turn), served and recorded like any request but kept
out of training (DESIGN §3).

The rule is configurable (`Settings.side_requests`, `--side-request REGEX`): a request that
declares no tools and whose system prompt matches one of the regular expressions is a side
request. By default that is Claude Code's title request, whose system text asks for "a concise,
sentence-case title". A side request

- runs in a session of its own (`side-<hex>`), whatever session it names (Claude Code's
  `metadata.user_id` names the episode's), so the episode's segments never see it;
- closes that session as soon as its turn is recorded, with the status `side` (never
  rewarded) and the rule that matched in `info.rule`. The mark is the status, which only the
  server writes: a client writes `info`, and an agent must not hide its episode from training
  by posting `info: {"side": true}`;
- is left out of the trainer's stream (`GET /v1/trajectories` as server-sent events); the
  store, the paged `GET /v1/trajectories` and `molt-proxy export` keep it, marked.

A session key's request cannot leave its session, so it is never taken for a side request.
Every API format (chat completions, Anthropic Messages, Responses) applies the rule the same
way, streamed or not: its route asks `side_request` where to serve a request and calls
`Side.done` once the turn is recorded (a stream: `Side.after`, once its events have all gone
out). A Responses request is classified on its whole conversation (a `previous_response_id`'s
history included), after that response's session was found.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from molt_proxy.auth import Role
from molt_proxy.conversation import Conversation
from molt_proxy.session import Caller
from molt_proxy.types import SessionStatus


def side_rule(conversation: Conversation, caller: Caller, rules: Sequence[str]) -> str | None:
    """The rule that makes this request a side request, if one does. The system prompt is every
    `system` message's text, and every `developer` message's (OpenAI's newer name for it)."""
    if conversation.tools or caller.principal.role is Role.SESSION:
        return None
    system = "\n".join(
        m["content"]
        for m in conversation.messages
        if m["role"] in ("system", "developer") and isinstance(m["content"], str)
    )
    return next((rule for rule in rules if re.search(rule, system)), None)


Close = Callable[[str, float | None, dict[str, Any], SessionStatus], Awaitable[object]]
"""`Proxy.close_session(session_id, reward, info, status)`."""


@dataclass(frozen=True)
class Side:
    """Where a request is served: `caller`, which is a side session of its own when `rule`
    matched; `done` closes that session once the turn is recorded (a no-op otherwise)."""

    caller: Caller
    rule: str | None
    close: Close

    async def done(self) -> None:
        if self.rule is not None and self.caller.session_id is not None:
            await self.close(self.caller.session_id, None, side_info(self.rule), SessionStatus.SIDE)

    def after(self, events: AsyncGenerator[str]) -> AsyncGenerator[str]:
        """A streamed reply's events, `done` once they have all gone out."""
        return then(events, self.done) if self.rule is not None else events


def side_request(conversation: Conversation, caller: Caller, rules: Sequence[str], close: Close) -> Side:
    """The rule applied to one request, whatever its API format."""
    rule = side_rule(conversation, caller, rules)
    return Side(side_caller(caller) if rule is not None else caller, rule, close)


def side_caller(caller: Caller) -> Caller:
    """The caller in a new session of its own, with no group (it groups by its prompt)."""
    return Caller(f"side-{uuid.uuid4().hex}", None, None, caller.principal)


def side_info(rule: str) -> dict[str, Any]:
    return {"rule": rule}


def is_side(trajectory: dict[str, Any]) -> bool:
    """Status `side`; or, in a store from before that status, unrewarded with `info.side`
    (then only the server closed sessions unrewarded with an `info`)."""
    if trajectory.get("status") == SessionStatus.SIDE:
        return True
    info = trajectory.get("info")
    legacy = trajectory.get("status") == SessionStatus.UNREWARDED
    return legacy and isinstance(info, dict) and info.get("side") is True


async def then(events: AsyncGenerator[str], done: Callable[[], Awaitable[object]]) -> AsyncGenerator[str]:
    """`events`, then `done()` once they have all gone out (not if the client left first:
    then nothing was recorded)."""
    async with aclosing(events):
        async for line in events:
            yield line
    await done()
