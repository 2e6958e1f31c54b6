"""The PostgreSQL store's delivery ledger (:class:`~chatlane.stores.protocols.Deliveries`).

Each function that writes runs inside one of the store's transactions
(``moment`` is the server's clock read in it), except :func:`record`, one
statement calling the schema's ``chatlane_record_deliveries``
(:mod:`~chatlane.stores.postgres.routines`), as a commit's own statement does;
the others are single reads.
The rows live in the ``deliveries`` table (schema step 3). What stays true:

* ``seq`` comes from the table's identity: it grows in the order deliveries
  are recorded and is never reused. Recording first takes an advisory lock on
  each of its targets (sorted, so two recorders never wait for each other in a
  circle), held until the transaction ends: the deliveries of one target
  therefore become visible in ``seq`` order, and a claim never sees a later
  one while an earlier one is still on its way in.
* Deliveries recorded with a commit are written by the commit's own
  transaction, after its fenced checks: a refused commit records nothing.
* A claim reads only pending deliveries, through the partial indexes: each
  lane's targets one by one (a skip scan of ``deliveries_lane``), each
  target's head as the first entry of ``deliveries_target``. It costs a few
  index probes per target with pending deliveries in the asked lanes, never a
  read of what was delivered or of a target's later deliveries.
* A claim locks the heads it takes (``FOR UPDATE SKIP LOCKED``): a head
  another claimer holds locked is passed over, and one changed by a claim or
  settlement that committed meanwhile is checked again as it is now (due, and
  under no live claim) before it is taken. So two claimers never both take a
  delivery while a claim on it is live.
* A settlement is a compare-and-set on the claim's token, under the row's
  lock: of two settlements of one claim, only the first applies.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from chatlane.stores.base import (
    DEAD,
    DELIVERED,
    PENDING,
    Delivery,
    DeliveryDraft,
    DeliveryStats,
    Settlement,
    SettlementKind,
)
from chatlane.stores.ids import new_token
from chatlane.stores.postgres.db import Db, Row

__all__ = [
    "claim",
    "columns",
    "get",
    "listed",
    "prune",
    "record",
    "retry_dead",
    "settle",
    "stats",
    "target_lock",
]

_COLUMNS = (
    "id",
    "seq",
    "lane",
    "target",
    "payload",
    "created_at",
    "state",
    "attempts",
    "next_at",
    "claim",
    "claim_expires",
    "holder",
    "uncertain",
    "reason",
    "settled_at",
)
"""A delivery's columns, in the order of :class:`~chatlane.stores.records.Delivery`'s fields."""


def _columns(alias: str = "") -> str:
    prefix = f"{alias}." if alias else ""
    return ", ".join(prefix + column for column in _COLUMNS)


def _delivery(row: Row) -> Delivery:
    """A row of :func:`_columns` as a delivery."""
    id_, seq, lane, target, payload, created_at, state, attempts, *rest = row
    next_at, claim_token, claim_expires, holder, uncertain, reason, settled_at = rest
    return Delivery(
        id_,
        int(seq),
        lane,
        target,
        bytes(payload),
        created_at,
        state,
        int(attempts),
        next_at,
        claim_token,
        claim_expires,
        holder,
        bool(uncertain),
        reason,
        settled_at,
    )


# -- recording -------------------------------------------------------------------------

_RECORD = (
    "SELECT chatlane_record_deliveries($1, $2, $3, $4, extract(epoch FROM clock_timestamp()), "
    "$5, $6)"
)
"""One statement: the targets' locks in the order given, then the drafts inserted in order,
each id at most once (:mod:`~chatlane.stores.postgres.routines`)."""


def target_lock(schema: str) -> str:
    """The prefix of a target's advisory lock in ``schema`` (the target's text follows it)."""
    return f"chatlane-target:{schema}:"


def columns(drafts: Sequence[DeliveryDraft], lock: str) -> list[Any]:
    """The drafts as the schema's ``chatlane_record_deliveries`` takes them: their ids, lanes,
    targets and payloads (a later draft of one id left out, as recording would ignore it),
    then ``lock``, the store's :func:`target_lock` prefix, and the targets to lock, sorted
    (so two recorders never wait for each other in a circle)."""
    firsts: dict[str, DeliveryDraft] = {}
    for draft in drafts:
        firsts.setdefault(draft.id, draft)
    first = list(firsts.values())
    return [
        [d.id for d in first],
        [d.lane for d in first],
        [d.target for d in first],
        [d.payload for d in first],
        lock,
        sorted({d.target for d in first}),
    ]


async def record(db: Db, drafts: Sequence[DeliveryDraft], lock: str) -> None:
    """Record each draft not recorded before as pending and due now; one statement, in its
    own transaction.

    :param lock: the store's :func:`target_lock` prefix.
    """
    if drafts:
        await db.execute(_RECORD, *columns(drafts, lock))


# -- claiming ----------------------------------------------------------------------------

_DUE = f"""WITH RECURSIVE lanes AS (
    SELECT DISTINCT lane FROM unnest($1::text[]) AS l(lane)
), targets AS (
    SELECT l.lane, f.target FROM lanes l CROSS JOIN LATERAL (
        SELECT target FROM deliveries WHERE state = '{PENDING}' AND lane = l.lane
        ORDER BY target LIMIT 1
    ) f
    UNION ALL
    SELECT t.lane, f.target FROM targets t CROSS JOIN LATERAL (
        SELECT target FROM deliveries WHERE state = '{PENDING}' AND lane = t.lane
            AND target > t.target
        ORDER BY target LIMIT 1
    ) f
), heads AS (
    SELECT h.seq FROM targets t CROSS JOIN LATERAL (
        SELECT seq FROM deliveries WHERE state = '{PENDING}' AND target = t.target
        ORDER BY seq LIMIT 1
    ) h
)
SELECT d.seq FROM deliveries d
WHERE d.seq IN (SELECT seq FROM heads) AND d.state = '{PENDING}' AND d.next_at <= $2
    AND (d.claim = '' OR d.claim_expires <= $2)
ORDER BY d.seq LIMIT $3
FOR UPDATE OF d SKIP LOCKED"""
"""The due heads of the lanes' targets, oldest first, at most ``$3``, locked: each lane's
targets found one index probe at a time, each target's head (its oldest pending delivery,
whatever its state of claim) by another; a head locked by another claimer is skipped, and one
changed since the statement began is taken only if it is still pending, due and unclaimed."""

_TAKE = f"""UPDATE deliveries d SET claim = c.token, claim_expires = $2, holder = $3,
    uncertain = d.uncertain OR d.claim <> ''
FROM unnest($1::bigint[], $4::text[]) AS c(seq, token)
WHERE d.seq = c.seq
RETURNING {_columns("d")}"""
"""Give each locked head its token; a head whose last claim expired unsettled is uncertain."""


async def claim(
    db: Db, moment: float, lanes: Sequence[str], holder: str, ttl: float, limit: int
) -> list[Delivery]:
    """See :meth:`~chatlane.stores.protocols.Deliveries.claim_deliveries`."""
    if not lanes or limit <= 0:
        return []
    seqs = [int(row[0]) for row in await db.fetch(_DUE, list(lanes), moment, limit)]
    if not seqs:
        return []
    tokens = [new_token() for _ in seqs]
    rows = await db.fetch(_TAKE, seqs, moment + ttl, holder, tokens)
    return sorted((_delivery(row) for row in rows), key=lambda delivery: delivery.seq)


# -- settling ----------------------------------------------------------------------------

_SETTLE = f"""UPDATE deliveries d SET state = s.state, claim = '',
    attempts = d.attempts + s.spent,
    next_at = coalesce($1 + s.delay, d.next_at),
    reason = coalesce(s.reason, d.reason),
    uncertain = d.uncertain OR s.maybe_sent,
    settled_at = CASE WHEN s.state = '{PENDING}' THEN d.settled_at ELSE $1 END
FROM unnest($2::text[], $3::text[], $4::text[], $5::int[], $6::float8[], $7::text[],
    $8::bool[], $9::int[]) AS s(id, claim, state, spent, delay, reason, maybe_sent, n)
WHERE d.id = s.id AND d.claim = s.claim AND s.claim <> ''
RETURNING s.n"""
"""Apply each settlement whose token is its delivery's claim; ``delay`` and ``reason`` are NULL
where the delivery keeps its own."""

_Change = tuple[str, int, float | None, str | None, bool]
"""What a settlement makes of its delivery: state, attempts spent, delay (None: keep
``next_at``), reason (None: keep it), whether it may have been sent."""


def _change(settlement: Settlement) -> _Change:
    """The one reading of each :class:`~chatlane.stores.records.SettlementKind`, as
    :func:`~chatlane.stores.memory_ledger.settled` reads it."""
    kind = settlement.kind
    if kind is SettlementKind.DELIVERED:
        return DELIVERED, 0, None, None, False
    if kind is SettlementKind.DEAD:
        return DEAD, 0, None, settlement.reason, settlement.maybe_sent
    spent = 1 if kind is SettlementKind.RETRY else 0
    return PENDING, spent, settlement.delay, settlement.reason or None, settlement.maybe_sent


async def settle(db: Db, moment: float, settlements: Sequence[Settlement]) -> list[bool]:
    """See :meth:`~chatlane.stores.protocols.Deliveries.settle_deliveries`.

    One statement for all of them. A settlement repeating an earlier one's id and token
    is not sent: it would find the claim already settled by the first.
    """
    seen: set[tuple[str, str]] = set()
    asked: list[tuple[int, Settlement]] = []
    for n, settlement in enumerate(settlements):
        if (settlement.id, settlement.claim) not in seen:
            seen.add((settlement.id, settlement.claim))
            asked.append((n, settlement))
    if not asked:
        return []
    changes = [_change(settlement) for _, settlement in asked]
    rows = await db.fetch(
        _SETTLE,
        moment,
        [s.id for _, s in asked],
        [s.claim for _, s in asked],
        *(list(column) for column in zip(*changes, strict=True)),
        [n for n, _ in asked],
    )
    applied = {int(row[0]) for row in rows}
    return [n in applied for n in range(len(settlements))]


async def retry_dead(db: Db, delivery_id: str) -> bool:
    """Make a dead delivery pending again, due at once, with no attempts counted."""
    row = await db.fetchrow(
        f"UPDATE deliveries SET state = '{PENDING}', attempts = 0, next_at = 0, settled_at = 0 "
        f"WHERE id = $1 AND state = '{DEAD}' RETURNING 1",
        delivery_id,
    )
    return row is not None


async def prune(db: Db, delivered_before: float, dead_before: float) -> None:
    """Forget delivered ones settled by the first cutoff, dead ones by the second; never a
    pending one."""
    await db.execute(
        f"DELETE FROM deliveries WHERE (state = '{DELIVERED}' AND settled_at <= $1) "
        f"OR (state = '{DEAD}' AND settled_at <= $2)",
        delivered_before,
        dead_before,
    )


# -- reading -------------------------------------------------------------------------------


async def listed(db: Db, state: str, limit: int) -> list[Delivery]:
    """Deliveries in ``state``, oldest recorded first."""
    rows = await db.fetch(
        f"SELECT {_columns()} FROM deliveries WHERE state = $1 ORDER BY seq LIMIT $2",
        state,
        max(limit, 0),
    )
    return [_delivery(row) for row in rows]


async def get(db: Db, delivery_id: str) -> Delivery | None:
    row = await db.fetchrow(f"SELECT {_columns()} FROM deliveries WHERE id = $1", delivery_id)
    return None if row is None else _delivery(row)


_STATS = f"""SELECT count(*) FILTER (WHERE state = '{PENDING}'),
    coalesce(min(created_at) FILTER (WHERE state = '{PENDING}'), 0),
    count(*) FILTER (WHERE state = '{DEAD}')
FROM deliveries WHERE state IN ('{PENDING}', '{DEAD}')"""


async def stats(db: Db) -> DeliveryStats:
    row = await db.fetchrow(_STATS)
    assert row is not None
    return DeliveryStats(int(row[0]), float(row[1]), int(row[2]))
