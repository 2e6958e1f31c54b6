"""A turn's small writes run on the event loop while the writer thread idles — never at the
cost of order, of another process's lock, or of a stalled loop."""

from __future__ import annotations

import asyncio
import queue
import sqlite3
import threading
import time
import types
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from chatlane.stores import WriteBatch, sqlite_writer
from chatlane.stores.sqlite import SQLiteStore
from chatlane.stores.sqlite_checkpoints import Checkpointer
from tests.keys import chat_key
from tests.stores.test_sqlite import write_lock, writer_held

KEY = chat_key("c1")


@pytest.fixture(autouse=True)
def steady(monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch slowed by a loaded machine sends no later call to the thread: where each
    call runs is then the design's doing, not the load's (the slow-batch tests set it)."""
    monkeypatch.setattr(sqlite_writer, "PAUSE_AFTER_SLOW", 0.0)


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "chatlane.db"


@pytest.fixture
async def store(path: Path) -> AsyncIterator[SQLiteStore]:
    opened = await SQLiteStore.open(f"sqlite:///{path}")
    yield opened
    await opened.close()


def thread_of(_: sqlite3.Connection) -> int:
    return threading.get_ident()


async def turn(store: SQLiteStore, n: int) -> None:
    admission = await store.enqueue_and_acquire(KEY, f"m{n}", "p1", b"hello", 5)
    assert admission.lease is not None
    await store.commit_and_release(admission.lease, WriteBatch(done=[admission.seq]))


async def test_a_turn_runs_on_the_loop_while_the_writer_idles(store: SQLiteStore) -> None:
    before = store.stats.on_loop
    for n in range(10):
        await turn(store, n)
    assert store.stats.on_loop - before == 20
    assert store.stats.handed_over == 0
    assert await store._quick(thread_of) == threading.get_ident()
    assert await store._write(thread_of) != threading.get_ident()
    assert await store.pending(KEY) == []


async def test_quick_calls_of_one_pass_share_a_transaction(store: SQLiteStore) -> None:
    before = store.stats.transactions
    keys = [chat_key(f"k{i}") for i in range(30)]
    leases = await asyncio.gather(*(store.acquire(key, "p1", 5) for key in keys))
    assert store.stats.transactions - before == 1
    assert [lease.generation for lease in leases] == [1] * 30


async def test_a_pass_with_more_quick_calls_than_the_loop_takes_goes_to_the_thread(
    store: SQLiteStore,
) -> None:
    count = sqlite_writer.MAX_HERE + 1
    threads = await in_one_pass(store, count)
    assert threading.get_ident() not in threads
    assert store.stats.handed_over == 1
    threads = await in_one_pass(store, count - 1)
    assert set(threads) == {threading.get_ident()}


async def in_one_pass(store: SQLiteStore, count: int) -> list[int]:
    """The threads ``count`` quick calls ran on, made in one pass by a task each."""

    async def call() -> int:
        return await store._quick(thread_of)

    return await asyncio.gather(*(call() for _ in range(count)))


async def made_alone(store: SQLiteStore) -> bool:
    """Whether a quick call made as its pass's only callback (the test's task waits)
    had run by the time the call returned."""
    loop = asyncio.get_running_loop()
    ran_at_once: asyncio.Future[bool] = loop.create_future()

    def lone() -> None:
        made = store._quick(thread_of)
        ran_at_once.set_result(made.done() and made.result() == threading.get_ident())

    loop.call_soon(lone)
    return await ran_at_once


async def test_a_lone_quick_call_runs_as_it_is_made(store: SQLiteStore) -> None:
    """With nothing else for the loop to run before it polls, no call could join it: it
    runs at once, and its caller goes on without waiting for the pass's end."""
    assert await made_alone(store)
    assert await made_alone(store)
    asyncio.get_running_loop().call_soon(lambda: None)  # it may make a call in this pass too
    made = store._quick(thread_of)
    assert not made.done()
    assert await made == threading.get_ident()


async def test_after_a_batch_of_several_calls_a_lone_one_waits_for_company(
    store: SQLiteStore,
) -> None:
    """While other turns write, a call made last in its pass still waits for the pass's
    end: the turns that wake next may join its batch (a loop running every call at once
    polls more often for less work). A batch of one call says they stopped."""
    await in_one_pass(store, 3)
    assert not await made_alone(store)  # the batch of one it then made
    assert await made_alone(store)


async def test_a_quick_call_waits_behind_a_call_the_thread_has(store: SQLiteStore) -> None:
    order: list[str] = []

    def step(name: str) -> sqlite_writer.Operation[None]:
        return lambda _: order.append(name)

    first = store._write(step("thread"))  # the thread has it: the quick one waits its turn
    second = store._quick(step("quick"))
    await asyncio.gather(first, second)
    third = store._quick(step("quick first"))  # a call after a quick one keeps their order
    fourth = store._write(step("thread after"))
    await asyncio.gather(third, fourth)
    assert order == ["thread", "quick", "quick first", "thread after"]

    async with writer_held(store) as queued:
        held_up = [asyncio.ensure_future(store._quick(step(f"held {i}"))) for i in range(3)]
        await queued(3)
    await asyncio.gather(*held_up)
    assert order[4:] == ["held 0", "held 1", "held 2"]


class GatedQueue(queue.SimpleQueue[Any]):
    """A queue the writer thread cannot take from until :attr:`gate` opens."""

    gate = threading.Event()

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        assert self.gate.wait(10)
        return super().get(block, timeout)


async def test_a_queued_call_the_thread_has_not_taken_yet_still_goes_first(
    path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The write lock is free, yet the quick call must wait behind the queued one."""
    gated = types.SimpleNamespace(SimpleQueue=GatedQueue, Empty=queue.Empty)
    monkeypatch.setattr(sqlite_writer, "queue", gated)
    GatedQueue.gate.clear()
    store = await SQLiteStore.open(f"sqlite:///{path}")
    order: list[str] = []
    try:
        first = store._write(lambda _: order.append("queued"))
        second = store._quick(lambda _: order.append("quick"))
        await asyncio.sleep(0)  # the quick call's pass ends while the thread waits
        GatedQueue.gate.set()
        await asyncio.gather(first, second)
        assert order == ["queued", "quick"]
    finally:
        GatedQueue.gate.set()
        await store.close()


async def test_another_process_holding_the_lock_never_blocks_the_loop(path: Path) -> None:
    """The store would wait a minute for the lock; the loop must not wait with it."""
    store = await SQLiteStore.open(f"sqlite:///{path}?busy_timeout=60000")
    try:
        with write_lock(path):
            acquiring = asyncio.ensure_future(store.acquire(KEY, "p1", 5))
            for _ in range(20):
                await asyncio.sleep(0)  # a loop stuck in SQLite's busy wait never returns here
            assert not acquiring.done()
            assert store.stats.handed_over == 1
        lease = await acquiring  # the thread waited for the lock and took it
        assert lease.generation == 1
        assert await store._quick(thread_of) == threading.get_ident()  # back on the loop
    finally:
        await store.close()


def slow(_: sqlite3.Connection) -> None:
    time.sleep(sqlite_writer.SLOW_BATCH * 2)  # a disk that stalls a write


async def test_a_slow_batch_sends_the_next_calls_to_the_thread(
    store: SQLiteStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sqlite_writer, "PAUSE_AFTER_SLOW", 60.0)
    await store._quick(slow)
    assert await store._quick(thread_of) != threading.get_ident()


async def test_the_thread_takes_them_only_for_a_while(store: SQLiteStore) -> None:
    await store._quick(slow)  # the pause after it: none (see ``steady``)
    assert await store._quick(thread_of) == threading.get_ident()


async def test_a_quick_call_cancelled_before_its_pass_ends_is_never_applied(
    store: SQLiteStore,
) -> None:
    acquiring = asyncio.ensure_future(store.acquire(KEY, "p1", 5))
    await asyncio.sleep(0)  # the call is made; its pass has not ended
    acquiring.cancel()
    with pytest.raises(asyncio.CancelledError):
        await acquiring
    assert await store.generation(KEY) == 0


@pytest.fixture
def reported(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Set once a checkpoint beside the writes has run and reported (cleared by its waiter)."""
    event = threading.Event()
    run = Checkpointer._run

    def reporting(self: Checkpointer, connection: sqlite3.Connection) -> None:
        run(self, connection)
        event.set()

    monkeypatch.setattr(Checkpointer, "_run", reporting)
    return event


async def write_in_rounds(store: SQLiteStore, rounds: int, reported: threading.Event) -> None:
    """``rounds`` times: 100 transactions, in which a checkpoint beside them is asked for,
    then that checkpoint's report, then one turn more — whose calls go to the writer
    thread if the report found the WAL past its bound: it then copies the rest, its writes
    held — and a call queued after that copy.

    What follows a checkpoint is then the design's doing, whatever the machine's load:
    a checkpoint thread that a loaded machine holds up is waited for.
    """
    for round_ in range(rounds):
        for n in range(50):
            await turn(store, round_ * 100 + n)
        await asyncio.to_thread(reported.wait)
        reported.clear()
        await turn(store, round_ * 100 + 99)
        await store._write(thread_of)


async def test_checkpoints_keep_the_wal_within_its_bound(
    store: SQLiteStore, path: Path, reported: threading.Event
) -> None:
    """SQLite's own checkpoint is off (it would sync on the loop); ours keep up.

    Without them, 1,500 transactions of about ten pages each leave a WAL of
    some 60 MB. Checkpoints beside the writes copy it into the file; past the
    bound the writer copies the rest itself and the WAL starts again.
    """
    connection = store._writer._connection
    assert connection is not None
    assert connection.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == 0
    await write_in_rounds(store, 15, reported)
    assert store.stats.checkpoints == 15  # each copied the WAL, or found it past the bound
    wal = path.with_name(path.name + "-wal")
    assert wal.stat().st_size < 2 * sqlite_writer.WAL_FRAMES_BOUND * 4096
    assert store.stats.on_loop > 0  # the others went to the thread while a checkpoint ran


async def test_past_its_bound_the_writer_copies_the_rest_and_starts_the_wal_again(
    store: SQLiteStore, path: Path, monkeypatch: pytest.MonkeyPatch, reported: threading.Event
) -> None:
    """Every checkpoint beside the writes finds the WAL past its bound (one frame): the
    writer thread then checkpoints it itself, its writes held, and the WAL starts again."""
    monkeypatch.setattr(sqlite_writer, "WAL_FRAMES_BOUND", 1)  # every checkpoint finds it past
    await write_in_rounds(store, 8, reported)
    assert store.stats.checkpoints == 8
    assert store.stats.held_checkpoints == 8
    wal = path.with_name(path.name + "-wal")
    assert wal.stat().st_size < 20 * 1024 * 1024  # never started again: some 35 MB


async def test_a_checkpoint_beside_the_writes_holds_none_of_them_up(
    store: SQLiteStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint that does not end (a slow disk) while 200 more transactions commit."""
    started, release = threading.Event(), threading.Event()
    run = Checkpointer._run

    def stuck(self: Checkpointer, connection: sqlite3.Connection) -> None:
        started.set()
        release.wait()
        run(self, connection)

    monkeypatch.setattr(Checkpointer, "_run", stuck)
    try:
        for n in range(50):
            await turn(store, n)
        await asyncio.to_thread(started.wait)  # asked after these 100 transactions: stuck
        for n in range(50, 150):
            await turn(store, n)
        assert store.stats.transactions >= 300
        assert store.stats.checkpoints == 0
    finally:
        release.set()


async def test_many_sessions_mixing_quick_and_queued_calls(store: SQLiteStore) -> None:
    """Turns, reads and scans of 40 sessions interleave; each session's order holds."""

    async def session(i: int) -> None:
        key = chat_key(f"s{i}")
        for n in range(5):
            admission = await store.enqueue_and_acquire(key, f"s{i}m{n}", "p1", b"x", 5)
            assert admission.lease is not None
            assert [r.seq for r in await store.pending(key)] == [admission.seq]
            answer = WriteBatch(persistent={"n": n}, done=[admission.seq])
            await store.commit_and_release(admission.lease, answer)
            assert await store.load_persistent(key) == {"n": n}
        assert await store.generation(key) == 5

    await asyncio.gather(*(session(i) for i in range(40)))
    assert await store.pending_keys() == []
    assert store.stats.on_loop > 0


async def test_an_urgent_call_runs_before_the_backlog_queued_ahead_of_it(
    store: SQLiteStore,
) -> None:
    """A heartbeat waits for one batch at most, however many calls a burst queued."""
    order: list[str] = []

    def note(name: str) -> Callable[[sqlite3.Connection], None]:
        return lambda _: order.append(name)

    backlog = 2 * sqlite_writer.MAX_BATCH + 10
    async with writer_held(store) as queued:
        calls = [store._write(note(f"w{n}")) for n in range(backlog)]
        await queued(backlog)
        calls.append(store._urgent(note("beat")))
    await asyncio.gather(*calls)
    assert order[0] == "beat"
    assert order[1:] == [f"w{n}" for n in range(backlog)]  # the others keep their order
    await store.heartbeat("p1", 5.0)  # the store's own urgent call, end to end
    assert await store.alive(["p1"]) == {"p1": True}
