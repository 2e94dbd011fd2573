"""Stored Responses API conversations (`store: true`), in the proxy's SQLite store.

A stored response keeps what a later request naming it as `previous_response_id` continues
from: every item of its conversation (the stored history it continued, its own input, its
output, reasoning with `encrypted_content` so it renders exactly as sampled), the session it
belongs to, and the response object as returned (`GET /v1/responses/{id}`). Durable, like
every turn: a restarted proxy still continues a stored conversation. Each row holds its whole
history, zlib-compressed JSON, so deleting one response never breaks another's chain. A
session's stored responses go when it closes (`Store.close_session`, in the same transaction):
a closed session takes no more turns, and its trajectories hold every token.

The SQL is here (with `Store.on_db` running it on the store's thread), as the migrations'
is in `store_migrations.py`: `store.py` stays the store of sessions, turns and trajectories.
"""

from __future__ import annotations

import json
import sqlite3
import time
import zlib
from dataclasses import dataclass
from typing import Any

from molt_proxy.store_writer import OnDb

SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    session_id TEXT NOT NULL,
    data BLOB NOT NULL,
    created REAL NOT NULL
) WITHOUT ROWID;
"""


@dataclass(slots=True, frozen=True)
class StoredResponse:
    session_id: str
    history: list[dict[str, Any]]
    """The items a continuation renders first, in order."""
    response: dict[str, Any]


def _save(db: sqlite3.Connection, response_id: str, session_id: str, data: bytes) -> None:
    db.execute(
        "INSERT OR REPLACE INTO responses (id, session_id, data, created) VALUES (?, ?, ?, ?)",
        (response_id, session_id, data, time.time()),
    )


def _load(db: sqlite3.Connection, response_id: str) -> tuple[str, bytes] | None:
    return db.execute("SELECT session_id, data FROM responses WHERE id = ?", (response_id,)).fetchone()


def _delete(db: sqlite3.Connection, response_id: str) -> bool:
    return db.execute("DELETE FROM responses WHERE id = ?", (response_id,)).rowcount > 0


class StoredResponses:
    def __init__(self, store: OnDb):
        self.store = store

    async def save(self, response: dict[str, Any], session_id: str, history: list[dict[str, Any]]) -> None:
        data = zlib.compress(json.dumps({"history": history, "response": response}).encode())
        await self.store.on_db(_save, response["id"], session_id, data)

    async def load(self, response_id: str) -> StoredResponse | None:
        row = await self.store.on_db(_load, response_id)
        if row is None:
            return None
        data = json.loads(zlib.decompress(row[1]))
        return StoredResponse(row[0], data["history"], data["response"])

    async def delete(self, response_id: str) -> bool:
        return await self.store.on_db(_delete, response_id)
