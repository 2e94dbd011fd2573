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
Every API format applies the rule the same way, streamed or not: the turn classifies its
request when it opens (`completions.Completions.turn`) and closes the side session once the
turn is recorded (a stream: once its events have all gone out). A Responses request is
classified on its whole conversation (a `previous_response_id`'s history included), after that
response's session was found. The default rules and their check are settings
(`config.DEFAULT_SIDE_REQUESTS`, `config.check_rules`); what is here is how the store marks a
side request and how a reader tells one.
"""

from __future__ import annotations

from typing import Any

from molt_proxy.types import SessionStatus


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
