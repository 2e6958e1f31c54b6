"""The SQLite store's durable queue: accepted messages and the ones set aside as failed.

Each function is an operation of the store's writer thread
(:mod:`chatlane.stores.sqlite_writer`): a function of the connection, run
inside the transaction of its batch, depending on the database alone. What
stays true:

* ``seq`` is the ``pending`` table's ``AUTOINCREMENT`` key: it grows in the
  order the store accepted messages and is never reused, even after deletes
  and restarts; a failed message keeps its ``seq`` and gets it back when retried.
* Enqueueing is idempotent per message id.
* Adopting is atomic per record: of two adopters, each record goes to one.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from typing import Any

from chatlane.errors import MessageIdInUse
from chatlane.stores.base import Clock, FailedRecord, PendingRecord
from chatlane.types import SessionKey

__all__ = [
    "adopt",
    "adopt_orphans",
    "drop",
    "enqueue",
    "failed",
    "park",
    "pending",
    "pending_keys",
    "retry_failed",
]


def drop(db: sqlite3.Connection, key: SessionKey, seqs: Sequence[int]) -> None:
    """Remove ``key``'s records ``seqs`` (those already gone are no error)."""
    if len(seqs) == 1:  # a turn's own message: one statement, not a batch of one
        db.execute("DELETE FROM pending WHERE key = ? AND seq = ?", (key, seqs[0]))
    else:
        db.executemany(
            "DELETE FROM pending WHERE key = ? AND seq = ?", [(key, seq) for seq in seqs]
        )


def drop_own(db: sqlite3.Connection, key: SessionKey, seqs: Sequence[int], owner: str) -> list[int]:
    """Remove those of ``key``'s records ``seqs`` that ``owner`` still owns; their seqs."""
    removed = [
        db.execute(
            "DELETE FROM pending WHERE key = ? AND seq = ? AND owner = ? RETURNING seq",
            (key, seq, owner),
        ).fetchone()
        for seq in sorted(seqs)
    ]
    return [row[0] for row in removed if row is not None]


def enqueue(
    db: sqlite3.Connection,
    clock: Clock,
    key: SessionKey,
    message_id: str,
    owner: str,
    payload: bytes,
    seq: int = 0,
) -> int:
    """Queue a message and return its ``seq``: the one it has if it is queued already.

    Given a ``seq`` (one it had before), a message no longer queued goes back under it.

    :raises MessageIdInUse: another session's queued message has that id (nothing written).
    """
    if seq:
        return _enqueue_under(db, clock, key, (message_id, owner, payload), seq)
    row = db.execute(
        "INSERT INTO pending (key, message_id, owner, payload, accepted_at) "
        "VALUES (?, ?, ?, ?, ?) ON CONFLICT (message_id) DO NOTHING RETURNING seq",
        (key, message_id, owner, payload, clock()),
    ).fetchone()
    if row is None:  # queued already: nothing was written
        return _queued_seq(db, key, message_id)
    return int(row[0])


def _queued_seq(db: sqlite3.Connection, key: SessionKey, message_id: str) -> int:
    """The seq ``message_id`` is queued under, in ``key``'s queue.

    :raises MessageIdInUse: it is queued in another session's.
    """
    row = db.execute("SELECT seq, key FROM pending WHERE message_id = ?", (message_id,)).fetchone()
    if row[1] != key:
        raise MessageIdInUse(message_id, key=key)
    return int(row[0])


def _enqueue_under(
    db: sqlite3.Connection, clock: Clock, key: SessionKey, message: tuple[str, str, bytes], seq: int
) -> int:
    """:func:`enqueue` under ``seq``: two statements, never on a turn's path."""
    message_id, owner, payload = message
    known = db.execute("SELECT 1 FROM pending WHERE message_id = ?", (message_id,)).fetchone()
    if known is not None:
        return _queued_seq(db, key, message_id)
    db.execute(
        "INSERT INTO pending (seq, key, message_id, owner, payload, accepted_at) "
        "VALUES (?, ?, ?, ?, ?, ?)",
        (seq, key, message_id, owner, payload, clock()),
    )
    return seq


def _pending_record(row: Sequence[Any]) -> PendingRecord:
    """A ``key, seq, message_id, owner, payload, accepted_at`` row (the key was stored from one)."""
    key, seq, message_id, owner, payload, accepted_at = row
    return PendingRecord(SessionKey(key), seq, message_id, owner, payload, accepted_at)


def pending(db: sqlite3.Connection, key: SessionKey) -> list[PendingRecord]:
    rows = db.execute(
        "SELECT key, seq, message_id, owner, payload, accepted_at FROM pending "
        "WHERE key = ? ORDER BY seq",
        (key,),
    ).fetchall()
    return [_pending_record(row) for row in rows]


def pending_keys(db: sqlite3.Connection) -> list[SessionKey]:
    rows = db.execute("SELECT DISTINCT key FROM pending ORDER BY key")
    return [SessionKey(row[0]) for row in rows]


def adopt(
    db: sqlite3.Connection, key: SessionKey, seqs: Sequence[int], old_owner: str, new_owner: str
) -> list[int]:
    owned = "SELECT 1 FROM pending WHERE key = ? AND seq = ? AND owner = ?"
    adopted = [seq for seq in sorted(seqs) if db.execute(owned, (key, seq, old_owner)).fetchone()]
    db.executemany(
        "UPDATE pending SET owner = ? WHERE key = ? AND seq = ?",
        [(new_owner, key, seq) for seq in adopted],
    )
    return adopted


def adopt_orphans(
    db: sqlite3.Connection, clock: Clock, holder: str, limit: int
) -> list[PendingRecord]:
    """Take the records of up to ``limit`` sessions whose owners' heartbeats are gone."""
    moment = clock()
    orphaned = (
        "SELECT DISTINCT p.key FROM pending p LEFT JOIN heartbeats h ON h.holder = p.owner "
        "WHERE p.owner != ? AND (h.expires_at IS NULL OR h.expires_at <= ?) "
        "ORDER BY p.key LIMIT ?"
    )
    keys = [SessionKey(row[0]) for row in db.execute(orphaned, (holder, moment, limit))]
    adopted: list[PendingRecord] = []
    for key in keys:
        adopted += _adopt_session(db, key, holder, moment)
    return adopted


def _adopt_session(
    db: sqlite3.Connection, key: SessionKey, holder: str, moment: float
) -> list[PendingRecord]:
    rows = db.execute(
        "UPDATE pending SET owner = ? WHERE key = ? AND owner != ? AND owner NOT IN "
        "(SELECT holder FROM heartbeats WHERE expires_at > ?) "
        "RETURNING key, seq, message_id, owner, payload, accepted_at",
        (holder, key, holder, moment),
    ).fetchall()
    return sorted((_pending_record(row) for row in rows), key=lambda r: r.seq)


def park(
    db: sqlite3.Connection, clock: Clock, key: SessionKey, seqs: Sequence[int], reason: str
) -> None:
    moment = clock()
    for seq in sorted(seqs):
        db.execute(
            "INSERT OR REPLACE INTO failed (message_id, key, seq, owner, payload, accepted_at, "
            "reason, failed_at) SELECT message_id, key, seq, owner, payload, accepted_at, ?, ? "
            "FROM pending WHERE key = ? AND seq = ?",
            (reason, moment, key, seq),
        )
    drop(db, key, seqs)


def failed(db: sqlite3.Connection, limit: int) -> list[FailedRecord]:
    rows = db.execute(
        "SELECT key, seq, message_id, owner, payload, accepted_at, reason, failed_at "
        "FROM failed ORDER BY failed_at, seq LIMIT ?",
        (max(limit, 0),),
    ).fetchall()
    return [FailedRecord(_pending_record(row[:6]), row[6], row[7]) for row in rows]


def retry_failed(db: sqlite3.Connection, message_id: str, owner: str) -> PendingRecord | None:
    row = db.execute(
        "DELETE FROM failed WHERE message_id = ? "
        "RETURNING key, seq, message_id, owner, payload, accepted_at",
        (message_id,),
    ).fetchone()
    if row is None:
        return None
    key, seq, _, _, payload, accepted_at = row
    queued = db.execute("SELECT key FROM pending WHERE message_id = ?", (message_id,)).fetchone()
    if queued is not None and queued[0] != key:  # the DELETE rolls back with the raise
        raise MessageIdInUse(message_id, key=SessionKey(key))
    record = PendingRecord(SessionKey(key), seq, message_id, owner, payload, accepted_at)
    db.execute(
        "INSERT OR REPLACE INTO pending (seq, key, message_id, owner, payload, accepted_at) "
        "VALUES (?, ?, ?, ?, ?, ?)",
        (seq, key, message_id, owner, payload, accepted_at),
    )
    return record
