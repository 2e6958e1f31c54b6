"""A clock for code that takes one: monotonic seconds that move only when a test moves them."""

from __future__ import annotations


class Clock:
    """Monotonic seconds that move only when a test moves them (set :attr:`now`)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now
