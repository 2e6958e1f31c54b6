"""Processes writing one SQLite file let a waiting writer in: no writer starves.

SQLite gives its write lock to whoever asks while it is free, and a
connection that finds it taken sleeps and asks again, every 100 ms once it
has waited a while. A process whose writer commits back to back — the
store's group commit under load — leaves it free only for microseconds
between transactions, so another process's writer could wait out its whole
busy timeout and fail ("database is locked"). Measured with plain
connections, one process committing 0.5 ms transactions back to back and
another writing every 10 ms: the second's writes waited 1.7 s at the median,
and 31 of 200 failed after 5 s; taking turns as below, 0.7 ms at the median,
7 ms at most, none failed.

The writers of one file agree through a lock file beside it,
``<db>-writers`` (it holds no data; deleting it while no process has the
store open loses nothing). What stays true:

* A writer that finds the write lock taken says so: it holds a shared
  ``flock`` on the lock file while it asks again, every
  :data:`POLL` seconds, until it has the lock or its busy timeout ran out.
* A writer about to take the write lock first lets such waiters in: while
  one holds the shared lock, it waits (:data:`POLL` at a time, for at most
  :data:`LET_IN_BOUND` seconds, so that a waiter stuck behind a writer that
  is not chatlane's holds no one up for long).
* Asking when no one writes costs one ``BEGIN IMMEDIATE``; letting others in
  when no one waits costs one non-blocking ``flock`` and its release (about
  a microsecond). Only a writer that found the lock taken polls.
* ``flock`` locks belong to an open file, so two stores on one file in one
  process take turns as two processes do. Nothing here touches SQLite's own
  locks, which are ``fcntl`` locks on the database and its ``-shm`` file.
"""

from __future__ import annotations

import fcntl
import os
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

from chatlane.stores.sqlite_schema import is_busy

__all__ = ["LET_IN_BOUND", "POLL", "LockWaits", "WaitingWriters", "lock_file"]

POLL = 0.0002
"""Seconds between two asks for the write lock (a waiter) or two looks for waiters."""

LET_IN_BOUND = 0.05
"""Most seconds a writer waits for waiters to get in before it asks for the lock itself."""


@dataclass(slots=True)
class LockWaits:
    """What taking turns came to for one writer (``chatlane_sqlite_lock_waits_total``)."""

    waited: int = 0
    """Times it found the write lock taken and waited for it as a waiter."""
    let_in: int = 0
    """Times it found others waiting and let them in before it asked."""


def lock_file(database: Path) -> Path:
    """The lock file beside ``database`` through which its writers let each other in."""
    return Path(f"{database}-writers")


class WaitingWriters:
    """This writer's side of the agreement (see the module docstring); one per connection."""

    def __init__(
        self,
        database: Path,
        counts: LockWaits | None = None,
        let_in_bound: float = LET_IN_BOUND,
    ) -> None:
        """Open (or create) the lock file beside ``database``; ``counts`` are kept up to date.

        :raises OSError: the lock file cannot be opened or created.
        """
        self._fd = os.open(lock_file(database), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        self.counts = LockWaits() if counts is None else counts
        self.let_in_bound = let_in_bound

    def close(self) -> None:
        os.close(self._fd)

    def others_wait(self) -> bool:
        """Whether another writer of the file waits for the write lock now."""
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        return False

    def begin(self, connection: sqlite3.Connection, timeout: float) -> None:
        """``BEGIN IMMEDIATE`` on ``connection`` (whose busy timeout is 0), fairly.

        Waiters are let in first; if the lock is taken, this writer waits
        as one, for up to ``timeout`` seconds.

        :raises sqlite3.OperationalError: still locked after ``timeout``, or any other error.
        """
        if self.others_wait():
            self._let_waiters_in()
        try:
            connection.execute("BEGIN IMMEDIATE")
            return
        except sqlite3.OperationalError as error:
            if not is_busy(error):
                raise
        self.counts.waited += 1
        fcntl.flock(self._fd, fcntl.LOCK_SH)
        try:
            self._ask_until(connection, time.monotonic() + timeout)
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _let_waiters_in(self) -> None:
        self.counts.let_in += 1
        deadline = time.monotonic() + self.let_in_bound
        while time.monotonic() < deadline:
            time.sleep(POLL)
            if not self.others_wait():
                return

    def _ask_until(self, connection: sqlite3.Connection, deadline: float) -> None:
        while True:
            try:
                connection.execute("BEGIN IMMEDIATE")
                return
            except sqlite3.OperationalError as error:
                if not is_busy(error) or time.monotonic() >= deadline:
                    raise
            time.sleep(POLL)
