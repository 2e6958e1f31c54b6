"""The SQLite store's files are readable by their owner only."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from chatlane.stores import open_store
from tests.keys import chat_key


@pytest.fixture
def open_umask() -> Iterator[None]:
    """The usual umask (022): files are world-readable unless created otherwise."""
    previous = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(previous)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.usefixtures("open_umask")
async def test_the_database_and_its_wal_are_created_0600(tmp_path: Path) -> None:
    path = tmp_path / "new" / "chatlane.db"
    path.parent.mkdir()  # the store makes its file, not its folder
    store = await open_store(f"sqlite:///{path}")
    try:
        await store.enqueue(chat_key("c", "web"), "m1", "owner", b"payload")
        wal, shm = Path(f"{path}-wal"), Path(f"{path}-shm")
        assert {p.name: mode(p) for p in (path, wal, shm)} == {
            p.name: 0o600 for p in (path, wal, shm)
        }
    finally:
        await store.close()
