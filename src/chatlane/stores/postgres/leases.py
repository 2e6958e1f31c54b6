"""The PostgreSQL store's generations and leases: operations run inside the store's transactions.

Each function takes the connection and ``moment``, the server's clock read
inside the transaction (after its session lock, see
:mod:`chatlane.stores.postgres.store`). What stays true:

* A refusal writes nothing but the session's ``waiting`` mark (when the
  session is busy: see :mod:`~chatlane.stores.postgres.wakeups`): the checks,
  the lease taken with the session's new generation, the mark and the read of
  its persistent fields are one statement (:data:`_ADMIT`), which takes the
  lease only where nothing refuses.
* Releasing a lease wakes the session's waiters (``pg_notify``, in the same
  statement) only if one marked it ``waiting``.
* A busy session is reported as busy whichever check found it — unless its
  live lease carries the caller's token: then it is the caller's, taken by an
  earlier try whose answer was lost, and returned as it stands.
* With ``max_active``, the live leases are counted under one store-wide
  advisory lock, so two processes at the limit never both take the last place.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from chatlane.errors import ActiveSessionLimit, EarlierMessageFirst, SessionBusy
from chatlane.stores.base import Lease, already_released, taken_over
from chatlane.stores.codec import decode_value
from chatlane.stores.ids import new_token
from chatlane.stores.postgres.db import Db
from chatlane.types import SessionKey

__all__ = [
    "acquire",
    "active",
    "admit",
    "bump",
    "free",
    "generation",
    "generations",
    "release",
    "renew_many",
]

_ADMIT = """WITH checked AS (SELECT
    EXISTS (SELECT 1 FROM leases WHERE key = $1 AND expires_at > $2) AS busy,
    $3::bigint IS NOT NULL
        AND EXISTS (SELECT 1 FROM pending WHERE key = $1 AND seq < $3 AND owner <> $4) AS earlier,
    CASE WHEN $5 > 0 THEN (SELECT count(*) FROM leases WHERE expires_at > $2) ELSE 0 END AS live
), taken AS (
    INSERT INTO leases (key, holder, token, generation, expires_at)
    SELECT $1, $4, $6, coalesce((SELECT generation FROM sessions WHERE key = $1), 0) + 1, $7
    FROM checked WHERE NOT busy AND NOT earlier AND ($5 = 0 OR live < $5)
    ON CONFLICT (key) DO UPDATE SET holder = excluded.holder, token = excluded.token,
        generation = excluded.generation, expires_at = excluded.expires_at
    WHERE leases.expires_at <= $2
    RETURNING generation
), bumped AS (
    INSERT INTO sessions (key, generation) SELECT $1, generation FROM taken
    ON CONFLICT (key) DO UPDATE SET generation = excluded.generation
    RETURNING generation
), waits AS (
    INSERT INTO sessions (key, waiting) SELECT $1, true FROM checked WHERE busy OR earlier
    ON CONFLICT (key) DO UPDATE SET waiting = true WHERE NOT sessions.waiting
)
SELECT busy, earlier, live, (SELECT generation FROM bumped),
    CASE WHEN $8 THEN (SELECT coalesce(array_agg(field ORDER BY position), '{}')
        FROM persistent WHERE key = $1) END,
    CASE WHEN $8 THEN (SELECT coalesce(array_agg(value ORDER BY position), '{}')
        FROM persistent WHERE key = $1) END
FROM checked"""
"""One statement: whether ``key`` is busy, whether another holder's message came before
``head_seq``, how many sessions hold a live lease (if ``max_active``); the lease taken with
the session's next generation only when none of those refuses (and no live lease holds it:
then nothing is written); the session marked ``waiting`` when it is busy (a live lease or an
earlier message), so its next release notifies; and, if asked, the persistent fields, as the
transaction reads them."""

_OWN = """SELECT holder, generation, expires_at FROM leases
WHERE key = $1 AND token = $2 AND expires_at > $3"""
"""``key``'s live lease, if it carries the caller's token."""

Turn = tuple[int | None, int, str]
"""``head_seq``, ``max_active`` and the caller's ``token`` ("" for a fresh one)."""

_ACTIVE_LOCK = "SELECT pg_advisory_xact_lock(hashtextextended('chatlane-active:' || $1, 0))"

Persistent = dict[str, Any]


async def admit(
    db: Db,
    moment: float,
    key: SessionKey,
    holder: str,
    ttl: float,
    turn: Turn,
    schema: str,
    read: bool,
) -> tuple[Lease | SessionBusy, Persistent | None]:
    """Take ``key``'s lease for ``holder`` if nothing refuses it (see the module docstring).

    :param turn: ``head_seq``, ``max_active`` and ``token``, as :meth:`Leases.acquire`
        takes them.
    :returns: the lease, or what :meth:`Leases.acquire` would raise; and, if ``read``,
        the session's persistent fields.
    """
    head_seq, max_active, token = turn
    if max_active:
        await db.execute(_ACTIVE_LOCK, schema)
    chosen = token or new_token()
    row = await db.fetchrow(
        _ADMIT, key, moment, head_seq, holder, max_active, chosen, moment + ttl, read
    )
    assert row is not None
    busy, earlier, live, generation, names, values = row
    persistent = _fields(key, names, values) if read else None
    if generation is not None:
        return Lease(key, holder, chosen, int(generation), moment + ttl), persistent
    if busy and token:
        own = await db.fetchrow(_OWN, key, token, moment)
        if own is not None:
            return Lease(key, own[0], token, int(own[1]), own[2]), persistent
    if not busy and earlier:
        return EarlierMessageFirst(f"an earlier message of {key!r} runs first", key=key), persistent
    if not busy and max_active and live >= max_active:
        refusal = ActiveSessionLimit(f"at the active session limit ({live}/{max_active})", key=key)
        return refusal, persistent
    return _busy(key), persistent


def _fields(key: SessionKey, names: list[str], values: list[str]) -> Persistent:
    return {name: decode_value(key, name, value) for name, value in zip(names, values, strict=True)}


async def acquire(
    db: Db,
    moment: float,
    key: SessionKey,
    holder: str,
    ttl: float,
    turn: Turn,
    schema: str,
) -> Lease | SessionBusy:
    """:func:`admit`, without the persistent fields.

    :returns: the lease, or what :meth:`~chatlane.stores.protocols.Leases.acquire`
        raises: the caller raises it once the transaction committed (so the
        session's ``waiting`` mark is kept).
    """
    lease, _ = await admit(db, moment, key, holder, ttl, turn, schema, False)
    return lease


def _busy(key: SessionKey) -> SessionBusy:
    return SessionBusy(f"session {key!r} is running elsewhere", key=key)


_RENEW = """UPDATE leases l SET expires_at = $1 + $2
FROM unnest($3::text[], $4::text[], $5::bigint[]) AS r(key, token, generation), sessions s
WHERE l.key = r.key AND l.token = r.token AND l.expires_at > $1 AND l.generation = r.generation
    AND s.key = r.key AND s.generation = r.generation
RETURNING l.key"""
"""Extend every live, unfenced holding named by its key, token and generation."""


async def renew_many(
    db: Db, moment: float, leases: Sequence[Lease], ttl: float
) -> list[Lease | None]:
    """One compare-and-set for all ``leases``: ``None`` for each one lost."""
    keys = [lease.key for lease in leases]
    tokens = [lease.token for lease in leases]
    fences = [lease.generation for lease in leases]
    renewed = {row[0] for row in await db.fetch(_RENEW, moment, ttl, keys, tokens, fences)}
    return [
        Lease(lease.key, lease.holder, lease.token, lease.generation, moment + ttl)
        if lease.key in renewed
        else None
        for lease in leases
    ]


WAKE = """UPDATE sessions SET waiting = false WHERE key = $1 AND waiting {condition}
RETURNING pg_notify({channel}, {token})"""
"""Clear a session's ``waiting`` mark and notify its waiters, only where it was set (and the
condition holds); a statement of its own or a ``WITH`` clause of another."""

_FREE = f"""WITH freed AS (DELETE FROM leases WHERE key = $1 AND token = $2 RETURNING 1),
woken AS ({WAKE.format(condition="AND EXISTS (SELECT 1 FROM freed)", channel="$3", token="$4")})
SELECT EXISTS (SELECT 1 FROM freed)"""


async def release(db: Db, lease: Lease, notice: tuple[str, str]) -> None:
    """Delete the lease only if it still carries ``lease.token``; otherwise say why not.

    :param notice: the store's channel, and the session's token on it: the waiters to wake.
    """
    if await free(db, lease, notice):
        return
    held = await db.fetchval("SELECT 1 FROM leases WHERE key = $1", lease.key)
    if not held and await generation(db, lease.key) == lease.generation:
        raise already_released(lease)
    raise taken_over(lease)


async def free(db: Db, lease: Lease, notice: tuple[str, str]) -> bool:
    """Delete the lease if it still carries ``lease.token`` (waking its waiters); whether it did."""
    return bool(await db.fetchval(_FREE, lease.key, lease.token, *notice))


async def bump(db: Db, key: SessionKey) -> int:
    return int(
        await db.fetchval(
            "INSERT INTO sessions (key, generation) VALUES ($1, 1) ON CONFLICT (key) "
            "DO UPDATE SET generation = sessions.generation + 1 RETURNING generation",
            key,
        )
    )


async def generation(db: Db, key: SessionKey) -> int:
    found = await db.fetchval("SELECT generation FROM sessions WHERE key = $1", key)
    return 0 if found is None else int(found)


async def generations(db: Db, keys: Sequence[SessionKey]) -> list[int]:
    rows = await db.fetch(
        "SELECT coalesce(s.generation, 0) FROM unnest($1::text[]) WITH ORDINALITY AS k(key, n) "
        "LEFT JOIN sessions s ON s.key = k.key ORDER BY k.n",
        list(keys),
    )
    return [int(row[0]) for row in rows]


async def active(db: Db) -> int:
    live = "SELECT count(*) FROM leases WHERE expires_at > extract(epoch FROM now())"
    return int(await db.fetchval(live))
