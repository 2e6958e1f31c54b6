"""What the PostgreSQL store asks of a connection, typed: the few asyncpg calls it makes.

asyncpg ships no type information, so the store talks to its connections
through :class:`Db`; every driver failure the store turns into a
:class:`~chatlane.errors.StoreError` is one of :data:`DriverError`.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol

import asyncpg

__all__ = ["ConnectError", "Db", "DriverError", "Row"]

Row = Sequence[Any]
"""A result row (asyncpg's ``Record``), read by position."""

DriverError: tuple[type[BaseException], ...] = (
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
    asyncpg.InternalClientError,
    OSError,
    TimeoutError,
    UnicodeEncodeError,
)
"""What a call may raise when the server refuses it, cannot be reached, or cannot be sent
the text (a lone surrogate); or when the driver lost track of a connection the server
dropped (``InternalClientError``: "cannot switch to state …; another operation is in
progress"), which says nothing of whether the statement applied."""

ConnectError: tuple[type[BaseException], ...] = (*DriverError, ValueError)
"""What opening a pool may raise besides: the driver's refusal of a URL it cannot read."""


class Db(Protocol):
    """One connection, as the store's operations use it."""

    def transaction(self) -> AbstractAsyncContextManager[Any]: ...

    def terminate(self) -> None: ...

    async def execute(self, query: str, *args: Any) -> str: ...

    async def fetch(self, query: str, *args: Any) -> list[Row]: ...

    async def fetchrow(self, query: str, *args: Any) -> Row | None: ...

    async def fetchval(self, query: str, *args: Any) -> Any: ...
