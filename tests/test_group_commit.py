"""Group commit (`molt_proxy/store_writer.py`): turns recorded at the same moment share one
transaction, each caller resumes only once the transaction holding its turn is on disk, and a
transaction that fails fails exactly the turns in it, keeping none of them, in memory or on
disk. Real SQLite files through `Sessions` and `Store`, as the proxy records turns.
"""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import pytest

from molt_proxy.errors import StoreUnavailable
from molt_proxy.session import Session
from molt_proxy.sessions import Sessions
from molt_proxy.stitching import PromptPlan
from molt_proxy.store import Store
from molt_proxy.tokenizer import Tokenizer
from molt_proxy.types import Generation, ParsedReply, RecordedReply
from tests.inprocess import loaded_tokenizer, qwen3_tokenizer_dir

SESSIONS = 16


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return loaded_tokenizer(str(qwen3_tokenizer_dir()))


async def _record(sessions: Sessions, session: Session, completion_id: str, turn: int) -> None:
    """One turn on `session`: a first turn opens its chain, a later one continues it."""
    prompt = [1000 + turn, 2000 + turn, 3000 + turn]
    sampled = [40 + turn, 50 + turn]
    generation = Generation(sampled, [-0.25, -0.5], [0, 0], "stop")
    plan = PromptPlan(prompt, prompt, sessions.tokenizer.ids_bytes(prompt), 0 if turn > 0 else None)
    reply = RecordedReply(completion_id, 0, "tiny", ParsedReply("ok"), "stop", len(prompt), len(sampled))
    await sessions.record(session, plan, generation, f"hash-{completion_id}", reply)


def _stored(path: Path, completion_id: str) -> int:
    """Rows of `completion_id` another connection sees: what is on disk, committed."""
    db = sqlite3.connect(path)
    try:
        return db.execute("SELECT count(*) FROM turns WHERE completion_id = ?", (completion_id,)).fetchone()[
            0
        ]
    finally:
        db.close()


def _turn_ids(session: Session) -> list[str]:
    return [turn.completion_id for segment in session.segments for turn in segment.turns]


async def _open(path: Path, tokenizer: Tokenizer) -> tuple[Store, Sessions, list[Session]]:
    store = Store(path)
    await store.open()
    sessions = Sessions(store, tokenizer, "tiny")
    return store, sessions, [await sessions.create(f"s{i}") for i in range(SESSIONS)]


def test_concurrent_turns_share_one_transaction_and_each_is_on_disk_when_its_record_returns(
    tmp_path, tokenizer
):
    path = tmp_path / "p.db"

    async def scenario() -> None:
        store, sessions, opened = await _open(path, tokenizer)
        before = store.writer.transactions

        async def turn(i: int) -> int:
            await _record(sessions, opened[i], f"c{i}", 0)
            return _stored(path, f"c{i}")  # read at once, by another connection

        assert await asyncio.gather(*(turn(i) for i in range(SESSIONS))) == [1] * SESSIONS
        assert store.writer.transactions - before == 1  # all of them waited at the same moment
        await _record(sessions, opened[0], "alone", 1)
        assert store.writer.transactions - before == 2 and _stored(path, "alone") == 1
        await store.close()

    asyncio.run(scenario())


def test_a_transaction_that_cannot_commit_fails_exactly_its_turns_and_keeps_none(tmp_path, tokenizer):
    path = tmp_path / "p.db"

    async def scenario() -> None:
        store, sessions, opened = await _open(path, tokenizer)
        await asyncio.gather(*(_record(sessions, opened[i], f"first{i}", 0) for i in range(SESSIONS)))
        await store.on_db(lambda db: db.execute("PRAGMA busy_timeout = 50"))
        blocker = sqlite3.connect(path, isolation_level=None)
        blocker.execute("BEGIN IMMEDIATE")  # another writer holds the lock: the batch cannot begin
        failed = await asyncio.gather(
            *(_record(sessions, opened[i], f"lost{i}", 1) for i in range(SESSIONS)), return_exceptions=True
        )
        blocker.execute("ROLLBACK")
        blocker.close()
        assert all(isinstance(error, StoreUnavailable) for error in failed)
        error = failed[0]
        assert error.status == 503 and error.body() == {
            "error": {
                "message": "the store could not commit: database is locked",
                "type": "service_unavailable",
                "param": None,
                "code": "store_unavailable",
            }
        }
        assert [_turn_ids(s) for s in opened] == [[f"first{i}"] for i in range(SESSIONS)]  # memory as before
        assert sum(_stored(path, f"lost{i}") for i in range(SESSIONS)) == 0
        await asyncio.gather(*(_record(sessions, opened[i], f"again{i}", 1) for i in range(SESSIONS)))
        await store.close()

        store, sessions, _ = await _reopen(path, tokenizer)
        assert [_turn_ids(sessions.get(f"s{i}")) for i in range(SESSIONS)] == [
            [f"first{i}", f"again{i}"] for i in range(SESSIONS)
        ]
        await store.close()

    asyncio.run(scenario())


async def _reopen(path: Path, tokenizer: Tokenizer) -> tuple[Store, Sessions, int]:
    store = Store(path)
    await store.open()
    sessions = Sessions(store, tokenizer, "tiny")
    return store, sessions, await sessions.recover()


def test_a_write_that_fails_inside_a_batch_fails_alone(tmp_path, tokenizer):
    path = tmp_path / "p.db"

    async def scenario() -> None:
        store, sessions, opened = await _open(path, tokenizer)
        await _record(sessions, opened[0], "taken", 0)
        before = store.writer.transactions
        results = await asyncio.gather(
            _record(sessions, opened[1], "ok1", 0),
            _record(sessions, opened[2], "taken", 0),  # a completion id already stored
            _record(sessions, opened[3], "ok3", 0),
            return_exceptions=True,
        )
        assert store.writer.transactions - before == 1
        assert results[0] is None and results[2] is None
        assert isinstance(results[1], StoreUnavailable)
        assert (
            results[1].message == "the store could not write: UNIQUE constraint failed: turns.completion_id"
        )
        assert [_turn_ids(opened[i]) for i in range(4)] == [["taken"], ["ok1"], [], ["ok3"]]
        assert (_stored(path, "ok1"), _stored(path, "taken"), _stored(path, "ok3")) == (1, 1, 1)
        await store.close()

    asyncio.run(scenario())
