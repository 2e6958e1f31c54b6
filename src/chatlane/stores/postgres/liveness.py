"""The PostgreSQL store's process heartbeats, and the pruning each heartbeat does.

Each function runs inside one of the store's transactions (``moment`` is the
server's clock). A heartbeat also forgets what no one needs any more: answered
marks past their retention, and heartbeats and leases expired for
:data:`~chatlane.stores.base.PRUNE_AFTER` seconds.
"""

from __future__ import annotations

from collections.abc import Sequence

from chatlane.stores.base import PRUNE_AFTER
from chatlane.stores.postgres.db import Db

__all__ = ["alive", "heartbeat"]


async def heartbeat(db: Db, moment: float, holder: str, ttl: float, retention: float) -> None:
    """Beat for ``holder``; forget answered marks past their retention and long-dead rows."""
    await db.execute(
        "INSERT INTO heartbeats (holder, expires_at) VALUES ($1, $2) "
        "ON CONFLICT (holder) DO UPDATE SET expires_at = excluded.expires_at",
        holder,
        moment + ttl,
    )
    await db.execute("DELETE FROM answered WHERE at <= $1", moment - retention)
    await db.execute("DELETE FROM heartbeats WHERE expires_at <= $1", moment - PRUNE_AFTER)
    await db.execute("DELETE FROM leases WHERE expires_at <= $1", moment - PRUNE_AFTER)


async def alive(db: Db, holders: Sequence[str]) -> dict[str, bool]:
    rows = await db.fetch(
        "SELECT holder FROM heartbeats WHERE holder = ANY($1) "
        "AND expires_at > extract(epoch FROM now())",
        list(holders),
    )
    beating = {row[0] for row in rows}
    return {holder: holder in beating for holder in holders}
