"""The bounds of the numbers in the runtime's settings records, declared once.

A settings field typed :data:`Seconds`, :data:`PositiveSeconds`,
:data:`Count` or :data:`CountOrZero` carries its bounds as a msgspec ``Meta``.
The configuration's decoder checks them, naming the TOML key; settings built
in code (a :class:`~chatlane.testing.GatewayHarness` keyword, a
``RuntimeSettings(...)`` call) are checked against the same bounds by
:func:`check_bounds`: a wrong value stops construction with a
:class:`~chatlane.errors.ConfigError` naming the field, never a ``TypeError``
deep inside a turn.
"""

from __future__ import annotations

import math
import sys
import typing
from typing import Annotated, Any

import msgspec

from chatlane.errors import ConfigError

_FINITE = sys.float_info.max

Seconds = Annotated[float, msgspec.Meta(ge=0, le=_FINITE)]
"""A finite duration >= 0 (``inf`` and ``nan`` are refused)."""
PositiveSeconds = Annotated[float, msgspec.Meta(gt=0, le=_FINITE)]
"""A finite duration > 0."""
Count = Annotated[int, msgspec.Meta(gt=0)]
"""A whole number > 0."""
CountOrZero = Annotated[int, msgspec.Meta(ge=0)]
"""A whole number >= 0 (0 usually meaning "unlimited" or "off")."""

_Bound = tuple[str, bool, bool]
"""A bounded field: its name, whether it is a count, whether 0 is out of range."""


def check_bounds(record: object) -> None:
    """Check every bounded field of ``record`` (see the module docstring).

    :raises ConfigError: naming the first field out of its bounds.
    """
    bounds = _bounds(type(record))
    positive = tuple(name for name, _, strict in bounds if strict)
    non_negative = tuple(name for name, _, strict in bounds if not strict)
    whole = tuple(name for name, count, _ in bounds if count)
    require_numbers(record, positive=positive, non_negative=non_negative, whole=whole)


_BOUNDS: dict[type[Any], tuple[_Bound, ...]] = {}


def _bounds(cls: type[Any]) -> tuple[_Bound, ...]:
    """The bounded fields of ``cls``, read once from its annotations."""
    cached = _BOUNDS.get(cls)
    if cached is not None:
        return cached
    found: list[_Bound] = []
    for name, hint in typing.get_type_hints(cls, include_extras=True).items():
        if typing.get_origin(hint) is not Annotated:
            continue
        base, *extras = typing.get_args(hint)
        for meta in extras:
            if isinstance(meta, msgspec.Meta) and (meta.gt == 0 or meta.ge == 0):
                found.append((name, base is int, meta.gt == 0))
    _BOUNDS[cls] = tuple(found)
    return _BOUNDS[cls]


def require_numbers(
    record: object,
    *,
    positive: tuple[str, ...] = (),
    non_negative: tuple[str, ...] = (),
    whole: tuple[str, ...] = (),
) -> None:
    """Check that each named field of ``record`` is a finite number in its range.

    Fields also named in ``whole`` are counts: they must be ``int``.

    :raises ConfigError: naming the first field that is not.
    """
    for names, lowest in ((positive, "> 0"), (non_negative, ">= 0")):
        for name in names:
            value = getattr(record, name)
            if not _in_range(value, strictly_positive=lowest == "> 0"):
                raise ConfigError(
                    f"{type(record).__name__}.{name} = {value!r}: expected a finite number {lowest}"
                )
            if name in whole and not isinstance(value, int):
                raise ConfigError(
                    f"{type(record).__name__}.{name} = {value!r}: expected a whole number {lowest}"
                )


def _in_range(value: object, *, strictly_positive: bool) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    if not math.isfinite(value):
        return False
    return value > 0 if strictly_positive else value >= 0
