"""Stopping a gateway process (``SIGSTOP``) between two of its SQLite transactions.

SQLite's write lock is the file's, held by the process that took it: a process
stopped while it holds it keeps every other process from writing until it runs
again (see docs/stores.md, "Threads and transactions"). The tests that stop a
process check how the others take over from it, so they stop it between two
transactions: the test takes the write lock itself (SQLite's busy handler
returns as soon as the process commits), stops the process while holding it
— so the process cannot be inside a write transaction — waits until it has
stopped, and gives the lock back.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

__all__ = ["assert_not_held", "sqlite_file", "stop_between_transactions", "write_lock_is_free"]

LOCK_TIMEOUT = 30.0
"""Seconds to wait for the process to end its transaction (it never holds one that long)."""


def stop_between_transactions(pid: int, database: Path | None) -> None:
    """``SIGSTOP`` ``pid`` (a child of this process) at a moment it holds no write lock on
    ``database`` (None: no SQLite file, any moment will do); return once it has stopped."""
    if database is None:
        _stop(pid)
        return
    with _write_lock(database):
        _stop(pid)
    assert_not_held(database)


def assert_not_held(database: Path, timeout: float = LOCK_TIMEOUT) -> None:
    """:raises AssertionError: unless the write lock on ``database`` can be taken
    within ``timeout`` seconds.

    Other processes sharing the file may take it for a moment, so this waits
    for them as :func:`_write_lock` does (a check at once failed when another
    gateway wrote just then); a stopped process holding it never lets go.
    """
    try:
        with _write_lock(database, timeout):
            pass
    except sqlite3.OperationalError as error:
        raise AssertionError(f"the write lock on {database} stayed held: {error}") from error


def _stop(pid: int) -> None:
    os.kill(pid, signal.SIGSTOP)
    _, status = os.waitpid(pid, os.WUNTRACED)  # returns once the child has stopped
    assert os.WIFSTOPPED(status), f"process {pid} ended instead of stopping"


@contextlib.contextmanager
def _write_lock(database: Path, timeout: float = LOCK_TIMEOUT) -> Iterator[None]:
    """Hold SQLite's write lock on ``database``, taken as soon as whoever holds it lets go."""
    connection = _connect(database, timeout)
    try:
        connection.execute("BEGIN IMMEDIATE")
        yield
        connection.execute("ROLLBACK")
    finally:
        connection.close()


def _connect(database: Path, timeout: float) -> sqlite3.Connection:
    return sqlite3.connect(
        f"file:{quote(str(database))}?mode=rw", uri=True, timeout=timeout, isolation_level=None
    )


def write_lock_is_free(database: Path) -> bool:
    """Whether SQLite's write lock on ``database`` can be taken at once (it is given back)."""
    connection = _connect(database, 0)
    try:
        connection.execute("BEGIN IMMEDIATE")
        connection.execute("ROLLBACK")
        return True
    except sqlite3.OperationalError as error:
        if "locked" not in str(error) and "busy" not in str(error):
            raise
        return False
    finally:
        connection.close()


def sqlite_file(store_url: str) -> Path | None:
    """The database file of a ``sqlite:///`` store URL, or None for any other store."""
    prefix = "sqlite:///"
    if not store_url.startswith(prefix):
        return None
    return Path(store_url[len(prefix) :].split("?", 1)[0])
