"""What only the SQLite store promises: its file, its schema, group commit, and real processes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import pytest

from chatlane.errors import (
    ActiveSessionLimit,
    AlreadyAnswered,
    SessionBusy,
    StaleGeneration,
    StoreError,
)
from chatlane.identity import SessionKey
from chatlane.stores import (
    Delivery,
    DeliveryDraft,
    MemoryStore,
    Settlement,
    SettlementKind,
    Store,
    TranscriptEntry,
    WriteBatch,
    open_store,
)
from chatlane.stores import sqlite_ledger as ledger
from chatlane.stores.base import DELIVERED, PENDING, AnsweredMark
from chatlane.stores.codec import decode_message
from chatlane.stores.sqlite import SQLiteStore
from chatlane.stores.sqlite_schema import MIGRATIONS, Location, connect, migrate, parse_url
from chatlane.types import Attachment, AttachmentKind
from tests.adapters.test_api import eventually
from tests.keys import chat_key

KEY = chat_key("c1")


OLD_PAYLOAD = (
    b'{"source":{"platform":"telegram","chat_id":"42","chat_type":"dm","chat_name":"",'
    b'"thread_id":null,"user_id":"42","user_name":"","message_id":null},'
    b'"text":"queued before","id":"m1","internal":false,"received_at":1.0,'
    b'"busy_policy":"","idempotent":false}'
)
"""A message as stored before attachments: every field written, defaults included."""


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "chatlane.db"


@contextlib.asynccontextmanager
async def opened(path: Path) -> AsyncIterator[SQLiteStore]:
    """The store in ``path``, opened (and so migrated) by this version, closed at the end."""
    store = await SQLiteStore.open(f"sqlite:///{path}")
    try:
        yield store
    finally:
        await store.close()


@pytest.fixture
async def store(path: Path) -> AsyncIterator[SQLiteStore]:
    async with opened(path) as store:
        yield store


@contextlib.contextmanager
def file_at_step(path: Path, step: int) -> Iterator[sqlite3.Connection]:
    """A file whose schema stops at ``step``, to write what a store of that version held."""
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as db:
        migrate(db, path, MIGRATIONS[:step])
        yield db


@contextlib.contextmanager
def write_lock(path: Path) -> Iterator[threading.Event]:
    """Hold the file's write lock from another connection until the yielded event is set."""
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        other = sqlite3.connect(path, isolation_level=None)
        other.execute("BEGIN IMMEDIATE")
        held.set()
        release.wait(10)
        other.execute("ROLLBACK")
        other.close()

    thread = threading.Thread(target=hold)
    thread.start()
    assert held.wait(5)
    try:
        yield release
    finally:
        release.set()
        thread.join(5)


@contextlib.asynccontextmanager
async def writer_held(store: SQLiteStore) -> AsyncIterator[Callable[[int], Awaitable[None]]]:
    """Keep ``store``'s writer thread inside one operation until the block ends.

    Calls made meanwhile wait in the writer's queue and are taken together
    once the block ends. The yielded ``queued(count)`` waits until ``count``
    calls wait there.
    """
    entered, release = threading.Event(), threading.Event()

    def hold(_: sqlite3.Connection) -> None:
        entered.set()
        release.wait(10)

    async def queued(count: int) -> None:
        await eventually(lambda: store._writer._queue.qsize() >= count)

    held = store._write(hold)
    try:
        await eventually(entered.is_set)
        yield queued
    finally:
        release.set()
        await held


def contents(path: Path) -> bytes:
    return path.read_bytes()


def pragma(path: Path, name: str) -> object:
    with contextlib.closing(sqlite3.connect(path)) as db:
        return db.execute(f"PRAGMA {name}").fetchone()[0]


class TestUrl:
    @pytest.mark.parametrize(
        ("url", "expected"),
        [
            ("sqlite:///chatlane.db", Location(Path("chatlane.db"))),
            ("sqlite:///data/x.db", Location(Path("data/x.db"))),
            ("sqlite:////abs/x.db", Location(Path("/abs/x.db"))),
            ("sqlite:///x.db?busy_timeout=250", Location(Path("x.db"), 250)),
        ],
    )
    def test_forms(self, url: str, expected: Location) -> None:
        assert parse_url(url) == expected

    @pytest.mark.parametrize(
        "url",
        [
            "sqlite://host/x.db",
            "sqlite:///",
            "sqlite:x.db",
            "sqlite:///x.db?busy_timeout=soon",
            "sqlite:///x.db?journal=off",
            "memory://",
        ],
    )
    def test_malformed_is_a_store_error(self, url: str) -> None:
        with pytest.raises(StoreError, match="store URL"):
            parse_url(url)

    @pytest.mark.parametrize(
        "value", ["²", "٣", "-1", "1.5", "2147483648", "9" * 20, "9" * 5000, " 1"]
    )
    def test_a_busy_timeout_that_is_not_plain_milliseconds_is_named(self, value: str) -> None:
        with pytest.raises(StoreError, match="busy_timeout must be a whole number of milli"):
            parse_url(f"sqlite:///x.db?busy_timeout={value}")

    def test_the_longest_busy_timeout_sqlite_holds(self) -> None:
        assert parse_url("sqlite:///x.db?busy_timeout=2147483647").busy_timeout_ms == 2**31 - 1

    async def test_a_relative_path_is_under_the_working_directory(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.chdir(tmp_path)
        (tmp_path / "nested").mkdir()
        opened = await open_store("sqlite:///nested/chatlane.db")
        await opened.close()
        assert (tmp_path / "nested" / "chatlane.db").is_file()

    async def test_a_missing_folder_is_an_error_not_created(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.chdir(tmp_path)
        with pytest.raises(StoreError) as raised:
            await open_store("sqlite:///nested/deeper/chatlane.db")
        assert str(raised.value) == (
            f"cannot create SQLite store '{tmp_path}/nested/deeper/chatlane.db': "
            f"'{tmp_path}/nested/deeper' does not exist "
            "(chatlane creates the database file, not its folder)"
        )
        assert not (tmp_path / "nested").exists()
        (tmp_path / "nested").write_text("a file")
        with pytest.raises(StoreError, match="nested' is not a folder"):
            await open_store(f"sqlite:///{tmp_path}/nested/chatlane.db")


class TestFile:
    def test_connection_settings(self, path: Path) -> None:
        with contextlib.closing(connect(Location(path, busy_timeout_ms=1234))) as db:
            assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
            assert db.execute("PRAGMA synchronous").fetchone()[0] == 1  # NORMAL
            assert db.execute("PRAGMA busy_timeout").fetchone()[0] == 1234

    async def test_wal_and_schema_version(self, store: SQLiteStore, path: Path) -> None:
        await store.bump_generation(KEY)
        assert pragma(path, "journal_mode") == "wal"
        assert pragma(path, "user_version") == len(MIGRATIONS)

    @pytest.fixture
    def garbage(self, path: Path) -> Path:
        path.write_bytes(b"this is not a database, only bytes \x00\xff" * 100)
        return path

    async def test_garbage_file_is_a_store_error_naming_the_path(self, garbage: Path) -> None:
        with pytest.raises(StoreError, match="not a database") as raised:
            await open_store(f"sqlite:///{garbage}")
        assert str(garbage) in str(raised.value)

    async def test_directory_in_the_way_is_a_store_error(self, tmp_path: Path) -> None:
        with pytest.raises(StoreError, match="cannot open SQLite store"):
            await open_store(f"sqlite:///{tmp_path}")  # a directory where the file should be

    async def test_newer_schema_is_refused(self, path: Path) -> None:
        with contextlib.closing(sqlite3.connect(path)) as db:
            db.execute(f"PRAGMA user_version = {len(MIGRATIONS) + 1}")
        with pytest.raises(StoreError, match=r"schema version \d+, newer than"):
            await open_store(f"sqlite:///{path}")

    @pytest.mark.parametrize("step", range(1, len(MIGRATIONS)))
    async def test_a_store_of_every_older_version_is_upgraded(self, path: Path, step: int) -> None:
        with file_at_step(path, step) as db:
            db.execute("PRAGMA journal_mode = WAL")
            db.execute("INSERT INTO sessions (key, generation) VALUES ('k', 7)")
        async with opened(path) as store:
            assert await store.generation(SessionKey("k")) == 7
        assert pragma(path, "user_version") == len(MIGRATIONS)
        with contextlib.closing(sqlite3.connect(path)) as db:
            assert db.execute("SELECT value FROM meta").fetchall() == [("chatlane",)]

    async def test_a_store_of_a_newer_chatlane_is_refused_untouched(self, path: Path) -> None:
        async with opened(path):
            pass
        with contextlib.closing(sqlite3.connect(path)) as db:
            db.execute(f"PRAGMA user_version = {len(MIGRATIONS) + 1}")
        before = contents(path)
        with pytest.raises(StoreError, match=r"schema version \d+, newer than"):
            await open_store(f"sqlite:///{path}")
        assert contents(path) == before

    async def test_a_first_version_file_is_upgraded_and_keeps_its_data(self, path: Path) -> None:
        with file_at_step(path, 1) as db:
            db.execute("INSERT INTO answered VALUES ('m1', 'k', 1, 1e12)")
        async with opened(path) as store:
            assert pragma(path, "user_version") == len(MIGRATIONS)
            assert await store.is_answered("m1")
            assert await store.answer("m1") == ""  # answered before answers were kept

    async def test_step_6_keeps_conversations_and_answered_marks(self, path: Path) -> None:
        with file_at_step(path, 5) as db:
            db.execute(
                "INSERT INTO conversations (id, key, started_at, ended_at, title) "
                "VALUES ('c_old', 'k', 1.0, 2.0, 'first'), ('c_now', 'k', 3.0, 0, '')"
            )
            db.execute("INSERT INTO sessions VALUES ('k', 4, 'c_now')")
            db.execute("INSERT INTO answered VALUES ('m1', 'k', 4, 1e12, 'hi')")
        async with opened(path) as store:
            key = SessionKey("k")
            listed = await store.conversations(key)
            assert [(c.id, c.title, c.ended_at) for c in listed] == [
                ("c_now", "", 0.0),
                ("c_old", "first", 2.0),
            ]
            assert (await store.conversation(key)).id == "c_now"
            assert await store.answer("m1") == "hi"
        with contextlib.closing(sqlite3.connect(path)) as db:
            answered = [row[1] for row in db.execute("PRAGMA table_info(answered)")]
            assert answered == ["message_id", "at", "answer", "key", "failure"]  # step 12 too
            with pytest.raises(sqlite3.OperationalError, match="rowid"):
                db.execute("SELECT rowid FROM conversations")

    async def test_step_8_adds_the_ledger_and_keeps_what_was_there(self, path: Path) -> None:
        with file_at_step(path, 7) as db:
            db.execute("INSERT INTO sessions VALUES ('k', 3, '')")
            db.execute(
                "INSERT INTO pending (key, message_id, owner, payload, accepted_at) "
                "VALUES ('k', 'm1', 'p1', x'00', 1.0)"
            )
        async with opened(path) as store:
            assert pragma(path, "user_version") == len(MIGRATIONS)
            key = SessionKey("k")
            assert await store.generation(key) == 3
            assert [r.message_id for r in await store.pending(key)] == ["m1"]
            await store.record_deliveries([DeliveryDraft("d1", "tg", "chat", b"hi")])
            [claimed] = await store.claim_deliveries(["tg"], "p1", 5, 10)
            assert (claimed.id, claimed.seq, claimed.payload) == ("d1", 1, b"hi")
        with contextlib.closing(sqlite3.connect(path)) as db:
            indexes = db.execute(
                "SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'deliveries' "
                "AND sql IS NOT NULL ORDER BY name"
            ).fetchall()
        assert [name for (name,) in indexes] == [
            "deliveries_dead",
            "deliveries_delivered",
            "deliveries_lane",
            "deliveries_target",
        ]

    async def test_step_9_keeps_old_messages_readable_without_attachments(self, path: Path) -> None:
        with file_at_step(path, 8) as db:
            db.execute("INSERT INTO sessions VALUES ('k', 1, 'c_1')")
            db.execute("INSERT INTO conversations (id, key, started_at) VALUES ('c_1', 'k', 1.0)")
            db.execute(
                "INSERT INTO transcript (conversation_id, role, content, generation, message_id, "
                "created_at) VALUES ('c_1', 'user', 'old words', 1, 'm0', 1.0)"
            )
            db.execute(
                "INSERT INTO pending (key, message_id, owner, payload, accepted_at) "
                "VALUES ('k', 'm1', 'p1', ?, 1.0)",
                (OLD_PAYLOAD,),
            )
        async with opened(path) as store:
            key = SessionKey("k")
            [old] = await store.transcript(key)
            assert (old.content, old.attachments) == ("old words", ())
            [record] = await store.pending(key)
            message = decode_message(record.payload)
            assert (message.text, message.attachments) == ("queued before", ())
            photo = Attachment(AttachmentKind.IMAGE, "f1", "image/jpeg", 10)
            new = TranscriptEntry("user", "", 2, message_id="m1", attachments=(photo,))
            await store.append_transcript(key, None, new)
            assert [e.attachments for e in await store.transcript(key)] == [(), (photo,)]

    async def test_step_11_chains_the_entries_a_file_already_holds(self, path: Path) -> None:
        with file_at_step(path, 10) as db:
            db.execute("INSERT INTO sessions VALUES ('k', 1, 'c_2'), ('j', 1, 'c_3')")
            db.execute(
                "INSERT INTO conversations (id, key, started_at) "
                "VALUES ('c_1', 'k', 1.0), ('c_2', 'k', 2.0), ('c_3', 'j', 3.0), ('c_4', 'j', 4.0)"
            )
            for n, conversation in enumerate(["c_1", "c_3", "c_1", "c_2", "c_3", "c_2", "c_3"]):
                db.execute(
                    "INSERT INTO transcript (conversation_id, role, content, generation, "
                    "message_id, created_at) VALUES (?, 'user', ?, 1, ?, 1.0)",
                    (conversation, f"{conversation}:{n}", f"m{n}"),
                )
        async with opened(path) as store:
            k, j = SessionKey("k"), SessionKey("j")
            assert [e.content for e in await store.transcript(k, "c_1")] == ["c_1:0", "c_1:2"]
            assert [e.content for e in await store.transcript(k)] == ["c_2:3", "c_2:5"]
            assert [e.content for e in await store.transcript(j, limit=2)] == ["c_3:4", "c_3:6"]
            assert await store.transcript(j, "c_4") == []
            await store.append_transcript(k, None, TranscriptEntry("user", "new", 2))
            assert [e.content for e in await store.transcript(k)] == ["c_2:3", "c_2:5", "new"]
        with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as db:
            names = {row[0] for row in db.execute("SELECT name FROM sqlite_master")}
            db.execute(  # as a process of an earlier version still running beside it would
                "INSERT INTO transcript (conversation_id, role, content, generation, "
                "message_id, created_at) VALUES ('c_2', 'user', 'from before', 2, 'm9', 1.0)"
            )
        assert "transcript_conversation" not in names
        assert {"transcript_chained", "transcript_unchained"} <= names
        async with opened(path) as store:
            assert [e.content for e in await store.transcript(SessionKey("k"))] == [
                "c_2:3",
                "c_2:5",
                "new",
                "from before",
            ]

    async def test_step_12_keeps_old_marks_as_the_asking_sessions_answers(self, path: Path) -> None:
        with file_at_step(path, 11) as db:
            db.execute(
                "INSERT INTO answered (message_id, at, answer) VALUES ('m1', ?, 'hi')",
                (time.time(),),
            )
        async with opened(path) as store:
            assert await store.mark("m1") == AnsweredMark("hi")
            assert (await store.mark("m1") or AnsweredMark("")).belongs_to(SessionKey("k"))
            with pytest.raises(AlreadyAnswered):
                await store.commit(SessionKey("k"), None, WriteBatch(answered=["m1"]))
            failed = WriteBatch(answered=["m2"], answer="sorry", failure="Boom")
            await store.commit(SessionKey("k"), None, failed)
            assert await store.mark("m2") == AnsweredMark("sorry", SessionKey("k"), "Boom")
        with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as db:
            db.execute(  # as a process of an earlier version still running beside it would
                "INSERT INTO answered (message_id, at, answer) VALUES ('m3', ?, 'old')",
                (time.time(),),
            )
        async with opened(path) as store:
            assert await store.mark("m3") == AnsweredMark("old")

    def test_missing_steps_are_applied_in_order(self, path: Path) -> None:
        steps = [("CREATE TABLE a (x)",), ("ALTER TABLE a ADD COLUMN y", "CREATE TABLE b (z)")]
        with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as db:
            assert migrate(db, path, steps[:1]) == 1
            assert migrate(db, path, steps) == 2
            assert migrate(db, path, steps) == 2
            db.execute("INSERT INTO a (x, y) VALUES (1, 2)")
            db.execute("INSERT INTO b (z) VALUES (3)")
        assert pragma(path, "user_version") == 2

    def test_a_failed_step_keeps_the_file_as_it_was(self, path: Path) -> None:
        steps = [("CREATE TABLE a (x)",), ("CREATE TABLE b (x)", "CREATE TABLE a (x)")]
        with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as db:
            with pytest.raises(StoreError, match="migration 2 failed"):
                migrate(db, path, steps)
            tables = db.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall()
        assert tables == []
        assert pragma(path, "user_version") == 0


class TestWriterThread:
    async def test_group_commit_batches_concurrent_writes(self, store: SQLiteStore) -> None:
        before = store.stats.transactions
        await asyncio.gather(*(store.set_persistent(KEY, None, **{f"f{i}": i}) for i in range(200)))
        assert store.stats.transactions - before < 20
        assert await store.load_persistent(KEY) == {f"f{i}": i for i in range(200)}

    async def test_a_failing_operation_rolls_back_only_itself(self, store: SQLiteStore) -> None:
        lease = await store.acquire(KEY, "p1", 5)
        before = store.stats.transactions
        async with writer_held(store) as queued:
            commits = [
                store.set_persistent(KEY, lease.generation, **{f"f{i}": i}) for i in range(20)
            ]
            stale = store.set_persistent(KEY, lease.generation - 1, stale=True)
            tasks = [asyncio.ensure_future(c) for c in [*commits, stale]]
            await queued(len(tasks))
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert store.stats.transactions - before <= 2  # the stale one shared a transaction
        assert results[:20] == [None] * 20
        assert isinstance(results[20], StaleGeneration)
        assert await store.load_persistent(KEY) == {f"f{i}": i for i in range(20)}

    async def test_an_operation_failing_after_it_wrote_undoes_only_its_own_writes(
        self, store: SQLiteStore
    ) -> None:
        def writes_then_fails(db: sqlite3.Connection) -> None:
            db.execute("INSERT INTO heartbeats (holder, expires_at) VALUES ('half', 1e12)")
            raise ValueError("failed half-way")

        async def write_in_turn() -> None:
            await store._write(writes_then_fails)

        reruns = store.stats.reruns
        async with writer_held(store) as queued:
            commits = [store.set_persistent(KEY, None, **{f"f{i}": i}) for i in range(20)]
            broken = write_in_turn()  # queued in task order, between the commits
            tasks = [asyncio.ensure_future(c) for c in [*commits[:10], broken, *commits[10:]]]
            await queued(len(tasks))
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert isinstance(results[10], ValueError)
        assert results[:10] + results[11:] == [None] * 20
        assert store.stats.reruns == reruns + 1
        assert await store.load_persistent(KEY) == {f"f{i}": i for i in range(20)}
        assert await store.alive(["half"]) == {"half": False}
        with pytest.raises(ValueError, match="half-way"):
            await store._write(writes_then_fails)  # alone: no second run needed
        assert store.stats.reruns == reruns + 1
        assert await store.alive(["half"]) == {"half": False}

    async def test_a_turn_is_two_operations_and_a_refusal_reruns_nothing(
        self, store: SQLiteStore
    ) -> None:
        before = (store.stats.operations, store.stats.reruns)
        admission = await store.enqueue_and_acquire(KEY, "m1", "p1", b"", 5)
        assert admission.lease is not None
        await store.commit_and_release(admission.lease, WriteBatch(done=[admission.seq]))
        assert store.stats.operations - before[0] == 2
        await store.acquire(KEY, "p2", 5)
        async with writer_held(store) as queued:  # many admissions, all refused, in one batch
            calls = [store.enqueue_and_acquire(KEY, f"m{i}", "p1", b"", 5) for i in range(20)]
            tasks = [asyncio.ensure_future(call) for call in calls]
            await queued(len(tasks))
        admissions = await asyncio.gather(*tasks)
        assert all(isinstance(a.refusal, SessionBusy) for a in admissions)
        assert store.stats.reruns == before[1]
        assert len(await store.pending(KEY)) == 20

    async def test_reads_do_not_wait_for_the_write_lock(
        self, store: SQLiteStore, path: Path
    ) -> None:
        await store.bump_generation(KEY)
        with write_lock(path):
            assert await asyncio.wait_for(store.generation(KEY), 1) == 1

    async def test_a_call_cancelled_while_queued_is_never_applied(self, store: SQLiteStore) -> None:
        async with writer_held(store) as queued:
            cancelled = asyncio.ensure_future(store.acquire(KEY, "p1", 5))
            await queued(1)
            cancelled.cancel()
        assert await store.generation(KEY) == 0
        assert cancelled.cancelled()

    async def test_event_loop_stays_responsive(self, store: SQLiteStore) -> None:
        """A write that takes a second holds up its caller, never the event loop.

        Checked by counting the loop's turns while the write runs (a blocked
        loop turns at most once), not by timing it: the machine may be slow.
        """
        turns = 0
        done = asyncio.Event()
        writing = threading.Event()

        async def probe() -> None:
            nonlocal turns
            while not done.is_set():
                await asyncio.sleep(0.01)
                turns += writing.is_set()  # counts only while the slow write runs

        def slow_write(connection: sqlite3.Connection) -> None:
            writing.set()
            time.sleep(1.0)
            writing.clear()
            connection.execute("SELECT 1")

        async def writer(n: int) -> None:
            for i in range(10):
                await store.append_transcript(
                    chat_key(f"k{n}"), None, TranscriptEntry("user", "x" * 500, i)
                )

        probing = asyncio.ensure_future(probe())
        await asyncio.gather(store._write(slow_write), *(writer(n) for n in range(50)))
        done.set()
        await probing
        assert turns >= 10
        assert len(await store.transcript(chat_key("k49"), limit=100)) == 10


class TestLifecycle:
    async def test_close_flushes_queued_writes(self, path: Path) -> None:
        url = f"sqlite:///{path}"
        first = await open_store(url)
        writes = [asyncio.ensure_future(first.enqueue(KEY, f"m{i}", "p", b"")) for i in range(100)]
        await asyncio.sleep(0)
        await first.close()
        assert all(w.done() for w in writes)
        again = await open_store(url)
        assert len(await again.pending(KEY)) == 100
        await again.close()

    async def test_calls_after_close_are_refused(self, store: SQLiteStore) -> None:
        await store.close()
        with pytest.raises(StoreError, match="store is closed"):
            await store.generation(KEY)

    async def test_seqs_are_never_reused_after_delete_and_restart(self, path: Path) -> None:
        url = f"sqlite:///{path}"
        first = await open_store(url)
        seq = await first.enqueue(KEY, "m1", "p", b"")
        await first.drop_pending(KEY, [seq])
        await first.close()
        again = await open_store(url)
        assert await again.enqueue(KEY, "m1", "p", b"") > seq
        await again.close()


class TestValues:
    @pytest.mark.parametrize("other", ["memory", "sqlite"])
    async def test_entry_naming_another_conversation(self, other: str, store: SQLiteStore) -> None:
        chosen: Store = MemoryStore() if other == "memory" else store
        first = await chosen.conversation(KEY)
        await chosen.new_conversation(KEY)
        named = TranscriptEntry("user", "hi", 0, conversation_id=first.id, created_at=1.0)
        await chosen.commit(KEY, None, WriteBatch(transcript=[named]))
        assert await chosen.transcript(KEY) == [named]
        assert await chosen.transcript(KEY, first.id) == []


class TestRefusalsWriteNothing:
    """A refused lease or answer leaves every row as it was, and says why it was refused."""

    async def test_a_busy_session_at_the_active_limit_is_refused_as_busy(
        self, store: SQLiteStore, path: Path
    ) -> None:
        held = await store.acquire(KEY, "p1", 30, max_active=1)
        with pytest.raises(SessionBusy) as raised:
            await store.acquire(KEY, "p2", 30, max_active=1)
        assert not isinstance(raised.value, ActiveSessionLimit)
        with pytest.raises(ActiveSessionLimit):
            await store.acquire(chat_key("other"), "p2", 30, max_active=1)
        assert await store.generations([KEY, chat_key("other")]) == [1, 0]
        await store.close()
        with contextlib.closing(sqlite3.connect(path)) as db:
            rows = db.execute("SELECT key, holder, token, generation FROM leases").fetchall()
        assert rows == [(KEY, "p1", held.token, 1)]

    async def test_a_live_lease_is_never_overwritten(self, store: SQLiteStore, path: Path) -> None:
        first = await store.acquire(KEY, "p1", 30)
        await store.release(first)
        second = await store.acquire(KEY, "p2", 30)  # a released lease's row is taken again
        with pytest.raises(SessionBusy):
            await store.acquire(KEY, "p1", 30)
        assert (second.generation, await store.generation(KEY)) == (2, 2)
        await store.commit(KEY, second.generation, WriteBatch(persistent={"n": 1}))
        await store.close()
        with contextlib.closing(sqlite3.connect(path)) as db:
            rows = db.execute("SELECT holder, token, generation FROM leases").fetchall()
        assert rows == [("p2", second.token, 2)]

    async def test_a_repeated_answer_is_refused_before_any_write(self, store: SQLiteStore) -> None:
        lease = await store.acquire(KEY, "p1", 30)
        entry = TranscriptEntry("user", "hi", lease.generation, message_id="m1")
        answered = WriteBatch(transcript=[entry], answered=["m1"], answer="first")
        await store.commit(KEY, lease.generation, answered)
        again = WriteBatch(transcript=[entry], persistent={"n": 2}, answered=["m1"], answer="x")
        with pytest.raises(AlreadyAnswered):
            await store.commit(KEY, lease.generation, again)
        assert await store.answer("m1") == "first"
        assert [e.content for e in await store.transcript(KEY)] == ["hi"]
        assert await store.load_persistent(KEY) == {}
        assert store.stats.reruns == 0  # refused by its own first write: nothing to undo


def drafts(count: int, targets: int, lane: str = "tg") -> list[DeliveryDraft]:
    return [DeliveryDraft(f"d{n}", lane, f"T{n % targets}", b"") for n in range(count)]


def delivered(claimed: list[Delivery]) -> list[Settlement]:
    return [Settlement(d.id, d.claim, SettlementKind.DELIVERED) for d in claimed]


def vm_steps(db: sqlite3.Connection, action: Callable[[], object]) -> int:
    """How many virtual machine instructions SQLite ran for ``action``."""
    steps = 0

    def count() -> int:
        nonlocal steps
        steps += 1
        return 0

    db.set_progress_handler(count, 1)
    try:
        action()
    finally:
        db.set_progress_handler(None, 1)
    return steps


class TestDeliveryLedger:
    def test_columns_are_the_records_fields(self) -> None:
        assert ledger._COLUMNS.split(", ") == list(Delivery.__struct_fields__)

    def test_a_claims_work_grows_with_neither_backlog_nor_history(self, path: Path) -> None:
        """A claim seeks each target of its lanes and that target's head: a deep backlog
        behind a head, settled deliveries and other lanes cost it nothing."""

        def claim_once(db: sqlite3.Connection) -> int:
            db.execute("BEGIN IMMEDIATE")
            try:
                return vm_steps(db, lambda: ledger.claim(db, lambda: 10.0, ["tg"], "p1", 5, 10))
            finally:
                db.execute("ROLLBACK")

        with contextlib.closing(connect(Location(path))) as db:
            ledger.record(db, lambda: 1.0, drafts(5, 5))
            few = claim_once(db)
            backlog = [DeliveryDraft(f"b{n}", "tg", "T0", b"") for n in range(3000)]
            ledger.record(db, lambda: 2.0, backlog)
            settled = [DeliveryDraft(f"old{n}", "tg", "old", b"") for n in range(3000)]
            ledger.record(db, lambda: 3.0, settled)
            db.execute("UPDATE deliveries SET state = 'delivered' WHERE target = 'old'")
            elsewhere = [DeliveryDraft(f"w{n}", "web", f"W{n % 50}", b"") for n in range(3000)]
            ledger.record(db, lambda: 5.0, elsewhere)
            many = claim_once(db)
            assert len(ledger.claim(db, lambda: 10.0, ["tg"], "p1", 5, 10)) == 5
        assert many <= few * 1.2

    async def test_a_lane_named_twice_is_claimed_from_once(self, store: SQLiteStore) -> None:
        await store.record_deliveries(drafts(4, 2))
        claimed = await store.claim_deliveries(["tg", "tg"], "p1", 5, 10)
        assert [d.id for d in claimed] == ["d0", "d1"]

    async def test_a_target_in_two_lanes_is_still_sent_in_order(self, store: SQLiteStore) -> None:
        """A target belongs to one lane; if two name it, its head still goes first."""
        await store.record_deliveries(
            [DeliveryDraft("a1", "tg", "T", b""), DeliveryDraft("a2", "web", "T", b"")]
        )
        assert await store.claim_deliveries(["web"], "p1", 5, 10) == []
        [first] = await store.claim_deliveries(["tg", "web"], "p1", 5, 10)
        assert first.id == "a1"

    async def test_an_already_answered_commit_records_nothing(self, store: SQLiteStore) -> None:
        lease = await store.acquire(KEY, "p1", 30)
        await store.commit(KEY, lease.generation, WriteBatch(answered=["m1"]))
        again = WriteBatch(answered=["m1"], deliveries=drafts(1, 1))
        with pytest.raises(AlreadyAnswered):
            await store.commit(KEY, lease.generation, again)
        with pytest.raises(AlreadyAnswered):
            await store.commit_and_release(lease, again)
        both = WriteBatch(answered=["m1", "m2"], deliveries=drafts(1, 1))
        with pytest.raises(AlreadyAnswered):
            await store.commit(KEY, lease.generation, both)
        assert await store.delivery("d0") is None
        assert (await store.delivery_stats()).pending == 0

    async def test_a_commit_records_what_it_was_given_then(self, store: SQLiteStore) -> None:
        lease = await store.acquire(KEY, "p1", 30)
        batch = WriteBatch(deliveries=drafts(1, 1))
        committing = asyncio.ensure_future(store.commit_and_release(lease, batch))
        await asyncio.sleep(0)  # the call was made: its batch is queued
        batch.deliveries.append(DeliveryDraft("late", "tg", "T0", b""))
        assert await committing is True
        assert [d.id for d in await store.deliveries(PENDING)] == ["d0"]

    async def test_seqs_are_never_reused_after_pruning_and_restart(self, path: Path) -> None:
        url = f"sqlite:///{path}"
        first = await SQLiteStore.open(url)
        first.delivered_retention = 0.0
        await first.record_deliveries(drafts(1, 1))
        [claimed] = await first.claim_deliveries(["tg"], "p1", 5, 10)
        assert await first.settle_deliveries(delivered([claimed])) == [True]
        await first.heartbeat("p1", 5)
        assert await first.deliveries(DELIVERED) == []
        await first.close()
        again = await SQLiteStore.open(url)
        await again.record_deliveries([DeliveryDraft("next", "tg", "T0", b"")])
        recorded = await again.delivery("next")
        await again.close()
        assert recorded is not None
        assert recorded.seq > claimed.seq


CONTENDER = textwrap.dedent(
    """
    import asyncio, json, sys
    from chatlane.errors import SessionBusy
    from chatlane.stores import open_store

    async def main(url: str, name: str, rounds: int) -> None:
        store = await open_store(url)
        print("ready", flush=True)
        sys.stdin.readline()
        won = []
        for r in range(rounds):
            try:
                await store.acquire(f"round-{r}", name, 30)
            except SessionBusy:
                continue
            won.append(r)
        await store.close()
        print(json.dumps(won), flush=True)

    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
    """
)


OPENER = textwrap.dedent(
    """
    import asyncio, sys
    from chatlane.stores import open_store

    async def main(url: str) -> None:
        sys.stdin.readline()
        store = await open_store(url)
        await store.bump_generation("opened")
        await store.close()

    asyncio.run(main(sys.argv[1]))
    """
)


CLAIMER = textwrap.dedent(
    """
    import asyncio, json, sys
    from chatlane.stores import Settlement, SettlementKind, open_store

    async def main(url: str, name: str) -> None:
        store = await open_store(url)
        print("ready", flush=True)
        sys.stdin.readline()
        claimed = []
        while (await store.delivery_stats()).pending:
            batch = await store.claim_deliveries(["tg"], name, 30, 3)
            claimed += [d.id for d in batch]
            done = [Settlement(d.id, d.claim, SettlementKind.DELIVERED) for d in batch]
            assert all(await store.settle_deliveries(done))
        await store.close()
        print(json.dumps(claimed), flush=True)

    asyncio.run(main(sys.argv[1], sys.argv[2]))
    """
)


def start(script: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", script, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def go(processes: list[subprocess.Popen[str]]) -> list[str]:
    """Release every process at once, then collect their output (failing on an error)."""
    for process in processes:
        assert process.stdin is not None
        process.stdin.write("go\n")
        process.stdin.flush()
    results = [process.communicate(timeout=30) for process in processes]
    for process, (_, err) in zip(processes, results, strict=True):
        assert process.returncode == 0, err
    return [out for out, _ in results]


async def test_processes_opening_a_new_file_at_once(path: Path) -> None:
    processes = [start(OPENER, f"sqlite:///{path}") for _ in range(6)]
    await asyncio.to_thread(go, processes)
    opened = await open_store(f"sqlite:///{path}")
    assert await opened.generation(SessionKey("opened")) == 6
    await opened.close()


def test_two_processes_contend_and_one_wins_each_round(path: Path) -> None:
    rounds = 60
    processes = [start(CONTENDER, f"sqlite:///{path}", name, str(rounds)) for name in "ab"]
    for process in processes:
        assert process.stdout is not None
        assert process.stdout.readline().strip() == "ready"
    outputs = go(processes)
    won = [set(json.loads(out.splitlines()[-1])) for out in outputs]
    assert not won[0] & won[1]
    assert won[0] | won[1] == set(range(rounds))


async def test_processes_claiming_at_once_send_each_delivery_once_in_order(path: Path) -> None:
    url = f"sqlite:///{path}"
    store = await SQLiteStore.open(url)
    await store.record_deliveries(drafts(120, 7))
    processes = [start(CLAIMER, url, name) for name in "abc"]
    for process in processes:
        assert process.stdout is not None
        assert (await asyncio.to_thread(process.stdout.readline)).strip() == "ready"
    outputs = await asyncio.to_thread(go, processes)
    claimed = [json.loads(out.splitlines()[-1]) for out in outputs]
    everything = [delivery_id for ids in claimed for delivery_id in ids]
    assert sorted(everything) == sorted(f"d{n}" for n in range(120))  # each once
    sent = await store.deliveries(DELIVERED, limit=200)
    await store.close()
    for target in {d.target for d in sent}:  # each target's, one after the other, in order
        mine = [d for d in sent if d.target == target]
        assert [d.settled_at for d in mine] == sorted(d.settled_at for d in mine)


async def test_busy_session_across_instances(path: Path) -> None:
    """A second instance on the file sees the first one's lease as soon as it is granted."""
    first, second = (
        await SQLiteStore.open(f"sqlite:///{path}"),
        await open_store(f"sqlite:///{path}"),
    )
    lease = await first.acquire(KEY, "p1", 5)
    with pytest.raises(SessionBusy):
        await second.acquire(KEY, "p2", 5)
    await first.release(lease)
    assert (await second.acquire(KEY, "p2", 5)).generation == 2
    await first.close()
    await second.close()
