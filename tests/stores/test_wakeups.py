"""Wake-ups: a store tells whoever waits for a session's lease that it may be free.

Each test opens two stores on one backend, as two processes would (the memory
store is shared instead: one process's engines). Waits are given a minute, far
longer than any test runs, under an overall timeout of a few seconds: a test
passes only if the wake-up came, never because a delay ran out.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import closing, contextmanager
from typing import Any

import asyncpg
import pytest

from chatlane.errors import EarlierMessageFirst, SessionBusy
from chatlane.stores import MemoryStore, Store, WriteBatch
from chatlane.stores.postgres import PostgresStore
from chatlane.stores.postgres import wakeups as pg_wakeups
from chatlane.stores.postgres.url import parse_url
from chatlane.stores.protocols import Wakeups, Watch
from chatlane.stores.wakeups import Watch as HubWatch
from chatlane.types import SessionKey
from tests.adapters.test_api import eventually
from tests.keys import chat_key
from tests.stores.conftest import forget_store, own_schema

KEY = chat_key("c1")
LONG = 60.0
"""A wait no test lasts: only a wake-up ends it in time."""


@pytest.fixture
def postgres_store_url(postgres_url: str) -> str:
    return own_schema(postgres_url, "wakeups")


@pytest.fixture(params=["memory", "postgres"])
async def pair(request: pytest.FixtureRequest) -> AsyncIterator[tuple[Store, Store]]:
    """Two stores sharing their data: the one holding the lease, and the one waiting for it."""
    if request.param == "memory":
        shared = MemoryStore()
        yield shared, shared
        return
    url: str = request.getfixturevalue("postgres_store_url")
    first = await PostgresStore.open(url)
    second = await PostgresStore.open(url)
    yield first, second
    await first.close()
    await second.close()
    await forget_store(url)


@contextmanager
def watch(store: Store, key: SessionKey = KEY) -> Iterator[Watch]:
    assert isinstance(store, Wakeups)
    with closing(store.watch_wakeups(key)) as found:
        yield found


async def woken(watch: Watch) -> bool:
    async with asyncio.timeout(10):
        return await watch.wait(LONG)


async def refused(store: Store, key: SessionKey = KEY, head_seq: int | None = None) -> None:
    with pytest.raises(SessionBusy):
        await store.acquire(key, "h-waiter", 30, head_seq=head_seq)


async def test_a_release_elsewhere_wakes_the_waiter(pair: tuple[Store, Store]) -> None:
    holder, waiter = pair
    lease = await holder.acquire(KEY, "h-holder", 30)
    with watch(waiter) as wakeup:
        await refused(waiter)
        await holder.release(lease)
        assert await woken(wakeup)
        assert (await waiter.acquire(KEY, "h-waiter", 30)).generation == lease.generation + 1


async def test_a_commit_that_releases_wakes_the_waiter(pair: tuple[Store, Store]) -> None:
    holder, waiter = pair
    seq = await holder.enqueue(KEY, "m1", "h-holder", b"x")
    lease = await holder.acquire(KEY, "h-holder", 30, head_seq=seq)
    with watch(waiter) as wakeup:
        await refused(waiter)
        await holder.commit(KEY, lease.generation, WriteBatch(persistent={"a": 1}))
        assert not await wakeup.wait(0.2)  # a commit that frees nothing wakes no one
        assert await holder.commit_and_release(lease, WriteBatch(done=[seq], answered=["m1"]))
        assert await woken(wakeup)


@pytest.mark.parametrize("how", ["done", "drop", "park"])
async def test_an_earlier_message_leaving_the_queue_wakes_the_waiter(
    pair: tuple[Store, Store], how: str
) -> None:
    holder, waiter = pair
    earlier = await holder.enqueue(KEY, "m1", "h-holder", b"x")
    later = await waiter.enqueue(KEY, "m2", "h-waiter", b"y")
    with watch(waiter) as wakeup:
        with pytest.raises(EarlierMessageFirst):
            await waiter.acquire(KEY, "h-waiter", 30, head_seq=later)
        if how == "done":
            await holder.commit(KEY, None, WriteBatch(done=[earlier]))
        elif how == "drop":
            await holder.drop_pending(KEY, [earlier])
        else:
            await holder.park(KEY, [earlier], "no")
        assert await woken(wakeup)
        await waiter.acquire(KEY, "h-waiter", 30, head_seq=later)


async def test_a_wakeup_before_the_wait_is_kept(pair: tuple[Store, Store]) -> None:
    holder, waiter = pair
    lease = await holder.acquire(KEY, "h-holder", 30)
    with watch(waiter) as wakeup:
        await refused(waiter)
        await holder.release(lease)
        assert isinstance(wakeup, HubWatch)
        await eventually(lambda: wakeup.woken)  # it arrived while no one waited
        assert await woken(wakeup)
        assert not await wakeup.wait(0.05)  # each wake-up is returned once


async def test_only_the_released_session_is_woken(pair: tuple[Store, Store]) -> None:
    holder, waiter = pair
    other = chat_key("c2")
    mine, theirs = await holder.acquire(KEY, "h-holder", 30), await holder.acquire(other, "h", 30)
    with watch(waiter) as wakeup, watch(waiter, other) as elsewhere:
        await refused(waiter)
        await refused(waiter, other)
        await holder.release(theirs)
        assert await woken(elsewhere)
        assert not await wakeup.wait(0.2)
        await holder.release(mine)
        assert await woken(wakeup)


@pytest.mark.parametrize(
    "key",
    [
        SessionKey("k" * 9000),  # longer than NOTIFY's whole payload
        SessionKey("tg:chat:'; NOTIFY x; --\"\\ ✓ 🙂\n\t"),
    ],
    ids=["long", "odd"],
)
async def test_any_key_is_woken(pair: tuple[Store, Store], key: SessionKey) -> None:
    holder, waiter = pair
    lease = await holder.acquire(key, "h-holder", 30)
    with watch(waiter, key) as wakeup:
        await refused(waiter, key)
        await holder.release(lease)
        assert await woken(wakeup)


# -- PostgreSQL: what is sent, and the listening connection -------------------------------------


async def heard(url: str, store: PostgresStore) -> tuple[Any, list[str]]:
    """A connection of its own listening on ``store``'s channel, and what it hears."""
    connection = await asyncpg.connect(parse_url(url).dsn)
    payloads: list[str] = []
    await connection.add_listener(store.listener.channel, lambda *a: payloads.append(a[3]))
    return connection, payloads


async def test_postgres_notifies_only_for_a_session_someone_waits_for(
    postgres_store_url: str,
) -> None:
    store = await PostgresStore.open(postgres_store_url)
    connection, payloads = await heard(postgres_store_url, store)
    try:
        for n in range(3):  # turns no one waits for
            seq = await store.enqueue(KEY, f"m{n}", "h1", b"x")
            lease = await store.acquire(KEY, "h1", 30, head_seq=seq)
            await store.commit_and_release(lease, WriteBatch(done=[seq], answered=[f"m{n}"]))
        lease = await store.acquire(KEY, "h1", 30)
        await refused(store)
        await refused(store)  # waiting twice marks once
        await store.release(lease)
        await store.drop_pending(KEY, [12345])  # nobody waits any more
        await connection.execute("SELECT pg_notify($1, 'end')", store.listener.channel)
        await eventually(lambda: "end" in payloads)
        assert payloads == [pg_wakeups.token(KEY), "end"]
    finally:
        await connection.close()
        await store.close()
        await forget_store(postgres_store_url)


async def test_postgres_channel_and_token_fit_the_server() -> None:
    assert pg_wakeups.channel("chatlane") == "chatlane.wakeups"
    long_schema = "s" * 63
    assert len(pg_wakeups.channel(long_schema)) <= 63
    assert pg_wakeups.channel(long_schema) != pg_wakeups.channel("t" * 63)
    assert len(pg_wakeups.token("k" * 100_000)) == 32
    assert pg_wakeups.token("a") != pg_wakeups.token("b")


async def terminate(url: str, pid: int) -> None:
    connection = await asyncpg.connect(parse_url(url).dsn)
    try:
        assert await connection.fetchval("SELECT pg_terminate_backend($1)", pid)
    finally:
        await connection.close()


async def test_postgres_listener_comes_back_after_it_is_killed(postgres_store_url: str) -> None:
    holder = await PostgresStore.open(postgres_store_url)
    waiter = await PostgresStore.open(postgres_store_url)
    listener = waiter.listener
    try:
        assert listener.listening
        assert listener.opened == 1
        pid = listener.server_pid
        assert pid is not None
        with watch(waiter) as wakeup:
            await terminate(postgres_store_url, pid)
            await eventually(lambda: listener.opened == 2 and listener.listening)
            assert listener.server_pid != pid
            assert await woken(wakeup)  # back: every waiter asks again, in case it missed one
            lease = await holder.acquire(KEY, "h-holder", 30)
            await refused(waiter)
            await holder.release(lease)
            assert await woken(wakeup)
    finally:
        await holder.close()
        await waiter.close()
        await forget_store(postgres_store_url)


async def test_postgres_waiters_poll_while_the_listener_is_down(
    postgres_store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    holder = await PostgresStore.open(postgres_store_url)
    waiter = await PostgresStore.open(postgres_store_url)
    listener = waiter.listener
    attempts: list[int] = []
    reconnect = pg_wakeups.connect

    async def refused_connect(*args: Any, **kwargs: Any) -> Any:
        attempts.append(1)
        raise OSError("no route to host")

    try:
        monkeypatch.setattr(pg_wakeups, "connect", refused_connect)
        pid = listener.server_pid
        assert pid is not None
        with watch(waiter) as wakeup:
            await terminate(postgres_store_url, pid)
            await eventually(lambda: len(attempts) >= 2)
            assert not listener.listening
            assert not wakeup.listening
            lease = await holder.acquire(KEY, "h-holder", 30)
            await refused(waiter)
            await holder.release(lease)
            assert not await wakeup.wait(0.3)  # unheard: the waiter's poll delay is all it has
            await waiter.acquire(KEY, "h-waiter", 30)  # the store works without its listener
            monkeypatch.setattr(pg_wakeups, "connect", reconnect)
            await eventually(lambda: listener.listening)
            assert listener.opened == 2
    finally:
        await holder.close()
        await waiter.close()
        await forget_store(postgres_store_url)


async def test_postgres_close_closes_the_listener(postgres_store_url: str) -> None:
    store = await PostgresStore.open(postgres_store_url)
    try:
        pid = store.listener.server_pid
        with watch(store) as wakeup:
            await store.close()
            assert not store.listener.listening
            assert await woken(wakeup)  # a waiter finds out at once that the store is gone
        connection = await asyncpg.connect(parse_url(postgres_store_url).dsn)
        try:
            await until_gone(connection, pid)
        finally:
            await connection.close()
    finally:
        await store.close()
        await forget_store(postgres_store_url)


async def until_gone(connection: Any, pid: int | None) -> None:
    async def gone() -> bool:
        query = "SELECT 1 FROM pg_stat_activity WHERE pid = $1"
        return not await connection.fetchval(query, pid)

    await eventually(gone)
