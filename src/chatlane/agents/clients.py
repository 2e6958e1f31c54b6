"""A bounded cache of HTTP clients, one per endpoint, least recently used evicted first.

What stays true:

* At most ``size`` clients are kept; using one more evicts the least
  recently used, so distinct endpoints cannot pin memory without bound.
* An evicted client is closed once nothing uses it any more: a stream that is
  still reading from it is never cut off by the eviction.
* :meth:`ClientCache.aclose` closes every client; those still in use are
  closed when their last use ends.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar


class Closable(Protocol):
    async def close(self) -> None: ...


C = TypeVar("C", bound=Closable)


@dataclass
class _Entry(Generic[C]):
    client: C
    users: int = 0
    evicted: bool = False


class ClientCache(Generic[C]):
    """Clients made by ``make(url)``, at most ``size`` of them (see the module docstring)."""

    def __init__(self, make: Callable[[str], C], size: int) -> None:
        if size < 1:
            raise ValueError("a client cache holds at least one client")
        self._make = make
        self._size = size
        self._entries: OrderedDict[str, _Entry[C]] = OrderedDict()

    def urls(self) -> list[str]:
        """The endpoints with a cached client, least recently used first."""
        return list(self._entries)

    @contextlib.asynccontextmanager
    async def use(self, url: str) -> AsyncIterator[C]:
        """The client for ``url`` (made if need be), kept open while the block runs."""
        entry = await self._entry(url)
        entry.users += 1
        try:
            yield entry.client
        finally:
            entry.users -= 1
            if entry.evicted and not entry.users:
                await entry.client.close()

    async def _entry(self, url: str) -> _Entry[C]:
        entry = self._entries.get(url)
        if entry is not None:
            self._entries.move_to_end(url)
            return entry
        entry = self._entries[url] = _Entry(self._make(url))
        while len(self._entries) > self._size:
            _, oldest = self._entries.popitem(last=False)
            await self._evict(oldest)
        return entry

    @staticmethod
    async def _evict(entry: _Entry[C]) -> None:
        entry.evicted = True
        if not entry.users:
            await entry.client.close()

    async def aclose(self) -> None:
        """Close every client (one in use, when its use ends)."""
        entries, self._entries = list(self._entries.values()), OrderedDict()
        for entry in entries:
            await self._evict(entry)
