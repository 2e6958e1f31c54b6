"""What only the PostgreSQL store promises: URLs, migrations, clear errors, the server's clock."""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from hypothesis import given
from hypothesis import strategies as st

from chatlane.errors import AlreadyAnswered, LeaseLost, StoreError
from chatlane.runtime.settings import LeaseSettings
from chatlane.stores import DeliveryDraft, TranscriptEntry, WriteBatch, open_store
from chatlane.stores.base import AnsweredMark
from chatlane.stores.postgres import PostgresStore, ledger
from chatlane.stores.postgres.pools import QUICK_POOL, _milliseconds
from chatlane.stores.postgres.schema import MIGRATIONS, migrate
from chatlane.stores.postgres.store import _LOCKED_NOW, _rolled_back
from chatlane.stores.postgres.text import escape, unescape
from chatlane.stores.postgres.url import Location, parse_url, redact
from chatlane.testing import GatewayHarness
from chatlane.testing_postgres import ENV, PASSWORD, USER, binaries, throwaway
from chatlane.testing_redis import free_port
from chatlane.types import Attachment, AttachmentKind, SessionKey
from tests.adapters.test_api import eventually
from tests.keys import chat_key
from tests.runtime.agents import EchoAgent
from tests.stores.conftest import forget_store, own_schema
from tests.stores.taken_back import check_taken_back

KEY = chat_key("c1")


@pytest.fixture
def url(postgres_url: str) -> str:
    return own_schema(postgres_url, "unit")


@pytest.fixture
async def store(url: str) -> AsyncIterator[PostgresStore]:
    opened = await PostgresStore.open(url)
    yield opened
    await opened.close()
    await forget_store(url)


@pytest.fixture(scope="module")
def scram_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """A server that checks passwords: the tests' own cluster, or (when the tests were given a
    server, which may trust everyone) a throwaway one."""
    if not os.environ.get(ENV):
        yield request.getfixturevalue("postgres_url")
        return
    if binaries() is None:
        pytest.skip(f"${ENV} may trust every password, and no initdb/pg_ctl to start a server")
    with throwaway() as started:
        yield started


class TestUrls:
    def test_every_option_is_read_and_ours_are_taken_out(self) -> None:
        location = parse_url(
            "postgres://bot:s3cret@db.internal:6432/chat?schema=bot_eu&pool_min=0&pool_max=4"
            "&connect_timeout=2.5&idle_in_transaction_timeout=0.75&sslmode=require"
            "&command_timeout=12&renew_timeout=1.5&keepalives=1&keepalives_idle=60"
        )
        assert location == Location(
            "postgresql://bot:s3cret@db.internal:6432/chat?sslmode=require",
            "bot_eu",
            0,
            4,
            2.5,
            0.75,
            12.0,
            1.5,
            60,
        )

    def test_keepalive_can_be_turned_off(self) -> None:
        assert parse_url("postgresql://localhost/chat?keepalives=0").keepalives_idle == 0

    def test_defaults(self) -> None:
        assert parse_url("postgresql://localhost/chat") == Location("postgresql://localhost/chat")

    def test_the_largest_pool(self) -> None:
        location = parse_url("postgresql://localhost/chat?pool_min=1000&pool_max=1000")
        assert (location.pool_min, location.pool_max) == (1000, 1000)

    @pytest.mark.parametrize(
        ("url", "complaint"),
        [
            ("mysql://localhost/chat", "the scheme must be postgresql or postgres"),
            ("postgresql://localhost/chat?shema=x", "unknown option 'shema'"),
            ("postgresql://localhost/chat?schema=Bot-EU", "schema must be a lower-case SQL name"),
            ("postgresql://localhost/chat?schema=", "schema must be a lower-case SQL name"),
            ("postgresql://localhost/chat?schema=pg_x", "not starting with the reserved pg_"),
            (
                "postgresql://localhost/chat?schema=information_schema",
                "schema must not be the server's own information_schema",
            ),
            (
                "postgresql://localhost/chat?pool_max=0",
                "pool_max must be a whole number from 1 to 1000, not '0'",
            ),
            (
                "postgresql://localhost/chat?pool_max=1001",
                "pool_max must be a whole number from 1 to 1000, not '1001'",
            ),
            (
                "postgresql://localhost/chat?pool_max=99999999999999999999",
                "pool_max must be a whole number from 1 to 1000",
            ),
            (
                f"postgresql://localhost/chat?pool_max={'9' * 5000}",
                "pool_max must be a whole number from 1 to 1000, not '99999999999999999999…'",
            ),
            ("postgresql://localhost/chat?pool_max=²", "pool_max must be a whole number"),
            ("postgresql://localhost/chat?pool_max=٣", "pool_max must be a whole number"),
            (
                "postgresql://localhost/chat?pool_min=1001&pool_max=1000",
                "pool_min must be a whole number from 0 to 1000, not '1001'",
            ),
            ("postgresql://localhost/chat?pool_min=x", "pool_min must be a whole number"),
            ("postgresql://localhost/chat?pool_min=5&pool_max=2", "must not exceed pool_max"),
            (
                "postgresql://localhost/chat?connect_timeout=nan",
                "connect_timeout must be a positive",
            ),
            (
                "postgresql://localhost/chat?idle_in_transaction_timeout=0",
                "idle_in_transaction_timeout must be a positive",
            ),
            (
                "postgresql://localhost/chat?idle_in_transaction_timeout=0.001",
                "idle_in_transaction_timeout must be from 0.1 to 2000000 seconds, not '0.001'",
            ),
            (
                "postgresql://localhost/chat?idle_in_transaction_timeout=3e6",
                "idle_in_transaction_timeout must be from 0.1 to 2000000 seconds",
            ),
            (
                "postgresql://localhost/chat?idle_in_transaction_timeout=inf",
                "idle_in_transaction_timeout must be a positive",
            ),
            (
                "postgresql://localhost/chat?connect_timeout=inf",
                "connect_timeout must be a positive",
            ),
            (
                "postgresql://localhost/chat?command_timeout=0",
                "command_timeout must be a positive",
            ),
            ("postgresql://localhost/chat?renew_timeout=inf", "renew_timeout must be a positive"),
            (
                "postgresql://localhost/chat?keepalives=yes",
                "keepalives must be 1 (on) or 0 (off), not 'yes'",
            ),
            (
                "postgresql://localhost/chat?keepalives_idle=0",
                "keepalives_idle must be a whole number of seconds from 1 to 32767, not '0'",
            ),
            (
                "postgresql://localhost/chat?keepalives_idle=32768",
                "keepalives_idle must be a whole number of seconds from 1 to 32767",
            ),
            ("postgresql://localhost/chat?keepalives_idle=1.5", "keepalives_idle must be a whole"),
            ("postgresql://localhost:port/chat", "malformed (a port that is not a number"),
            ("postgresql://localhost/chat?schema", "every option must be name=value"),
        ],
    )
    def test_a_url_part_that_is_not_understood_is_named(self, url: str, complaint: str) -> None:
        with pytest.raises(StoreError, match="postgres store URL") as raised:
            parse_url(url)
        assert complaint in str(raised.value)

    async def test_open_store_names_the_bad_part(self) -> None:
        with pytest.raises(StoreError, match="unknown option 'pool'"):
            await open_store("postgres://u:hidden@localhost/chat?pool=3")

    def test_passwords_are_masked(self) -> None:
        assert redact("postgresql://u:s3cret@h/db") == "postgresql://u:***@h/db"
        assert redact("postgresql://h/db?user=u&password=s3cret") == (
            "postgresql://h/db?user=u&password=***"
        )
        with pytest.raises(StoreError) as raised:
            parse_url("postgresql://u:s3cret@h/db?bad=1")
        assert "s3cret" not in str(raised.value)

    async def test_without_the_driver_the_error_says_what_to_install(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setitem(sys.modules, "asyncpg", None)
        for name in [name for name in sys.modules if name.startswith("chatlane.stores.postgres")]:
            monkeypatch.delitem(sys.modules, name)
        with pytest.raises(StoreError, match=r"pip install 'chatlane\[postgres\]'"):
            await open_store("postgresql://localhost/chat")


class TestCannotOpen:
    async def test_an_unreachable_server_is_a_store_error(self) -> None:
        url = f"postgresql://u:s3cret@127.0.0.1:{free_port()}/chat?connect_timeout=2"
        with pytest.raises(StoreError, match="cannot connect") as raised:
            await open_store(url)
        assert "s3cret" not in str(raised.value)
        assert "u:***@127.0.0.1" in str(raised.value)

    async def test_a_wrong_password_is_a_store_error(self, scram_url: str) -> None:
        wrong = scram_url.replace(f":{PASSWORD}@", ":not-the-password@")
        assert wrong != scram_url
        with pytest.raises(StoreError, match="password authentication failed") as raised:
            await open_store(wrong)
        assert "not-the-password" not in str(raised.value)

    async def test_the_right_password_opens_it(self, scram_url: str) -> None:
        url = own_schema(scram_url, "scram")
        store = await open_store(url)
        await store.close()
        await forget_store(url)
        assert f"{USER}:{PASSWORD}@" in scram_url

    async def test_a_missing_database_is_a_store_error(self, postgres_url: str) -> None:
        base, _, _ = postgres_url.partition("?")
        missing = base.rsplit("/", 1)[0] + "/no_such_database_here"
        with pytest.raises(StoreError, match="no_such_database_here"):
            await open_store(missing)

    def test_chatlane_serve_says_why_and_shows_no_traceback(self, tmp_path: Path) -> None:
        url = f"postgresql://bot:s3cret@127.0.0.1:{free_port()}/chat?connect_timeout=2"
        port = str(free_port())  # not 8080, which a gateway here may hold
        result = subprocess.run(
            [sys.executable, "-m", "chatlane.cli", "serve", "--port", port, "--store", url],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 1
        assert "cannot connect" in result.stderr
        assert "Traceback" not in result.stderr
        assert "s3cret" not in result.stderr


class TestMigrations:
    async def test_a_new_schema_gets_every_step(self, store: PostgresStore) -> None:
        rows = await store._fetch("SELECT version FROM schema_version ORDER BY version")
        assert [row[0] for row in rows] == list(range(1, len(MIGRATIONS) + 1))

    async def test_processes_opening_a_new_schema_at_once_migrate_it_once(self, url: str) -> None:
        stores = await asyncio.gather(*(PostgresStore.open(url) for _ in range(4)))
        rows = await stores[0]._fetch("SELECT count(*) FROM schema_version")
        for store in stores:
            await store.close()
        await forget_store(url)
        assert rows[0][0] == len(MIGRATIONS)

    async def test_a_newer_schema_is_refused_and_left_alone(
        self, store: PostgresStore, url: str
    ) -> None:
        await store.set_persistent(KEY, None, model="m1")
        newer = len(MIGRATIONS) + 1
        await _execute(url, f"INSERT INTO schema_version (version) VALUES ({newer})")
        with pytest.raises(StoreError, match=f"schema version {newer}, newer than this chatlane"):
            await open_store(url)
        assert await store.load_persistent(KEY) == {"model": "m1"}

    async def test_a_failed_step_leaves_the_schema_as_it_was(self, store: PostgresStore) -> None:
        broken = (*MIGRATIONS, ("CREATE TABLE extra (x int)", "SELECT no_such_function()"))
        async with store._pools.turns.acquire() as db:
            with pytest.raises(StoreError, match=f"migration {len(broken)} failed"):
                await migrate(db, store.location.schema, broken)
        tables = await store._fetch("SELECT 1 FROM pg_tables WHERE tablename = 'extra'")
        assert tables == []
        versions = await store._fetch("SELECT max(version) FROM schema_version")
        assert versions[0][0] == len(MIGRATIONS)

    async def test_a_second_version_schema_gets_the_ledger_and_keeps_its_data(
        self, url: str
    ) -> None:
        await _migrated(url, 2)
        await _execute(url, "INSERT INTO sessions (key, generation) VALUES ('k', 4)")
        await _execute(url, "INSERT INTO answered (message_id, at, answer) VALUES ('m1', 1e12, '')")
        store = await PostgresStore.open(url)
        try:
            rows = await store._fetch("SELECT version FROM schema_version ORDER BY version")
            assert [row[0] for row in rows] == list(range(1, len(MIGRATIONS) + 1))
            assert await store.generation(SessionKey("k")) == 4
            assert await store.is_answered("m1")
            await store.record_deliveries([DeliveryDraft("d1", "tg", "chat", b"x")])
            assert [d.id for d in await store.claim_deliveries(["tg"], "p1", 5, 10)] == ["d1"]
        finally:
            await store.close()
            await forget_store(url)

    async def test_a_third_version_schema_keeps_its_transcript_without_attachments(
        self, url: str
    ) -> None:
        await _migrated(url, 3)
        await _execute(
            url,
            "INSERT INTO sessions (key, generation, current_conversation) VALUES ('k', 1, 'c_1')",
        )
        await _execute(
            url, "INSERT INTO conversations (id, key, started_at) VALUES ('c_1', 'k', 1)"
        )
        await _execute(
            url,
            "INSERT INTO transcript (conversation_id, role, content, generation, message_id, "
            "created_at) VALUES ('c_1', 'user', 'old words', 1, 'm0', 1.0)",
        )
        store = await PostgresStore.open(url)
        try:
            key = SessionKey("k")
            photo = Attachment(AttachmentKind.IMAGE, "f1", "image/jpeg", 10)
            new = TranscriptEntry("user", "", 2, message_id="m1", attachments=(photo,))
            await store.append_transcript(key, None, new)
            stored = await store.transcript(key)
            assert [(e.content, e.attachments) for e in stored] == [
                ("old words", ()),
                ("", (photo,)),
            ]
        finally:
            await store.close()
            await forget_store(url)

    async def test_step_7_keeps_old_marks_as_the_asking_sessions_answers(self, url: str) -> None:
        await _migrated(url, 6)
        await _execute(
            url,
            "INSERT INTO answered (message_id, at, answer) "
            "VALUES ('m1', extract(epoch FROM now()), 'hi')",
        )
        store = await PostgresStore.open(url)
        try:
            assert await store.mark("m1") == AnsweredMark("hi")
            with pytest.raises(AlreadyAnswered):
                await store.commit(KEY, None, WriteBatch(answered=["m1"]))
            await store.commit(KEY, None, WriteBatch(answered=["m2"], answer="no", failure="X"))
            assert await store.mark("m2") == AnsweredMark("no", KEY, "X")
        finally:
            await store.close()
            await forget_store(url)

    async def test_a_fifth_version_schema_reads_its_text_back_as_it_was(self, url: str) -> None:
        await _migrated(url, 5)
        soh = "chr(1)"  # stored raw by a version without the escape, two of them in a row too
        await _execute(
            url,
            "INSERT INTO sessions (key, generation, current_conversation) "
            f"VALUES ('k' || {soh}, 3, 'c_1')",
        )
        await _execute(
            url, f"INSERT INTO conversations (id, key, started_at) VALUES ('c_1', 'k' || {soh}, 1)"
        )
        await _execute(
            url,
            "INSERT INTO transcript (conversation_id, role, content, generation, message_id, "
            f"created_at) VALUES ('c_1', 'user', 'a' || {soh} || {soh} || 'b', 1, 'm0', 1.0)",
        )
        await _execute(
            url,
            "INSERT INTO pending (key, message_id, owner, payload, accepted_at) "
            f"VALUES ('k' || {soh}, 'm' || {soh}, 'p1', '', 1.0)",
        )
        store = await PostgresStore.open(url)
        try:
            key = SessionKey("k\x01")
            assert await store.generation(key) == 3
            assert [e.content for e in await store.transcript(key)] == ["a\x01\x01b"]
            assert [r.message_id for r in await store.pending(key)] == ["m\x01"]
            assert await store.pending_keys() == [key]
        finally:
            await store.close()
            await forget_store(url)

    async def test_schemas_do_not_see_each_other(self, store: PostgresStore, url: str) -> None:
        await store.set_persistent(KEY, None, model="mine")
        other_url = own_schema(url.partition("?")[0], "other")
        other = await PostgresStore.open(other_url)
        try:
            assert await other.load_persistent(KEY) == {}
        finally:
            await other.close()
            await forget_store(other_url)


class TestServerClock:
    async def test_a_lease_expires_by_the_servers_clock(self, store: PostgresStore) -> None:
        before = (await store._fetch("SELECT extract(epoch FROM clock_timestamp())::float8"))[0][0]
        lease = await store.acquire(KEY, "p1", 30)
        after = (await store._fetch("SELECT extract(epoch FROM clock_timestamp())::float8"))[0][0]
        assert before + 30 <= lease.expires_at <= after + 30


class TestText:
    @given(*[st.text(alphabet=st.sampled_from("\x00\x01\x02a"))] * 2)
    def test_the_escape_is_reversible_and_keeps_order(self, text: str, other: str) -> None:
        assert "\x00" not in escape(text)
        assert unescape(escape(text)) == text
        assert (escape(text) < escape(other)) is (text < other)
        assert escape(text + other) == escape(text) + escape(other)

    async def test_the_tables_hold_the_escaped_text(self, store: PostgresStore) -> None:
        await store.enqueue(KEY, "a\x00b\x01c", "p1", b"")
        rows = await store._fetch(
            "SELECT encode(convert_to(message_id, 'UTF8'), 'hex') FROM pending"
        )
        assert rows[0][0] == "610101620102" + "63"


class TestBadInput:
    async def test_text_the_server_cannot_keep_is_refused_whole(self, store: PostgresStore) -> None:
        lease = await store.acquire(KEY, "p1", 5)
        content = "lone \ud800 surrogate"
        entries = [TranscriptEntry("user", "fine", 1), TranscriptEntry("user", content, 1)]
        with pytest.raises(StoreError) as refused:
            await store.commit(
                KEY, lease.generation, WriteBatch(transcript=entries, answered=["m1"])
            )
        assert not refused.value.maybe_applied  # refused before its commit: rolled back
        assert await store.transcript(KEY) == []
        assert not await store.is_answered("m1")

    async def test_a_closed_store_refuses_work_and_a_renewal_is_lease_lost(
        self, store: PostgresStore
    ) -> None:
        lease = await store.acquire(KEY, "p1", 5)
        await store.close()
        with pytest.raises(StoreError, match="is closed"):
            await store.generation(KEY)
        with pytest.raises(LeaseLost, match="could not be renewed"):
            await store.renew(lease, 5)


class TestLedger:
    async def test_a_later_delivery_waits_for_an_earlier_one_of_its_target_being_recorded(
        self, store: PostgresStore
    ) -> None:
        first, later = (DeliveryDraft(i, "tg", "chat", b"x") for i in ("first", "later"))
        async with store._pools.turns.acquire() as db:
            transaction = db.transaction()
            await transaction.start()
            try:
                await ledger.record(db, [first], store._target_lock)
                recording = asyncio.create_task(store.record_deliveries([later]))
                await eventually(lambda: _waiting_for_a_lock(store))
                assert await store.claim_deliveries(["tg"], "p1", 5, 10) == []
            finally:
                await transaction.commit()
        await recording
        claimed = await store.claim_deliveries(["tg"], "p1", 5, 10)
        assert [d.id for d in claimed] == ["first"]  # recorded first, so sent first
        assert claimed[0].seq < (await store.delivery("later")).seq  # type: ignore[union-attr]

    async def test_a_repeated_id_in_one_call_is_recorded_once(self, store: PostgresStore) -> None:
        drafts = [DeliveryDraft("d1", "tg", "a", b"1"), DeliveryDraft("d1", "tg", "b", b"2")]
        await store.commit(KEY, None, WriteBatch(deliveries=drafts))
        [only] = await store.deliveries("pending")
        assert (only.id, only.target, only.payload) == ("d1", "a", b"1")


def _server_error(severity: str, sqlstate: str) -> BaseException:
    """The error asyncpg raises for the server's message of ``severity``."""
    error: BaseException = asyncpg.PostgresError.new(
        {"S": severity, "V": severity, "C": sqlstate, "M": "refused (test)"}
    )
    return error


async def _waiting_for(store: PostgresStore, locker: int) -> bool:
    """Whether a connection waits for a lock the server process ``locker`` holds."""
    rows = await store._fetch(
        "SELECT 1 FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))", locker
    )
    return bool(rows)


async def _waiting_for_a_lock(
    store: PostgresStore, routine: str = "chatlane_record_deliveries"
) -> bool:
    """Whether a connection calling ``routine`` waits for an advisory lock (by default: one
    recording deliveries, for a target's)."""
    rows = await store._fetch(
        "SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
        "AND wait_event = 'advisory' AND datname = current_database() "
        f"AND query LIKE '%{routine}(%' AND query NOT LIKE '%pg_stat_activity%'"
    )
    return bool(rows)


class TestUpkeep:
    async def test_a_heartbeat_does_not_wait_for_busy_turn_connections(self, url: str) -> None:
        store = await PostgresStore.open(f"{url}&pool_max=1")
        try:
            async with store._pools.turns.acquire():  # every turn connection is taken
                started = time.monotonic()
                async with asyncio.timeout(5):
                    await store.heartbeat("p1", 5)
                    assert await store.alive(["p1"]) == {"p1": True}
                    assert await store.generations([KEY]) == [0]
                assert time.monotonic() - started < 5
        finally:
            await store.close()
            await forget_store(url)

    async def test_heartbeats_and_renewals_do_not_wait_behind_reads(
        self, store: PostgresStore
    ) -> None:
        """Every read connection is held (a burst of reads: the scheduler's checks of
        thousands of sessions due for a reset), and more reads wait for one."""
        lease = await store.acquire(KEY, "p1", 5)
        gate, holding = asyncio.Event(), Counted(QUICK_POOL)

        async def held(db: Any) -> None:
            holding.add()
            await gate.wait()

        reads = [asyncio.create_task(store._read(held)) for _ in range(QUICK_POOL + 3)]
        try:
            await holding.reached.wait()
            async with asyncio.timeout(5):  # never, were they queued behind the reads
                await store.heartbeat("p1", 5)
                [renewed] = await store.renew_many([lease], 5)
            assert renewed is not None
            assert renewed.expires_at > lease.expires_at
            assert not any(read.done() for read in reads)  # the reads still held theirs
        finally:
            gate.set()
            await asyncio.gather(*reads)
        assert await store.alive(["p1"]) == {"p1": True}


class Counted:
    """A count that sets ``reached`` once it gets to ``goal``."""

    def __init__(self, goal: int) -> None:
        self.goal, self.count = goal, 0
        self.reached = asyncio.Event()

    def add(self) -> None:
        self.count += 1
        if self.count >= self.goal:
            self.reached.set()


class TestStoppedClients:
    async def test_a_transaction_left_idle_is_ended_and_frees_the_session(self, url: str) -> None:
        """A client stopped mid-transaction (here: one that never sends its next statement)
        holds the session's lock and lease row only until the server ends its transaction."""
        stopped = await PostgresStore.open(f"{url}&idle_in_transaction_timeout=0.2")
        taker = await PostgresStore.open(url)
        try:
            await stopped.acquire(KEY, "stopped", 0.1)
            async with stopped._pools.turns.acquire() as db:
                transaction = db.transaction()
                await transaction.start()
                await db.fetchval(_LOCKED_NOW, KEY)  # the session's lock, as every write takes it
                await db.execute("UPDATE leases SET holder = holder")  # and the lease's row
                async with asyncio.timeout(30):  # never, without the server's timeout
                    # waits for the session's lock; the stopped lease (0.1 s) expired before
                    # the server ended the transaction, 0.2 s after its last statement
                    lease = await taker.acquire(KEY, "taker", 5)
                assert lease.holder == "taker"
                # its connection was ended with it: asyncpg says so with the server's error,
                # a closed connection, or (the end still being read) its own state check
                ended = (asyncpg.PostgresError, asyncpg.InterfaceError, asyncpg.InternalClientError)
                with pytest.raises(ended):
                    await db.fetchval("SELECT 1")
        finally:
            await stopped.close()
            await taker.close()
            await forget_store(url)

    def test_every_connection_is_given_the_timeout(self) -> None:
        assert _milliseconds(5.0) == "5000"
        assert _milliseconds(0.0001) == "1"  # never 0, which turns the server's timeout off


class Statements:
    """Counts the statements the store's connections send (``BEGIN`` and ``COMMIT`` too)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.sent: list[str] = []
        for name in ("execute", "fetch", "fetchrow", "fetchval"):
            monkeypatch.setattr(asyncpg.Connection, name, self._counted(name))

    def _counted(self, name: str) -> Any:
        method = getattr(asyncpg.Connection, name)

        async def counted(connection: Any, query: str, *args: Any, **options: Any) -> Any:
            self.sent.append(query)
            return await method(connection, query, *args, **options)

        return counted

    def taken(self) -> list[str]:
        sent, self.sent = self.sent, []
        return sent


class TestRoutines:
    """A turn's calls are one statement each: one round trip, in its own transaction."""

    async def test_a_turns_calls_send_one_statement_each(
        self, store: PostgresStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        statements = Statements(monkeypatch)
        admission = await store.enqueue_and_acquire(KEY, "m1", "p1", b"hi", 5)
        assert admission.lease is not None
        assert len(statements.taken()) == 1
        answer = WriteBatch(
            transcript=[TranscriptEntry("user", "hi", admission.lease.generation)],
            answered=["m1"],
            done=[admission.seq],
            deliveries=[DeliveryDraft("d1", "tg", "chat", b"reply")],
        )
        assert await store.commit_and_release(admission.lease, answer) is True
        assert len(statements.taken()) == 1
        taken = await store.acquire_and_read(KEY, "p1", 5)
        await store.commit(KEY, taken.lease.generation, WriteBatch(persistent={"model": "m"}))
        await store.record_deliveries([DeliveryDraft("d2", "tg", "chat", b"more")])
        assert len(statements.taken()) == 3
        assert [d.id for d in await store.deliveries("pending")] == ["d1", "d2"]
        assert await store.load_persistent(KEY) == {"model": "m"}

    async def test_ids_of_every_shape_come_back_from_a_refused_commit(
        self, store: PostgresStore
    ) -> None:
        ids = ['quote " and \\ back', "comma, colon: slash/", "émoji 🎉 and ناقل", "m1"]
        await store.commit(KEY, None, WriteBatch(answered=ids))
        entry = TranscriptEntry("user", "again", 0)
        with pytest.raises(AlreadyAnswered) as refused:
            await store.commit(KEY, None, WriteBatch(transcript=[entry], answered=["new", *ids]))
        assert refused.value.message_ids == ids
        assert await store.transcript(KEY) == []  # the whole commit rolled back
        assert not await store.is_answered("new")

    async def test_a_call_cut_off_at_the_server_may_have_applied(
        self, store: PostgresStore
    ) -> None:
        """The server ends the connection of a call waiting for the session's lock: the
        caller cannot tell that from an answer lost after the commit.

        The session is this test's own: advisory locks are the whole database's, so a
        test running beside this one on a session of the same name in its own schema
        would wait for the lock held here, and be ended too."""
        key = chat_key("cut-off-" + secrets.token_hex(4))
        async with store._pools.turns.acquire() as holder:
            transaction = holder.transaction()
            await transaction.start()
            await holder.fetchval(_LOCKED_NOW, key)  # the session's lock, as every write takes it
            calling = asyncio.create_task(store.enqueue_and_acquire(key, "m1", "p1", b"hi", 5))
            locker = holder.get_server_pid()  # only what waits for it: never another test's
            await eventually(lambda: _waiting_for(store, locker))
            await store._fetch(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE $1 = ANY(pg_blocking_pids(pid))",
                locker,
            )
            with pytest.raises(StoreError) as cut:
                await calling
            await transaction.rollback()
        assert cut.value.maybe_applied
        assert await store.pending(key) == []  # it had not: the lock was never given

    @pytest.mark.parametrize("way", ["_call", "_write", "_read"])
    async def test_a_connection_the_driver_lost_track_of_is_an_outage_and_is_closed(
        self, store: PostgresStore, way: str
    ) -> None:
        """asyncpg's ``InternalClientError`` ("cannot switch to state …; another operation is
        in progress", seen after the server dropped connections) is a store failure, never an
        error of the caller's own (an agent's, a request's), and its connection is not
        handed out again."""
        pids: list[int] = []

        async def lost(db: Any, *_: Any) -> None:
            pids.append(await db.fetchval("SELECT pg_backend_pid()"))
            raise asyncpg.InternalClientError("cannot switch to state 12 (test)")

        call = getattr(store, way)
        with pytest.raises(StoreError) as failed:
            await (call(None, lost) if way == "_write" else call(lost))
        assert failed.value.maybe_applied is (way == "_call")  # a transaction: not committed
        [pid] = pids
        gone = "SELECT count(*) = 0 FROM pg_stat_activity WHERE pid = $1"
        await eventually(lambda: store._read(lambda db: db.fetchval(gone, pid)))

    @pytest.mark.parametrize(
        ("error", "rolled_back"),
        [
            (UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogates not allowed"), True),
            (asyncpg.DataError("invalid input for query argument $1"), True),  # never sent
            (_server_error("ERROR", "22021"), True),  # refused: rolled back
            (_server_error("FATAL", "57P01"), False),  # the server ended the connection
            (ConnectionResetError(), False),
            (asyncpg.ConnectionDoesNotExistError("closed in the middle"), False),
            (TimeoutError(), False),
        ],
    )
    def test_what_a_failed_call_tells_of_its_statement(
        self, error: BaseException, rolled_back: bool
    ) -> None:
        assert _rolled_back(error) is rolled_back


class LoseNextAnswer:
    """Makes the store's next write — a transaction, or a routine's statement — fail *after*
    it committed, as if the connection broke on the way back: the caller gets
    ``StoreError`` (maybe applied)."""

    def __init__(self, store: PostgresStore, monkeypatch: pytest.MonkeyPatch) -> None:
        self.armed, self.lost = False, 0
        self.passes = 0
        """Writes to let through, once armed, before the one whose answer is lost."""
        write, call = store._write, store._call

        async def losing_write(
            key: SessionKey | None, op: Any, *, upkeep: bool = False, **options: Any
        ) -> Any:
            done = await write(key, op, upkeep=upkeep, **options)
            return done if upkeep else self._answer(done)

        async def losing_call(op: Any) -> Any:
            return self._answer(await call(op))

        monkeypatch.setattr(store, "_write", losing_write)
        monkeypatch.setattr(store, "_call", losing_call)

    def _answer(self, done: Any) -> Any:
        if self.armed and self.passes:
            self.passes -= 1
        elif self.armed:
            self.armed, self.lost = False, self.lost + 1
            raise StoreError("connection lost (test)", maybe_applied=True)
        return done


class TestLostAnswers:
    async def test_a_message_whose_admission_answer_was_lost_is_taken_back(
        self, store: PostgresStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        lose = LoseNextAnswer(store, monkeypatch)
        lasting = LeaseSettings(ttl=3600)  # a lease left behind would hold the session for good
        async with GatewayHarness(EchoAgent(), store=store, leases=lasting) as h:
            lose.armed = True
            with pytest.raises(StoreError):
                await h.send("lost", chat_id="c")  # queued and leased, its answer lost
            assert lose.lost == 1
            await check_taken_back(h, store, ["echo: next"])

    async def test_a_waiting_turn_whose_lease_answer_was_lost_takes_it_at_its_next_try(
        self, store: PostgresStore, url: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        lose = LoseNextAnswer(store, monkeypatch)
        lasting = LeaseSettings(ttl=3600)
        other = await PostgresStore.open(url)  # another process, on the same schema
        try:
            async with GatewayHarness(EchoAgent(), store=store, leases=lasting) as h:
                key = h.session_key(chat_id="c")
                elsewhere = await other.acquire(key, "another process", 3600)
                await h.send("waits", chat_id="c")  # queued: the session runs elsewhere
                lose.armed = True  # its next try takes the lease, and the answer is lost
                await other.release(elsewhere)
                assert (await h.replies(chat_id="c", count=2))[1] == "echo: waits"
                assert lose.lost == 1
                await h.settle()
                assert await store.active_sessions() == 0
        finally:
            await other.close()

    async def test_an_adoption_whose_answer_was_lost_is_read_back_by_the_next(
        self, store: PostgresStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The orphaned records are read, then the one statement adopting exactly those
        commits and its answer is lost: the next adoption returns them."""
        key, other = chat_key("a"), chat_key("b")
        await store.enqueue(key, "m1", "a process that died", b"left")
        await store.enqueue(other, "m2", "a process that died", b"left too")
        lose = LoseNextAnswer(store, monkeypatch)
        lose.armed, lose.passes = True, 1  # the read goes through; the adoption's answer is lost
        with pytest.raises(StoreError):
            await store.adopt_orphans("me", 10)
        assert lose.lost == 1
        assert [r.owner for r in [*await store.pending(key), *await store.pending(other)]] == [
            "me",
            "me",
        ]
        lose.armed = True  # the next adoption's own read fails: what it reads back stays
        adopted = await store.adopt_orphans("me", 10)
        assert lose.lost == 2
        assert [(r.key, r.message_id, r.owner) for r in adopted] == [
            (key, "m1", "me"),
            (other, "m2", "me"),
        ]
        assert await store.adopt_orphans("me", 10) == []


async def _migrated(url: str, steps: int) -> None:
    """Make ``url``'s schema as a store of the first ``steps`` schema steps left it."""
    location = parse_url(url)
    connection = await asyncpg.connect(location.dsn)
    try:
        await migrate(connection, location.schema, MIGRATIONS[:steps])
    finally:
        await connection.close()


async def _execute(url: str, statement: str) -> None:
    location = parse_url(url)
    connection = await asyncpg.connect(location.dsn)
    try:
        await connection.execute(f'SET search_path = "{location.schema}"')
        await connection.execute(statement)
    finally:
        await connection.close()
