"""The SQLite store's file: where it is, how a connection to it is set up, and its schema.

What stays true:

* A connection is in WAL mode with ``synchronous=NORMAL`` and a busy timeout,
  and in autocommit mode: every transaction is an explicit ``BEGIN``.
* The schema version is ``PRAGMA user_version``; it equals the number of
  :data:`MIGRATIONS` applied. Missing steps are applied in order, in one
  ``BEGIN IMMEDIATE`` transaction, so two processes opening the same new file
  never both migrate it, and a failed step leaves the file as it was.
* A store file is created only where none exists, whole (see
  :mod:`chatlane.stores.sqlite_file`); an existing file is opened only if it
  is chatlane's, carrying the marker row ``meta.store = 'chatlane'`` (or, at a
  version from before the marker, chatlane's first tables), and passes
  ``quick_check``. Whether it is chatlane's is found by reading alone, before
  any setting that changes the file (WAL): another program's database is
  refused as it was, whatever its ``user_version``.
* Nothing here is called on the event loop's thread (the writer thread opens
  the connection), and every failure surfaces as
  :class:`~chatlane.errors.StoreError` naming the path
  (:class:`~chatlane.errors.StoreDamaged` for damage, saying what to do).
"""

from __future__ import annotations

import contextlib
import sqlite3
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qsl

from chatlane.errors import StoreError
from chatlane.stores.sqlite_file import (
    check_access,
    check_files,
    check_integrity,
    create_if_missing,
    damaged,
    is_damage,
)

__all__ = ["MIGRATIONS", "Location", "connect", "is_busy", "migrate", "parse_url"]

DEFAULT_BUSY_TIMEOUT_MS = 5000
MAX_BUSY_TIMEOUT_MS = 2**31 - 1
"""The longest busy timeout SQLite's setting holds (a C ``int`` of milliseconds: 24 days)."""

Migration = tuple[str, ...]
"""One schema step: SQL statements run in order (never ``executescript``, which commits)."""

_V1: Migration = (
    """CREATE TABLE sessions (
        key TEXT PRIMARY KEY,
        generation INTEGER NOT NULL DEFAULT 0,
        current_conversation TEXT NOT NULL DEFAULT ''
    ) WITHOUT ROWID""",
    """CREATE TABLE leases (
        key TEXT PRIMARY KEY,
        holder TEXT NOT NULL,
        token TEXT NOT NULL,
        generation INTEGER NOT NULL,
        expires_at REAL NOT NULL
    ) WITHOUT ROWID""",
    "CREATE INDEX leases_expires_at ON leases (expires_at)",
    """CREATE TABLE persistent (
        key TEXT NOT NULL,
        field TEXT NOT NULL,
        value TEXT NOT NULL,
        PRIMARY KEY (key, field)
    )""",
    """CREATE TABLE conversations (
        id TEXT PRIMARY KEY,
        key TEXT NOT NULL,
        started_at REAL NOT NULL,
        ended_at REAL NOT NULL DEFAULT 0,
        title TEXT NOT NULL DEFAULT ''
    )""",
    "CREATE INDEX conversations_key ON conversations (key, started_at)",
    """CREATE TABLE transcript (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        conversation_id TEXT NOT NULL,
        entry_conversation TEXT,
        role TEXT NOT NULL,
        content TEXT NOT NULL,
        generation INTEGER NOT NULL,
        message_id TEXT NOT NULL,
        created_at REAL NOT NULL
    )""",
    "CREATE INDEX transcript_conversation ON transcript (conversation_id, id)",
    """CREATE TABLE answered (
        message_id TEXT PRIMARY KEY,
        key TEXT NOT NULL,
        generation INTEGER,
        at REAL NOT NULL
    ) WITHOUT ROWID""",
    """CREATE TABLE pending (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        key TEXT NOT NULL,
        message_id TEXT NOT NULL UNIQUE,
        owner TEXT NOT NULL,
        payload BLOB NOT NULL,
        accepted_at REAL NOT NULL
    )""",
    "CREATE INDEX pending_key ON pending (key, seq)",
    """CREATE TABLE heartbeats (
        holder TEXT PRIMARY KEY,
        expires_at REAL NOT NULL
    ) WITHOUT ROWID""",
)

_V2: Migration = ("CREATE INDEX answered_at ON answered (at)",)
"""Answered marks are pruned by age (see ``Store.answered_retention``)."""

_V3: Migration = ("ALTER TABLE answered ADD COLUMN answer TEXT NOT NULL DEFAULT ''",)
"""Each answered mark keeps the text it was answered with (``Store.answer``)."""

_V4: Migration = (
    """CREATE TABLE failed (
        message_id TEXT PRIMARY KEY,
        key TEXT NOT NULL,
        seq INTEGER NOT NULL,
        owner TEXT NOT NULL,
        payload BLOB NOT NULL,
        accepted_at REAL NOT NULL,
        reason TEXT NOT NULL,
        failed_at REAL NOT NULL
    ) WITHOUT ROWID""",
    "CREATE INDEX failed_at ON failed (failed_at)",
    "CREATE INDEX pending_owner ON pending (owner)",
)
"""Messages that could not be completed are kept aside until an operator retries them;
adoption looks pending records up by owner."""

_V5: Migration = (
    "CREATE TABLE meta (name TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID",
    "INSERT INTO meta (name, value) VALUES ('store', 'chatlane')",
)
"""The marker: a file holding this row is a chatlane store (new files get it in their main file)."""

_V6: Migration = (
    """CREATE TABLE conversations_v6 (
        id TEXT PRIMARY KEY,
        key TEXT NOT NULL,
        started_at REAL NOT NULL,
        ended_at REAL NOT NULL DEFAULT 0,
        title TEXT NOT NULL DEFAULT ''
    ) WITHOUT ROWID""",
    "INSERT INTO conversations_v6 (id, key, started_at, ended_at, title) "
    "SELECT id, key, started_at, ended_at, title FROM conversations",
    "DROP TABLE conversations",
    "ALTER TABLE conversations_v6 RENAME TO conversations",
    "CREATE INDEX conversations_key ON conversations (key, started_at)",
    """CREATE TABLE answered_v6 (
        message_id TEXT PRIMARY KEY,
        at REAL NOT NULL,
        answer TEXT NOT NULL DEFAULT ''
    ) WITHOUT ROWID""",
    "INSERT INTO answered_v6 (message_id, at, answer) SELECT message_id, at, answer FROM answered",
    "DROP TABLE answered",
    "ALTER TABLE answered_v6 RENAME TO answered",
    "CREATE INDEX answered_at ON answered (at)",
)
"""Smaller and append-mostly: a conversation is stored once, by its id (no rowid and
separate id index; ids come in creation order, see ``new_conversation_id``), and an
answered mark keeps only what is read back (id, time, answer), not its key and generation."""

_V7: Migration = ("DROP INDEX pending_owner",)
"""No query looks pending records up by owner alone (adoption finds them by session), so
the index only cost a page write for every message queued and every one answered."""

_V8: Migration = (
    """CREATE TABLE deliveries (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        id TEXT NOT NULL UNIQUE,
        lane TEXT NOT NULL,
        target TEXT NOT NULL,
        payload BLOB NOT NULL,
        created_at REAL NOT NULL,
        state TEXT NOT NULL DEFAULT 'pending',
        attempts INTEGER NOT NULL DEFAULT 0,
        next_at REAL NOT NULL DEFAULT 0,
        claim TEXT NOT NULL DEFAULT '',
        claim_expires REAL NOT NULL DEFAULT 0,
        holder TEXT NOT NULL DEFAULT '',
        uncertain INTEGER NOT NULL DEFAULT 0,
        reason TEXT NOT NULL DEFAULT '',
        settled_at REAL NOT NULL DEFAULT 0
    )""",
    "CREATE INDEX deliveries_target ON deliveries (target, seq) WHERE state = 'pending'",
    "CREATE INDEX deliveries_lane ON deliveries (lane, target) WHERE state = 'pending'",
    "CREATE INDEX deliveries_delivered ON deliveries (settled_at) WHERE state = 'delivered'",
    "CREATE INDEX deliveries_dead ON deliveries (settled_at) WHERE state = 'dead'",
)
"""The delivery ledger (:mod:`chatlane.stores.sqlite_ledger`). Only pending deliveries are
in the claim's indexes: each target's oldest by ``seq``, and each lane's targets. Delivered
and dead ones are indexed apart, by when they were settled, for pruning and listing."""

_V9: Migration = ("ALTER TABLE transcript ADD COLUMN attachments BLOB",)
"""A transcript entry keeps the attachments its message came with (msgspec JSON, see
:mod:`chatlane.stores.codec`); NULL for none, so older rows and entries without any cost
nothing."""

_V10: Migration = ("DROP INDEX leases_expires_at",)
"""Leases are found by key; the few rows the table holds (running turns, and leases of
dead processes until pruned) are counted by a scan. The index cost two page writes a
turn (taking and giving back the lease) and one per renewal."""

_V11: Migration = (
    "ALTER TABLE transcript ADD COLUMN prev INTEGER NOT NULL DEFAULT -1",
    "ALTER TABLE conversations ADD COLUMN last_entry INTEGER NOT NULL DEFAULT 0",
    "UPDATE transcript SET prev = coalesce((SELECT max(t.id) FROM transcript t "
    "WHERE t.conversation_id = transcript.conversation_id AND t.id < transcript.id), 0)",
    "UPDATE conversations SET last_entry = coalesce((SELECT max(t.id) FROM transcript t "
    "WHERE t.conversation_id = conversations.id), 0)",
    "DROP INDEX transcript_conversation",
    """CREATE TRIGGER transcript_chained AFTER INSERT ON transcript WHEN NEW.prev >= 0 BEGIN
        UPDATE conversations SET last_entry = NEW.id WHERE id = NEW.conversation_id;
    END""",
    """CREATE TRIGGER transcript_unchained AFTER INSERT ON transcript WHEN NEW.prev < 0 BEGIN
        UPDATE transcript SET prev = coalesce((SELECT last_entry FROM conversations
            WHERE id = NEW.conversation_id), 0) WHERE id = NEW.id;
        UPDATE conversations SET last_entry = NEW.id WHERE id = NEW.conversation_id;
    END""",
)
"""A conversation's entries are chained, newest first, instead of indexed: each entry
names the one before it (``prev``), the conversation its newest (``last_entry``, moved on
by a trigger). An entry appended without ``prev`` (-1: by a process of an earlier version
still running beside the one that migrated) is chained by the other trigger. The index on
``(conversation_id, id)`` took a page write at a place of its own for every entry —
where that conversation's entries end, so with many conversations running, a different
page each time — and those pages were most of what a checkpoint copied. The
conversation's row is written instead; conversations started about the same time share
its pages (ids come in creation order)."""

_V12: Migration = (
    "ALTER TABLE answered ADD COLUMN key TEXT NOT NULL DEFAULT ''",
    "ALTER TABLE answered ADD COLUMN failure TEXT NOT NULL DEFAULT ''",
)
"""An answered mark keeps the session whose commit set it, and why that turn failed ("" if
it was answered): a message id another session used is told apart, and a failed turn ends
failed in every process (``Store.mark``). Marks set before, or by a process of an earlier
version, hold "" for both: taken as the asking session's, and as answered."""

MIGRATIONS: tuple[Migration, ...] = (
    *(_V1, _V2, _V3, _V4, _V5, _V6, _V7, _V8, _V9, _V10, _V11),
    _V12,
)
"""Every schema step ever shipped, oldest first; append, never edit a shipped step.

``transcript.entry_conversation`` is NULL unless an entry named another
conversation than the one it was appended to (it is returned as written).
``transcript.prev`` is the id of the entry appended to the same conversation just
before it (0 for its first), and ``conversations.last_entry`` the id of its newest entry
(0: none). The statement that appends (``_APPEND`` in
:mod:`chatlane.stores.sqlite_conversations`) sets the first and the
``transcript_chained`` trigger the second; an entry appended without ``prev`` gets
both from ``transcript_unchained``. Entries are never deleted: a step that deletes
some must mend the chains it cuts.
"""


@dataclass(frozen=True, slots=True)
class Location:
    """Where a SQLite store lives: the file (as written in the URL) and its busy timeout."""

    path: Path
    busy_timeout_ms: int = DEFAULT_BUSY_TIMEOUT_MS


def parse_url(url: str) -> Location:
    """Read ``sqlite:///relative/path.db`` or ``sqlite:////abs/path.db`` (``?busy_timeout=ms``).

    The path is taken literally (no percent-decoding), relative to the working
    directory unless it starts with ``/``.

    :raises StoreError: for any other form, or an unknown or invalid parameter.
    """
    scheme, sep, rest = url.partition("://")
    written, _, query = rest.partition("?")
    if scheme != "sqlite" or not sep or not written.startswith("/") or len(written) < 2:
        raise StoreError(f"store URL {url!r}: expected sqlite:///path/to/file.db")
    return Location(Path(written[1:]), _busy_timeout(url, query))


def _busy_timeout(url: str, query: str) -> int:
    params = dict(parse_qsl(query, keep_blank_values=True))
    unknown = sorted(set(params) - {"busy_timeout"})
    if unknown:
        raise StoreError(
            f"store URL {url!r}: unknown parameter {unknown[0]!r} (known: busy_timeout)"
        )
    value = params.get("busy_timeout", str(DEFAULT_BUSY_TIMEOUT_MS))
    digits = value.isascii() and value.isdigit() and len(value) <= 10
    if not digits or int(value) > MAX_BUSY_TIMEOUT_MS:
        shown = value if len(value) <= 20 else f"{value[:20]}…"
        raise StoreError(
            f"store URL {url!r}: busy_timeout must be a whole number of milliseconds "
            f"from 0 to {MAX_BUSY_TIMEOUT_MS}, got {shown!r}"
        )
    return int(value)


def connect(location: Location) -> sqlite3.Connection:
    """Open, check, configure and migrate the store's file, creating it only if no file is
    there (its folder must exist).

    :raises StoreDamaged: the file is empty, damaged, or lost committed writes.
    :raises StoreError: the folder is missing, the file is not a
        chatlane store (then left as it was), or its schema is newer than this version
        knows.
    """
    create_if_missing(location.path, lambda temporary: _build(temporary, location))
    check_access(location.path)
    check_files(location.path)
    connection = _open_file(location)
    try:
        _while_busy(location, lambda: _identify(connection, location.path))
        _while_busy(location, lambda: _configure(connection, location))
        _while_busy(location, lambda: check_integrity(connection, location.path))
        _while_busy(location, lambda: _upgrade(connection, location.path))
    except sqlite3.Error as error:
        connection.close()
        raise _cannot_open(location.path, error) from error
    except BaseException:
        connection.close()
        raise
    return connection


def _build(temporary: Path, location: Location) -> None:
    """Fill a new file with the whole schema and marker, checkpointed into the file itself."""
    with contextlib.closing(sqlite3.connect(temporary, isolation_level=None)) as connection:
        _configure(connection, location)
        migrate(connection, location.path)
        connection.execute("PRAGMA wal_checkpoint(TRUNCATE)")


def _open_file(location: Location) -> sqlite3.Connection:
    timeout = location.busy_timeout_ms / 1000
    try:
        # Used by one thread at a time, not always the one that opened it (the
        # writer's lock sees to that): see chatlane.stores.sqlite_writer.
        return sqlite3.connect(
            location.path, timeout=timeout, isolation_level=None, check_same_thread=False
        )
    except sqlite3.Error as error:
        raise _cannot_open(location.path, error) from error


def _while_busy(location: Location, action: Callable[[], object]) -> None:
    """Run ``action``, retrying for up to the busy timeout while the file is locked.

    SQLite returns "database is locked" without waiting in a few cases (switching
    a new file to WAL while another process sets it up, recovery), so opening
    waits for those here, on the writer thread.
    """
    deadline = time.monotonic() + location.busy_timeout_ms / 1000
    while True:
        try:
            action()
            return
        except sqlite3.OperationalError as error:
            if not is_busy(error) or time.monotonic() >= deadline:
                raise
        time.sleep(0.01)


def is_busy(error: sqlite3.OperationalError) -> bool:
    """Whether ``error`` is SQLite saying another connection holds the lock it needs."""
    code: int = getattr(error, "sqlite_errorcode", 0)
    return code & 0xFF in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)


def _cannot_open(path: Path, error: sqlite3.Error) -> StoreError:
    if is_damage(error):
        return damaged(path, str(error))
    return StoreError(f"cannot open SQLite store {str(path)!r}: {error}")


_TABLES = "SELECT name FROM sqlite_master WHERE type = 'table'"
_MARKED_FROM = MIGRATIONS.index(_V5) + 1
"""The first version whose files carry the marker."""
_FIRST_TABLES = frozenset(
    {"sessions", "leases", "persistent", "conversations", "transcript", "answered"}
    | {"pending", "heartbeats"}
)
"""The tables of step 1: how a file from before the marker is known as chatlane's."""


def _identify(connection: sqlite3.Connection, path: Path) -> None:
    """Refuse, by reading alone, a file that is not a chatlane store, or is one of a newer
    chatlane.

    A file is chatlane's if it carries the marker, or if its version is from before the
    marker (step 5) and it holds the tables of step 1. A file without tables says nothing
    of whose it is: only a version newer than this chatlane knows is taken at its word.

    :raises StoreError: naming the path, the file left as it was.
    """
    connection.execute("BEGIN")  # one snapshot for the three reads; takes no write lock
    try:
        version: int = connection.execute("PRAGMA user_version").fetchone()[0]
        tables = {row[0] for row in connection.execute(_TABLES)}
        marked = _marked(connection)
    finally:
        if connection.in_transaction:
            connection.execute("ROLLBACK")
    if version > len(MIGRATIONS) and (marked or not tables):
        raise StoreError(
            f"SQLite store {str(path)!r} has schema version {version}, newer than this "
            f"chatlane knows ({len(MIGRATIONS)}); upgrade chatlane to open it"
        )
    if marked or (0 < version < _MARKED_FROM and tables >= _FIRST_TABLES):
        return
    raise StoreError(
        f"{str(path)!r} is not a chatlane store: a SQLite database without chatlane's schema "
        "(empty, or another program's), left as it was. A store is only created where no "
        "file exists: check the store URL, restore the store from a backup, or move the "
        "file aside to start a new store."
    )


def _marked(connection: sqlite3.Connection) -> bool:
    """Whether the file holds the marker row (another program's ``meta`` may be otherwise)."""
    columns = {row[1] for row in connection.execute("PRAGMA table_info(meta)")}
    if not {"name", "value"} <= columns:
        return False
    marker = connection.execute("SELECT value FROM meta WHERE name = 'store'").fetchone()
    return marker is not None and marker[0] == "chatlane"


def _upgrade(connection: sqlite3.Connection, path: Path) -> None:
    """Migrate a store :func:`_identify` found to be chatlane's and not newer.

    Applied steps are checkpointed into the main file at once. A store already at
    this version is only read: opening it never waits for the write lock, which
    another process's writes may hold without pause.
    """
    version: int = connection.execute("PRAGMA user_version").fetchone()[0]
    if version != len(MIGRATIONS) and migrate(connection, path) > version:
        connection.execute("PRAGMA wal_checkpoint(PASSIVE)")


def _configure(connection: sqlite3.Connection, location: Location) -> None:
    connection.execute(f"PRAGMA busy_timeout = {location.busy_timeout_ms:d}")
    mode = connection.execute("PRAGMA journal_mode = WAL").fetchone()[0]
    if mode != "wal":
        raise StoreError(f"SQLite store {str(location.path)!r}: cannot use WAL (got {mode!r})")
    connection.execute("PRAGMA synchronous = NORMAL")


def migrate(
    connection: sqlite3.Connection, path: Path, steps: Sequence[Migration] = MIGRATIONS
) -> int:
    """Bring the schema to ``len(steps)`` in one transaction and return that version.

    :raises StoreError: the file's version is newer than ``steps`` know, or a step failed
        (then nothing of the migration is kept).
    """
    connection.execute("BEGIN IMMEDIATE")
    try:
        _apply(connection, path, steps)
        connection.execute("COMMIT")
    except BaseException:
        if connection.in_transaction:
            connection.execute("ROLLBACK")
        raise
    return len(steps)


def _apply(connection: sqlite3.Connection, path: Path, steps: Sequence[Migration]) -> None:
    version: int = connection.execute("PRAGMA user_version").fetchone()[0]
    if version > len(steps):
        raise StoreError(
            f"SQLite store {str(path)!r} has schema version {version}, newer than this "
            f"chatlane knows ({len(steps)}); upgrade chatlane to open it"
        )
    for number, step in enumerate(steps[version:], start=version + 1):
        try:
            for statement in step:
                connection.execute(statement)
        except sqlite3.Error as error:
            raise StoreError(
                f"SQLite store {str(path)!r}: migration {number} failed: {error}"
            ) from error
    if version < len(steps):
        connection.execute(f"PRAGMA user_version = {len(steps):d}")
