"""The SQLite store's files are readable by their owner only, and a store this user may not
use is refused saying so."""

from __future__ import annotations

import os
import pwd
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from chatlane.errors import StoreError
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


def user() -> str:
    return pwd.getpwuid(os.geteuid()).pw_name


def entries(folder: Path) -> list[str]:
    return sorted(os.listdir(folder))


@pytest.fixture
def deny(monkeypatch: pytest.MonkeyPatch) -> Callable[[Path, int], None]:
    """``deny(path, modes)``: access(2) answers for ``path`` as for a user without
    ``modes``, as chmod makes it (the store asks access(2); chmod takes nothing from root)."""
    denied: dict[Path, int] = {}
    real = os.access

    def access(path: Any, mode: int, **options: Any) -> bool:
        taken = denied.get(Path(path).absolute(), 0)
        return not mode & taken and real(path, mode, **options)

    monkeypatch.setattr(os, "access", access)
    return lambda path, modes: denied.__setitem__(path.absolute(), modes)


async def made(path: Path) -> Path:
    """A store at ``path``, made and closed (its -wal and -shm gone with it)."""
    store = await open_store(f"sqlite:///{path}")
    await store.close()
    return path


@pytest.mark.parametrize(
    ("modes", "lacking"), [(os.R_OK | os.W_OK, "read or write"), (os.W_OK, "write")]
)
async def test_a_store_file_this_user_may_not_use_is_refused_saying_so(
    tmp_path: Path, deny: Callable[[Path, int], None], modes: int, lacking: str
) -> None:
    path = await made(tmp_path / "chatlane.db")
    deny(path, modes)
    with pytest.raises(StoreError) as raised:
        await open_store(f"sqlite:///{path}")
    assert str(raised.value) == (
        f"cannot open SQLite store '{path}': permission denied: the user {user()} "
        f"may not {lacking} '{path}'"
    )


async def test_a_store_in_a_folder_this_user_may_not_write_is_refused_saying_so(
    tmp_path: Path, deny: Callable[[Path, int], None]
) -> None:
    path = await made(tmp_path / "chatlane.db")
    deny(tmp_path, os.W_OK)
    with pytest.raises(StoreError) as raised:
        await open_store(f"sqlite:///{path}")
    assert str(raised.value) == (
        f"cannot open SQLite store '{path}': permission denied: the user {user()} may not "
        f"write in its folder '{tmp_path}', where SQLite keeps its -wal and -shm"
    )


async def test_a_new_store_in_a_folder_this_user_may_not_write_names_the_folder(
    tmp_path: Path, deny: Callable[[Path, int], None]
) -> None:
    deny(tmp_path, os.W_OK)
    path = tmp_path / "chatlane.db"
    with pytest.raises(StoreError) as raised:
        await open_store(f"sqlite:///{path}")
    assert str(raised.value) == (
        f"cannot create SQLite store '{path}': permission denied: the user {user()} may not "
        f"write in its folder '{tmp_path}'"
    )
    assert entries(tmp_path) == []  # nor a temporary file of its own


@pytest.mark.skipif(os.geteuid() == 0, reason="chmod takes nothing from root")
async def test_a_read_only_store_file_is_refused_saying_so(tmp_path: Path) -> None:
    path = await made(tmp_path / "chatlane.db")
    path.chmod(0o400)
    with pytest.raises(StoreError, match=r"permission denied: the user \S+ may not write"):
        await open_store(f"sqlite:///{path}")
