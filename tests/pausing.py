"""Stopping a gateway process (``SIGSTOP``) between two of its SQLite transactions.

SQLite's write lock is the file's, held by the process that took it: a process
stopped while it holds it keeps every other process from writing until it runs
again (see docs/stores.md, "Threads and transactions"). The tests that stop a
process check how the others take over from it, so they stop it between two
transactions: stop it, check from here that the write lock is free, and if it
is not, let the process run on a moment (to its commit) and try again.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import time
from pathlib import Path
from urllib.parse import quote

__all__ = ["sqlite_file", "stop_between_transactions", "write_lock_is_free"]

ATTEMPTS = 200


def stop_between_transactions(pid: int, database: Path | None) -> None:
    """``SIGSTOP`` ``pid`` at a moment it holds no write lock on ``database`` (None: no SQLite
    file, any moment will do)."""
    for _ in range(ATTEMPTS):
        os.kill(pid, signal.SIGSTOP)
        if database is None or write_lock_is_free(database):
            return
        os.kill(pid, signal.SIGCONT)
        time.sleep(0.005)  # a transaction's length: the process commits and lets go
    raise AssertionError(f"process {pid} held {database}'s write lock at every try")


def write_lock_is_free(database: Path) -> bool:
    """Whether SQLite's write lock on ``database`` can be taken at once (it is given back)."""
    connection = sqlite3.connect(
        f"file:{quote(str(database))}?mode=rw", uri=True, timeout=0, isolation_level=None
    )
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
