"""The only module that touches SQL: sessions, turns and trajectories in SQLite (WAL).

Every turn and every reward is committed (`synchronous=FULL`) before the proxy answers, so a
killed proxy loses nothing it acknowledged. A turn row holds only what the turn appended
(its new prompt ids and its sampled ids, as packed arrays) with its reply and the reply's echo
view (`echo.py`), so a write costs the turn, not the conversation; open sessions are rebuilt
on restart by replaying their turns in order.
Finalized trajectories get a dense, increasing `seq`: the trainer's cursor.

Each token is kept once. Closing a session writes its trajectories and, in the same
transaction, drops its turn rows (the trajectories hold every token of them), keeping only
`completions` (completion id → session id) so that a reward naming a reply still finds its
session. A trajectory's `data` is its JSON, compact and zlib-compressed (prompt tokens' mask,
logprob and version are runs of one value): readers get the same JSON back, and rows written
before, as plain JSON text, read as they are.

All SQL runs on one dedicated thread with one connection; callers await it. Writes are
group-committed (`store_writer.py`): the turns that wait at the same moment share one
transaction and one fsync, and each caller resumes once its transaction has committed.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import zlib
from array import array
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import fields, is_dataclass
from functools import cache
from pathlib import Path
from typing import Any, TypeVar, cast

from molt_proxy.store_advantages import SCHEMA as ADVANTAGES_SCHEMA
from molt_proxy.store_migrations import (
    add_turn_columns,
    decode_reply,
    hash_plain_session_keys,
    make_private,
)
from molt_proxy.store_responses import SCHEMA as RESPONSES_SCHEMA
from molt_proxy.store_writer import GroupCommit, Write
from molt_proxy.types import (
    EchoView,
    Generation,
    Sampling,
    SessionStatus,
    StoredSession,
    StoredTurn,
    Trajectory,
)

T = TypeVar("T")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    id TEXT PRIMARY KEY,
    group_id TEXT,
    api_key_hash TEXT UNIQUE,
    owner TEXT,
    inferred INTEGER NOT NULL,
    status TEXT NOT NULL,
    reward REAL,
    info TEXT NOT NULL DEFAULT '{}',
    created REAL NOT NULL,
    closed REAL
);
CREATE TABLE IF NOT EXISTS turns (
    position INTEGER PRIMARY KEY AUTOINCREMENT,
    completion_id TEXT NOT NULL UNIQUE,
    session_id TEXT NOT NULL REFERENCES sessions(id),
    segment INTEGER NOT NULL,
    new_ids BLOB NOT NULL,
    sampled_ids BLOB NOT NULL,
    logprobs BLOB NOT NULL,
    versions BLOB NOT NULL,
    finish_reason TEXT NOT NULL,
    created REAL NOT NULL,
    request_hash TEXT NOT NULL,
    reply TEXT NOT NULL,
    reward REAL,
    sampling TEXT,
    idempotency_key TEXT,
    constrained INTEGER,
    echo BLOB
);
CREATE INDEX IF NOT EXISTS turns_by_session ON turns(session_id, position);
CREATE INDEX IF NOT EXISTS sessions_by_group ON sessions(group_id);
CREATE TABLE IF NOT EXISTS completions (
    completion_id TEXT PRIMARY KEY,
    session_id TEXT NOT NULL
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS weights (
    id INTEGER PRIMARY KEY CHECK (id = 0),
    path TEXT NOT NULL,
    version INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS trajectories (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    trajectory_id TEXT NOT NULL UNIQUE,
    session_id TEXT NOT NULL,
    data TEXT NOT NULL
);
"""


def _pack(typecode: str, values: list) -> bytes:
    return array(typecode, values).tobytes()


def _unpack(typecode: str, blob: bytes) -> list:
    values = array(typecode)
    values.frombytes(blob)
    return values.tolist()


_DROPPED = b"\xff"
"""Opens a stored echo view that stands for the end of the turn's prompt too (`EchoView.dropped`):
never a byte of UTF-8, so no view of the reply alone (what older stores hold) starts with it."""


def _pack_echo(echo: EchoView | None) -> bytes | None:
    """The `echo` column: the view, or `_DROPPED` + dropped + `_DROPPED` + view when it stands
    for the end of the prompt too (one value, as stores written before hold it)."""
    if echo is None:
        return None
    return _DROPPED + echo.dropped + _DROPPED + echo.view if echo.dropped else echo.view


def _unpack_echo(stored: bytes | None) -> EchoView | None:
    if stored is None:
        return None
    if not stored.startswith(_DROPPED):
        return EchoView(stored)
    dropped, view = stored[1:].split(_DROPPED, 1)
    return EchoView(view, dropped)


def _turn(
    completion_id: str,
    segment: int,
    new_ids: bytes,
    sampled: bytes,
    logprobs: bytes,
    versions: bytes,
    finish_reason: str,
    created: float,
    request_hash: str,
    reply: str,
    reward: float | None,
    sampling: str | None,
    idempotency_key: str | None,
    constrained: int | None,
    echo: bytes | None,
) -> StoredTurn:
    generation = Generation(
        token_ids=_unpack("i", sampled),
        logprobs=_unpack("d", logprobs),
        weight_versions=_unpack("i", versions),
        finish_reason=finish_reason,
        constrained=bool(constrained),  # NULL: a row from before the column, unconstrained
    )
    return StoredTurn(
        completion_id,
        segment,
        _unpack("i", new_ids),
        generation,
        created,
        request_hash,
        decode_reply(reply),
        reward,
        Sampling.from_json(json.loads(sampling)) if sampling else None,
        idempotency_key,
        _unpack_echo(echo),
    )


class Store:
    def __init__(self, path: str | Path):
        self.path = str(path)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="molt-store")
        self._db: sqlite3.Connection | None = None
        self.writer = GroupCommit(self._run, lambda: self.db)

    async def _write(self, write: Write) -> Any:
        """`write(db)` committed with the writes batched with it (`store_writer.py`)."""
        return await self.writer.write(write)

    async def _execute(self, sql: str, params: tuple[Any, ...]) -> None:
        await self._write(lambda db: db.execute(sql, params))

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def open(self) -> None:
        await self._run(self._open)

    def _open(self) -> None:
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            make_private(self.path)
        db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")
        db.execute("PRAGMA foreign_keys=ON")
        hash_plain_session_keys(db)
        db.executescript(_SCHEMA)
        db.executescript(RESPONSES_SCHEMA)
        db.executescript(ADVANTAGES_SCHEMA)
        add_turn_columns(db)
        self._db = db

    async def close(self) -> None:
        await self.writer.drain()
        if self._db is not None:
            await self._run(self._db.close)
            self._db = None
        self._executor.shutdown(wait=True)

    async def on_db(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(db, *args)` on the store's thread: the SQL of `store_responses.py` and
        `store_advantages.py`."""
        return await self._run(fn, self.db, *args)

    @property
    def db(self) -> sqlite3.Connection:
        if self._db is None:
            raise RuntimeError("the store is not open")
        return self._db

    # -- sessions --------------------------------------------------------------------------

    async def create_session(self, session: StoredSession) -> SessionStatus | None:
        """The session's row inserted, unless a session has its id already: then nothing is
        written and that session's status is returned (None: inserted). Looked up and inserted
        in one write on the store's thread: a lookup of its own was one more hop there, 45 µs
        of CPU, for every new session."""

        def write(db: sqlite3.Connection) -> SessionStatus | None:
            row = db.execute("SELECT status FROM sessions WHERE id = ?", (session.id,)).fetchone()
            if row is not None:
                return SessionStatus(row[0])
            db.execute(
                "INSERT INTO sessions (id, group_id, api_key_hash, owner, inferred, status, created)"
                " VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    session.id,
                    session.group_id,
                    session.api_key_hash,
                    session.owner,
                    session.inferred,
                    session.status.value,
                    session.created,
                ),
            )
            return None

        existing: SessionStatus | None = await self._write(write)
        return existing

    async def open_sessions(self) -> list[tuple[StoredSession, list[StoredTurn]]]:
        return await self._run(self._open_sessions)

    def _open_sessions(self) -> list[tuple[StoredSession, list[StoredTurn]]]:
        """Two queries however many sessions are open: the sessions, then all their turns."""
        result: dict[str, tuple[StoredSession, list[StoredTurn]]] = {}
        for sid, group_id, api_key_hash, owner, inferred, status, created in self.db.execute(
            "SELECT id, group_id, api_key_hash, owner, inferred, status, created FROM sessions"
            " WHERE status = ?",
            (SessionStatus.OPEN.value,),
        ):
            stored = StoredSession(
                sid, group_id, api_key_hash, owner, bool(inferred), SessionStatus(status), created
            )
            result[sid] = (stored, [])
        for sid, *turn in self.db.execute(
            "SELECT t.session_id, t.completion_id, t.segment, t.new_ids, t.sampled_ids, t.logprobs,"
            " t.versions, t.finish_reason, t.created, t.request_hash, t.reply, t.reward, t.sampling,"
            " t.idempotency_key, t.constrained, t.echo"
            " FROM turns t JOIN sessions s ON s.id = t.session_id WHERE s.status = ? ORDER BY t.position",
            (SessionStatus.OPEN.value,),
        ):
            result[sid][1].append(_turn(*turn))
        return list(result.values())

    async def session_status(self, session_id: str) -> SessionStatus | None:
        def query() -> SessionStatus | None:
            row = self.db.execute("SELECT status FROM sessions WHERE id = ?", (session_id,)).fetchone()
            return SessionStatus(row[0]) if row else None

        return await self._run(query)

    async def session_owner(self, session_id: str) -> str | None:
        """The agent key id that created the session (None: no owner, or no such session)."""

        def query() -> str | None:
            row = self.db.execute("SELECT owner FROM sessions WHERE id = ?", (session_id,)).fetchone()
            return row[0] if row else None

        return await self._run(query)

    async def group_owner(self, group_id: str) -> tuple[bool, str | None]:
        """Whether a session ever named the group, and the owner of the first that did."""

        def query() -> tuple[bool, str | None]:
            row = self.db.execute(
                "SELECT owner FROM sessions WHERE group_id = ? ORDER BY rowid LIMIT 1", (group_id,)
            ).fetchone()
            return (True, row[0]) if row else (False, None)

        return await self._run(query)

    # -- turns -----------------------------------------------------------------------------

    async def record_turn(self, session_id: str, turn: StoredTurn) -> None:
        g = turn.generation
        await self._execute(
            "INSERT INTO turns (completion_id, session_id, segment, new_ids, sampled_ids, logprobs,"
            " versions, finish_reason, created, request_hash, reply, sampling, idempotency_key, constrained,"
            " echo)"
            " VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
            (
                turn.completion_id,
                session_id,
                turn.segment,
                _pack("i", turn.new_ids),
                _pack("i", g.token_ids),
                _pack("d", g.logprobs),
                _pack("i", g.weight_versions),
                g.finish_reason,
                turn.created,
                turn.request_hash,
                _dataclass_json(turn.reply) if turn.reply is not None else "{}",
                _dataclass_json(turn.sampling) if turn.sampling else None,
                turn.idempotency_key,
                int(g.constrained),
                _pack_echo(turn.echo),
            ),
        )

    async def session_of_completion(self, completion_id: str) -> str | None:
        def query() -> str | None:
            row = self.db.execute(
                "SELECT session_id FROM turns WHERE completion_id = ?"
                " UNION ALL SELECT session_id FROM completions WHERE completion_id = ?",
                (completion_id, completion_id),
            ).fetchone()
            return row[0] if row else None

        return await self._run(query)

    async def set_turn_reward(self, completion_id: str, reward: float) -> None:
        await self._execute("UPDATE turns SET reward = ? WHERE completion_id = ?", (reward, completion_id))

    # -- weights ---------------------------------------------------------------------------

    async def save_weights(self, path: str, version: int) -> None:
        """The weights the replicas serve: a replica that (re)starts later gets them first,
        even across a proxy restart."""
        await self._execute(
            "INSERT INTO weights (id, path, version) VALUES (0, ?, ?)"
            " ON CONFLICT(id) DO UPDATE SET path = excluded.path, version = excluded.version",
            (path, version),
        )

    async def last_weights(self) -> tuple[str, int] | None:
        def query() -> tuple[str, int] | None:
            row = self.db.execute("SELECT path, version FROM weights WHERE id = 0").fetchone()
            return (row[0], row[1]) if row else None

        return await self._run(query)

    # -- finalization ----------------------------------------------------------------------

    async def close_session(
        self,
        session_id: str,
        status: SessionStatus,
        reward: float | None,
        info: dict[str, Any],
        closed: float,
        trajectories: list[Trajectory],
    ) -> list[Trajectory]:
        """Mark the session closed, append its trajectories and drop its turn rows (keeping
        which session each completion id belongs to), atomically; returns the trajectories with
        their `seq` set."""
        return await self._write(
            lambda db: _close_session(db, session_id, status, reward, info, closed, trajectories)
        )

    async def trajectories_after(self, seq: int, limit: int) -> list[dict[str, Any]]:
        def query() -> list[dict[str, Any]]:
            rows = self.db.execute(_TRAJECTORIES + " WHERE t.seq > ? ORDER BY t.seq LIMIT ?", (seq, limit))
            return _with_info(rows.fetchall())

        return await self._run(query)


def _close_session(
    db: sqlite3.Connection,
    session_id: str,
    status: SessionStatus,
    reward: float | None,
    info: dict[str, Any],
    closed: float,
    trajectories: list[Trajectory],
) -> list[Trajectory]:
    db.execute(
        "UPDATE sessions SET status = ?, reward = ?, info = ?, closed = ? WHERE id = ?",
        (status.value, reward, json.dumps(info), closed, session_id),
    )
    for trajectory in trajectories:
        cursor = db.execute(
            "INSERT INTO trajectories (trajectory_id, session_id, data) VALUES (?, ?, '')",
            (trajectory.trajectory_id, session_id),
        )
        trajectory.seq = cast(int, cursor.lastrowid)  # an INSERT's row id: never None
        data = trajectory.to_json()
        del data["info"]  # once per session, in its row: `_with_info` puts it back on read
        db.execute(
            "UPDATE trajectories SET data = ? WHERE seq = ?", (_encode_trajectory(data), trajectory.seq)
        )
    db.execute(
        "INSERT INTO completions (completion_id, session_id)"
        " SELECT completion_id, session_id FROM turns WHERE session_id = ?",
        (session_id,),
    )
    db.execute("DELETE FROM turns WHERE session_id = ?", (session_id,))
    db.execute("DELETE FROM responses WHERE session_id = ?", (session_id,))  # nothing continues them
    return trajectories


_TRAJECTORIES = (
    "SELECT t.data, t.session_id, s.info FROM trajectories t LEFT JOIN sessions s ON s.id = t.session_id"
)
"""A trajectory row with its session's `info`: a reward's `info` is stored once per session,
not in each of its segments' rows (a 20-segment session would hold 20 copies)."""


def _with_info(rows: list[tuple[bytes | str, str, str | None]]) -> list[dict[str, Any]]:
    """Trajectories from `_TRAJECTORIES` rows, each with its session's `info` (a row written
    before `info` moved to the session keeps its own); a session's `info` is parsed once."""
    infos: dict[str, dict[str, Any]] = {}
    trajectories = []
    for data, session_id, info in rows:
        trajectory = _decode_trajectory(data)
        if "info" not in trajectory:
            if session_id not in infos:
                infos[session_id] = json.loads(info) if info else {}
            trajectory["info"] = infos[session_id]
        trajectories.append(trajectory)
    return trajectories


def _dataclass_json(value: object) -> str:
    """`json.dumps(asdict(value))`, the same text, without `asdict`'s deep copy of every field:
    `json` meets each dataclass as it writes and writes its fields, in order. A turn's reply
    and sampling took 70 µs that way and take 30 µs this way; a reply with 17 tokens' logprobs,
    480 µs and 110 µs."""
    return json.dumps(value, default=_fields)


def _fields(value: object) -> dict[str, Any]:
    if not is_dataclass(value) or isinstance(value, type):
        raise TypeError(f"{type(value).__name__} is not JSON serializable")
    return {name: getattr(value, name) for name in _field_names(type(value))}


@cache
def _field_names(kind: type) -> tuple[str, ...]:
    return tuple(f.name for f in fields(kind))


def _encode_trajectory(data: dict[str, Any]) -> bytes:
    return zlib.compress(json.dumps(data, separators=(",", ":")).encode())


def _decode_trajectory(stored: bytes | str) -> dict[str, Any]:
    """The JSON of a trajectory row: compressed (see the module doc), or plain text as written
    by a proxy from before that."""
    return json.loads(zlib.decompress(stored) if isinstance(stored, bytes) else stored)


def read_trajectories(path: str | Path) -> list[dict[str, Any]]:
    """All finalized trajectories of a store file, in order (for export; read-only)."""
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return _with_info(db.execute(_TRAJECTORIES + " ORDER BY t.seq").fetchall())
    finally:
        db.close()
