"""Fixtures shared by the runtime tests."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from chatlane.stores import MemoryStore, Store, open_store
from tests.stores.conftest import forget_store


@pytest.fixture(params=["memory", "sqlite", "redis"])
async def two_stores(
    request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[tuple[Store, Store]]:
    """Two processes' stores: one memory store shared, or two clients of one SQLite
    file or one Redis server (under a prefix of this test's own)."""
    if request.param == "memory":
        shared = MemoryStore()
        yield shared, shared
        return
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'shared.db'}"
    else:
        server: str = request.getfixturevalue("redis_url")
        separator = "&" if "?" in server else "?"
        url = f"{server}{separator}prefix=redirect-{uuid.uuid4().hex[:12]}"
    first, second = await open_store(url), await open_store(url)
    try:
        yield first, second
    finally:
        await first.close()
        await second.close()
        await forget_store(url)
