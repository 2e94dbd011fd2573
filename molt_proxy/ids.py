"""The ids a client names sessions and groups by, checked where they enter (DESIGN §3, §8).

A session id travels far: into URLs (`/s/<id>/v1`), log lines, SQLite, trajectory ids
(`<session>:<segment>`), the viewer's pages and the trainer's records. An id with a newline
forges a log line, one with a NUL or a `/` cannot be put back into a URL, and an 8 KB id is
copied into every one of those places. So ids are limited to what every client that names
sessions sends, and every id the proxy mints:

- Claude Code and Codex name their sessions by UUIDs (`0198c4d5-…`), with dashes;
- the proxy mints `uuid4().hex` for inferred sessions and `side-<hex>` for side requests;
- groups it derives are `prompt-<hex>`, and evaluation groups are `eval/<group>`, so a group
  may hold a `/` (a task path such as `swe/django-11099` reads naturally too).

Anything outside the charset or the length is refused (400) where the id is named explicitly
(the path, `X-Session-Id`, `X-Group-Id`, `metadata.session_id`, `POST /v1/sessions`). An id a
harness merely hints at (Claude Code's `metadata.user_id`, Codex's `client_metadata`) is
checked with `valid_session_id` and ignored when it fails: the request is then inferred, as it
would be without the hint, since the client never asked the proxy to read that field.
"""

from __future__ import annotations

import re

from molt_proxy.errors import BadRequest

MAX_SESSION_ID = 128
"""A UUID is 36 characters; `side-` plus a hex UUID is 37. Room for a harness's own prefix."""
MAX_GROUP_ID = 256
"""A group may carry the `eval/` prefix on top of a task name of its own."""
_SESSION_ID = re.compile(rf"[A-Za-z0-9._:-]{{1,{MAX_SESSION_ID}}}")
_GROUP_ID = re.compile(rf"[A-Za-z0-9._:/-]{{1,{MAX_GROUP_ID}}}")
_RULE = "letters, digits, '.', '_', ':' and '-'"


def valid_session_id(value: str) -> bool:
    return _SESSION_ID.fullmatch(value) is not None


def check_session_id(value: str | None, param: str) -> str | None:
    """`value` (None: not named), or BadRequest naming `param`. The message quotes no part of
    the id: it may be 8 KB, or hold the control characters that made it refused."""
    if value is not None and not valid_session_id(value):
        raise BadRequest(
            f"'{param}' must be 1 to {MAX_SESSION_ID} characters of {_RULE} ({len(value)} given)",
            param=param,
        )
    return value


def check_group_id(value: str | None, param: str) -> str | None:
    """As `check_session_id`, for a group id (`/` allowed too)."""
    if value is not None and _GROUP_ID.fullmatch(value) is None:
        raise BadRequest(
            f"'{param}' must be 1 to {MAX_GROUP_ID} characters of {_RULE} and '/' ({len(value)} given)",
            param=param,
        )
    return value
