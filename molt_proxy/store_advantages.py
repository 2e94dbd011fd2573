"""The advantages the trainer trained each trajectory with, as it posted them
(`POST /v1/admin/advantages`, `advantages.py`), in the proxy's SQLite store, for the viewer.

One row per trajectory id: the step and weight version the trainer reported, and either one
advantage for the whole trajectory or one per turn (per-turn credit; None where a turn had no
sampled token to train). A later post for the same trajectory replaces it. Rows are never read
by the trainer: they are what it did, shown next to the reward on the viewer's group page.

The SQL is here (with `Store.on_db` running it on the store's thread), as that of stored
responses is in `store_responses.py`. The table is created when the store opens, so a store
written before it existed gains it then (with no rows).
"""

from __future__ import annotations

import json
import sqlite3
import time
import zlib
from dataclasses import dataclass
from typing import Any

from molt_proxy.errors import BadRequest, NotFound
from molt_proxy.store_writer import OnDb

SCHEMA = """
CREATE TABLE IF NOT EXISTS advantages (
    trajectory_id TEXT PRIMARY KEY,
    step INTEGER NOT NULL,
    version INTEGER NOT NULL,
    advantage REAL,
    turn_advantages TEXT,
    created REAL NOT NULL
) WITHOUT ROWID;
"""


@dataclass(slots=True, frozen=True)
class Posted:
    """One trajectory's advantages: `advantage` or `turn_advantages`, the other None."""

    trajectory_id: str
    advantage: float | None
    turn_advantages: list[float | None] | None


def _turns(db: sqlite3.Connection, trajectory_id: str) -> int | None:
    """The number of turns of a stored trajectory; None: no such trajectory."""
    row = db.execute("SELECT data FROM trajectories WHERE trajectory_id = ?", (trajectory_id,)).fetchone()
    if row is None:
        return None
    data = row[0]
    return len(json.loads(zlib.decompress(data) if isinstance(data, bytes) else data)["turns"])


def _check(db: sqlite3.Connection, index: int, entry: Posted) -> None:
    param = f"trajectories.{index}"
    turns = _turns(db, entry.trajectory_id)
    if turns is None:
        raise NotFound(f"no trajectory {entry.trajectory_id!r}", param=f"{param}.trajectory_id")
    if entry.turn_advantages is not None and len(entry.turn_advantages) != turns:
        raise BadRequest(
            f"trajectory {entry.trajectory_id!r} has {turns} turns, "
            f"not {len(entry.turn_advantages)} turn advantages",
            param=f"{param}.turn_advantages",
        )


def _save(db: sqlite3.Connection, step: int, version: int, entries: list[Posted]) -> None:
    """Every entry checked first, then all written in one transaction: all or nothing."""
    for index, entry in enumerate(entries):
        _check(db, index, entry)
    now = time.time()
    rows = [
        (
            e.trajectory_id,
            step,
            version,
            e.advantage,
            None if e.turn_advantages is None else json.dumps(e.turn_advantages),
            now,
        )
        for e in entries
    ]
    db.execute("BEGIN IMMEDIATE")
    try:
        db.executemany(
            "INSERT OR REPLACE INTO advantages"
            " (trajectory_id, step, version, advantage, turn_advantages, created) VALUES (?, ?, ?, ?, ?, ?)",
            rows,
        )
        db.execute("COMMIT")
    except BaseException:
        db.execute("ROLLBACK")
        raise


def _load(db: sqlite3.Connection, trajectory_id: str) -> tuple[int, int, float | None, str | None] | None:
    return db.execute(
        "SELECT step, version, advantage, turn_advantages FROM advantages WHERE trajectory_id = ?",
        (trajectory_id,),
    ).fetchone()


async def save(store: OnDb, step: int, version: int, entries: list[Posted]) -> None:
    """Store the entries (a 404 naming the first unknown trajectory, a 400 for a turn count
    that is not the trajectory's, and then nothing is stored)."""
    await store.on_db(_save, step, version, entries)


async def load(store: OnDb, trajectory_id: str) -> dict[str, Any] | None:
    """What the trainer posted for the trajectory, as the viewer reads it; None: nothing."""
    row = await store.on_db(_load, trajectory_id)
    if row is None:
        return None
    step, version, advantage, turn_advantages = row
    return {
        "step": step,
        "version": version,
        "advantage": advantage,
        "turn_advantages": None if turn_advantages is None else json.loads(turn_advantages),
    }
