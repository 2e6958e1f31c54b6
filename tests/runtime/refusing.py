"""A memory store that refuses chosen calls as an outage would, for the outage tests."""

from __future__ import annotations

import collections
import inspect
from collections.abc import Callable
from typing import Any

from chatlane.errors import StoreError
from chatlane.identity import SessionKey
from chatlane.stores import MemoryStore, PendingRecord


class Refusing(MemoryStore):
    """A memory store whose calls ``refuses(name)`` picks raise :class:`StoreError`.

    A refused call changes nothing, as when a SQLite write lock is held past
    the busy timeout or a server cannot be reached. ``refused`` counts them
    by method.
    """

    applies = False
    """Whether a refused call runs first (see :class:`LosingAnswers`)."""

    def __init__(self, refuses: Callable[[str], bool]) -> None:
        super().__init__()
        self.refuses = refuses
        self.refused: collections.Counter[str] = collections.Counter()

    def __getattribute__(self, name: str) -> Any:
        attr = super().__getattribute__(name)
        if name.startswith("_") or name == "aclose" or not inspect.iscoroutinefunction(attr):
            return attr
        refuses = super().__getattribute__("refuses")

        async def maybe_refused(*args: Any, **kwargs: Any) -> Any:
            if refuses(name):
                self.refused[name] += 1
                if self.applies:
                    await attr(*args, **kwargs)
                raise StoreError(f"the store refused {name}", maybe_applied=self.applies)
            return await attr(*args, **kwargs)

        return maybe_refused


class LosingAnswers(Refusing):
    """A memory store whose calls ``refuses(name)`` picks run, then raise :class:`StoreError`.

    As a Redis or PostgreSQL call whose answer a broken connection lost on
    its way back: the store changed, and its caller cannot tell.
    """

    applies = True
    answers_may_be_lost = True


def first_of(*names: str) -> Callable[[str], bool]:
    """Refuse the first call of each of ``names``, and nothing else."""
    left = set(names)

    def refuses(name: str) -> bool:
        if name in left:
            left.discard(name)
            return True
        return False

    return refuses


def every(*names: str) -> Callable[[str], bool]:
    """Refuse every call of ``names``."""
    return lambda name: name in names


class FailingAdoption(MemoryStore):
    """A memory store whose adoption of ``failing``'s records fails once: before it
    changed anything, or (``applies``) after, as when its answer is lost. It refuses
    the next ``reads_refused`` reads of a session's queue, and the next
    ``scans_refused`` listings of the sessions with queued records."""

    answers_may_be_lost = True

    def __init__(self, failing: SessionKey, *, applies: bool) -> None:
        super().__init__()
        self.failing: SessionKey | None = failing
        self.applies = applies
        self.reads_refused = 0
        self.scans_refused = 0

    async def adopt(self, key: SessionKey, *args: Any, **options: Any) -> list[int]:
        if key != self.failing:
            return await super().adopt(key, *args, **options)
        self.failing = None
        if self.applies:
            await super().adopt(key, *args, **options)
        raise StoreError("adoption failed (test)", maybe_applied=self.applies)

    async def pending(self, key: SessionKey) -> list[PendingRecord]:
        if self.reads_refused:
            self.reads_refused -= 1
            raise StoreError("read refused (test)", maybe_applied=False)
        return await super().pending(key)

    async def pending_keys(self) -> list[SessionKey]:
        if self.scans_refused:
            self.scans_refused -= 1
            raise StoreError("scan refused (test)", maybe_applied=False)
        return await super().pending_keys()
