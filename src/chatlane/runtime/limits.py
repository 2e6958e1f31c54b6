"""Checks for the numbers in the runtime's settings records.

Settings built in code (a :class:`~chatlane.testing.GatewayHarness` keyword,
a ``RuntimeSettings(...)`` call) are checked as the configuration file is:
a wrong value stops construction with a :class:`~chatlane.errors.ConfigError`
naming the field, never a ``TypeError`` deep inside a turn.
"""

from __future__ import annotations

import math

from chatlane.errors import ConfigError


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
