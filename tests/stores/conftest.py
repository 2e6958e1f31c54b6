"""One fixture, ``store``, parametrized over every backend; the contract suite uses only it.

The ``clock`` fixture is the time that store reads: tests move it on with
:meth:`StoreClock.advance` instead of sleeping past a TTL.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import sqlite3
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from chatlane.stores import MemoryStore, Store, open_store
from chatlane.stores.sqlite import SQLiteStore

BACKENDS = ["memory", "sqlite", "redis", "redis-py", "postgres"]
"""``redis-py``: the Redis store over a redis-py client (``RedisStore.from_client``)."""

REDIS_PY = "redis-py+"
"""How a test URL asks for the Redis store over a redis-py client instead of its own."""

Reopen = Callable[[], Awaitable[Store]]


def _url(kind: str, tmp_path: Path, server: str | None) -> str:
    if kind == "memory":
        return "memory://"
    if kind == "sqlite":
        return f"sqlite:///{tmp_path / 'chatlane.db'}"
    assert server is not None
    if kind == "postgres":
        return own_schema(server, "test")
    separator = "&" if "?" in server else "?"
    url = f"{server}{separator}prefix=test-{secrets.token_hex(6)}"
    return REDIS_PY + url if kind == "redis-py" else url


def own_schema(server: str, purpose: str) -> str:
    """A store URL on ``server`` in a schema of its own (dropped by :func:`forget_store`)."""
    separator = "&" if "?" in server else "?"
    return f"{server}{separator}schema={purpose}_{secrets.token_hex(6)}"


@pytest.fixture(params=BACKENDS)
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    kind: str = request.param
    servers = {"redis": "redis_url", "redis-py": "redis_url", "postgres": "postgres_url"}
    server = request.getfixturevalue(servers[kind]) if kind in servers else None
    return _url(kind, tmp_path, server)


class StoreClock:
    """The time a store under test reads, moved on by the test.

    The memory and SQLite stores read this clock, which stands still except
    for a microsecond per read (so two events are never at one instant, as
    with the wall clock) and jumps on :meth:`advance`. The Redis and
    PostgreSQL stores read their server's clock (``TIME``,
    ``clock_timestamp()``), which no test can move: for them, :meth:`advance`
    really waits, so their tests keep short TTLs.
    """

    TICK = 1e-6

    def __init__(self, *, real: bool) -> None:
        self.real = real
        self._now = time.time()

    def __call__(self) -> float:
        if self.real:
            return time.time()
        self._now += self.TICK
        return self._now

    async def advance(self, seconds: float) -> None:
        """Let ``seconds`` pass for the store: at once, or (Redis, PostgreSQL) by waiting."""
        if self.real:
            await asyncio.sleep(seconds)
        else:
            self._now += seconds


@pytest.fixture
def clock(store_url: str) -> StoreClock:
    return StoreClock(real=store_url.startswith(("redis", "postgres")))


async def open_with_clock(url: str, clock: StoreClock) -> Store:
    """Open the store ``url`` names, reading ``clock`` where the backend takes one."""
    if url.startswith("memory://"):
        return MemoryStore(url, clock=clock)
    if url.startswith("sqlite://"):
        return await SQLiteStore.open(url, clock=clock)
    if url.startswith(REDIS_PY):
        return await redis_py_store(url.removeprefix(REDIS_PY))
    return await open_store(url)


async def redis_py_store(url: str) -> Store:
    """The Redis store over a redis-py client of ``url``'s server (closed with the store)."""
    import redis.asyncio as aioredis

    from chatlane.stores.redis import RedisStore

    base, _, query = url.partition("?")
    prefix = dict(p.split("=", 1) for p in query.split("&"))["prefix"]
    client = aioredis.Redis.from_url(base)
    return await RedisStore.from_client(client, prefix=prefix, close_client=True)


@pytest.fixture
async def store(store_url: str, clock: StoreClock) -> AsyncIterator[Store]:
    opened = await open_with_clock(store_url, clock)
    yield opened
    await opened.close()
    await forget_store(store_url)


async def forget_store(url: str) -> None:
    """Delete a test's data on a shared server: its Redis prefix, or its PostgreSQL schema."""
    if url.startswith("postgres"):
        await forget_postgres_schema(url)
    else:
        await forget_redis_prefix(url)


async def forget_postgres_schema(url: str) -> None:
    """Drop a test's PostgreSQL schema (only its own: the server may be shared)."""
    import asyncpg

    from chatlane.stores.postgres.url import parse_url

    location = parse_url(url)
    connection = await asyncpg.connect(location.dsn)
    try:
        await connection.execute(f'DROP SCHEMA IF EXISTS "{location.schema}" CASCADE')
    finally:
        await connection.close()


async def forget_redis_prefix(url: str) -> None:
    """Delete a test's Redis keys (only its own prefix: the server may be shared)."""
    if not url.startswith("redis") or "prefix=" not in url:
        return
    import redis.asyncio as aioredis

    base, _, query = url.removeprefix(REDIS_PY).partition("?")
    prefix = dict(p.split("=", 1) for p in query.split("&"))["prefix"]
    client = aioredis.Redis.from_url(base)
    try:
        async for name in client.scan_iter(match=f"{prefix}:*", count=500):
            await client.unlink(name)
    finally:
        await client.aclose()


async def stored_answered_ids(store: Store) -> list[str]:
    """Every answered mark the backend still keeps, oldest first (read from its own storage)."""
    from chatlane.stores.postgres import PostgresStore
    from chatlane.stores.redis import RedisStore

    if isinstance(store, MemoryStore):
        return list(store._answered)
    if isinstance(store, PostgresStore):
        rows = await store._fetch("SELECT message_id FROM answered ORDER BY at")
        return [row[0] for row in rows]
    if isinstance(store, SQLiteStore):
        with contextlib.closing(sqlite3.connect(store.location.path)) as db:
            rows = db.execute("SELECT message_id FROM answered ORDER BY at").fetchall()
        return [row[0] for row in rows]
    assert isinstance(store, RedisStore)
    names = await store._command("ZRANGE", store._keys.one("answered_at"), 0, -1)
    return [name.decode() for name in names]


async def stored_liveness(store: Store) -> tuple[list[str], list[str]]:
    """The heartbeats and leases the backend still keeps (read from its own storage), sorted."""
    from chatlane.stores.postgres import PostgresStore
    from chatlane.stores.redis import RedisStore

    if isinstance(store, MemoryStore):
        leases = [key for key, s in store._sessions.items() if s.lease is not None]
        return sorted(store._heartbeats), sorted(leases)
    if isinstance(store, PostgresStore):
        beats = [row[0] for row in await store._fetch("SELECT holder FROM heartbeats")]
        leases = [row[0] for row in await store._fetch("SELECT key FROM leases")]
        return sorted(beats), sorted(leases)
    if isinstance(store, SQLiteStore):
        with contextlib.closing(sqlite3.connect(store.location.path)) as db:
            beats = [row[0] for row in db.execute("SELECT holder FROM heartbeats")]
            leases = [row[0] for row in db.execute("SELECT key FROM leases")]
        return sorted(beats), sorted(leases)
    assert isinstance(store, RedisStore)
    prefix = store._keys.prefix
    beats = await store._command("KEYS", f"{prefix}:hb:*")
    leases = await store._command("KEYS", f"{prefix}:s:*:lease")
    return (
        sorted(name.decode().split("{")[1].rstrip("}") for name in beats),
        sorted(name.decode().split("{")[1].split("}")[0] for name in leases),
    )


@pytest.fixture
async def reopen(store_url: str, clock: StoreClock) -> AsyncIterator[Reopen]:
    """Open the same store again, as a restarted process (or a second one) would."""
    if store_url.startswith("memory://"):
        pytest.skip("the memory store lives and dies with its process")
    opened: list[Store] = []

    async def _open() -> Store:
        opened.append(await open_with_clock(store_url, clock))
        return opened[-1]

    yield _open
    for each in opened:
        await each.close()
