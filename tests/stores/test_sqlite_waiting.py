"""Writers of one SQLite file in several processes let a waiting one in
(:mod:`chatlane.stores.sqlite_waiting`); two connections stand for two processes."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import sqlite3
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from chatlane.errors import StoreError
from chatlane.stores import WriteBatch
from chatlane.stores.sqlite import SQLiteStore
from chatlane.stores.sqlite_waiting import LockWaits, WaitingWriters, lock_file
from tests.keys import chat_key
from tests.stores.test_sqlite import write_lock

ROOT = Path(__file__).resolve().parents[2]

PATIENT = 60.0
"""A bound no loaded machine reaches: what is let in is the design's doing, not the clock's."""


@pytest.fixture
def path(tmp_path: Path) -> Path:
    database = tmp_path / "chatlane.db"
    with contextlib.closing(sqlite3.connect(database, isolation_level=None)) as connection:
        connection.execute("PRAGMA journal_mode = WAL")
        connection.execute("CREATE TABLE t (who TEXT)")
    return database


class Announcing(WaitingWriters):
    """Says what it is doing through events: :attr:`waiting` once it says it waits (its
    shared lock taken), :attr:`letting_in` once it found waiters and lets them in. As a
    waiter, it asks again only once ``asks_after`` is set (if given), so that a test
    decides whether it could have got in by asking alone."""

    def __init__(
        self, database: Path, let_in_bound: float, asks_after: threading.Event | None
    ) -> None:
        super().__init__(database, let_in_bound=let_in_bound)
        self.waiting = threading.Event()
        self.letting_in = threading.Event()
        self._asks_after = asks_after

    def _let_waiters_in(self) -> None:
        self.letting_in.set()
        super()._let_waiters_in()

    def _ask_until(self, connection: sqlite3.Connection, deadline: float) -> None:
        self.waiting.set()
        if self._asks_after is not None:
            assert self._asks_after.wait(PATIENT)
        super()._ask_until(connection, deadline)


@contextlib.contextmanager
def writer(
    path: Path, let_in_bound: float = PATIENT, asks_after: threading.Event | None = None
) -> Iterator[tuple[sqlite3.Connection, Announcing]]:
    """A connection as the store's writer holds it (no busy timeout), and its writer's side."""
    connection = sqlite3.connect(path, isolation_level=None, timeout=0, check_same_thread=False)
    writers = Announcing(path, let_in_bound, asks_after)
    try:
        yield connection, writers
    finally:
        writers.close()
        connection.close()


def test_a_writer_that_found_the_lock_taken_goes_before_the_holder_writes_again(
    path: Path,
) -> None:
    """The waiter asks again only once the holder lets it in, so it cannot get in by
    asking alone while the holder is slow to begin again (a loaded machine)."""
    order: list[str] = []
    with (
        writer(path) as (holder, holders),
        writer(path, asks_after=holders.letting_in) as (other, others),
    ):
        holders.begin(holder, timeout=5)

        def wait_as_another_process() -> None:
            others.begin(other, timeout=PATIENT)
            order.append("waiter")
            other.execute("INSERT INTO t VALUES ('waiter')")
            other.execute("COMMIT")

        waiting = threading.Thread(target=wait_as_another_process)
        waiting.start()
        assert others.waiting.wait(PATIENT)  # it found the lock taken and says so
        assert holders.others_wait()
        holder.execute("INSERT INTO t VALUES ('holder')")
        holder.execute("COMMIT")
        holders.begin(holder, timeout=PATIENT)  # at once, were the waiter not let in
        order.append("holder")
        holder.execute("COMMIT")
        waiting.join(PATIENT)
        assert order == ["waiter", "holder"]
        assert (holders.counts.let_in, others.counts.waited) == (1, 1)
        assert not holders.others_wait()  # the waiter no longer says it waits


def test_with_no_one_waiting_a_writer_begins_at_once(path: Path) -> None:
    with writer(path) as (connection, writers):
        for _ in range(3):
            writers.begin(connection, timeout=5)
            connection.execute("COMMIT")
        assert writers.counts == LockWaits()


def test_a_writer_waits_out_its_timeout_then_fails_as_locked(path: Path) -> None:
    with writer(path) as (connection, writers), writer(path) as (_, third):
        with write_lock(path), pytest.raises(sqlite3.OperationalError, match="locked"):
            writers.begin(connection, timeout=0.05)
        assert not connection.in_transaction
        assert not third.others_wait()  # it no longer says it waits
        writers.begin(connection, timeout=5)  # the lock is free again
        connection.execute("COMMIT")


def test_a_waiter_that_never_gets_in_holds_a_writer_up_only_for_the_bound(path: Path) -> None:
    """A waiter stuck behind another program's lock (here: one that says it waits and
    never asks) keeps no writer from writing for longer than the bound."""
    stuck = os.open(lock_file(path), os.O_RDWR | os.O_CREAT)
    fcntl.flock(stuck, fcntl.LOCK_SH)
    try:
        with writer(path, let_in_bound=0.01) as (connection, writers):
            writers.begin(connection, timeout=5)
            connection.execute("COMMIT")
            assert writers.counts == LockWaits(let_in=1)
    finally:
        os.close(stuck)


async def test_a_store_keeps_writing_beside_another_process_that_commits_back_to_back(
    tmp_path: Path,
) -> None:
    """Another process writes the same file without pause (see ``busy_writer``); this
    one runs 1,600 turns from 8 tasks, each within a busy timeout of 1 s, and neither
    side's writes fail. SQLite alone gives the lock to whoever asks while it is free,
    and a writer that found it taken asks again only every 100 ms: here some turns
    waited out their timeout in every run."""
    database = tmp_path / "chatlane.db"
    store = await SQLiteStore.open(f"sqlite:///{database}?busy_timeout=1000")
    other = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "tests.stores.busy_writer", str(database)),
        cwd=ROOT,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert other.stdout is not None
        assert await other.stdout.readline() == b"writing\n"
        failed = await asyncio.gather(*(turns(store, task, 200) for task in range(8)))
        assert other.returncode is None  # it kept writing all along
        assert store.stats.lock.waited > 0  # this process did find the lock taken
    finally:
        assert other.stdin is not None
        other.stdin.close()
        await store.close()
        said = await asyncio.wait_for(other.communicate(), 60)
    committed, others_failed = said[0].split()
    assert sum(failed) == 0
    assert (int(others_failed), await other.wait()) == (0, 0)
    assert int(committed) > 1


async def turns(store: SQLiteStore, task: int, count: int) -> int:
    """Run ``count`` turns of new sessions; how many failed."""
    failed = 0
    for n in range(count):
        key = chat_key(f"beside-{task}-{n}")
        try:
            admission = await store.enqueue_and_acquire(key, f"m-{task}-{n}", "p1", b"hello", 5)
            assert admission.lease is not None
            await store.commit_and_release(admission.lease, WriteBatch(done=[admission.seq]))
        except StoreError:
            failed += 1
    return failed
