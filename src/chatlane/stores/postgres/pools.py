"""The PostgreSQL store's connections: a pool for turns, and one connection for upkeep.

What stays true:

* A turn's calls share the pool of ``pool_min`` to ``pool_max`` connections,
  waiting their turn for one when all are busy.
* Heartbeats, renewals and fence checks — the calls that keep a process's
  leases and liveness — have a connection of their own, so a backlog of turns
  never delays them past a TTL (which would make the process look dead and
  its messages be adopted and run elsewhere while it still runs them).
* Every connection's ``search_path`` is the store's schema.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import asyncpg

from chatlane.errors import StoreError
from chatlane.stores.postgres.db import ConnectError
from chatlane.stores.postgres.url import Location

__all__ = ["Pools", "open_pools"]


@dataclass(frozen=True, slots=True)
class Pools:
    """The store's two pools (asyncpg's ``Pool``, untyped)."""

    turns: Any
    upkeep: Any

    async def close(self) -> None:
        await asyncio.gather(self.turns.close(), self.upkeep.close())


async def open_pools(location: Location, name: str) -> Pools:
    """Open both pools.

    :raises StoreError: the server cannot be reached, or refuses the credentials.
    """
    upkeep = await _pool(location, name, 1, 1)
    try:
        turns = await _pool(location, name, location.pool_min, location.pool_max)
    except BaseException:
        await upkeep.close()
        raise
    return Pools(turns, upkeep)


async def _pool(location: Location, name: str, least: int, most: int) -> Any:
    try:
        return await asyncpg.create_pool(
            location.dsn,
            min_size=least,
            max_size=most,
            timeout=location.connect_timeout,
            server_settings={"search_path": f'"{location.schema}"'},
        )
    except ConnectError as error:
        raise StoreError(f"{name}: cannot connect ({str(error) or type(error).__name__})") from None
