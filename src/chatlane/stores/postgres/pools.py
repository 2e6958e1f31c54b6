"""The PostgreSQL store's connections: a pool for transactions, a small one for reads, and one
kept for liveness.

What stays true:

* Transactions that take a session's lock (acquire, commit, enqueue…) share
  the pool of ``pool_min`` to ``pool_max`` connections, waiting their turn for
  one when all are busy.
* Reads that are a single statement (fence checks, persistent fields, queues,
  answers) never wait for a session's lock, and have a pool of their own
  (:data:`QUICK_POOL`): a backlog of turns never delays the reads the
  runtime's upkeep makes between two renewals.
* Heartbeats and lease renewals have a pool of their own too
  (:data:`LIVENESS_POOL`), which nothing else uses: neither a backlog of turns
  nor a burst of reads (the scheduler's checks of thousands of sessions due
  for an auto-reset, say) ever delays them past a TTL, which would make the
  process look dead and its messages be adopted and run elsewhere while it
  still runs them. Neither takes a session's lock.
* Every connection's ``search_path`` is the store's schema, and stays so: the
  store never changes a pooled session's settings, listens on it (its one
  ``LISTEN`` has a connection of its own, outside the pools:
  :mod:`~chatlane.stores.postgres.wakeups`), or holds a lock past its
  transaction, so a connection given back to the pool is not reset by a query
  of its own (a round trip per call); an open transaction is still rolled back.
* The server ends a transaction of the store's left idle longer than the
  location's ``idle_in_transaction_timeout`` (and with it the connection):
  a process stopped mid-transaction (``SIGSTOP``, a debugger, a frozen VM)
  holds a session's lock and rows only that long, never until it runs again,
  so another process can take its sessions over once their leases expire.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Literal

import asyncpg

from chatlane.errors import StoreError
from chatlane.stores.postgres.db import ConnectError
from chatlane.stores.postgres.url import Location

__all__ = ["LIVENESS_POOL", "QUICK_POOL", "PoolName", "Pools", "open_pools"]

PoolName = Literal["turns", "quick", "liveness"]
"""The store's pools: for transactions, for single-statement reads, for heartbeats and renewals."""

QUICK_POOL = 2
"""Connections the single-statement reads use at most (one is kept open)."""

LIVENESS_POOL = 2
"""Connections heartbeats and renewals use at most (one is kept open): one each, so that
neither waits for the other."""


@dataclass(frozen=True, slots=True)
class Pools:
    """The store's three pools (asyncpg's ``Pool``, untyped)."""

    turns: Any
    quick: Any
    liveness: Any

    def __getitem__(self, name: PoolName) -> Any:
        return getattr(self, name)

    async def close(self) -> None:
        await asyncio.gather(self.turns.close(), self.quick.close(), self.liveness.close())


async def open_pools(location: Location, name: str) -> Pools:
    """Open the three pools.

    :raises StoreError: the server cannot be reached, or refuses the credentials.
    """
    opened: list[Any] = []
    try:
        for least, most in ((1, LIVENESS_POOL), (1, QUICK_POOL)):
            opened.append(await _pool(location, name, least, most))
        opened.append(await _pool(location, name, location.pool_min, location.pool_max))
    except BaseException:
        await asyncio.gather(*(pool.close() for pool in opened))
        raise
    liveness, quick, turns = opened
    return Pools(turns, quick, liveness)


async def _pool(location: Location, name: str, least: int, most: int) -> Any:
    try:
        return await asyncpg.create_pool(
            location.dsn,
            min_size=least,
            max_size=most,
            timeout=location.connect_timeout,
            server_settings={
                "search_path": f'"{location.schema}"',
                "idle_in_transaction_session_timeout": _milliseconds(
                    location.idle_in_transaction_timeout
                ),
            },
            reset=_keep_session,
        )
    except ConnectError as error:
        raise StoreError(f"{name}: cannot connect ({str(error) or type(error).__name__})") from None


def _milliseconds(seconds: float) -> str:
    """A server setting in milliseconds: at least 1, since 0 would turn the timeout off."""
    return str(max(1, round(seconds * 1000)))


async def _keep_session(connection: Any) -> None:
    """Give a connection back as it is (asyncpg has already rolled back any open transaction)."""
