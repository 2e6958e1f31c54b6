"""The SQLite store's writer thread: one connection, group commit, results back on the loop.

What stays true:

* No ``sqlite3`` call runs on an event loop's thread. One writer thread per
  store owns the only connection; every call becomes an operation (a function
  of that connection) on the thread's queue, and its result comes back through
  an :class:`asyncio.Future` completed with ``loop.call_soon_threadsafe``.
* Group commit: the thread takes every operation already waiting (up to
  :data:`MAX_BATCH`) and runs them in one transaction. An operation that
  raises (``StaleGeneration``, ``SessionBusy``, …) undoes only its own writes
  and gets its own exception; the others commit. A result is delivered only
  after ``COMMIT`` succeeded.
* The batch first runs without savepoints (the common case: nothing
  raises). If an operation raises, the whole transaction is rolled back and
  the batch runs again with each operation inside its own ``SAVEPOINT``.
  Operations are functions of the connection alone, so the second run is
  what a first run with savepoints would have done.
* A batch with a write begins ``IMMEDIATE`` (the write lock first); a batch
  of reads begins deferred.
* Reads go through the same thread as writes, in queue order: a read issued
  after a write returned sees that write.
* A call cancelled while still queued is skipped; one cancelled while its
  transaction runs may still be applied (its result is dropped).
* Damage SQLite reports while running (a malformed page, a file that is no
  longer a database) reaches its caller as
  :class:`~chatlane.errors.StoreDamaged`, and :attr:`Writer.damage` keeps
  the first such error: from then on the store refuses every call.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import sqlite3
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from chatlane.errors import StoreDamaged, StoreError
from chatlane.stores.sqlite_file import damaged, is_damage
from chatlane.stores.sqlite_schema import Location, connect

__all__ = ["MAX_BATCH", "Operation", "Writer", "WriterStats"]

log = logging.getLogger("chatlane.stores.sqlite")

T = TypeVar("T")
Operation = Callable[[sqlite3.Connection], T]

MAX_BATCH = 512
"""Most operations committed in one transaction (bounds how long one batch holds the lock)."""


@dataclass(slots=True)
class WriterStats:
    """Counts kept by the writer thread: committed transactions and the operations in them."""

    transactions: int = 0
    operations: int = 0
    reruns: int = 0
    """Batches rolled back and run again, one savepoint per operation, because one raised."""


_Call = tuple[Operation[Any], bool, asyncio.AbstractEventLoop, "asyncio.Future[Any]"]
"""A queued call: its operation, whether it may write, and the loop and future awaiting it
(a plain tuple: one is built per store call, on the event loop's thread)."""
_Outcome = tuple[_Call, Any, BaseException | None]


class Writer:
    """The thread that owns a store's connection and runs its queued operations."""

    def __init__(self, location: Location) -> None:
        self.location = location
        self.stats = WriterStats()
        self._queue: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._stopping = False
        self._stopped: _Call | None = None
        self._thread: threading.Thread | None = None
        self.damage: StoreDamaged | None = None
        """The first damage found while running (set once, by the writer thread)."""

    def start(self) -> asyncio.Future[None]:
        """Start the thread; the future completes once the file is open and migrated."""
        ready = _signal()
        name = f"chatlane-sqlite:{self.location.path}"
        self._thread = threading.Thread(target=self._main, args=(ready,), name=name, daemon=True)
        self._thread.start()
        return ready[3]

    def submit(self, op: Operation[T], writes: bool) -> asyncio.Future[T]:
        """Queue ``op``; never blocks the event loop."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._queue.put((op, writes, loop, future))
        return future

    def stop(self) -> asyncio.Future[None]:
        """Let the thread finish every queued operation, then close the connection."""
        self._stopped = _signal()
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(None)
        else:
            _deliver([(self._stopped, None, None)])
        return self._stopped[3]

    def _main(self, ready: _Call) -> None:
        try:
            connection = connect(self.location)
        except Exception as error:  # handed to the awaiting open()
            _deliver([(ready, None, error)])
            return
        _deliver([(ready, None, None)])
        try:
            while (batch := self._next_batch()) is not None:
                self._run(connection, batch)
        finally:
            connection.close()
            self._fail_queued()

    def _next_batch(self) -> list[_Call] | None:
        """Block for one call, then take the calls already waiting; None once stopped."""
        if self._stopping:
            return None
        batch: list[_Call] = []
        item = self._queue.get()
        while item is not None:
            batch.append(item)
            if len(batch) >= MAX_BATCH or self._queue.empty():
                return batch
            item = self._queue.get_nowait()
        self._stopping = True
        return batch or None

    def _run(self, connection: sqlite3.Connection, batch: list[_Call]) -> None:
        calls = [call for call in batch if not call[3].cancelled()]
        if not calls:
            return
        try:
            outcomes = self._transaction(connection, calls)
        except Exception as error:  # the whole batch failed: every caller gets the error
            _rollback(connection)
            outcomes = [(call, None, self._store_error(error)) for call in calls]
        _deliver(outcomes)

    def _transaction(self, connection: sqlite3.Connection, calls: list[_Call]) -> list[_Outcome]:
        begin = "BEGIN IMMEDIATE" if any(c[1] for c in calls) else "BEGIN"
        connection.execute(begin)
        outcomes = self._run_plain(connection, calls)
        if outcomes is None:
            connection.execute(begin)
            outcomes = [self._run_one(connection, call) for call in calls]
        if connection.in_transaction:  # not after a lone operation's failure
            connection.execute("COMMIT")
        self.stats.transactions += 1
        self.stats.operations += len(calls)
        return outcomes

    def _run_plain(
        self, connection: sqlite3.Connection, calls: list[_Call]
    ) -> list[_Outcome] | None:
        """Run every operation without savepoints; None (rolled back) if one raised.

        A lone operation needs no second run: its failure is its outcome, and
        its transaction is rolled back.
        """
        outcomes: list[_Outcome] = []
        for call in calls:
            try:
                outcomes.append((call, call[0](connection), None))
            except Exception as error:  # decided below: delivered, or the batch runs again
                _rollback(connection)
                if len(calls) > 1:
                    self.stats.reruns += 1
                    return None
                failure = self._store_error(error) if isinstance(error, sqlite3.Error) else error
                return [(call, None, failure)]
        return outcomes

    def _run_one(self, connection: sqlite3.Connection, call: _Call) -> _Outcome:
        """Run one operation in its own savepoint: its failure undoes only its own writes."""
        connection.execute("SAVEPOINT op")
        try:
            result = call[0](connection)
        except Exception as error:  # delivered to this call's future, never swallowed
            connection.execute("ROLLBACK TO op")
            connection.execute("RELEASE op")
            failure = self._store_error(error) if isinstance(error, sqlite3.Error) else error
            return call, None, failure
        connection.execute("RELEASE op")
        return call, result, None

    def _store_error(self, error: Exception) -> StoreError:
        if isinstance(error, sqlite3.Error) and is_damage(error):
            failure: StoreError = self._damaged(error)
        else:
            failure = StoreError(f"SQLite store {str(self.location.path)!r}: {error}")
        failure.__cause__ = error
        return failure

    def _damaged(self, error: sqlite3.Error) -> StoreDamaged:
        """The caller's error; the first one is also kept (and logged)."""
        failure = damaged(self.location.path, str(error))
        if self.damage is None:
            self.damage = failure
            log.error("%s", failure)
        return failure

    def _fail_queued(self) -> None:
        """Answer whatever is still queued once the thread ends (only after a crash)."""
        leftovers: list[_Outcome] = []
        with contextlib.suppress(queue.Empty):
            while True:
                item = self._queue.get_nowait()
                if item is not None:
                    leftovers.append((item, None, StoreError("store is closed")))
        if self._stopped is not None:
            leftovers.append((self._stopped, None, None))
        _deliver(leftovers)


def _signal() -> _Call:
    loop = asyncio.get_running_loop()
    return (lambda _: None, False, loop, loop.create_future())


def _rollback(connection: sqlite3.Connection) -> None:
    if connection.in_transaction:
        # A failing ROLLBACK means SQLite already rolled back; callers get the first error.
        with contextlib.suppress(sqlite3.Error):
            connection.execute("ROLLBACK")


def _deliver(outcomes: list[_Outcome]) -> None:
    """Hand outcomes to their event loops, one wake-up per loop."""
    by_loop: dict[asyncio.AbstractEventLoop, list[_Outcome]] = {}
    for outcome in outcomes:
        by_loop.setdefault(outcome[0][2], []).append(outcome)
    for loop, settled in by_loop.items():
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody awaits these
            loop.call_soon_threadsafe(_settle, settled)


def _settle(outcomes: list[_Outcome]) -> None:
    for call, result, error in outcomes:
        future = call[3]
        if future.done():
            continue
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)
