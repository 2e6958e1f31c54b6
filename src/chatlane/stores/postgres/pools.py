"""The PostgreSQL store's connections: a pool for transactions, and a small one for quick calls.

What stays true:

* Transactions that take a session's lock (acquire, commit, enqueue…) share
  the pool of ``pool_min`` to ``pool_max`` connections, waiting their turn for
  one when all are busy.
* Quick calls — heartbeats and lease renewals, and every read that is a
  single statement (fence checks, persistent fields, queues, answers) — never
  wait for a session's lock, and have a pool of their own
  (:data:`QUICK_POOL`). A backlog of turns therefore never delays them: not
  the heartbeats and renewals past a TTL (which would make the process look
  dead and its messages be adopted and run elsewhere while it still runs
  them), nor the reads the runtime's upkeep makes between two renewals.
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
from typing import Any

import asyncpg

from chatlane.errors import StoreError
from chatlane.stores.postgres.db import ConnectError
from chatlane.stores.postgres.url import Location

__all__ = ["QUICK_POOL", "Pools", "open_pools"]

QUICK_POOL = 2
"""Connections the quick calls use at most (one is kept open)."""


@dataclass(frozen=True, slots=True)
class Pools:
    """The store's two pools (asyncpg's ``Pool``, untyped)."""

    turns: Any
    quick: Any

    async def close(self) -> None:
        await asyncio.gather(self.turns.close(), self.quick.close())


async def open_pools(location: Location, name: str) -> Pools:
    """Open both pools.

    :raises StoreError: the server cannot be reached, or refuses the credentials.
    """
    quick = await _pool(location, name, 1, QUICK_POOL)
    try:
        turns = await _pool(location, name, location.pool_min, location.pool_max)
    except BaseException:
        await quick.close()
        raise
    return Pools(turns, quick)


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
