"""How long one message's sends may wait out a platform's rate limits, in place.

A long message goes out in parts, and a rate limit met between two parts is
waited out where it is met, so the parts stay in order. What stays true:

* The waits of one message add up to at most its cap (the adapter's, a
  minute), counted over all its parts together, not per part.
* A send of the delivery ledger also has the worker's deadline
  (:attr:`~chatlane.delivery.worker.Attempt.deadline`): a wait is taken only
  if it ends at least :data:`SEND_ROOM` seconds before it, so the send after it
  can finish before the worker gives the attempt up. A wait that does not fit
  is not begun: the adapter raises the rate limit at once, and the worker
  settles it by its kind instead of cancelling a send that was only waiting.
"""

from __future__ import annotations

import math
import time

__all__ = ["SEND_ROOM", "WaitBudget"]

SEND_ROOM = 5.0
"""Seconds kept after a wait, before the attempt's deadline, for the send it waited for."""


class WaitBudget:
    """What one message may still spend waiting (see the module docstring)."""

    __slots__ = ("until",)

    def __init__(self, cap: float, deadline: float = math.inf) -> None:
        """Waits end by ``cap`` seconds from now, and :data:`SEND_ROOM` before ``deadline``
        (``time.monotonic()``) when a deadline is given."""
        self.until = min(time.monotonic() + cap, deadline - SEND_ROOM)
        """``time.monotonic()`` by which every wait must have ended."""

    def allows(self, seconds: float) -> bool:
        """Whether a wait of ``seconds`` starting now fits."""
        return time.monotonic() + seconds <= self.until
