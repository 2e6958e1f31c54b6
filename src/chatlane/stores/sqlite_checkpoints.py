"""Checkpoints of a SQLite store's WAL on a connection and a thread of their own.

The writer (:mod:`chatlane.stores.sqlite_writer`) asks for one every
:data:`~chatlane.stores.sqlite_writer.CHECKPOINT_EVERY` transactions. What
stays true:

* A checkpoint here never holds the writer's lock and never waits for a
  writer: it is ``PASSIVE``, copying into the main file what the WAL holds
  while turn writes go on (their commits write to the page cache; the
  checkpoint's disk syncs are its own).
* At most one runs at a time; asks that come while one runs make one more
  run after it, not one each.
* Each run is reported as the WAL's frames and those of them now in the
  main file, so the writer can start the WAL again once all are, or — a WAL
  written without pause is never all copied by a checkpoint that runs
  beside the writes — checkpoint it itself with its writes held, once the
  WAL has grown past its bound.
* A checkpoint that fails is logged, not reported; the next ask tries again.
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
import threading
from collections.abc import Callable
from urllib.parse import quote

from chatlane.stores.sqlite_schema import Location

__all__ = ["Checkpointer"]

log = logging.getLogger("chatlane.stores.sqlite")

Report = Callable[[int, int], None]
"""Told after each run: the WAL's frames, and how many of them are in the main file."""


class Checkpointer:
    """A thread that checkpoints ``location``'s WAL when asked (see the module docstring)."""

    def __init__(self, location: Location, report: Report) -> None:
        self.location = location
        self._report = report
        self._asked = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.runs = 0
        """Checkpoints run so far (failed ones included)."""
        self.running = False
        """Whether a checkpoint runs now: its disk syncs can hold up a write to the WAL."""

    def start(self) -> None:
        name = f"chatlane-sqlite-checkpoints:{self.location.path}"
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def ask(self) -> None:
        """Checkpoint soon (from any thread; never blocks)."""
        self._asked.set()

    def stop(self) -> None:
        """Let a running checkpoint finish, then end the thread (blocks until it has)."""
        self._stopping = True
        self._asked.set()
        if self._thread is not None:
            self._thread.join()

    def _main(self) -> None:
        try:
            connection = sqlite3.connect(  # mode=rw: never a file of its own making
                f"file:{quote(str(self.location.path))}?mode=rw",
                uri=True,
                isolation_level=None,
                check_same_thread=False,
            )
            connection.execute("PRAGMA synchronous = NORMAL")
        except sqlite3.Error as error:  # the writer checkpoints by itself past the bound
            log.warning("cannot checkpoint %s beside the writes: %s", self.location.path, error)
            return
        with contextlib.closing(connection):
            while True:
                self._asked.wait()
                self._asked.clear()
                if self._stopping:
                    return
                self._run(connection)

    def _run(self, connection: sqlite3.Connection) -> None:
        self.runs += 1
        self.running = True
        try:
            _, logged, copied = connection.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        except sqlite3.Error as error:
            log.warning("checkpoint of %s failed: %s", self.location.path, error)
            return
        finally:
            self.running = False
        self._report(int(logged), int(copied))
