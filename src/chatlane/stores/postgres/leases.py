"""The PostgreSQL store's generations and leases: operations run inside the store's transactions.

Each function takes the connection and ``moment``, the server's clock read
inside the transaction (after its session lock, see
:mod:`chatlane.stores.postgres.store`). What stays true:

* Every refusal writes nothing: the checks are reads, and the lease is written
  only where none is live (:data:`_TAKE`), together with the session's new
  generation, in one statement.
* A busy session is reported as busy whichever check found it.
* With ``max_active``, the live leases are counted under one store-wide
  advisory lock, so two processes at the limit never both take the last place.
"""

from __future__ import annotations

from collections.abc import Sequence

from chatlane.errors import ActiveSessionLimit, EarlierMessageFirst, SessionBusy
from chatlane.stores.base import Lease, already_released, taken_over
from chatlane.stores.ids import new_token
from chatlane.stores.postgres.db import Db
from chatlane.types import SessionKey

__all__ = [
    "acquire",
    "active",
    "bump",
    "free",
    "generation",
    "generations",
    "release",
    "renew_many",
]

_TAKE = """WITH taken AS (
    INSERT INTO leases (key, holder, token, generation, expires_at)
    VALUES ($1, $2, $3, coalesce((SELECT generation FROM sessions WHERE key = $1), 0) + 1, $4)
    ON CONFLICT (key) DO UPDATE SET holder = excluded.holder, token = excluded.token,
        generation = excluded.generation, expires_at = excluded.expires_at
    WHERE leases.expires_at <= $5
    RETURNING generation
)
INSERT INTO sessions (key, generation) SELECT $1, generation FROM taken
ON CONFLICT (key) DO UPDATE SET generation = excluded.generation
RETURNING generation"""
"""Take ``key``'s lease unless a live one holds it, and store its generation (the session's
next one) with it: no row comes back, and nothing is written, while it is busy."""

_CHECK = """SELECT
    EXISTS (SELECT 1 FROM leases WHERE key = $1 AND expires_at > $2),
    $3::bigint IS NOT NULL
        AND EXISTS (SELECT 1 FROM pending WHERE key = $1 AND seq < $3 AND owner <> $4),
    CASE WHEN $5 THEN (SELECT count(*) FROM leases WHERE expires_at > $2) ELSE 0 END"""
"""Whether ``key`` is busy, whether another holder's message came before ``head_seq``, and
(if asked) how many sessions hold a live lease."""

_ACTIVE_LOCK = "SELECT pg_advisory_xact_lock(hashtextextended('chatlane-active:' || $1, 0))"


async def acquire(
    db: Db,
    moment: float,
    key: SessionKey,
    holder: str,
    ttl: float,
    head_seq: int | None,
    max_active: int,
    schema: str,
) -> Lease:
    """Check that ``key`` is free and take it (see the module docstring).

    :raises SessionBusy: as :meth:`~chatlane.stores.protocols.Leases.acquire`.
    """
    if head_seq is not None or max_active:
        await _check_turn(db, moment, key, holder, head_seq, max_active, schema)
    token = new_token()
    generation = await db.fetchval(_TAKE, key, holder, token, moment + ttl, moment)
    if generation is None:
        raise _busy(key)
    return Lease(key, holder, token, int(generation), moment + ttl)


async def _check_turn(
    db: Db,
    moment: float,
    key: SessionKey,
    holder: str,
    head_seq: int | None,
    max_active: int,
    schema: str,
) -> None:
    """Refuse a turn that must wait for an earlier message or a free slot (busy comes first)."""
    if max_active:
        await db.execute(_ACTIVE_LOCK, schema)
    row = await db.fetchrow(_CHECK, key, moment, head_seq, holder, bool(max_active))
    assert row is not None
    busy, earlier, live = row
    if busy:
        raise _busy(key)
    if earlier:
        raise EarlierMessageFirst(f"an earlier message of {key!r} runs first", key=key)
    if max_active and live >= max_active:
        raise ActiveSessionLimit(f"at the active session limit ({live}/{max_active})", key=key)


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


async def release(db: Db, lease: Lease) -> None:
    """Delete the lease only if it still carries ``lease.token``; otherwise say why not."""
    if await free(db, lease):
        return
    held = await db.fetchval("SELECT 1 FROM leases WHERE key = $1", lease.key)
    if not held and await generation(db, lease.key) == lease.generation:
        raise already_released(lease)
    raise taken_over(lease)


async def free(db: Db, lease: Lease) -> bool:
    """Delete the lease if it still carries ``lease.token``; whether it did."""
    freed = "DELETE FROM leases WHERE key = $1 AND token = $2 RETURNING 1"
    return bool(await db.fetchval(freed, lease.key, lease.token))


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
