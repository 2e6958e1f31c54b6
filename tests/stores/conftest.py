"""One fixture, ``store``, parametrized over every backend; the contract suite uses only it."""

from __future__ import annotations

import contextlib
import secrets
import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from chatlane.stores import Store, open_store

BACKENDS = ["memory", "sqlite", "redis"]

Reopen = Callable[[], Awaitable[Store]]


def _url(kind: str, tmp_path: Path, redis_base: str | None) -> str:
    if kind == "memory":
        return "memory://"
    if kind == "sqlite":
        return f"sqlite:///{tmp_path / 'chatlane.db'}"
    assert redis_base is not None
    separator = "&" if "?" in redis_base else "?"
    return f"{redis_base}{separator}prefix=test-{secrets.token_hex(6)}"


@pytest.fixture(params=BACKENDS)
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    kind: str = request.param
    redis_base = request.getfixturevalue("redis_url") if kind == "redis" else None
    return _url(kind, tmp_path, redis_base)


@pytest.fixture
async def store(store_url: str) -> AsyncIterator[Store]:
    opened = await open_store(store_url)
    yield opened
    await opened.close()
    await forget_redis_prefix(store_url)


async def forget_redis_prefix(url: str) -> None:
    """Delete a test's Redis keys (only its own prefix: the server may be shared)."""
    if not url.startswith("redis") or "prefix=" not in url:
        return
    import redis.asyncio as aioredis

    base, _, query = url.partition("?")
    prefix = dict(p.split("=", 1) for p in query.split("&"))["prefix"]
    client = aioredis.Redis.from_url(base)
    try:
        async for name in client.scan_iter(match=f"{prefix}:*", count=500):
            await client.unlink(name)
    finally:
        await client.aclose()


async def stored_answered_ids(store: Store) -> list[str]:
    """Every answered mark the backend still keeps, oldest first (read from its own storage)."""
    from chatlane.stores.memory import MemoryStore
    from chatlane.stores.redis import RedisStore
    from chatlane.stores.sqlite import SQLiteStore

    if isinstance(store, MemoryStore):
        return list(store._answered)
    if isinstance(store, SQLiteStore):
        with contextlib.closing(sqlite3.connect(store.location.path)) as db:
            rows = db.execute("SELECT message_id FROM answered ORDER BY at").fetchall()
        return [row[0] for row in rows]
    assert isinstance(store, RedisStore)
    names = await store._command("ZRANGE", store._keys.one("answered_at"), 0, -1)
    return [name.decode() for name in names]


async def stored_liveness(store: Store) -> tuple[list[str], list[str]]:
    """The heartbeats and leases the backend still keeps (read from its own storage), sorted."""
    from chatlane.stores.memory import MemoryStore
    from chatlane.stores.redis import RedisStore
    from chatlane.stores.sqlite import SQLiteStore

    if isinstance(store, MemoryStore):
        leases = [key for key, s in store._sessions.items() if s.lease is not None]
        return sorted(store._heartbeats), sorted(leases)
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
async def reopen(store_url: str) -> AsyncIterator[Reopen]:
    """Open the same store again, as a restarted process (or a second one) would."""
    if store_url.startswith("memory://"):
        pytest.skip("the memory store lives and dies with its process")
    opened: list[Store] = []

    async def _open() -> Store:
        opened.append(await open_store(store_url))
        return opened[-1]

    yield _open
    for each in opened:
        await each.close()
