"""The PostgreSQL store's text: every ``str`` kept exactly, NUL included.

PostgreSQL's ``text`` cannot hold U+0000 (NUL), which the other stores keep
like any other character: a user's message may carry one, and so may an id,
a key or an agent's reply. The store therefore escapes its text at its
boundary with the server, in :class:`Escaped`, the connection every call
talks through: each ``str`` (alone or in an array) sent as a parameter is
escaped, each read back unescaped. What stays true:

* The escape is U+0001 (SOH): a NUL is stored as U+0001 U+0001, a U+0001 as
  U+0001 U+0002, every other character as it is. Text without either is sent
  and read as it is (what almost all text is: the cost is a scan for the two).
* It is reversible, and keeps order and equality: ``"C"`` collation compares
  the stored text byte by byte, and the escaped forms order as the characters
  they stand for (U+0000 < U+0001 < everything else), so keys and ids sort and
  compare as in the other stores; an empty text stays empty; a prefix stays a
  prefix.
* Everything the store hashes, locks or notifies on is computed either in
  Python from the text as given (``NOTIFY`` payloads, the order of target
  locks) or in SQL from the escaped text (advisory locks): each always from
  the same form, so every process agrees.
* Persistent values are JSON, ASCII-escaped (:mod:`chatlane.stores.codec`): they
  never hold either character raw, and pass through unchanged.
* A lone surrogate, which no UTF-8 can carry, is still refused: the driver
  cannot encode it, and the call fails with
  :class:`~chatlane.errors.StoreError` before anything is sent.

Schema step 6 (:mod:`~chatlane.stores.postgres.schema`) escaped the U+0001
characters already stored, so text written before the escape reads back as it was.
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from typing import Any

from chatlane.stores.postgres.db import Db, Row

__all__ = ["Escaped", "escape", "unescape"]

_NUL = "\x00"
_SOH = "\x01"


def escape(text: str) -> str:
    """``text`` as the store keeps it: U+0001 as U+0001 U+0002, NUL as U+0001 U+0001."""
    if _SOH in text:
        text = text.replace(_SOH, "\x01\x02")
    if _NUL in text:
        text = text.replace(_NUL, "\x01\x01")
    return text


def unescape(text: str) -> str:
    """The text :func:`escape` made ``text`` from.

    The pairs are read left to right, so no U+0001 of one is taken for the start of another.
    """
    if _SOH not in text:
        return text
    return text.replace("\x01\x01", _NUL).replace("\x01\x02", _SOH)


def _sent(value: Any) -> Any:
    """A parameter as the server is sent it: a text (or an array's texts) escaped."""
    if type(value) is str:
        return escape(value)
    if type(value) is list:
        return [escape(v) if type(v) is str else v for v in value]
    return value


def _read(value: Any) -> Any:
    """A value as the server sent it, its text (or its array's texts) unescaped."""
    if type(value) is str:
        return unescape(value)
    if type(value) is list:
        return [unescape(v) if type(v) is str else v for v in value]
    return value


def _row(row: Row) -> Row:
    """``row`` with its texts unescaped: the row itself when none needs it (most rows)."""
    for value in row:
        if type(value) is list or (type(value) is str and _SOH in value):
            return tuple(_read(v) for v in row)
    return row


class Escaped:
    """A connection (:class:`~chatlane.stores.postgres.db.Db`) whose text is escaped on the
    way to the server and unescaped on the way back (see the module docstring)."""

    __slots__ = ("_db",)

    def __init__(self, db: Db) -> None:
        self._db = db

    def transaction(self) -> AbstractAsyncContextManager[Any]:
        return self._db.transaction()

    def terminate(self) -> None:
        self._db.terminate()

    async def execute(self, query: str, *args: Any) -> str:
        return await self._db.execute(query, *map(_sent, args))

    async def fetch(self, query: str, *args: Any) -> list[Row]:
        return [_row(row) for row in await self._db.fetch(query, *map(_sent, args))]

    async def fetchrow(self, query: str, *args: Any) -> Row | None:
        row = await self._db.fetchrow(query, *map(_sent, args))
        return None if row is None else _row(row)

    async def fetchval(self, query: str, *args: Any) -> Any:
        return _read(await self._db.fetchval(query, *map(_sent, args)))
