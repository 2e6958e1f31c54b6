"""The ids a store makes: lease tokens and conversation ids, the same for every backend."""

from __future__ import annotations

import itertools
import os
import secrets
import string
import threading
import time

__all__ = ["ProcessIds", "new_conversation_id", "new_token", "time_prefix"]


class ProcessIds:
    """Ids unique across processes: 64 random bits drawn once per process, then a count.

    Cheaper than drawing random bits for every id. A forked child draws its
    own prefix (and counts from 1 again), so parent and child never hand out
    the same id.
    """

    def __init__(self) -> None:
        self._redraw()
        os.register_at_fork(after_in_child=self._redraw)

    def _redraw(self) -> None:
        self._prefix, self._numbers = secrets.token_hex(8), itertools.count(1)

    def next(self) -> str:
        """A new id: ``<prefix>-<count>``."""
        return f"{self._prefix}-{next(self._numbers)}"


_tokens = ProcessIds()

_DIGITS = string.digits + string.ascii_uppercase + string.ascii_lowercase
"""Base 62 in ASCII order, so equal-width numbers sort as their text does."""
_STAMP_WIDTH = 8
"""Milliseconds since 1970 fit in 8 base-62 digits for the next few thousand years."""
_RANDOM_WIDTH = 11
"""64 random bits fit in 11 base-62 digits."""


def time_prefix() -> str:
    """This millisecond since 1970 as 12 hex digits: ids that start with it sort by the time
    they were made, so a store's index of them grows at its end."""
    return f"{time.time_ns() // 1_000_000:012x}"


def new_token() -> str:
    """A lease token: never reused in this process or a forked one, unguessable from another."""
    return _tokens.next()


def new_conversation_id() -> str:
    """A conversation id: URL-safe, unguessable (64 random bits), and in creation order.

    It starts with a millisecond stamp that only grows in this process, so a
    later id sorts after an earlier one from the same process (and roughly
    after those of other processes). A store's indexes on conversation ids
    therefore grow at their end instead of at random places.
    """
    return "c_" + _base62(_stamp(), _STAMP_WIDTH) + _base62(secrets.randbits(64), _RANDOM_WIDTH)


class _Stamps:
    """Milliseconds since 1970, each one more than the last if the clock did not move on."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # stores make ids on their own threads too
        self._last = 0

    def __call__(self) -> int:
        with self._lock:
            self._last = max(time.time_ns() // 1_000_000, self._last + 1)
            return self._last


_stamp = _Stamps()


def _base62(number: int, width: int) -> str:
    digits = []
    for _ in range(width):
        number, digit = divmod(number, 62)
        digits.append(_DIGITS[digit])
    return "".join(reversed(digits))
