"""The SQLite store's files on disk: created whole or not at all, and refused when damaged.

What stays true:

* A store file is created only where no file exists, and it appears whole:
  it is built under a temporary name (schema, marker row, checkpointed into
  the file) and then hard-linked into place, which fails if the name was
  taken meanwhile. So a file found at the store's path is always a complete
  store, even while another process is creating it, and an empty file (0
  bytes) is never a store being born: it is refused.
* ``<db>-wal`` holds commits not yet copied into ``<db>``, and the WAL index
  ``<db>-shm`` counts them (see https://www.sqlite.org/walformat.html). When
  the index counts committed frames that are in neither file, the WAL was
  deleted or truncated after a crash; the store is refused rather than
  opened at the older state (generations, the fencing tokens, would go back).
* A WAL left without its main file is refused too: SQLite would replay it
  into a new file.
* Damage SQLite reports (``SQLITE_CORRUPT``, ``SQLITE_NOTADB``) becomes
  :class:`~chatlane.errors.StoreDamaged`, whose message says what to do.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import secrets
import sqlite3
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from chatlane.errors import StoreDamaged, StoreError

__all__ = [
    "check_access",
    "check_files",
    "check_integrity",
    "create_if_missing",
    "damaged",
    "is_damage",
]

ADVICE = (
    "Stop every chatlane process using it, then restore the store from a backup, "
    "or move the file (with its -wal and -shm files) aside to start a new store "
    "(see docs/stores.md, 'Damage')."
)

_WAL_HEADER = 32
_FRAME_HEADER = 24
_INDEX_HEADER = 48
"""Bytes of one copy of the WAL index header; two copies come first in ``-shm``."""
_BACKFILL_AT = 2 * _INDEX_HEADER
"""Offset of ``nBackfill``: frames already copied into the main file."""


def wal_path(path: Path) -> Path:
    """The store's write-ahead log."""
    return Path(f"{path}-wal")


def shm_path(path: Path) -> Path:
    """The store's WAL index (shared memory)."""
    return Path(f"{path}-shm")


def damaged(path: Path, reason: str, advice: str = ADVICE) -> StoreDamaged:
    """The error for a damaged store at ``path``."""
    return StoreDamaged(f"SQLite store {str(path)!r} is damaged: {reason}. {advice}", reason)


def is_damage(error: sqlite3.Error) -> bool:
    """Whether SQLite reports damage: a malformed page, or a file that is not a database."""
    code: int = getattr(error, "sqlite_errorcode", 0)
    return code & 0xFF in (sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB)


# -- creation ------------------------------------------------------------------------


def create_if_missing(path: Path, build: Callable[[Path], None]) -> None:
    """Create the store at ``path`` with ``build`` (which fills a new file) if no file is there.

    Another process creating it at the same moment is fine: whichever links
    first wins, and the other opens that one. The folder must exist: a
    mistyped path stops the start instead of scattering stores in new folders.

    :raises StoreError: the folder is missing, the file cannot be created, or
        only a WAL is there.
    """
    folder = path.absolute().parent
    if not folder.is_dir():
        what = "is not a folder" if folder.exists() else "does not exist"
        raise StoreError(
            f"cannot create SQLite store {str(path.absolute())!r}: {str(folder)!r} {what} "
            "(chatlane creates the database file, not its folder)"
        )
    cannot = f"cannot create SQLite store {str(path.absolute())!r}"
    try:
        if os.path.lexists(path):
            return
        _refuse_orphan_wal(path)
        if not os.access(folder, os.W_OK | os.X_OK):
            raise StoreError(f"{cannot}: {_denied_in(folder)}")
        _link_new(path, build)
    except PermissionError as error:
        raise StoreError(f"{cannot}: {_denied_in(folder)}") from error
    except OSError as error:
        raise StoreError(f"{cannot}: {error}") from error


def _link_new(path: Path, build: Callable[[Path], None]) -> None:
    temporary = path.with_name(f".{path.name}.new-{secrets.token_hex(6)}")
    try:
        _create_private(temporary)
        build(temporary)
        with contextlib.suppress(FileExistsError):  # another process created it first
            os.link(temporary, path)
        _sync_directory(path.parent)
    finally:
        temporary.unlink(missing_ok=True)


def _create_private(path: Path) -> None:
    """Create ``path`` empty with mode 0600 (SQLite gives its WAL and shared memory that mode)."""
    os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))


def _sync_directory(directory: Path) -> None:
    """Make the new name durable (a crash right after creation keeps the file)."""
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _refuse_orphan_wal(path: Path) -> None:
    if _size(wal_path(path)) > 0:
        raise damaged(
            path,
            f"the file is missing but its write-ahead log {str(wal_path(path))!r} is there",
            "Put the store file back (restore it from a backup), or move the -wal and -shm "
            "files aside to start a new store.",
        )


# -- checks before and after the file is opened --------------------------------------


def check_access(path: Path) -> None:
    """Refuse, saying so, a store this process may not read and write: the file, its
    ``-wal`` and ``-shm`` files when they are there, and its folder when SQLite must make
    one of them. SQLite itself says only "unable to open database file", or opens a file
    it may not write read-only, to fail at the first write.

    :raises StoreError: "permission denied", naming what this user may not do with which
        file (or that it is on a read-only file system).
    """
    cannot = f"cannot open SQLite store {str(path.absolute())!r}"
    for file in (path, wal_path(path), shm_path(path)):
        lacking = _lacking(file) if os.path.lexists(file) else ""
        if lacking:
            raise StoreError(f"{cannot}: {_denied(file, lacking)}")
    folder = path.absolute().parent
    made = wal_path(path).exists() and shm_path(path).exists()
    if not made and not os.access(folder, os.W_OK | os.X_OK):
        raise StoreError(f"{cannot}: {_denied_in(folder)}, where SQLite keeps its -wal and -shm")


def _lacking(file: Path) -> str:
    """What this process may not do with ``file``: "read", "write", both, or nothing."""
    readable, writable = os.access(file, os.R_OK), os.access(file, os.W_OK)
    return {(False, False): "read or write", (True, False): "write", (False, True): "read"}.get(
        (readable, writable), ""
    )


def _denied(file: Path, lacking: str) -> str:
    if "write" in lacking and _read_only_file_system(file.absolute().parent):
        return f"{str(file.absolute())!r} is on a read-only file system"
    return f"permission denied: the user {_user()} may not {lacking} {str(file.absolute())!r}"


def _denied_in(folder: Path) -> str:
    if _read_only_file_system(folder):
        return f"its folder {str(folder)!r} is on a read-only file system"
    return f"permission denied: the user {_user()} may not write in its folder {str(folder)!r}"


def _read_only_file_system(folder: Path) -> bool:
    try:
        return bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def _user() -> str:
    """The name this process runs as (its number where it has no name)."""
    uid = os.geteuid()
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def check_files(path: Path) -> None:
    """Refuse an empty store file, or one whose WAL lost committed frames.

    :raises StoreDamaged: with what happened and what to do.
    """
    if not path.is_file():
        return  # a directory in the way: opening it says so
    if path.stat().st_size == 0:
        raise damaged(
            path,
            "the file is empty (0 bytes), and a store is only created where no file exists",
        )
    lost = _lost_frames(path)
    if lost:
        raise damaged(path, _lost_reason(path, lost), _LOST_ADVICE)


_LOST_ADVICE = (
    "Put the -wal file back if you still have it, or restore the store from a backup. "
    "To open the main file as it is and lose those writes, stop every chatlane process "
    "using it and move the -shm file aside (generations may go back)."
)


def _lost_reason(path: Path, frames: int) -> str:
    return (
        f"{str(shm_path(path))!r} counts {frames} committed pages that are in neither the "
        f"file nor {str(wal_path(path))!r} (the write-ahead log was deleted or truncated)"
    )


def check_integrity(connection: sqlite3.Connection, path: Path) -> None:
    """Run SQLite's ``quick_check`` (every page read once, indexes not compared to tables).

    :raises StoreDamaged: naming SQLite's first findings.
    """
    findings = [str(row[0]) for row in connection.execute("PRAGMA quick_check(3)")]
    if findings != ["ok"]:
        lines = (line for found in findings for line in found.splitlines())
        raise damaged(path, "; ".join(line for line in lines if not line.startswith("***")))


# -- the WAL index --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _WalIndex:
    page_size: int
    frames: int
    """``mxFrame``: frames of committed transactions in the WAL."""
    backfilled: int
    """``nBackfill``: of those, frames already copied into the main file."""


def _lost_frames(path: Path) -> int:
    """Committed frames neither the main file nor the WAL holds (0 when unknown).

    Two readings must agree. A WAL only shrinks or disappears after its frames
    were copied into the main file and the index said so (a checkpoint, a last
    connection closing), so a second reading, taken after the first saw the WAL
    short, sees that; frames lost for good stay lost.
    """
    return _unsaved_frames(path) and _unsaved_frames(path)


def _unsaved_frames(path: Path) -> int:
    index = _wal_index(shm_path(path))
    if index is None or index.frames <= index.backfilled:
        return 0
    needed = _WAL_HEADER + index.frames * (index.page_size + _FRAME_HEADER)
    return index.frames - index.backfilled if _size(wal_path(path)) < needed else 0


def _wal_index(shm: Path) -> _WalIndex | None:
    """The index header, or None when it is missing, uninitialised or being written."""
    try:
        with shm.open("rb") as file:
            raw = file.read(_BACKFILL_AT + 4)
    except OSError:
        return None
    if len(raw) < _BACKFILL_AT + 4 or raw[:_INDEX_HEADER] != raw[_INDEX_HEADER:_BACKFILL_AT]:
        return None
    if not raw[12]:  # isInit
        return None
    page_size, frames = struct.unpack_from("=HI", raw, 14)  # native byte order
    (backfilled,) = struct.unpack_from("=I", raw, _BACKFILL_AT)
    return _WalIndex(65536 if page_size == 1 else page_size, frames, backfilled)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0
