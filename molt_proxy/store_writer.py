"""Group commit: the store's writes that wait at the same moment go to disk in one transaction.

Every acknowledged turn must be on disk before its reply (`synchronous=FULL`), and a commit
costs a hop to the store's thread and an fsync. Committing each turn alone, 64 concurrent
sessions queue behind one another's fsyncs. Here a write joins the batch being gathered; one
writer task commits batches one after the other, each in a single transaction, and a write's
caller resumes only once the transaction that holds it has committed. While a batch commits,
the next one gathers, so the batch grows with the load and a lone write commits at once.

Each write runs inside a savepoint of its own: one that fails (a constraint, a full disk) is
rolled back alone and fails its own caller. A transaction that cannot begin or commit fails
every write of its batch with `StoreUnavailable` and keeps none of them; writes that come
later get a transaction of their own.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from molt_proxy.errors import StoreUnavailable

T = TypeVar("T")


class OnDb(Protocol):
    """What the SQL kept beside the store's own (`store_responses.py`, `store_advantages.py`)
    runs through: `Store.on_db(fn, *args)`, `fn(db, *args)` on the store's thread."""

    async def on_db(self, fn: Callable[..., T], *args: Any) -> T: ...


Write = Callable[[sqlite3.Connection], Any]
"""SQL run on the store's thread inside the batch's transaction; what it returns is the
caller's."""
OnThread = Callable[..., Awaitable[Any]]
"""`on_thread(fn, *args)`: `fn(*args)` on the store's thread (`Store._run`)."""


@dataclass(slots=True)
class _Pending:
    write: Write
    done: asyncio.Future[Any]
    result: Any = None
    error: BaseException | None = None


@dataclass(slots=True)
class GroupCommit:
    on_thread: OnThread
    db: Callable[[], sqlite3.Connection]
    transactions: int = 0
    """Transactions committed: fewer than writes when writes were batched."""
    _batch: list[_Pending] = field(default_factory=list)
    _writer: asyncio.Task[None] | None = None

    async def write(self, write: Write) -> Any:
        """`write(db)` committed to disk (with the writes batched with it); its result."""
        pending = _Pending(write, asyncio.get_running_loop().create_future())
        self._batch.append(pending)
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._commit_batches())
        return await pending.done

    async def drain(self) -> None:
        """Wait for every write submitted so far to be committed (or failed)."""
        while self._writer is not None and not self._writer.done():
            await asyncio.shield(self._writer)

    async def _commit_batches(self) -> None:
        while self._batch:
            batch, self._batch = self._batch, []
            try:
                await self.on_thread(self._commit, batch)
            except Exception as exc:  # sqlite3.Error: a lock held too long, a full or failing disk
                failed = StoreUnavailable(f"the store could not commit: {exc}")
                for pending in batch:
                    _settle(pending.done, failed, None)
                continue
            self.transactions += 1
            for pending in batch:
                _settle(pending.done, pending.error, pending.result)

    def _commit(self, batch: list[_Pending]) -> None:
        """On the store's thread: one transaction, a savepoint per write."""
        db = self.db()
        db.execute("BEGIN IMMEDIATE")
        try:
            for pending in batch:
                db.execute("SAVEPOINT write")
                try:
                    pending.result = pending.write(db)
                except sqlite3.Error as exc:
                    db.execute("ROLLBACK TO write")
                    pending.error = StoreUnavailable(f"the store could not write: {exc}")
                except Exception as exc:  # a bug in the write: its own caller sees it
                    db.execute("ROLLBACK TO write")
                    pending.error = exc
                db.execute("RELEASE write")
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise


def _settle(done: asyncio.Future[Any], error: BaseException | None, result: Any) -> None:
    if done.done():  # its caller was cancelled: the write is committed all the same
        return
    if error is not None:
        done.set_exception(error)
    else:
        done.set_result(result)
