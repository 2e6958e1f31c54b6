"""The SQLite store's writer thread: one connection, group commit, results back on the loop.

What stays true:

* One connection per store, used by one thread at a time (under a lock). Every
  call becomes an operation (a function of that connection). The writer
  thread runs them from its queue, and a result comes back through an
  :class:`asyncio.Future` completed with ``loop.call_soon_threadsafe``.
* A *quick* call (a turn's small, bounded write) from the loop that opened the
  store is run on that loop's own thread instead, at the end of the loop's
  current pass, together with the other quick calls made in that pass (up
  to :data:`MAX_HERE`) — but only while the writer thread has nothing of
  that loop's queued or running (so calls still run in the order they were
  made), only if SQLite's write lock is free at once (``busy_timeout`` 0
  there: another process's transaction never blocks the loop; the batch
  goes to the thread instead) and no other process's writer waits for it
  (the thread lets it in first), and not for :data:`PAUSE_AFTER_SLOW` seconds
  after a batch that took more than :data:`SLOW_BATCH` there. While the
  loop's last batch held a single call (no other turn is writing), a call
  made when the loop has nothing else to run before it next polls for I/O,
  and no other quick call waits, would be its pass's batch alone: it runs
  as it is made, and its caller goes on without suspending (two passes of
  the loop fewer). While turns write together, it still waits for the
  pass's end, so that the turns woken next join its batch. Everything else
  (reads, scans, purges) runs on the writer thread.
* The loop never waits for the disk: commits in WAL mode with
  ``synchronous=NORMAL`` write to the page cache, and the only syncs are
  checkpoints' and the first write's after a full one, which starts the WAL
  again (SQLite's own automatic checkpoint is off). Every
  :data:`CHECKPOINT_EVERY` transactions a checkpoint runs beside the writes,
  on a connection and thread of its own (:mod:`chatlane.stores.sqlite_checkpoints`),
  holding up no write. Once one finds the WAL past :data:`WAL_FRAMES_BOUND`
  frames, the writer thread checkpoints what is left itself, with its writes
  held (a few transactions' worth: the rest was copied beside them), so the
  next write starts the WAL again: the WAL stays within about that bound.
  Those checkpoints and that first write run on the writer thread (until
  the write is made, the loop's quick calls go to the thread). While a
  checkpoint runs beside the writes, the loop's quick calls go to the thread
  too: its syncs of the WAL can hold up a write to it.
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
  of reads begins deferred. On the thread, a write lets other processes'
  writers that wait for the lock in first, and waits for it as one of them
  (:mod:`chatlane.stores.sqlite_waiting`): however fast this process
  commits, another process's writes are never starved of the lock.
* Reads go through the same thread as writes, in queue order: a read issued
  after a write returned sees that write. *Urgent* calls (the heartbeat and
  lease renewals: liveness, which other processes judge by the clock) jump
  the queue: each batch starts with every urgent call waiting, so however
  many calls a burst of messages queued, they wait for one batch at most.
* A call cancelled while still queued is skipped; one cancelled while its
  transaction runs may still be applied (its result is dropped).
* A text SQLite cannot be given (a lone surrogate, which no UTF-8 carries)
  fails its operation alone, with the :class:`~chatlane.errors.StoreError`
  every store refuses it with; its writes are undone.
* Damage SQLite reports while running (a malformed page, a file that is no
  longer a database) reaches its caller as
  :class:`~chatlane.errors.StoreDamaged`, and :attr:`Writer.damage` keeps
  the first such error: from then on the store refuses every call.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import queue
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from chatlane.errors import StoreDamaged, StoreError
from chatlane.stores.codec import encoding_refused
from chatlane.stores.sqlite_checkpoints import Checkpointer
from chatlane.stores.sqlite_file import damaged, is_damage
from chatlane.stores.sqlite_schema import Location, connect, is_busy
from chatlane.stores.sqlite_waiting import LockWaits, WaitingWriters, lock_file

__all__ = [
    "CHECKPOINT_EVERY",
    "MAX_BATCH",
    "MAX_HERE",
    "PAUSE_AFTER_SLOW",
    "SLOW_BATCH",
    "WAL_FRAMES_BOUND",
    "Operation",
    "Writer",
    "WriterStats",
]

log = logging.getLogger("chatlane.stores.sqlite")

T = TypeVar("T")
Operation = Callable[[sqlite3.Connection], T]

MAX_BATCH = 512
"""Most operations committed in one transaction (bounds how long one batch holds the lock)."""

CHECKPOINT_EVERY = 100
"""Transactions between two checkpoints of the WAL into the main file (beside the writes)."""

WAL_FRAMES_BOUND = 4096
"""Frames (pages) past which the writer thread checkpoints the WAL itself and starts it
again: about 16 MB with SQLite's 4 KB pages."""

MAX_HERE = 64
"""Most quick calls run together on the event loop's thread; a pass that made more hands
them all to the writer thread (a bound on how long one batch can hold the loop)."""

SLOW_BATCH = 0.02
"""Seconds a batch run on the event loop's thread may take before the loop stops running them."""

PAUSE_AFTER_SLOW = 1.0
"""Seconds every call goes to the writer thread after a slow batch on the loop's thread."""


@dataclass(slots=True)
class WriterStats:
    """Counts kept by the writer thread: committed transactions and the operations in them."""

    transactions: int = 0
    operations: int = 0
    reruns: int = 0
    """Batches rolled back and run again, one savepoint per operation, because one raised."""
    on_loop: int = 0
    """Of :attr:`transactions`, those run on the event loop's thread (quick calls)."""
    handed_over: int = 0
    """Quick batches the loop gave the writer thread: busy, a slow batch before, a checkpoint."""
    checkpoints: int = 0
    """Checkpoints run beside the writes."""
    held_checkpoints: int = 0
    """Checkpoints the writer thread ran with its writes held (the WAL past its bound)."""
    lock: LockWaits = field(default_factory=LockWaits)
    """Write transactions that waited for another process's, or let its waiting ones in."""


_Call = tuple[Operation[Any], bool, asyncio.AbstractEventLoop, "asyncio.Future[Any]"]
"""A queued call: its operation, whether it may write, and the loop and future awaiting it
(a plain tuple: one is built per store call, on the event loop's thread)."""
_Outcome = tuple[_Call, Any, BaseException | None]


class Writer:
    """The thread that owns a store's connection and runs its queued operations.

    Quick calls from the loop that started it may run on that loop's thread
    while this thread idles (see the module's docstring).
    """

    def __init__(self, location: Location) -> None:
        self.location = location
        self.stats = WriterStats()
        self._queue: queue.SimpleQueue[_Call | bool | None] = queue.SimpleQueue()
        """Calls in order; ``None`` stops the thread; ``True`` says an urgent call waits."""
        self._urgent: collections.deque[_Call] = collections.deque()
        self._stopping = False
        self._stopped: _Call | None = None
        self._thread: threading.Thread | None = None
        self.damage: StoreDamaged | None = None
        """The first damage found while running (set once, by whichever thread found it)."""
        self._connection: sqlite3.Connection | None = None
        self._writers: WaitingWriters | None = None
        """How this store's writes let other processes' in (set while the connection is open)."""
        self._lock = threading.Lock()
        """Held by whichever thread runs a transaction on the connection."""
        self._owner: asyncio.AbstractEventLoop | None = None
        """The loop that started the writer: the only one whose quick calls run on its thread."""
        self._here: list[_Call] = []
        """The owner loop's quick calls made in its current pass, run together at its end."""
        self._sent = 0
        """The owner loop's calls put on the queue (counted by that loop)."""
        self._done = 0
        """Of those, the ones the writer thread finished (counted by the thread)."""
        self._thread_only_until = 0.0
        self._checkpoint_due = False
        """The WAL grew past its bound: the writer thread checkpoints it next."""
        self._checkpointed_at = 0
        self._checkpointer: Checkpointer | None = None
        self._restart_due = False
        """A full checkpoint emptied the WAL: the next write starts it again, and syncs."""
        self._waits = True
        """Whether the connection's busy timeout is the location's (else 0), as last set."""
        self._alone = True
        """Whether the loop's last quick batch held one call (or there was none yet):
        no other turn seems to be writing, so a call is unlikely to find company."""

    def start(self) -> asyncio.Future[None]:
        """Start the thread; the future completes once the file is open and migrated."""
        ready = _signal()
        self._owner = ready[2]
        name = f"chatlane-sqlite:{self.location.path}"
        self._thread = threading.Thread(target=self._main, args=(ready,), name=name, daemon=True)
        self._thread.start()
        return ready[3]

    def submit(
        self, op: Operation[T], writes: bool, quick: bool = False, urgent: bool = False
    ) -> asyncio.Future[T]:
        """Queue ``op``; never blocks the event loop.

        :param quick: a small, bounded write: the loop may run it on its own
            thread (with the others of its pass) while the writer thread idles.
        :param urgent: run it before every call queued and not yet taken (a
            heartbeat, a lease renewal: see the module docstring).
        """
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        call = (op, writes, loop, future)
        if urgent:
            if loop is self._owner:
                self._sent += 1
            self._urgent.append(call)
            self._queue.put(True)  # wakes the thread if it waits
        elif quick and loop is self._owner:
            if self._alone and not self._here and _nothing_else_ready(loop):
                self._run_quick([call])  # no other call could join it: no wait for the pass
            else:
                self._here.append(call)
                if len(self._here) == 1:
                    loop.call_soon(self._flush)
        else:
            if self._here and loop is self._owner:
                self._hand_over(self._here)  # earlier quick calls keep their place
            self._hand_over([call])
        return future

    def stop(self) -> asyncio.Future[None]:
        """Let the thread finish every queued operation, then close the connection."""
        self._stopped = _signal()
        self._hand_over(self._here)
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(None)
        else:
            _deliver([(self._stopped, None, None)])
        return self._stopped[3]

    def _hand_over(self, calls: list[_Call]) -> None:
        """Put ``calls`` on the thread's queue, in order (emptying :attr:`_here` if it is that)."""
        for call in calls:
            if call[2] is self._owner:
                self._sent += 1
            self._queue.put(call)
        if calls is self._here:
            self._here = []

    # -- on the owner loop's thread -------------------------------------------

    def _flush(self) -> None:
        """Run the quick calls of the pass that ended, here if the thread idles, else there."""
        calls = [call for call in self._here if not call[3].cancelled()]
        self._here = []
        if calls:
            self._run_quick(calls)

    def _run_quick(self, calls: list[_Call]) -> None:
        """Run ``calls`` in one transaction here if the thread idles, else hand them to it."""
        self._alone = len(calls) == 1
        if len(calls) <= MAX_HERE and self._may_run_here() and self._lock.acquire(blocking=False):
            try:
                outcomes = self._run_here(calls)
            finally:
                self._lock.release()
            if outcomes is not None:
                _settle(outcomes)
                self._wake_for_checkpoint()
                return
        self.stats.handed_over += 1
        self._hand_over(calls)

    def _may_run_here(self) -> bool:
        return (
            self._sent == self._done
            and self._connection is not None
            and self._stopped is None
            and self.damage is None
            and not self._checkpoint_due
            and not self._restart_due
            and not (self._checkpointer is not None and self._checkpointer.running)
            and time.monotonic() >= self._thread_only_until
        )

    def _run_here(self, calls: list[_Call]) -> list[_Outcome] | None:
        """Run ``calls`` in one transaction on this thread; None if the write lock was taken
        or another process's writer waits for it."""
        connection, writers = self._connection, self._writers
        assert connection is not None
        assert writers is not None
        if writers.others_wait():  # the thread lets them in first
            return None
        started = time.perf_counter()
        try:
            outcomes = self._transaction(connection, calls, here=True)
        except sqlite3.OperationalError as error:
            _rollback(connection)
            if is_busy(error):  # another process writes: the thread waits for it instead
                return None
            outcomes = [(call, None, self._store_error(error)) for call in calls]
        except Exception as error:  # the whole batch failed: every caller gets the error
            _rollback(connection)
            outcomes = [(call, None, self._store_error(error)) for call in calls]
        self.stats.on_loop += 1
        took = time.perf_counter() - started
        if took > SLOW_BATCH:
            self._thread_only_until = time.monotonic() + PAUSE_AFTER_SLOW
            log.info(
                "a store batch took %.1f ms on the event loop: the writer thread runs "
                "every call for the next %.0f s",
                took * 1000,
                PAUSE_AFTER_SLOW,
            )
        return outcomes

    def _wake_for_checkpoint(self) -> None:
        """Have the thread checkpoint, when one is due, by giving it an empty call."""
        if self._checkpoint_due and self._sent == self._done:
            self._hand_over([_signal()])

    # -- on the writer thread ---------------------------------------------------

    def _main(self, ready: _Call) -> None:
        try:
            connection, writers = self._open()
        except Exception as error:  # handed to the awaiting open()
            _deliver([(ready, None, error)])
            return
        self._connection = connection
        self._writers = writers
        self._checkpointer = Checkpointer(self.location, self._checkpointed)
        self._checkpointer.start()
        _deliver([(ready, None, None)])
        try:
            while (batch := self._next_batch()) is not None:
                with self._lock:
                    outcomes = self._run(connection, batch)
                    self._done += sum(1 for call in batch if call[2] is self._owner)
                _deliver(outcomes)  # after the count: the loop may run the next call itself
                if self._checkpoint_due:
                    with self._lock:
                        self._checkpoint(connection)
        finally:
            self._checkpointer.stop()  # first: the writer's connection closes last
            with self._lock:
                self._connection = self._writers = None
                connection.close()
                writers.close()
            self._fail_queued()

    def _open(self) -> tuple[sqlite3.Connection, WaitingWriters]:
        connection = connect(self.location)
        try:
            connection.execute("PRAGMA wal_autocheckpoint = 0")  # ours: see the module docstring
            return connection, WaitingWriters(self.location.path, self.stats.lock)
        except OSError as error:
            connection.close()
            raise StoreError(
                f"cannot open {str(lock_file(self.location.path))!r}, beside the SQLite "
                f"store, through which its writers take turns: {error}"
            ) from error
        except BaseException:
            connection.close()
            raise

    def _next_batch(self) -> list[_Call] | None:
        """Block for one call, then take the calls already waiting; None once stopped."""
        if self._stopping:
            return None
        item = self._queue.get()
        batch = self._take_urgent()
        while item is not None:
            if item is not True:
                batch.append(item)  # type: ignore[arg-type]
            if len(batch) >= MAX_BATCH or self._queue.empty():
                return batch
            item = self._queue.get_nowait()
        self._stopping = True
        return batch or None

    def _take_urgent(self) -> list[_Call]:
        """Every urgent call waiting, oldest first (their wake-ups stay queued, and are skipped)."""
        taken: list[_Call] = []
        with contextlib.suppress(IndexError):
            while True:
                taken.append(self._urgent.popleft())
        return taken

    def _run(self, connection: sqlite3.Connection, batch: list[_Call]) -> list[_Outcome]:
        calls = [call for call in batch if not call[3].cancelled()]
        if not calls:
            return []
        try:
            return self._transaction(connection, calls, here=False)
        except Exception as error:  # the whole batch failed: every caller gets the error
            _rollback(connection)
            return [(call, None, self._store_error(error)) for call in calls]

    def _checkpoint(self, connection: sqlite3.Connection) -> None:
        """Copy the WAL into the main file; after a full one, the thread makes the next write.

        Both sync the disk (the only syncs with ``synchronous=NORMAL``: the
        first write after a full checkpoint starts the WAL again). Keeping
        that write on this thread keeps its sync off the loop; making it with
        the next batch, not here, splits the two waits the loop's calls see.
        """
        self._checkpoint_due = False
        try:
            self._wait_when_busy(connection, True)
            busy, logged, copied = connection.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        except sqlite3.Error as error:  # tried again after the next transactions
            log.warning("checkpoint of %s failed: %s", self.location.path, error)
            return
        self._restart_due = not busy and logged == copied
        self.stats.held_checkpoints += 1

    def _checkpointed(self, logged: int, copied: int) -> None:
        """A checkpoint beside the writes found ``logged`` frames in the WAL and ``copied``
        of them in the main file (on the checkpoints' thread)."""
        self.stats.checkpoints += 1
        if logged > WAL_FRAMES_BOUND:  # the next batch goes to the writer thread, which
            self._checkpoint_due = True  # copies the rest after it, its writes held

    # -- on either thread, holding the lock ----------------------------------------

    def _wait_when_busy(self, connection: sqlite3.Connection, wait: bool) -> None:
        """Have SQLite wait out another connection's lock (a read on the thread) or not
        (the loop, and writes: see :meth:`_begin`).

        Set only when it changes: a run of batches on one side pays nothing.
        """
        if wait != self._waits:
            timeout = self.location.busy_timeout_ms if wait else 0
            connection.execute(f"PRAGMA busy_timeout = {timeout:d}")
            self._waits = wait

    def _transaction(
        self, connection: sqlite3.Connection, calls: list[_Call], here: bool
    ) -> list[_Outcome]:
        writes = any(c[1] for c in calls)
        self._begin(connection, writes, here)
        outcomes = self._run_plain(connection, calls)
        if outcomes is None:
            self._begin(connection, writes, here)
            outcomes = [self._run_one(connection, call) for call in calls]
        if connection.in_transaction:  # not after a lone operation's failure
            connection.execute("COMMIT")
            if writes:
                self._restart_due = False  # this write started the WAL again
        stats = self.stats
        stats.transactions += 1
        stats.operations += len(calls)
        if stats.transactions - self._checkpointed_at >= CHECKPOINT_EVERY:
            self._checkpointed_at = stats.transactions
            if self._checkpointer is not None:
                self._checkpointer.ask()
        return outcomes

    def _begin(self, connection: sqlite3.Connection, writes: bool, here: bool) -> None:
        """Begin a batch's transaction: deferred for reads, which wait out a lock on the
        thread (SQLite's busy timeout); ``IMMEDIATE`` for writes, which on the loop take
        the write lock only if it is free at once, and on the thread let other processes'
        waiting writers in first and wait as one of them (:mod:`~chatlane.stores.sqlite_waiting`).
        A write transaction in WAL mode meets no lock once begun: it runs without a timeout.
        """
        self._wait_when_busy(connection, not (writes or here))
        if not writes:
            connection.execute("BEGIN")
        elif here:
            connection.execute("BEGIN IMMEDIATE")
        else:
            assert self._writers is not None  # set before the thread takes its first batch
            self._writers.begin(connection, self.location.busy_timeout_ms / 1000)

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
                return [(call, None, self._failure(error))]
        return outcomes

    def _run_one(self, connection: sqlite3.Connection, call: _Call) -> _Outcome:
        """Run one operation in its own savepoint: its failure undoes only its own writes."""
        connection.execute("SAVEPOINT op")
        try:
            result = call[0](connection)
        except Exception as error:  # delivered to this call's future, never swallowed
            connection.execute("ROLLBACK TO op")
            connection.execute("RELEASE op")
            return call, None, self._failure(error)
        connection.execute("RELEASE op")
        return call, result, None

    def _failure(self, error: Exception) -> Exception:
        """What an operation's ``error`` reaches its caller as: SQLite's own as a
        :class:`StoreError`, a text it could not encode (a lone surrogate) as the refusal
        every store makes (:func:`~chatlane.stores.codec.unstorable`), any other as raised."""
        if isinstance(error, sqlite3.Error):
            return self._store_error(error)
        if isinstance(error, UnicodeEncodeError):
            return encoding_refused(f"SQLite store {str(self.location.path)!r}", error)
        return error

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
        closed = StoreError("store is closed")
        leftovers: list[_Outcome] = [(call, None, closed) for call in self._take_urgent()]
        with contextlib.suppress(queue.Empty):
            while True:
                item = self._queue.get_nowait()
                if item is not None and item is not True:
                    leftovers.append((item, None, closed))  # type: ignore[arg-type]
        if self._stopped is not None:
            leftovers.append((self._stopped, None, None))
        _deliver(leftovers)


def _nothing_else_ready(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether ``loop`` has no other callback to run before it next polls for I/O.

    Then no other quick call can be made in this pass: a call run at once is the
    batch the pass's end would have run, without the wait for it. Known only for
    asyncio's own loops (their ``_ready`` queue); any other loop always batches.
    """
    ready = getattr(loop, "_ready", None)
    return ready is not None and not ready


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
