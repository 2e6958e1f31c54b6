"""Stores: where sessions, leases and the durable queue live.

:func:`open_store` picks the backend from a URL:

* ``memory://`` — this process only (tests, experiments);
* ``sqlite:///path/chatlane.db`` — the embedded default; several processes on one host;
* ``redis://host:port/db`` or ``rediss://…`` — several processes on several hosts;
  ``redis+sentinel://host:port,…/<primary name>[/db]`` follows a Sentinel-managed primary.
* ``postgresql://user@host:port/database`` (or ``postgres://…``) — several hosts, in the
  operators' own PostgreSQL database.
"""

from __future__ import annotations

from chatlane.errors import StoreError
from chatlane.redaction import redact_urls
from chatlane.stores.base import (
    Admission,
    Conversation,
    Conversations,
    Deliveries,
    Delivery,
    DeliveryDraft,
    DeliveryStats,
    Lease,
    Leases,
    Liveness,
    PendingQueue,
    PendingRecord,
    SessionData,
    Settlement,
    SettlementKind,
    Store,
    Taken,
    TranscriptEntry,
    Turns,
    WriteBatch,
)
from chatlane.stores.memory import MemoryStore
from chatlane.stores.urls import mask_userinfo

SCHEMES = ("memory", "sqlite", "redis", "rediss", "redis+sentinel", "postgresql", "postgres")


async def open_store(url: str) -> Store:
    """Open the store ``url`` names.

    :raises StoreError: for an unknown scheme, or a store that cannot be opened.
    """
    scheme, sep, _ = url.partition("://")
    if not sep or scheme not in SCHEMES:
        shown = redact_urls(mask_userinfo(url))
        raise StoreError(
            f"store URL {shown!r}: expected memory://, sqlite:///path, redis://host:port/db, "
            "rediss://…, redis+sentinel://host:port,…/<primary name> "
            "or postgresql://host:port/database"
        )
    if scheme == "memory":
        return MemoryStore(url)
    if scheme == "sqlite":
        from chatlane.stores.sqlite import SQLiteStore

        return await SQLiteStore.open(url)
    if scheme in ("postgresql", "postgres"):
        try:
            from chatlane.stores.postgres import PostgresStore
        except ImportError as error:
            raise StoreError(
                f"the PostgreSQL store needs the postgres extra ({error}): "
                "pip install 'chatlane[postgres]'"
            ) from None
        return await PostgresStore.open(url)
    try:
        from chatlane.stores.redis import RedisStore
    except ImportError as error:
        raise StoreError(
            f"the Redis store needs the redis extra ({error}): pip install 'chatlane[redis]'"
        ) from None
    return await RedisStore.open(url)


__all__ = [
    "Admission",
    "Conversation",
    "Conversations",
    "Deliveries",
    "Delivery",
    "DeliveryDraft",
    "DeliveryStats",
    "Lease",
    "Leases",
    "Liveness",
    "MemoryStore",
    "PendingQueue",
    "PendingRecord",
    "SessionData",
    "Settlement",
    "SettlementKind",
    "Store",
    "Taken",
    "TranscriptEntry",
    "Turns",
    "WriteBatch",
    "open_store",
]
