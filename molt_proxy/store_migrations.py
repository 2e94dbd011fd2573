"""What a store written by an older version needs to open: its migrations, and the reply form
it wrote before replies were kept format-neutral.

`store.py` runs these when it opens a database and reads a turn row.
A database written by an earlier version opens as it is: columns added since are added (NULL
on old rows), plain session keys are hashed, and an old row's reply is read in its old form.
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
from typing import Any

from molt_proxy.types import ParsedReply, RecordedReply


def make_private(path: str) -> None:
    """Create the database file 0600 before SQLite opens it (it holds training data and key
    digests); SQLite gives its -wal and -shm files the database file's mode. A file left by an
    older version, which created it 0644, is narrowed too."""
    os.close(os.open(path, os.O_CREAT | os.O_RDWR, 0o600))
    for file in (path, f"{path}-wal", f"{path}-shm"):
        if os.path.exists(file):
            os.chmod(file, 0o600)


def add_turn_columns(db: sqlite3.Connection) -> None:
    """A store from before a turn column existed gets it, NULL on its rows: `sampling` (the
    trainer leaves the tokens of such turns out, as it cannot know their distribution),
    `idempotency_key` (such a turn is replayed by its request hash only), `constrained` (such
    a turn was sampled unconstrained: the proxy refused constraints before) and `echo` (the
    reply's echo view: such a turn is continued by its sampled bytes only, as it was then)."""
    columns = [row[1] for row in db.execute("PRAGMA table_info(turns)")]
    added = (("sampling", "TEXT"), ("idempotency_key", "TEXT"), ("constrained", "INTEGER"), ("echo", "BLOB"))
    for name, kind in added:
        if name not in columns:
            db.execute(f"ALTER TABLE turns ADD COLUMN {name} {kind}")


def hash_plain_session_keys(db: sqlite3.Connection) -> None:
    """Migrate a store from before keys were hashed: `api_key` (plain) → `api_key_hash`, and
    the `owner` column. The sessions keep working with the same keys."""
    columns = [row[1] for row in db.execute("PRAGMA table_info(sessions)")]
    if "api_key" not in columns:
        return
    db.execute("BEGIN IMMEDIATE")
    try:
        rows = db.execute("SELECT id, api_key FROM sessions WHERE api_key IS NOT NULL").fetchall()
        db.execute("ALTER TABLE sessions RENAME COLUMN api_key TO api_key_hash")
        db.execute("ALTER TABLE sessions ADD COLUMN owner TEXT")
        db.executemany(
            "UPDATE sessions SET api_key_hash = ? WHERE id = ?",
            [(hashlib.sha256(key.encode()).hexdigest(), sid) for sid, key in rows],
        )
        db.execute("COMMIT")
    except BaseException:
        db.execute("ROLLBACK")
        raise


def decode_reply(text: str) -> RecordedReply | None:
    """A turn row's `reply` column: a `RecordedReply`'s JSON, or an OpenAI chat completion as
    rows written before replies were format-neutral hold it. None if it is neither (such a
    turn is then never replayed, only kept)."""
    data = json.loads(text)
    if isinstance(data, dict) and "message" in data:
        return RecordedReply.from_json(data)
    try:
        return _from_openai_reply(data)
    except (KeyError, IndexError, TypeError):
        return None


def _from_openai_reply(data: dict[str, Any]) -> RecordedReply:
    """The neutral form of a stored OpenAI reply. Its `finish_reason` is OpenAI's, where a stop
    that made tool calls reads `tool_calls`; vLLM's reason was `stop`."""
    choice = data["choices"][0]
    message = choice["message"]
    finish_reason = choice["finish_reason"]
    return RecordedReply(
        completion_id=data["id"],
        created=data["created"],
        model=data["model"],
        message=ParsedReply(
            message.get("content"), message.get("reasoning_content"), message.get("tool_calls") or []
        ),
        finish_reason="stop" if finish_reason == "tool_calls" else finish_reason,
        prompt_tokens=data["usage"]["prompt_tokens"],
        completion_tokens=data["usage"]["completion_tokens"],
    )
