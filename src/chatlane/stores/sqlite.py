"""The SQLite store: the embedded default, safe for several processes sharing one file.

Every call becomes an operation — a function of the connection — run by the
store's writer thread with group commit, or, for a turn's small writes
(:meth:`SQLiteStore._quick`), by the event loop itself while that thread
idles and the write lock is free (:mod:`chatlane.stores.sqlite_writer`).
The operations below (and those of the durable queue, in
:mod:`chatlane.stores.sqlite_queue`, of conversations and their transcripts,
in :mod:`chatlane.stores.sqlite_conversations`, and of the delivery ledger, in
:mod:`chatlane.stores.sqlite_ledger`) keep the store's contract inside
SQLite's transactions; a turn's fused calls are one operation each.

What stays true:

* A batch that may write runs in ``BEGIN IMMEDIATE``: it holds the file's
  write lock from its first read, so each check-and-set is atomic across
  processes (others wait up to the busy timeout; a batch the event loop runs
  waits for nothing: it goes to the writer thread). A batch of reads only runs
  in a deferred ``BEGIN`` and never blocks another process's writer.
* Every check an operation makes (generation, lease, answered ids) runs
  before its first write, in the transaction that writes.
* Lease expiry and heartbeats use the store's clock (wall-clock time,
  :data:`~chatlane.stores.base.now`, unless another is injected), read inside
  the transaction that checks them.
* An operation depends on the database alone, so the writer may run it again
  after a rollback (see :mod:`chatlane.stores.sqlite_writer`).
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from chatlane.errors import (
    ActiveSessionLimit,
    AlreadyAnswered,
    EarlierMessageFirst,
    LeaseLost,
    SessionBusy,
    StaleGeneration,
    StoreDamaged,
    StoreError,
)
from chatlane.stores import sqlite_conversations as conv
from chatlane.stores import sqlite_ledger as ledger
from chatlane.stores import sqlite_queue as pq
from chatlane.stores.base import (
    PRUNE_AFTER,
    Admission,
    AnsweredMark,
    Clock,
    Conversation,
    Delivery,
    DeliveryDraft,
    DeliveryStats,
    FailedRecord,
    Lease,
    PendingRecord,
    Settlement,
    Store,
    Taken,
    TranscriptEntry,
    WriteBatch,
    already_released,
    now,
    taken_over,
)
from chatlane.stores.codec import decode_value, detached_batch
from chatlane.stores.ids import new_token
from chatlane.stores.sqlite_schema import Location, parse_url
from chatlane.stores.sqlite_writer import MAX_BATCH, Operation, Writer, WriterStats
from chatlane.types import SessionKey

__all__ = ["MAX_BATCH", "SQLiteStore", "WriterStats"]

T = TypeVar("T")

# -- operations: each runs on the writer thread, inside its own savepoint ------------


def _scalar(db: sqlite3.Connection, sql: str, params: tuple[Any, ...]) -> Any:
    row = db.execute(sql, params).fetchone()
    return None if row is None else row[0]


def _generation(db: sqlite3.Connection, key: SessionKey) -> int:
    found = _scalar(db, "SELECT generation FROM sessions WHERE key = ?", (key,))
    return 0 if found is None else int(found)


_IN_CHUNK = 500
"""Keys per ``IN (...)`` list: far below SQLite's limit on bound parameters."""


def _generations(db: sqlite3.Connection, keys: list[SessionKey]) -> list[int]:
    found: dict[str, int] = {}
    for start in range(0, len(keys), _IN_CHUNK):
        chunk = keys[start : start + _IN_CHUNK]
        marks = ",".join("?" * len(chunk))
        query = f"SELECT key, generation FROM sessions WHERE key IN ({marks})"
        found.update(db.execute(query, chunk).fetchall())
    return [int(found.get(key, 0)) for key in keys]


def _bump(db: sqlite3.Connection, key: SessionKey) -> int:
    row = db.execute(
        "INSERT INTO sessions (key, generation) VALUES (?, 1) "
        "ON CONFLICT (key) DO UPDATE SET generation = generation + 1 RETURNING generation",
        (key,),
    ).fetchone()
    return int(row[0])


def _holder(db: sqlite3.Connection, key: SessionKey, moment: float) -> str | None:
    found = _scalar(db, "SELECT holder FROM leases WHERE key = ? AND expires_at > ?", (key, moment))
    return None if found is None else str(found)


def _active(db: sqlite3.Connection, moment: float) -> int:
    return int(_scalar(db, "SELECT count(*) FROM leases WHERE expires_at > ?", (moment,)))


_TAKE = (
    "INSERT INTO leases (key, holder, token, generation, expires_at) "
    "VALUES (?1, ?2, ?3, coalesce((SELECT generation FROM sessions WHERE key = ?1), 0) + 1, ?4) "
    "ON CONFLICT (key) DO UPDATE SET holder = excluded.holder, token = excluded.token, "
    "generation = excluded.generation, expires_at = excluded.expires_at "
    "WHERE leases.expires_at <= ?5 RETURNING generation"
)
"""Take ``key``'s lease unless a live one holds it: no row comes back (and nothing is
written) while it is busy. Its generation is the session's next one, stored just after
(:data:`_BUMP_TO`, in the same transaction, under the write lock)."""

_BUMP_TO = (
    "INSERT INTO sessions (key, generation) VALUES (?, ?) "
    "ON CONFLICT (key) DO UPDATE SET generation = excluded.generation"
)


def _acquire(
    db: sqlite3.Connection,
    clock: Clock,
    key: SessionKey,
    holder: str,
    ttl: float,
    head_seq: int | None,
    max_active: int,
    token: str = "",
) -> Lease:
    """Check that ``key`` is free and take it, in one transaction holding the write lock.

    Every refusal writes nothing: the queue and the active-session checks are reads,
    and the lease is written only where none is live (:data:`_TAKE`), before the
    session's generation is bumped. A busy session is reported as busy whichever
    check found it (the order a separate check of each would give) — unless the
    live lease carries ``token``: then it is this acquisition's, and returned.
    """
    moment, chosen = clock(), token or new_token()
    try:
        if head_seq is not None or max_active:
            _check_turn(db, key, holder, head_seq, max_active, moment)
        row = db.execute(_TAKE, (key, holder, chosen, moment + ttl, moment)).fetchone()
        if row is None:
            raise _busy(key)
    except SessionBusy:
        own = _own_lease(db, key, token, moment) if token else None
        if own is None:
            raise
        return own
    generation: int = row[0]
    db.execute(_BUMP_TO, (key, generation))
    return Lease(key, holder, chosen, generation, moment + ttl)


def _own_lease(db: sqlite3.Connection, key: SessionKey, token: str, moment: float) -> Lease | None:
    """``key``'s live lease if it carries ``token`` (taken by an earlier try of the caller's)."""
    row = db.execute(
        "SELECT holder, generation, expires_at FROM leases "
        "WHERE key = ? AND token = ? AND expires_at > ?",
        (key, token, moment),
    ).fetchone()
    return None if row is None else Lease(key, row[0], token, row[1], row[2])


def _busy(key: SessionKey) -> SessionBusy:
    return SessionBusy(f"session {key!r} is running elsewhere", key=key)


def _check_turn(
    db: sqlite3.Connection,
    key: SessionKey,
    holder: str,
    head_seq: int | None,
    max_active: int,
    moment: float,
) -> None:
    """Refuse a turn that must wait for an earlier message or a free slot (busy comes first)."""
    earlier = "SELECT 1 FROM pending WHERE key = ? AND seq < ? AND owner != ? LIMIT 1"
    if head_seq is not None and _scalar(db, earlier, (key, head_seq, holder)):
        _refuse_if_busy(db, key, moment)
        raise EarlierMessageFirst(f"an earlier message of {key!r} runs first", key=key)
    active = _active(db, moment) if max_active else 0
    if max_active and active >= max_active:
        _refuse_if_busy(db, key, moment)
        raise ActiveSessionLimit(f"at the active session limit ({active}/{max_active})", key=key)


def _refuse_if_busy(db: sqlite3.Connection, key: SessionKey, moment: float) -> None:
    if _scalar(db, "SELECT 1 FROM leases WHERE key = ? AND expires_at > ?", (key, moment)):
        raise _busy(key)


def _renew(db: sqlite3.Connection, clock: Clock, lease: Lease, ttl: float) -> Lease:
    """One compare-and-set: only the live, unfenced holding with ``lease.token`` is extended."""
    moment = clock()
    renewed = db.execute(
        "UPDATE leases SET expires_at = ? WHERE key = ? AND token = ? AND expires_at > ? "
        "AND generation = (SELECT generation FROM sessions WHERE key = ?) AND generation = ?",
        (moment + ttl, lease.key, lease.token, moment, lease.key, lease.generation),
    ).rowcount
    if not renewed:
        raise LeaseLost(
            f"lease on {lease.key!r} (generation {lease.generation}) was lost",
            key=lease.key,
            generation=lease.generation,
        )
    return Lease(lease.key, lease.holder, lease.token, lease.generation, moment + ttl)


def _renew_many(
    db: sqlite3.Connection, clock: Clock, leases: list[Lease], ttl: float
) -> list[Lease | None]:
    """Every lease's compare-and-set in one transaction; ``None`` for each one lost."""
    renewed: list[Lease | None] = []
    for lease in leases:
        try:
            renewed.append(_renew(db, clock, lease, ttl))
        except LeaseLost:
            renewed.append(None)
    return renewed


def _release(db: sqlite3.Connection, lease: Lease) -> None:
    """Delete the lease only if it still carries ``lease.token``; otherwise say why not."""
    freed = "DELETE FROM leases WHERE key = ? AND token = ?"
    if db.execute(freed, (lease.key, lease.token)).rowcount:
        return
    held = _scalar(db, "SELECT 1 FROM leases WHERE key = ?", (lease.key,))
    if not held and _generation(db, lease.key) == lease.generation:
        raise already_released(lease)
    raise taken_over(lease)


def _commit(
    db: sqlite3.Connection,
    clock: Clock,
    key: SessionKey,
    generation: int | None,
    batch: WriteBatch,
    fields: list[tuple[str, str]],
    retention: float,
) -> None:
    """Fenced: every check runs before the first write, in the transaction that writes
    (the batch's deliveries too: a refused commit records none)."""
    row = db.execute(
        "SELECT generation, current_conversation FROM sessions WHERE key = ?", (key,)
    ).fetchone()
    current, conversation = (0, None) if row is None else (int(row[0]), row[1])
    if generation is not None and generation != current:
        raise StaleGeneration(key, generation, current, "commit")
    answered = batch.answered
    told = (batch.answer, key, batch.failure)
    if len(answered) == 1:  # a turn's own message: checked and marked in one statement
        _mark_first_answer(db, clock, answered[0], told, retention)
    elif answered:
        cutoff = clock() - retention
        repeated = [m for m in answered if _answered(db, m, cutoff)]
        if repeated:
            raise AlreadyAnswered(repeated, key=key)
        _mark_answered(db, clock, answered, told)
    conversation = conversation or conv.start(db, clock, key, "").id
    if batch.transcript:  # each statement only when it has rows: every call costs a step
        conv.append(db, clock, conversation, batch.transcript)
    if batch.title:
        conv.set_title(db, conversation, batch.title, batch.rename)
    if fields:
        _set_fields(db, key, fields)
    if batch.done:
        pq.drop(db, key, batch.done)
    if batch.deliveries:
        ledger.record(db, clock, batch.deliveries)


_SET_FIELD = (
    "INSERT INTO persistent (key, field, value) VALUES (?, ?, ?) "
    "ON CONFLICT (key, field) DO UPDATE SET value = excluded.value"
)
_MARK_ANSWERED = (
    "INSERT INTO answered (message_id, at, answer, key, failure) VALUES (?, ?, ?, ?, ?) "
    "ON CONFLICT (message_id) DO UPDATE SET at = excluded.at, answer = excluded.answer, "
    "key = excluded.key, failure = excluded.failure"  # a mark past its retention
)

Told = tuple[str, SessionKey, str]
"""What a mark keeps beside its time: the answer, the session that set it, its failure."""


def _many(db: sqlite3.Connection, sql: str, rows: Sequence[Sequence[Any]]) -> None:
    """``executemany``, or ``execute`` for one row (the common case, and cheaper)."""
    if len(rows) == 1:
        db.execute(sql, rows[0])
    else:
        db.executemany(sql, rows)


def _set_fields(db: sqlite3.Connection, key: SessionKey, fields: list[tuple[str, str]]) -> None:
    _many(db, _SET_FIELD, [(key, name, value) for name, value in fields])


def _mark_answered(
    db: sqlite3.Connection, clock: Clock, message_ids: list[str], told: Told
) -> None:
    moment = clock()
    _many(db, _MARK_ANSWERED, [(message_id, moment, *told) for message_id in message_ids])


def _mark_first_answer(
    db: sqlite3.Connection, clock: Clock, message_id: str, told: Told, retention: float
) -> None:
    """Mark ``message_id`` answered unless a mark within ``retention`` says it was already:
    then nothing is written and :class:`AlreadyAnswered` is raised."""
    moment = clock()
    marked = db.execute(
        f"{_MARK_ANSWERED} WHERE answered.at <= ?", (message_id, moment, *told, moment - retention)
    ).rowcount
    if not marked:
        raise AlreadyAnswered([message_id], key=told[1])


def _answered(db: sqlite3.Connection, message_id: str, cutoff: float) -> bool:
    sql = "SELECT 1 FROM answered WHERE message_id = ? AND at > ?"
    return bool(_scalar(db, sql, (message_id, cutoff)))


def _mark(db: sqlite3.Connection, message_id: str, cutoff: float) -> AnsweredMark | None:
    sql = "SELECT answer, key, failure FROM answered WHERE message_id = ? AND at > ?"
    row = db.execute(sql, (message_id, cutoff)).fetchone()
    return None if row is None else AnsweredMark(row[0], SessionKey(row[1]), row[2])


def _load_persistent(db: sqlite3.Connection, key: SessionKey) -> dict[str, Any]:
    rows = db.execute(
        "SELECT field, value FROM persistent WHERE key = ? ORDER BY rowid", (key,)
    ).fetchall()
    return {name: decode_value(key, name, value) for name, value in rows}


def _load_fields(db: sqlite3.Connection, key: SessionKey, names: list[str]) -> dict[str, Any]:
    marks = ", ".join("?" * len(names))
    rows = db.execute(
        f"SELECT field, value FROM persistent WHERE key = ? AND field IN ({marks}) ORDER BY rowid",
        (key, *names),
    ).fetchall()
    return {name: decode_value(key, name, value) for name, value in rows}


# -- liveness ------------------------------------------------------------------------------


def _heartbeat(
    db: sqlite3.Connection,
    clock: Clock,
    holder: str,
    ttl: float,
    retention: float,
    delivered_retention: float,
) -> None:
    """Beat for ``holder``; forget answered marks and dead deliveries past ``retention``,
    delivered ones past ``delivered_retention``, and long-dead rows."""
    moment = clock()
    db.execute(
        "INSERT INTO heartbeats (holder, expires_at) VALUES (?, ?) "
        "ON CONFLICT (holder) DO UPDATE SET expires_at = excluded.expires_at",
        (holder, moment + ttl),
    )
    db.execute("DELETE FROM answered WHERE at <= ?", (moment - retention,))
    db.execute("DELETE FROM heartbeats WHERE expires_at <= ?", (moment - PRUNE_AFTER,))
    db.execute("DELETE FROM leases WHERE expires_at <= ?", (moment - PRUNE_AFTER,))
    ledger.prune(db, moment - delivered_retention, moment - retention)


def _alive(db: sqlite3.Connection, clock: Clock, holders: Sequence[str]) -> dict[str, bool]:
    moment = clock()
    sql = "SELECT expires_at FROM heartbeats WHERE holder = ?"
    return {holder: (_scalar(db, sql, (holder,)) or 0.0) > moment for holder in holders}


# -- a turn's fused calls: each one operation, so one transaction ------------------------


def _enqueue_and_acquire(
    db: sqlite3.Connection,
    clock: Clock,
    key: SessionKey,
    message: tuple[str, str, bytes],
    ttl: float,
    max_active: int,
    with_persistent: bool,
    token: str,
) -> Admission:
    """Queue the message, then take the lease for it; a refusal is returned, the queueing kept."""
    message_id, owner, payload = message
    seq = pq.enqueue(db, clock, key, message_id, owner, payload)
    lease: Lease | None = None
    refusal: SessionBusy | None = None
    try:  # every check of _acquire runs before its first write: a refusal writes nothing
        lease = _acquire(db, clock, key, owner, ttl, seq, max_active, token)
    except SessionBusy as error:
        refusal = error
    persistent = _load_persistent(db, key) if with_persistent else None
    return Admission(seq, lease, refusal, persistent)


def _commit_and_release(
    db: sqlite3.Connection,
    clock: Clock,
    lease: Lease,
    batch: WriteBatch,
    fields: list[tuple[str, str]],
    retention: float,
) -> bool:
    """The fenced commit, then the lease's own row deleted: nothing is released if it is refused."""
    _commit(db, clock, lease.key, lease.generation, batch, fields, retention)
    freed = "DELETE FROM leases WHERE key = ? AND token = ?"
    return bool(db.execute(freed, (lease.key, lease.token)).rowcount)


class SQLiteStore(Store):
    """A :class:`~chatlane.stores.base.Store` in one SQLite file; open it with :meth:`open`."""

    def __init__(self, url: str, location: Location, *, clock: Clock = now) -> None:
        """:param clock: where the store reads the time (wall-clock seconds by default)."""
        self.url = url
        self._clock = clock
        self.location = location
        self._writer = Writer(location)
        self._closing: asyncio.Future[None] | None = None

    @classmethod
    async def open(cls, url: str, *, clock: Clock = now) -> SQLiteStore:
        """Open the file ``url`` names (creating it only if there is none) and start its
        writer thread.

        :raises StoreDamaged: the file is empty, fails SQLite's ``quick_check``, or
            lost committed writes (a deleted WAL); the message says what to do.
        :raises StoreError: a malformed URL, a file that is not a chatlane store,
            or a schema newer than this version of chatlane knows.
        """
        store = cls(url, parse_url(url), clock=clock)
        await store._writer.start()
        return store

    @property
    def stats(self) -> WriterStats:
        """Transactions and operations committed so far by this store's writer thread."""
        return self._writer.stats

    def _write(self, op: Operation[T]) -> asyncio.Future[T]:
        if self._closing is None and self._writer.damage is None:  # one hop on the hot path
            return self._writer.submit(op, True)
        return self._submit(op, writes=True)

    def _urgent(self, op: Operation[T]) -> asyncio.Future[T]:
        """A write that says this process is alive (a heartbeat, lease renewals): it runs
        before the writes already queued (see :mod:`chatlane.stores.sqlite_writer`)."""
        if self._closing is None and self._writer.damage is None:
            return self._writer.submit(op, True, urgent=True)
        return self._submit(op, writes=True)

    def _quick(self, op: Operation[T]) -> asyncio.Future[T]:
        """A small, bounded write of a turn's: the event loop may run it itself (see
        :mod:`chatlane.stores.sqlite_writer`)."""
        if self._closing is None and self._writer.damage is None:
            return self._writer.submit(op, True, quick=True)
        return self._submit(op, writes=True)

    def _read(self, op: Operation[T]) -> asyncio.Future[T]:
        if self._closing is None and self._writer.damage is None:
            return self._writer.submit(op, False)
        return self._submit(op, writes=False)

    @property
    def damaged(self) -> StoreDamaged | None:
        """The first damage SQLite reported since the store opened; every later call is refused."""
        return self._writer.damage

    def _submit(self, op: Operation[T], writes: bool) -> asyncio.Future[T]:
        if self._closing is not None:
            raise StoreError("store is closed")
        damage = self._writer.damage
        if damage is not None:
            raise StoreDamaged(str(damage), damage.reason)
        return self._writer.submit(op, writes)

    # -- generations and leases ----------------------------------------------

    async def acquire(
        self,
        key: SessionKey,
        holder: str,
        ttl: float,
        *,
        head_seq: int | None = None,
        max_active: int = 0,
        token: str = "",
    ) -> Lease:
        return await self._quick(
            lambda db: _acquire(db, self._clock, key, holder, ttl, head_seq, max_active, token)
        )

    async def renew(self, lease: Lease, ttl: float) -> Lease:
        return await self._quick(lambda db: _renew(db, self._clock, lease, ttl))

    async def renew_many(self, leases: Sequence[Lease], ttl: float) -> list[Lease | None]:
        held = list(leases)
        if not held:
            return []
        return await self._urgent(lambda db: _renew_many(db, self._clock, held, ttl))

    async def release(self, lease: Lease) -> None:
        await self._quick(lambda db: _release(db, lease))

    async def bump_generation(self, key: SessionKey) -> int:
        return await self._quick(lambda db: _bump(db, key))

    async def generation(self, key: SessionKey) -> int:
        return await self._read(lambda db: _generation(db, key))

    async def generations(self, keys: Sequence[SessionKey]) -> list[int]:
        wanted = list(keys)
        return await self._read(lambda db: _generations(db, wanted))

    async def lease_holder(self, key: SessionKey) -> str | None:
        return await self._read(lambda db: _holder(db, key, self._clock()))

    async def active_sessions(self) -> int:
        return await self._read(lambda db: _active(db, self._clock()))

    # -- fenced writes and reads -----------------------------------------------

    async def commit(self, key: SessionKey, generation: int | None, batch: WriteBatch) -> None:
        fields, frozen = detached_batch(key, batch)
        retention = self.answered_retention
        await self._quick(
            lambda db: _commit(db, self._clock, key, generation, frozen, fields, retention)
        )

    async def load_persistent(self, key: SessionKey) -> dict[str, Any]:
        return await self._read(lambda db: _load_persistent(db, key))

    async def load_fields(self, key: SessionKey, names: Sequence[str]) -> dict[str, Any]:
        wanted = list(dict.fromkeys(names))
        return await self._read(lambda db: _load_fields(db, key, wanted)) if wanted else {}

    async def transcript(
        self, key: SessionKey, conversation_id: str | None = None, limit: int = 100
    ) -> list[TranscriptEntry]:
        def op(db: sqlite3.Connection) -> list[TranscriptEntry]:
            return conv.last_entries(db, self._clock, key, conversation_id, limit)

        return await self._submit(op, writes=conversation_id is None)

    async def is_answered(self, message_id: str) -> bool:
        cutoff = self._clock() - self.answered_retention
        return await self._read(lambda db: _answered(db, message_id, cutoff))

    async def mark(self, message_id: str) -> AnsweredMark | None:
        cutoff = self._clock() - self.answered_retention
        return await self._read(lambda db: _mark(db, message_id, cutoff))

    # -- a turn's fused calls ------------------------------------------------------

    async def enqueue_and_acquire(
        self,
        key: SessionKey,
        message_id: str,
        owner: str,
        payload: bytes,
        ttl: float,
        *,
        max_active: int = 0,
        with_persistent: bool = True,
        token: str = "",
    ) -> Admission:
        message = (message_id, owner, payload)
        return await self._quick(
            lambda db: _enqueue_and_acquire(
                db, self._clock, key, message, ttl, max_active, with_persistent, token
            )
        )

    async def acquire_and_read(
        self,
        key: SessionKey,
        holder: str,
        ttl: float,
        *,
        head_seq: int | None = None,
        max_active: int = 0,
        token: str = "",
    ) -> Taken:
        def op(db: sqlite3.Connection) -> Taken:
            lease = _acquire(db, self._clock, key, holder, ttl, head_seq, max_active, token)
            return Taken(lease, _load_persistent(db, key))

        return await self._quick(op)

    async def commit_and_release(self, lease: Lease, batch: WriteBatch) -> bool:
        fields, frozen = detached_batch(lease.key, batch)
        retention = self.answered_retention
        return await self._quick(
            lambda db: _commit_and_release(db, self._clock, lease, frozen, fields, retention)
        )

    # -- conversations -----------------------------------------------------------

    async def conversation(self, key: SessionKey) -> Conversation:
        return await self._write(lambda db: conv.current(db, self._clock, key))

    async def new_conversation(self, key: SessionKey, title: str = "") -> Conversation:
        return await self._write(lambda db: conv.new_conversation(db, self._clock, key, title))

    async def resume_conversation(self, key: SessionKey, conversation_id: str) -> Conversation:
        return await self._write(lambda db: conv.resume(db, self._clock, key, conversation_id))

    async def conversations(self, key: SessionKey, limit: int = 20) -> list[Conversation]:
        return await self._write(lambda db: conv.conversations(db, self._clock, key, limit))

    # -- the durable pending queue -------------------------------------------------

    async def enqueue(
        self, key: SessionKey, message_id: str, owner: str, payload: bytes, *, seq: int = 0
    ) -> int:
        return await self._quick(
            lambda db: pq.enqueue(db, self._clock, key, message_id, owner, payload, seq)
        )

    async def pending(self, key: SessionKey) -> list[PendingRecord]:
        return await self._read(lambda db: pq.pending(db, key))

    async def pending_keys(self) -> list[SessionKey]:
        return await self._read(pq.pending_keys)

    async def drop_pending(self, key: SessionKey, seqs: Sequence[int]) -> None:
        dropped = list(seqs)
        await self._quick(lambda db: pq.drop(db, key, dropped))

    async def drop_own(self, key: SessionKey, seqs: Sequence[int], owner: str) -> list[int]:
        asked = list(seqs)
        return await self._quick(lambda db: pq.drop_own(db, key, asked, owner))

    async def adopt(
        self,
        key: SessionKey,
        seqs: Sequence[int],
        old_owner: str,
        new_owner: str,
        *,
        generation: int | None = None,
    ) -> list[int]:
        asked = list(seqs)

        def adopt(db: sqlite3.Connection) -> list[int]:
            if generation is not None and _generation(db, key) != generation:
                return []
            return pq.adopt(db, key, asked, old_owner, new_owner)

        return await self._write(adopt)

    async def adopt_orphans(self, holder: str, limit: int) -> list[PendingRecord]:
        return await self._write(lambda db: pq.adopt_orphans(db, self._clock, holder, limit))

    async def park(self, key: SessionKey, seqs: Sequence[int], reason: str) -> None:
        parked = list(seqs)
        await self._write(lambda db: pq.park(db, self._clock, key, parked, reason))

    async def failed(self, limit: int = 100) -> list[FailedRecord]:
        return await self._read(lambda db: pq.failed(db, limit))

    async def retry_failed(self, message_id: str, owner: str) -> PendingRecord | None:
        return await self._write(lambda db: pq.retry_failed(db, message_id, owner))

    # -- the delivery ledger ---------------------------------------------------------

    async def record_deliveries(self, drafts: Sequence[DeliveryDraft]) -> None:
        recorded = list(drafts)
        await self._quick(lambda db: ledger.record(db, self._clock, recorded))

    async def claim_deliveries(
        self, lanes: Sequence[str], holder: str, ttl: float, limit: int
    ) -> list[Delivery]:
        asked = list(lanes)  # on the writer thread: a claim reads every target of its lanes
        return await self._write(
            lambda db: ledger.claim(db, self._clock, asked, holder, ttl, limit)
        )

    async def settle_deliveries(self, settlements: Sequence[Settlement]) -> list[bool]:
        settled = list(settlements)
        return await self._quick(lambda db: ledger.settle(db, self._clock, settled))

    async def deliveries(self, state: str, limit: int = 100) -> list[Delivery]:
        return await self._read(lambda db: ledger.listed(db, state, limit))

    async def delivery(self, delivery_id: str) -> Delivery | None:
        return await self._read(lambda db: ledger.delivery(db, delivery_id))

    async def delivery_stats(self) -> DeliveryStats:
        return await self._read(ledger.stats)

    async def retry_dead(self, delivery_id: str) -> bool:
        return await self._write(lambda db: ledger.retry_dead(db, delivery_id))

    # -- process liveness ------------------------------------------------------------

    async def heartbeat(self, holder: str, ttl: float) -> None:
        retention, delivered = self.answered_retention, self.delivered_retention
        await self._urgent(
            lambda db: _heartbeat(db, self._clock, holder, ttl, retention, delivered)
        )

    async def alive(self, holders: Sequence[str]) -> Mapping[str, bool]:
        asked = list(holders)
        return await self._read(lambda db: _alive(db, self._clock, asked))

    async def close(self) -> None:
        """Commit every queued operation, stop the writer thread and close the file.

        Idempotent; any call made after ``close`` raises ``StoreError("store is closed")``.
        """
        if self._closing is None:
            self._closing = self._writer.stop()
        await asyncio.shield(self._closing)
