"""The bounds of the numbers in the settings records, declared once.

A settings field typed :data:`Seconds`, :data:`PositiveSeconds`,
:data:`LeaseSeconds`, :data:`WholeSeconds`, :data:`Count`,
:data:`CountOrZero` or :data:`Bytes` carries its bounds as a msgspec
``Meta``: a lowest value and a highest. The configuration's decoder checks
them, naming the TOML key; settings built in code (a
:class:`~chatlane.testing.GatewayHarness` keyword, a ``RuntimeSettings(...)``
call) are checked against the same bounds by :func:`check_bounds`: a wrong
value stops construction with a :class:`~chatlane.errors.ConfigError` naming
the field, never a ``TypeError`` deep inside a turn, nor a number a store
cannot hold.

What stays true:

* Every count is at most :data:`MAX_COUNT` and every byte count at most
  :data:`MAX_BYTES`, so every store holds it (PostgreSQL's and SQLite's
  integers, the numbers of Redis's scripts).
* Every duration is finite and at most :data:`MAX_SECONDS`, so a moment that
  far ahead is still exact where a store keeps it (Redis's scripts count
  microseconds in a double) and the event loop's clock plus it is finite.
* A bound may be stricter in the configuration than in code
  (:data:`CONFIGURED_GE` in the ``Meta``'s ``extra``): a lease TTL read from
  the file is at least :data:`CONFIGURED_LEASE_TTL`, while code (tests that
  watch leases expire) may go down to :data:`MIN_LEASE_TTL`.
  :func:`out_of_bounds` with ``configured=True`` applies it.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Iterator, Mapping
from typing import Annotated, Any, Final, NamedTuple

import msgspec

from chatlane.errors import ConfigError

MAX_SECONDS: Final = 1_000_000_000
"""The longest duration a setting takes (about 31 years). Now plus it, in microseconds,
stays below 2**53, so Redis's scripts hold the moment exactly in a double."""
MAX_COUNT: Final = 1_000_000_000
"""The largest count a setting takes (sessions, messages, jobs, attempts): it fits a
32-bit integer, so every store's integers and parameters hold it."""
MAX_BYTES: Final = 1 << 40
"""The largest byte count a setting takes (1 TiB; a 64-bit integer holds it)."""
MIN_LEASE_TTL: Final = 0.1
"""The shortest lease TTL in code: a turn is given up when its lease has less than
:func:`~chatlane.runtime.upkeep.expiry_margin` (at least 0.05 s) left, so a TTL near that
would see every turn lose its lease at once."""
CONFIGURED_LEASE_TTL: Final = 1.0
"""The shortest lease TTL the configuration takes: a renewal (every ``ttl / 10``) has nine
tenths of it to come back from the store before the turn is given up, and a store over a
network needs that."""
CONFIGURED_GE: Final = "configured_ge"
"""The ``Meta.extra`` key of a lowest value that only the configuration enforces."""

Seconds = Annotated[float, msgspec.Meta(ge=0, le=MAX_SECONDS)]
"""A finite duration from 0 to :data:`MAX_SECONDS` (``inf`` and ``nan`` are refused)."""
PositiveSeconds = Annotated[float, msgspec.Meta(gt=0, le=MAX_SECONDS)]
"""A finite duration > 0, at most :data:`MAX_SECONDS`."""
LeaseSeconds = Annotated[
    float,
    msgspec.Meta(ge=MIN_LEASE_TTL, le=MAX_SECONDS, extra={CONFIGURED_GE: CONFIGURED_LEASE_TTL}),
]
"""A lease TTL: from :data:`MIN_LEASE_TTL` (:data:`CONFIGURED_LEASE_TTL` when configured)
to :data:`MAX_SECONDS`."""
WholeSeconds = Annotated[int, msgspec.Meta(gt=0, le=MAX_SECONDS)]
"""A whole number of seconds > 0, at most :data:`MAX_SECONDS`."""
Count = Annotated[int, msgspec.Meta(gt=0, le=MAX_COUNT)]
"""A whole number from 1 to :data:`MAX_COUNT`."""
CountOrZero = Annotated[int, msgspec.Meta(ge=0, le=MAX_COUNT)]
"""A whole number from 0 to :data:`MAX_COUNT` (0 usually meaning "unlimited" or "off")."""
Bytes = Annotated[int, msgspec.Meta(gt=0, le=MAX_BYTES)]
"""A whole number of bytes from 1 to :data:`MAX_BYTES`."""


class Bound(NamedTuple):
    """A bounded field: its name, whether it is a count, and its range."""

    name: str
    whole: bool
    meta: msgspec.Meta
    optional: bool
    """``None`` is taken too (the field is ``… | None``)."""

    def lowest(self, *, configured: bool) -> tuple[float, bool]:
        """The lowest value and whether it is taken itself (``>=``) or only above (``>``)."""
        extra = self.meta.extra or {}
        if configured and CONFIGURED_GE in extra:
            return extra[CONFIGURED_GE], True
        if self.meta.ge is not None:
            return self.meta.ge, True
        return self.meta.gt if self.meta.gt is not None else -math.inf, False

    def admits(self, value: object, *, configured: bool = False) -> bool:
        """Whether ``value`` is a number of the right kind within the range."""
        if value is None:
            return self.optional
        if isinstance(value, bool) or not isinstance(value, int | float):
            return False
        if (self.whole and not isinstance(value, int)) or not math.isfinite(value):
            return False
        low, inclusive = self.lowest(configured=configured)
        highest = self.meta.le if self.meta.le is not None else math.inf
        return (value >= low if inclusive else value > low) and value <= highest

    def expected(self, *, configured: bool = False) -> str:
        """The range in words: ``a whole number > 0 and <= 1000000000``."""
        low, inclusive = self.lowest(configured=configured)
        return expectation(self.whole, low, inclusive, self.meta.le)


def expectation(whole: bool, low: float, inclusive: bool, high: float | None) -> str:
    """What a bounded number must be, in words (one wording for the decoder and the checks)."""
    words = f"a {'whole' if whole else 'finite'} number {'>=' if inclusive else '>'} {_shown(low)}"
    return words if high is None else f"{words} and <= {_shown(high)}"


def _shown(number: float) -> str:
    return str(int(number)) if float(number).is_integer() else repr(number)


def check_bounds(record: object) -> None:
    """Check every bounded field of ``record`` (see the module docstring).

    :raises ConfigError: naming the first field out of its bounds.
    """
    for bound in bounds(type(record)):
        value = getattr(record, bound.name)
        if not bound.admits(value):
            raise ConfigError(
                f"{type(record).__name__}.{bound.name} = {value!r}: expected {bound.expected()}"
            )


class OutOfBounds(NamedTuple):
    """A field found out of its bounds: its path from the record checked, value and range."""

    path: tuple[str, ...]
    value: object
    expected: str


def out_of_bounds(record: object, *, configured: bool = False) -> OutOfBounds | None:
    """The first bounded field of ``record``, or of a record it holds, out of its bounds.

    Records are dataclasses and msgspec structs, held in a field or as the values of a
    mapping (the path then names the key). ``configured``: apply the configuration's
    stricter lowest values too.
    """
    for path, inner in _records(record, ()):
        for bound in bounds(type(inner)):
            value = getattr(inner, bound.name)
            if not bound.admits(value, configured=configured):
                return OutOfBounds(
                    (*path, bound.name), value, bound.expected(configured=configured)
                )
    return None


def _records(record: object, path: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], object]]:
    """``record`` and every record it holds, depth first, with their paths."""
    yield path, record
    for name in _field_names(record):
        value = getattr(record, name)
        if isinstance(value, Mapping):
            for key, item in value.items():
                if _field_names(item):
                    yield from _records(item, (*path, name, str(key)))
        elif _field_names(value):
            yield from _records(value, (*path, name))


def _field_names(record: object) -> tuple[str, ...]:
    if isinstance(record, msgspec.Struct):
        return record.__struct_fields__
    if dataclasses.is_dataclass(record) and not isinstance(record, type):
        return tuple(f.name for f in dataclasses.fields(record))
    return ()


_BOUNDS: dict[type[Any], tuple[Bound, ...]] = {}


def bounds(cls: type[Any]) -> tuple[Bound, ...]:
    """The bounded fields of ``cls``, read once from its annotations."""
    cached = _BOUNDS.get(cls)
    if cached is not None:
        return cached
    found: list[Bound] = []
    for name, hint in typing.get_type_hints(cls, include_extras=True).items():
        optional = typing.get_origin(hint) in (typing.Union, types.UnionType)
        for option in typing.get_args(hint) if optional else (hint,):
            if typing.get_origin(option) is not Annotated:
                continue
            base, *extras = typing.get_args(option)
            for meta in extras:
                if isinstance(meta, msgspec.Meta) and base in (int, float):
                    found.append(Bound(name, base is int, meta, optional))
    _BOUNDS[cls] = tuple(found)
    return _BOUNDS[cls]
