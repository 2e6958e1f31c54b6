"""The PostgreSQL store's durable queue: accepted messages and the ones set aside as failed.

Each function runs inside one of the store's transactions. What stays true:

* ``seq`` comes from the ``pending`` table's identity sequence: it grows in
  the order the store accepted messages (a session's messages are queued under
  its lock) and is never reused, even after deletes and restarts; a failed
  message keeps its ``seq`` and gets it back when retried.
* Enqueueing is idempotent per message id.
* Adopting is one ``UPDATE`` per call, so of two adopters each record goes to
  one: the row lock orders them, and the second finds the record no longer
  owned by a dead process.
"""

from __future__ import annotations

from collections.abc import Sequence

from chatlane.errors import MessageIdInUse
from chatlane.stores.base import FailedRecord, PendingRecord
from chatlane.stores.postgres.db import Db, Row
from chatlane.stores.postgres.leases import WAKE
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

_RECORD = "key, seq, message_id, owner, payload, accepted_at"


def _pending_record(row: Row) -> PendingRecord:
    """A row of :data:`_RECORD` (the key was stored from one)."""
    key, seq, message_id, owner, payload, accepted_at = row[:6]
    return PendingRecord(SessionKey(key), int(seq), message_id, owner, bytes(payload), accepted_at)


_DROP = f"""WITH dropped AS (DELETE FROM pending WHERE key = $1 AND seq = ANY($2) RETURNING 1)
{WAKE.format(condition="AND EXISTS (SELECT 1 FROM dropped)", channel="$3", token="$4")}"""


async def drop(db: Db, key: SessionKey, seqs: Sequence[int], notice: tuple[str, str]) -> None:
    """Remove ``key``'s records ``seqs`` (those already gone are no error), waking its waiters.

    :param notice: the store's channel and the session's token on it.
    """
    await db.execute(_DROP, key, list(seqs), *notice)


_DROP_OWN = f"""WITH dropped AS (
DELETE FROM pending WHERE key = $1 AND seq = ANY($2) AND owner = $5 RETURNING seq),
woken AS ({WAKE.format(condition="AND EXISTS (SELECT 1 FROM dropped)", channel="$3", token="$4")})
SELECT seq FROM dropped ORDER BY seq"""


async def drop_own(
    db: Db, key: SessionKey, seqs: Sequence[int], owner: str, notice: tuple[str, str]
) -> list[int]:
    """Remove those of ``key``'s records ``seqs`` that ``owner`` still owns, waking its
    waiters if any went; their seqs."""
    rows = await db.fetch(_DROP_OWN, key, list(seqs), *notice, owner)
    return [int(row[0]) for row in rows]


async def enqueue(
    db: Db,
    moment: float,
    key: SessionKey,
    message_id: str,
    owner: str,
    payload: bytes,
    wanted: int = 0,
) -> int:
    """Queue a message and return its ``seq``: the one it has if it is queued already.

    Given a ``seq`` it had before (``wanted``), a message no longer queued goes back under it.
    """
    if wanted:
        return await _enqueue_under(db, moment, key, (message_id, owner, payload), wanted)
    seq = await db.fetchval(
        "INSERT INTO pending (key, message_id, owner, payload, accepted_at) "
        "VALUES ($1, $2, $3, $4, $5) ON CONFLICT (message_id) DO NOTHING RETURNING seq",
        key,
        message_id,
        owner,
        payload,
        moment,
    )
    if seq is None:  # queued already: nothing was written
        return await _queued_seq(db, key, message_id)
    return int(seq)


async def _queued_seq(db: Db, key: SessionKey, message_id: str) -> int:
    """The seq ``message_id`` is queued under, in ``key``'s queue.

    :raises MessageIdInUse: it is queued in another session's.
    """
    row = await db.fetchrow("SELECT seq, key FROM pending WHERE message_id = $1", message_id)
    if row is None or row[1] != key:
        raise MessageIdInUse(message_id, key=key)
    return int(row[0])


async def _enqueue_under(
    db: Db, moment: float, key: SessionKey, message: tuple[str, str, bytes], seq: int
) -> int:
    """:func:`enqueue` under ``seq`` (never on a turn's path)."""
    message_id, owner, payload = message
    written = await db.fetchval(
        "INSERT INTO pending (seq, key, message_id, owner, payload, accepted_at) "
        "VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (message_id) DO NOTHING RETURNING seq",
        seq,
        key,
        message_id,
        owner,
        payload,
        moment,
    )
    if written is None:  # queued already, under the seq it has
        return await _queued_seq(db, key, message_id)
    return int(written)


async def pending(db: Db, key: SessionKey) -> list[PendingRecord]:
    rows = await db.fetch(f"SELECT {_RECORD} FROM pending WHERE key = $1 ORDER BY seq", key)
    return [_pending_record(row) for row in rows]


async def pending_keys(db: Db) -> list[SessionKey]:
    rows = await db.fetch("SELECT DISTINCT key FROM pending ORDER BY key")
    return [SessionKey(row[0]) for row in rows]


async def adopt(
    db: Db,
    key: SessionKey,
    seqs: Sequence[int],
    old_owner: str,
    new_owner: str,
    generation: int | None = None,
) -> list[int]:
    """The seqs of ``key`` that became ``new_owner``'s; none unless the session's generation
    is ``generation`` (when given), read in the same statement."""
    rows = await db.fetch(
        "UPDATE pending SET owner = $1 WHERE key = $2 AND seq = ANY($3) AND owner = $4 "
        "AND ($5::bigint IS NULL OR $5::bigint = "
        "(SELECT COALESCE(MAX(generation), 0) FROM sessions WHERE key = $2)) "
        "RETURNING seq",
        new_owner,
        key,
        list(seqs),
        old_owner,
        generation,
    )
    return sorted(int(row[0]) for row in rows)


_ORPHANED = """SELECT DISTINCT p.key FROM pending p LEFT JOIN heartbeats h ON h.holder = p.owner
WHERE p.owner <> $1 AND (h.expires_at IS NULL OR h.expires_at <= $2)
ORDER BY p.key LIMIT $3"""

_ORPHAN_RECORDS = f"""SELECT key, seq, owner FROM pending
WHERE key IN ({_ORPHANED}) AND owner <> $1
    AND owner NOT IN (SELECT holder FROM heartbeats WHERE expires_at > $2)
ORDER BY key, seq"""

_ADOPT_RECORDS = """UPDATE pending p SET owner = $1
FROM unnest($2::text[], $3::bigint[], $4::text[]) AS c (key, seq, owner)
WHERE p.key = c.key AND p.seq = c.seq AND p.owner = c.owner
    AND p.owner NOT IN (SELECT holder FROM heartbeats WHERE expires_at > $5)
RETURNING p.key, p.seq, p.message_id, p.owner, p.payload, p.accepted_at"""

Orphan = tuple[SessionKey, int, str]
"""An orphaned record: its session, ``seq`` and (dead) owner."""


async def orphans(db: Db, moment: float, holder: str, limit: int) -> list[Orphan]:
    """The records of up to ``limit`` sessions whose owners' heartbeats are gone, by session."""
    rows = await db.fetch(_ORPHAN_RECORDS, holder, moment, max(limit, 0))
    return [(SessionKey(row[0]), int(row[1]), row[2]) for row in rows]


async def adopt_orphans(
    db: Db, moment: float, holder: str, found: Sequence[Orphan]
) -> list[PendingRecord]:
    """Make ``found`` ``holder``'s, each only from the owner it was found with and while
    that owner's heartbeat is still gone; return those adopted, by session, in order."""
    keys, seqs, owners = (list(column) for column in zip(*found, strict=True))
    rows = await db.fetch(_ADOPT_RECORDS, holder, keys, seqs, owners, moment)
    return sorted((_pending_record(row) for row in rows), key=lambda r: (r.key, r.seq))


async def park(
    db: Db,
    moment: float,
    key: SessionKey,
    seqs: Sequence[int],
    reason: str,
    notice: tuple[str, str],
) -> None:
    await db.execute(
        "INSERT INTO failed (message_id, key, seq, owner, payload, accepted_at, reason, "
        "failed_at) SELECT message_id, key, seq, owner, payload, accepted_at, $3, $4 "
        "FROM pending WHERE key = $1 AND seq = ANY($2) "
        "ON CONFLICT (message_id) DO UPDATE SET key = excluded.key, seq = excluded.seq, "
        "owner = excluded.owner, payload = excluded.payload, accepted_at = excluded.accepted_at, "
        "reason = excluded.reason, failed_at = excluded.failed_at",
        key,
        list(seqs),
        reason,
        moment,
    )
    await drop(db, key, seqs, notice)


async def failed(db: Db, limit: int) -> list[FailedRecord]:
    rows = await db.fetch(
        f"SELECT {_RECORD}, reason, failed_at FROM failed ORDER BY failed_at, seq LIMIT $1",
        max(limit, 0),
    )
    return [FailedRecord(_pending_record(row), row[6], row[7]) for row in rows]


async def retry_failed(db: Db, message_id: str, owner: str) -> PendingRecord | None:
    """Move a failed message back into its queue under its ``seq``, owned by ``owner``."""
    row = await db.fetchrow(
        f"DELETE FROM failed WHERE message_id = $1 RETURNING {_RECORD}", message_id
    )
    if row is None:
        return None
    key, seq, _, _, payload, accepted_at = row
    await db.execute("SELECT pg_advisory_xact_lock(hashtextextended($1, 0))", key)
    queued = await db.fetchval("SELECT key FROM pending WHERE message_id = $1", message_id)
    if queued is not None and queued != key:  # the transaction rolls back with the raise
        raise MessageIdInUse(message_id, key=SessionKey(key))
    await db.execute("DELETE FROM pending WHERE seq = $1 OR message_id = $2", seq, message_id)
    await db.execute(
        "INSERT INTO pending (seq, key, message_id, owner, payload, accepted_at) "
        "VALUES ($1, $2, $3, $4, $5, $6)",
        seq,
        key,
        message_id,
        owner,
        payload,
        accepted_at,
    )
    return PendingRecord(SessionKey(key), int(seq), message_id, owner, bytes(payload), accepted_at)
