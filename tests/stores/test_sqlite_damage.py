"""A damaged SQLite store is refused or reported, never mistaken for a fresh start."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from chatlane.errors import StoreDamaged, StoreError
from chatlane.identity import SessionKey
from chatlane.stores import TranscriptEntry, open_store
from chatlane.stores.sqlite import SQLiteStore
from chatlane.stores.sqlite_schema import MIGRATIONS, migrate
from tests.keys import chat_key

KEY = chat_key("c1")
PAGE = 4096
GARBAGE = b"\xde\xad\xbe\xef" * (PAGE // 4)


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "chatlane.db"


def url(path: Path) -> str:
    return f"sqlite:///{path}"


def wal(path: Path) -> Path:
    return Path(f"{path}-wal")


def shm(path: Path) -> Path:
    return Path(f"{path}-shm")


async def fill(path: Path, entries: int = 200, key: SessionKey = KEY) -> None:
    """Give ``key`` a generation and a transcript of ``entries`` 1 KB entries, checkpointed
    into the main file."""
    store = await open_store(url(path))
    await store.bump_generation(key)
    for _ in range(entries // 10):
        batch = [TranscriptEntry("user", "x" * 1000, 0) for _ in range(10)]
        await store.append_transcript(key, None, *batch)
    await store.close()


def damage_the_second_half(path: Path) -> None:
    """Overwrite the second half of the file (the newest transcript pages; the header and
    the tables' first pages stay intact) with bytes that are no b-tree page."""
    pages = path.stat().st_size // PAGE
    with path.open("r+b") as file:
        file.seek(pages // 2 * PAGE)
        file.write(GARBAGE * (pages - pages // 2))


def truncate(path: Path) -> None:
    path.write_bytes(b"")


def size(path: Path) -> int:
    return path.stat().st_size


def contents(path: Path) -> bytes:
    return path.read_bytes()


def write_from_elsewhere(path: Path) -> None:
    """Commit from another connection: the store's connection drops its page cache."""
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as other:
        other.execute("INSERT INTO heartbeats VALUES ('elsewhere', 0)")


CRASHER = textwrap.dedent(
    """
    import asyncio, sys
    from chatlane.stores import open_store

    async def main(url: str) -> None:
        store = await open_store(url)
        for _ in range(3):
            await store.bump_generation("main:test:dm:c1")
        print("written", flush=True)
        sys.stdin.readline()

    asyncio.run(main(sys.argv[1]))
    """
)


def killed_after_writing(path: Path) -> None:
    """A process bumps a generation three times and is killed with SIGKILL (no checkpoint)."""
    process = subprocess.Popen(
        [sys.executable, "-c", CRASHER, url(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    assert process.stdout.readline().strip() == "written"
    process.send_signal(signal.SIGKILL)
    process.communicate(timeout=30)
    assert wal(path).stat().st_size > 0
    assert shm(path).exists()


def copy_store(path: Path, directory: Path) -> Path:
    """Copy the store with its -wal and -shm files (as a crash left them) into ``directory``."""
    directory.mkdir()
    for suffix in ("", "-wal", "-shm"):
        shutil.copyfile(f"{path}{suffix}", directory / f"{path.name}{suffix}")
    return directory / path.name


async def generation_after_reopen(path: Path) -> int:
    store = await open_store(url(path))
    try:
        return await store.generation(KEY)
    finally:
        await store.close()


class TestCreation:
    async def test_a_new_main_file_alone_already_holds_the_schema_and_marker(
        self, path: Path, tmp_path: Path
    ) -> None:
        store = await open_store(url(path))
        try:
            alone = tmp_path / "copy.db"
            shutil.copyfile(path, alone)  # the main file only, as if the WAL were lost
        finally:
            await store.close()
        with contextlib.closing(sqlite3.connect(alone)) as db:
            assert db.execute("PRAGMA user_version").fetchone()[0] == len(MIGRATIONS)
            marker = db.execute("SELECT value FROM meta WHERE name = 'store'").fetchone()
        assert marker == ("chatlane",)

    def test_a_file_created_meanwhile_by_another_process_is_the_one_kept(self, path: Path) -> None:
        from chatlane.stores.sqlite_file import create_if_missing

        built: list[Path] = []

        def build_while_another_wins(temporary: Path) -> None:
            path.write_bytes(b"theirs")  # the other process links its file first
            temporary.write_bytes(b"ours")
            built.append(temporary)

        create_if_missing(path, build_while_another_wins)
        assert path.read_bytes() == b"theirs"
        assert not built[0].exists()

    async def test_an_upgraded_store_gets_the_marker(self, path: Path) -> None:
        with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as db:
            migrate(db, path, MIGRATIONS[:2])
        await (await open_store(url(path))).close()
        with contextlib.closing(sqlite3.connect(path)) as db:
            assert db.execute("SELECT value FROM meta").fetchall() == [("chatlane",)]


class TestRefusedAtOpen:
    async def test_an_empty_file_is_refused_and_left_as_it_was(self, path: Path) -> None:
        await fill(path, entries=10)
        truncate(path)
        with pytest.raises(StoreDamaged, match=r"empty \(0 bytes\)") as raised:
            await open_store(url(path))
        assert str(path) in str(raised.value)
        assert "restore the store from a backup" in str(raised.value)
        assert "move the file" in str(raised.value)
        assert size(path) == 0

    async def test_a_sqlite_file_without_the_schema_is_refused_untouched(self, path: Path) -> None:
        with contextlib.closing(sqlite3.connect(path)) as db:
            db.execute("CREATE TABLE notes (text)")
        with pytest.raises(StoreError, match="without chatlane's schema"):
            await open_store(url(path))
        with contextlib.closing(sqlite3.connect(path)) as db:
            tables = db.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall()
        assert tables == [("notes",)]

    @pytest.mark.parametrize("version", [0, 3, 5, len(MIGRATIONS), 42])
    @pytest.mark.parametrize(
        "tables",
        [
            ("CREATE TABLE notes (text)",),
            ("CREATE TABLE meta (name TEXT, value TEXT)", "INSERT INTO meta VALUES ('v', '1')"),
            ("CREATE TABLE meta (key, val)",),
        ],
    )
    async def test_another_programs_database_is_refused_unchanged(
        self, path: Path, version: int, tables: tuple[str, ...]
    ) -> None:
        """Whatever its user_version: not a newer store, not damage, and never put in WAL."""
        with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as db:
            for statement in tables:
                db.execute(statement)
            db.execute(f"PRAGMA user_version = {version}")
        before = contents(path)
        for _ in range(2):
            with pytest.raises(StoreError) as raised:
                await open_store(url(path))
            assert not isinstance(raised.value, StoreDamaged)
            assert str(raised.value) == (
                f"{str(path)!r} is not a chatlane store: a SQLite database without chatlane's "
                "schema (empty, or another program's), left as it was. A store is only created "
                "where no file exists: check the store URL, restore the store from a backup, or "
                "move the file aside to start a new store."
            )
        assert contents(path) == before
        assert not wal(path).exists()
        with contextlib.closing(sqlite3.connect(path)) as db:
            assert db.execute("PRAGMA journal_mode").fetchone() == ("delete",)

    async def test_a_damaged_page_is_refused_with_sqlites_findings(self, path: Path) -> None:
        await fill(path)
        damage_the_second_half(path)
        with pytest.raises(StoreDamaged, match="btreeInitPage") as raised:
            await open_store(url(path))
        assert "restore the store from a backup" in str(raised.value)

    @pytest.mark.parametrize("how", ["deleted", "truncated"])
    async def test_a_wal_lost_after_sigkill_is_refused(
        self, path: Path, tmp_path: Path, how: str
    ) -> None:
        killed_after_writing(path)
        intact = copy_store(path, tmp_path / "intact")
        if how == "deleted":
            wal(path).unlink()
        else:
            wal(path).write_bytes(b"")
        for _ in range(2):  # the evidence stays for the next attempt
            with pytest.raises(StoreDamaged, match="log was deleted or truncated") as raised:
                await open_store(url(path))
        assert "Put the -wal file back" in str(raised.value)
        assert await generation_after_reopen(intact) == 3  # with its WAL: recovered
        shm(path).rename(f"{path}-shm.aside")  # what the message offers, knowingly
        assert await generation_after_reopen(path) == 0

    async def test_a_wal_without_its_file_is_refused(self, path: Path) -> None:
        killed_after_writing(path)
        os.unlink(path)
        with pytest.raises(StoreDamaged, match="missing but its write-ahead log"):
            await open_store(url(path))
        assert path.name not in os.listdir(path.parent)  # no new store was created


class TestDamageWhileRunning:
    @pytest.fixture
    async def damaged(self, path: Path) -> AsyncIterator[SQLiteStore]:
        """An open store whose file then lost the middle of its transcript."""
        await fill(path)
        store = await SQLiteStore.open(url(path))
        assert store.damaged is None
        damage_the_second_half(path)
        write_from_elsewhere(path)
        yield store
        await store.close()

    async def test_a_malformed_page_is_reported_as_damage(self, damaged: SQLiteStore) -> None:
        with pytest.raises(StoreDamaged, match="database disk image is malformed") as raised:
            await damaged.transcript(KEY, limit=1000)
        assert "restore the store from a backup" in str(raised.value)
        assert damaged.damaged is not None
        assert damaged.damaged.reason == "database disk image is malformed"

    async def test_a_damaged_store_refuses_every_later_call(self, damaged: SQLiteStore) -> None:
        with pytest.raises(StoreDamaged):
            await damaged.transcript(KEY, limit=1000)
        with pytest.raises(StoreDamaged, match="malformed"):
            await damaged.generation(chat_key("other"))
        with pytest.raises(StoreDamaged, match="malformed"):
            await damaged.bump_generation(chat_key("other"))
