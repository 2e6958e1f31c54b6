"""What an adapter remembers for a while: the last few thousand keys it noted, oldest forgotten."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

__all__ = ["Recent"]


class Recent:
    """The ``kept`` keys noted last, each with a value (a time); older ones are forgotten first."""

    def __init__(self, kept: int) -> None:
        self._kept = kept
        self._values: OrderedDict[Hashable, float] = OrderedDict()

    def __contains__(self, key: Hashable) -> bool:
        return key in self._values

    def get(self, key: Hashable) -> float | None:
        return self._values.get(key)

    def note(self, key: Hashable, value: float = 0.0) -> bool:
        """Remember ``key`` (as the newest) with ``value``; whether it was new."""
        new = self._values.pop(key, None) is None
        self._values[key] = value
        while len(self._values) > self._kept:
            self._values.popitem(last=False)
        return new
