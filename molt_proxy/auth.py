"""Who may do what (DESIGN §8): API keys → a principal, and the check for each kind of route.

Without an admin key the proxy is open (it binds to loopback by default): every caller is the
`OPEN` principal and may do everything. With one, every route that writes or reads training
data needs a key, sent as `Authorization: Bearer <key>`, `x-api-key: <key>` or (Google's
clients) `x-goog-api-key: <key>`:

    admin    everything
    agent    chat on, create, read and reward the sessions it created (`owner` = its key id)
    session  chat on, read and reward its own session (minted by `POST /v1/sessions`)

A request without a key, or with a key the proxy does not know, gets 401; a known key on a
route its kind may not use gets 403. A session a principal may not see answers exactly as an
unknown one (the caller raises its own 404), so ids cannot be probed.

Keys are kept and compared as SHA-256 digests: the admin key with `hmac.compare_digest`, agent
and session keys by dict lookup on their digest (no comparison leaks a prefix of a key), and
only session keys' digests are ever written to the store.

This module does not own sessions (`sessions.py`) nor HTTP (`app.py`).
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import secrets
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from molt_proxy.errors import Forbidden, Unauthorized

SESSION_KEY_PREFIX = "mp-sess-"
ADMIN_KEY_ENV = "MOLT_PROXY_ADMIN_KEY"
AGENT_KEYS_ENV = "MOLT_PROXY_AGENT_KEYS"


class Role(enum.Enum):
    OPEN = "open"
    """No admin key is configured: no key is needed and everything is allowed."""
    ADMIN = "admin"
    AGENT = "agent"
    SESSION = "session"


@dataclass(frozen=True, slots=True)
class Principal:
    role: Role
    id: str | None = None
    """AGENT: its key id (`key_id`), stamped on the sessions it creates; SESSION: the session id."""

    @property
    def owner(self) -> str | None:
        """The owner recorded on a session this principal creates (None: admin's or open)."""
        return self.id if self.role is Role.AGENT else None


OPEN = Principal(Role.OPEN)
ADMIN = Principal(Role.ADMIN)

CHAT = frozenset({Role.ADMIN, Role.AGENT, Role.SESSION})
"""Chat, rewards and reading one session: any key; which sessions is `may_use`'s call."""
CREATE = frozenset({Role.ADMIN, Role.AGENT})
"""`POST /v1/sessions`."""
ADMIN_ONLY = frozenset({Role.ADMIN})
"""Trajectories and weights."""


def key_id(key: str) -> str:
    """The SHA-256 hex digest of a key: what the proxy keeps and stores instead of the key."""
    return hashlib.sha256(key.encode()).hexdigest()


def new_session_key() -> str:
    return SESSION_KEY_PREFIX + secrets.token_urlsafe(24)


def presented_key(headers: Mapping[str, str]) -> str | None:
    """`Authorization: Bearer <key>` (OpenAI clients), else `x-api-key` (Anthropic clients),
    else `x-goog-api-key` (Google's; the Gemini routes read `?key=` as this header)."""
    value = headers.get("authorization", "")
    if value[:7].lower() == "bearer " and value[7:].strip():
        return value[7:].strip()
    return headers.get("x-api-key") or headers.get("x-goog-api-key") or None


class Keys:
    """The configured admin and agent keys, held as digests only."""

    def __init__(self, admin_key: str | None, agent_keys: Iterable[str]):
        self._admin = key_id(admin_key) if admin_key else None
        self._agents = frozenset(key_id(key) for key in agent_keys)

    def principal(
        self, headers: Mapping[str, str], allowed: frozenset[Role], session_of: Callable[[str], str | None]
    ) -> Principal:
        """The caller, if it may use a route of kind `allowed` (CHAT, CREATE or ADMIN_ONLY);
        `session_of` maps a key id to its open session's id. Checked before anything else a
        handler does, so an unauthenticated caller learns nothing about the sessions."""
        if self._admin is None:
            return OPEN
        key = presented_key(headers)
        if key is None:
            raise Unauthorized(
                "this route needs an API key (Authorization: Bearer <key>, x-api-key or x-goog-api-key)"
            )
        digest = key_id(key)
        session_id = session_of(digest) if key.startswith(SESSION_KEY_PREFIX) else None
        if hmac.compare_digest(digest, self._admin):
            principal = ADMIN
        elif digest in self._agents:
            principal = Principal(Role.AGENT, digest)
        elif session_id is not None:
            principal = Principal(Role.SESSION, session_id)
        else:
            raise Unauthorized("invalid API key (a session's key stops working when it closes)")
        if principal.role not in allowed:
            raise Forbidden(f"this route is not open to {principal.role.value} keys")
        return principal


def may_use(principal: Principal, session_id: str, owner: str | None) -> bool:
    """Whether `principal` may chat on, read or reward the session `session_id` of `owner`."""
    if principal.role is Role.AGENT:
        return owner == principal.id
    if principal.role is Role.SESSION:
        return session_id == principal.id
    return True


def chat_session(principal: Principal, named: str | None) -> str | None:
    """The session a chat request goes to: a session key's own (naming another is refused,
    whether or not it exists), else the one the request names (None: inferred)."""
    if principal.role is not Role.SESSION:
        return named
    if named is not None and named != principal.id:
        raise Forbidden("this session key may only chat on its own session", param="session_id")
    return principal.id


def load_keys(
    admin_key: str | None,
    admin_key_file: Path | None,
    agent_keys: Iterable[str],
    agent_keys_file: Path | None,
    environ: Mapping[str, str],
) -> tuple[str | None, list[str]]:
    """The admin key and agent keys from flags, files (one key a line) and the environment.

    A flag or file beats `MOLT_PROXY_ADMIN_KEY` (a flag is visible in `ps`; prefer the file
    or the environment). Agent keys are the union of `--agent-key`, the file and the
    comma-separated `MOLT_PROXY_AGENT_KEYS`.
    """
    if admin_key is not None and admin_key_file is not None:
        raise ValueError("give --admin-key or --admin-key-file, not both")
    if admin_key_file is not None:
        lines = _lines(admin_key_file)
        if len(lines) != 1:
            raise ValueError(f"{admin_key_file} must hold exactly one key")
        admin_key = lines[0]
    admin_key = admin_key if admin_key is not None else environ.get(ADMIN_KEY_ENV) or None
    agents = list(agent_keys)
    if agent_keys_file is not None:
        agents += _lines(agent_keys_file)
    agents += [key.strip() for key in environ.get(AGENT_KEYS_ENV, "").split(",") if key.strip()]
    return admin_key, list(dict.fromkeys(agents))


def _lines(path: Path) -> list[str]:
    return [line.strip() for line in path.read_text().splitlines() if line.strip()]
