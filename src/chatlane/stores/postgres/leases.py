"""The PostgreSQL store's generations and leases: operations run inside the store's transactions.

Taking a lease (:func:`admit`, :func:`acquire`) is one statement, in its own
transaction: a call of the schema's ``chatlane_admit``
(:mod:`~chatlane.stores.postgres.routines`), which takes the session's lock
and reads the server's clock itself. Every other function takes the
connection and ``moment``, the server's clock read inside the transaction
(after its session lock, see :mod:`chatlane.stores.postgres.store`). What stays
true:

* A refusal writes nothing but the session's ``waiting`` mark (when the
  session is busy: see :mod:`~chatlane.stores.postgres.wakeups`): the checks,
  the lease taken with the session's new generation, the mark and the read of
  its persistent fields are one statement, which takes the lease only where
  nothing refuses.
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

from chatlane.errors import ActiveSessionLimit, EarlierMessageFirst, MessageIdInUse, SessionBusy
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
    "holder",
    "release",
    "renew_many",
]

_ADMIT = "SELECT * FROM chatlane_admit($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)"
"""One statement, one round trip: the session's lock and clock, the message queued (if
one is given), the checks, the lease, the ``waiting`` mark and the persistent fields
(:mod:`~chatlane.stores.postgres.routines`)."""

Turn = tuple[int | None, int, str]
"""``head_seq``, ``max_active`` and the caller's ``token`` ("" for a fresh one)."""

Message = tuple[str, bytes]
"""A message to queue before the lease is asked for: its id and payload."""

Persistent = dict[str, Any]


async def admit(
    db: Db,
    key: SessionKey,
    holder: str,
    ttl: float,
    turn: Turn,
    schema: str,
    read: bool,
    message: Message | None = None,
) -> tuple[int | None, Lease | SessionBusy, Persistent | None]:
    """Queue ``message`` (if given), then take ``key``'s lease for ``holder`` if nothing
    refuses it (see the module docstring); one statement, in its own transaction.

    :param turn: ``head_seq``, ``max_active`` and ``token``, as :meth:`Leases.acquire`
        takes them; with a ``message``, its ``seq`` is the head.
    :returns: the message's ``seq`` (``head_seq`` without one); the lease, or what
        :meth:`Leases.acquire` would raise; and, if ``read``, the session's persistent fields.
    :raises MessageIdInUse: another session's queued message has ``message``'s id.
    """
    head_seq, max_active, token = turn
    chosen = token or new_token()
    message_id, payload = message or (None, None)
    row = await db.fetchrow(
        _ADMIT, key, holder, ttl, head_seq, max_active, token, chosen, read, schema, message_id,
        payload,
    )  # fmt: skip
    assert row is not None
    moment, seq, busy, earlier, live, generation, names, values, *own = row
    if message_id is not None and seq is None:  # queued by another session: nothing written
        raise MessageIdInUse(message_id, key=key)
    persistent = _fields(key, names, values) if read else None
    if generation is not None:
        return seq, Lease(key, holder, chosen, int(generation), moment + ttl), persistent
    if own[0] is not None:  # the live lease carries the caller's token
        return seq, Lease(key, own[0], token, int(own[1]), own[2]), persistent
    if not busy and earlier:
        refusal: SessionBusy = EarlierMessageFirst(
            f"an earlier message of {key!r} runs first", key=key
        )
    elif not busy and max_active and live >= max_active:
        refusal = ActiveSessionLimit(f"at the active session limit ({live}/{max_active})", key=key)
    else:
        refusal = _busy(key)
    return seq, refusal, persistent


def _fields(key: SessionKey, names: list[str], values: list[str]) -> Persistent:
    return {name: decode_value(key, name, value) for name, value in zip(names, values, strict=True)}


async def acquire(
    db: Db,
    key: SessionKey,
    holder: str,
    ttl: float,
    turn: Turn,
    schema: str,
) -> Lease | SessionBusy:
    """:func:`admit`, without a message or the persistent fields.

    :returns: the lease, or what :meth:`~chatlane.stores.protocols.Leases.acquire`
        raises: the caller raises it once the statement committed (so the
        session's ``waiting`` mark is kept).
    """
    _, lease, _ = await admit(db, key, holder, ttl, turn, schema, False)
    return lease


def _busy(key: SessionKey) -> SessionBusy:
    return SessionBusy(f"session {key!r} is running elsewhere", key=key)


_RENEW = """UPDATE leases l SET expires_at = $1 + $2
FROM unnest($3::text[], $4::text[], $5::bigint[]) AS r(key, token, generation), sessions s
WHERE l.key = r.key AND l.token = r.token AND l.expires_at > $1 AND l.generation = r.generation
    AND s.key = r.key AND s.generation = r.generation
RETURNING l.key, l.token"""
"""Extend every live, unfenced holding named by its key, token and generation; the renewed
come back by key and token, since one call may hold a lost lease and its successor."""


async def renew_many(
    db: Db, moment: float, leases: Sequence[Lease], ttl: float
) -> list[Lease | None]:
    """One compare-and-set for all ``leases``: ``None`` for each one lost.

    A lease is matched by its key and token, never its key alone: a lost lease renewed
    beside its successor on the same session (the same call) stays lost.
    """
    keys = [lease.key for lease in leases]
    tokens = [lease.token for lease in leases]
    fences = [lease.generation for lease in leases]
    rows = await db.fetch(_RENEW, moment, ttl, keys, tokens, fences)
    renewed = {(row[0], row[1]) for row in rows}
    return [
        Lease(lease.key, lease.holder, lease.token, lease.generation, moment + ttl)
        if (lease.key, lease.token) in renewed
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


async def holder(db: Db, key: SessionKey) -> str | None:
    live = "SELECT holder FROM leases WHERE key = $1 AND expires_at > extract(epoch FROM now())"
    found = await db.fetchval(live, key)
    return None if found is None else str(found)


async def active(db: Db) -> int:
    live = "SELECT count(*) FROM leases WHERE expires_at > extract(epoch FROM now())"
    return int(await db.fetchval(live))
