"""The SQLite store's delivery ledger (:class:`~chatlane.stores.protocols.Deliveries`).

Each function is an operation of the store's writer thread
(:mod:`chatlane.stores.sqlite_writer`): a function of the connection, run
inside the transaction of its batch, depending on the database alone. The
ledger is the ``deliveries`` table (schema step 8). What stays true:

* ``seq`` is the table's ``AUTOINCREMENT`` key: it grows with each delivery
  recorded and is never reused, even after pruning and restarts.
* Recording is idempotent per delivery id (``ON CONFLICT (id) DO NOTHING``),
  and a commit records its batch's deliveries after every check of the fenced
  commit, in the transaction that writes it: a refused commit records nothing.
* A target's head is its pending delivery with the smallest ``seq``, whatever
  its lane; delivered and dead ones are out of the pending indexes, so they
  never block their target.
* A claim reads the heads and writes their claims in one transaction that
  holds the write lock (``BEGIN IMMEDIATE``): of two claimers, in one process
  or several, each head goes to one, and a target's later deliveries are never
  claimed while its head is pending.
* A claim reads only the pending indexes: the targets of each lane
  (``deliveries_lane``, skipped from one target to the next) and each one's
  head (``deliveries_target``). It costs O(t log n) for the t targets with
  pending deliveries in its lanes, whatever the backlog of a target or the
  deliveries recorded since the store began.
* A settlement is one compare-and-set on its claim token: it applies only
  while the token is the delivery's claim.
* Times are the store's clock, read inside the operation, as leases read it.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from typing import Any

from chatlane.stores.base import (
    DEAD,
    DELIVERED,
    PENDING,
    Clock,
    Delivery,
    DeliveryDraft,
    DeliveryStats,
    Settlement,
    SettlementKind,
)
from chatlane.stores.ids import new_token

__all__ = [
    "claim",
    "delivery",
    "listed",
    "prune",
    "record",
    "retry_dead",
    "settle",
    "stats",
]

_COLUMNS = (
    "id, seq, lane, target, payload, created_at, state, attempts, next_at, claim, "
    "claim_expires, holder, uncertain, reason, settled_at"
)
"""A delivery's columns, in the order of :class:`~chatlane.stores.records.Delivery`'s fields."""
_UNCERTAIN = _COLUMNS.split(", ").index("uncertain")
"""Where ``uncertain`` is in a row: stored as 0 or 1, handed out as a bool."""


def _delivery(row: Sequence[Any]) -> Delivery:
    """A row of :data:`_COLUMNS` as a delivery (``uncertain`` is stored as 0 or 1)."""
    values = list(row)
    values[_UNCERTAIN] = bool(values[_UNCERTAIN])
    return Delivery(*values)


# -- recording -----------------------------------------------------------------------

_RECORD = (
    "INSERT INTO deliveries (id, lane, target, payload, created_at) VALUES (?, ?, ?, ?, ?) "
    "ON CONFLICT (id) DO NOTHING"
)


def record(db: sqlite3.Connection, clock: Clock, drafts: Sequence[DeliveryDraft]) -> None:
    """Record each draft not recorded before, in order: pending, due now, unclaimed."""
    moment = clock()
    rows = [(d.id, d.lane, d.target, d.payload, moment) for d in drafts]
    if len(rows) == 1:
        db.execute(_RECORD, rows[0])
    elif rows:
        db.executemany(_RECORD, rows)


# -- claims --------------------------------------------------------------------------

_DUE_HEADS = """
WITH RECURSIVE targets (target) AS (
    SELECT min(target) FROM deliveries WHERE state = 'pending' AND lane = :lane
    UNION ALL
    SELECT (
        SELECT min(target) FROM deliveries
        WHERE state = 'pending' AND lane = :lane AND target > t.target
    )
    FROM targets t WHERE t.target IS NOT NULL
)
SELECT head.seq FROM targets t JOIN deliveries head ON head.seq = (
    SELECT min(seq) FROM deliveries WHERE state = 'pending' AND target = t.target
)
WHERE head.lane = :lane AND head.next_at <= :now
    AND (head.claim = '' OR head.claim_expires <= :now)
ORDER BY head.seq LIMIT :limit
"""
"""The seqs of ``lane``'s claimable heads, oldest first: for each target with a pending
delivery in the lane (one index seek per target), its oldest pending delivery, if that
one is in the lane, due, and under no live claim."""

_CLAIM = (
    "UPDATE deliveries SET claim = ?, claim_expires = ?, holder = ?, "
    "uncertain = uncertain OR claim != '' "  # an expired claim, never settled: maybe sent
    f"WHERE seq = ? RETURNING {_COLUMNS}"
)


def claim(
    db: sqlite3.Connection,
    clock: Clock,
    lanes: Sequence[str],
    holder: str,
    ttl: float,
    limit: int,
) -> list[Delivery]:
    """See :meth:`~chatlane.stores.protocols.Deliveries.claim_deliveries`.

    Each lane gives at most ``limit`` heads, oldest first; the oldest ``limit``
    of them all are claimed, each with a fresh token.
    """
    if limit <= 0:
        return []
    moment = clock()
    seqs: list[int] = []
    for lane in dict.fromkeys(lanes):  # a lane named twice is read once
        asked = {"lane": lane, "now": moment, "limit": limit}
        seqs += [row[0] for row in db.execute(_DUE_HEADS, asked)]
    expires = moment + ttl
    return [
        _delivery(db.execute(_CLAIM, (new_token(), expires, holder, seq)).fetchone())
        for seq in sorted(seqs)[:limit]
    ]


# -- settlements -----------------------------------------------------------------------

_AGAIN = (
    "attempts = attempts + :spent, next_at = :next_at, claim = '', "
    "reason = coalesce(nullif(:reason, ''), reason), uncertain = uncertain OR :maybe_sent"
)
_SETTLED = {
    SettlementKind.DELIVERED: "state = 'delivered', claim = '', settled_at = :now",
    SettlementKind.DEAD: "state = 'dead', claim = '', reason = :reason, settled_at = :now, "
    "uncertain = uncertain OR :maybe_sent",
    SettlementKind.RETRY: _AGAIN,
    SettlementKind.RELEASE: _AGAIN,
}
"""What each kind of settlement sets: the one reading of each, as
:func:`chatlane.stores.memory_ledger.settled` gives it."""

_SETTLE = {
    kind: f"UPDATE deliveries SET {sets} WHERE id = :id AND claim = :claim AND claim != ''"
    for kind, sets in _SETTLED.items()
}


def settle(db: sqlite3.Connection, clock: Clock, settlements: Sequence[Settlement]) -> list[bool]:
    """See :meth:`~chatlane.stores.protocols.Deliveries.settle_deliveries`: in order, so a
    claim settled twice in one call applies once."""
    moment = clock()
    return [bool(db.execute(_SETTLE[s.kind], _fields(s, moment)).rowcount) for s in settlements]


def _fields(settlement: Settlement, moment: float) -> dict[str, Any]:
    return {
        "id": settlement.id,
        "claim": settlement.claim,
        "now": moment,
        "next_at": moment + settlement.delay,
        "spent": 1 if settlement.kind is SettlementKind.RETRY else 0,
        "reason": settlement.reason,
        "maybe_sent": settlement.maybe_sent,
    }


def retry_dead(db: sqlite3.Connection, delivery_id: str) -> bool:
    """Make a dead delivery pending again, due now, with no attempts counted."""
    revived = db.execute(
        "UPDATE deliveries SET state = 'pending', attempts = 0, next_at = 0, settled_at = 0 "
        "WHERE id = ? AND state = 'dead'",
        (delivery_id,),
    ).rowcount
    return bool(revived)


# -- reads and pruning -------------------------------------------------------------------

_LISTED = {
    PENDING: f"SELECT {_COLUMNS} FROM deliveries WHERE state = 'pending' ORDER BY seq LIMIT ?",
    DELIVERED: f"SELECT {_COLUMNS} FROM deliveries INDEXED BY deliveries_delivered "
    "WHERE state = 'delivered' ORDER BY seq LIMIT ?",
    DEAD: f"SELECT {_COLUMNS} FROM deliveries INDEXED BY deliveries_dead "
    "WHERE state = 'dead' ORDER BY seq LIMIT ?",
}
"""Each state's listing; a settled state's reads only its own rows (its partial index),
not the whole table in ``seq`` order."""


def listed(db: sqlite3.Connection, state: str, limit: int) -> list[Delivery]:
    """Deliveries in ``state``, oldest recorded first (none for a state that is not one)."""
    query = _LISTED.get(state)
    if query is None:
        return []
    return [_delivery(row) for row in db.execute(query, (max(limit, 0),))]


def delivery(db: sqlite3.Connection, delivery_id: str) -> Delivery | None:
    row = db.execute(f"SELECT {_COLUMNS} FROM deliveries WHERE id = ?", (delivery_id,)).fetchone()
    return None if row is None else _delivery(row)


def stats(db: sqlite3.Connection) -> DeliveryStats:
    """How many are pending (and since when) and dead: each counted on its partial index."""
    pending, oldest = db.execute(
        "SELECT count(*), coalesce(min(created_at), 0.0) FROM deliveries WHERE state = 'pending'"
    ).fetchone()
    dead = db.execute("SELECT count(*) FROM deliveries WHERE state = 'dead'").fetchone()[0]
    return DeliveryStats(pending, oldest, dead)


def prune(db: sqlite3.Connection, delivered_before: float, dead_before: float) -> None:
    """Forget delivered ones settled at or before the first cutoff, dead ones at or before
    the second; pending ones are never pruned."""
    db.execute(
        "DELETE FROM deliveries WHERE state = 'delivered' AND settled_at <= ?", (delivered_before,)
    )
    db.execute("DELETE FROM deliveries WHERE state = 'dead' AND settled_at <= ?", (dead_before,))
