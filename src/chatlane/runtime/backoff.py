"""Store calls that outlast an outage: retried with exponential backoff and jitter.

What stays true:

* Only :class:`~chatlane.errors.StoreError` (the store could not be reached
  or used) is retried; every answer the store gave (a stale generation, an
  answered message, a lost lease) is the caller's to handle, and so is
  :class:`~chatlane.errors.StoreDamaged`: damage does not pass by waiting.
* A call is retried only while ``wanted()`` holds; once it does not, the last
  error is raised, so a caller never waits on a store for work that no longer
  matters (a fenced turn, a closing engine).
* Retries are logged once per outage as a WARNING, then quietly.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable, Mapping
from typing import TypeVar

from chatlane.errors import StoreDamaged, StoreError

log = logging.getLogger("chatlane.runtime")

T = TypeVar("T")

FIRST_DELAY = 0.05
"""Seconds before the first retry; each retry doubles it, up to :data:`MAX_DELAY`."""

MAX_DELAY = 2.0
"""The longest wait between two tries."""


def retryable(error: StoreError) -> bool:
    """Whether waiting may cure ``error`` (an outage may pass; damage does not)."""
    return not isinstance(error, StoreDamaged)


async def retry_store(
    call: Callable[[], Awaitable[T]],
    *,
    wanted: Callable[[], bool],
    what: str,
    fields: Mapping[str, object] | None = None,
) -> T:
    """``await call()``, again after each :class:`StoreError` while ``wanted()`` holds.

    ``wanted()`` is asked after each failure and again just before each retry:
    a call no longer wanted once the wait is over (a turn gone stale
    meanwhile must not commit) is not made.

    :raises StoreError: the last failure, once ``wanted()`` is false.
    """
    delay, warned = FIRST_DELAY, False
    while True:
        try:
            return await call()
        except StoreError as error:
            if not retryable(error) or not wanted():
                raise
            level = logging.DEBUG if warned else logging.WARNING
            log.log(level, "%s failed, retrying: %s", what, error, extra=fields)
            warned, last = True, error
        await asyncio.sleep(delay * random.uniform(0.5, 1.0))
        delay = min(delay * 2, MAX_DELAY)
        if not wanted():
            raise last
