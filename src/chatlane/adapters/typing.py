"""Typing indicators: a chat sees that its message is being worked on, for as long as it is.

A chat adapter calls :meth:`TypingIndicators.show` for each message the
gateway accepted; the indicator runs beside the turn. What stays true:

* At most one indicator per chat and thread at a time: a second message to
  a chat whose indicator runs changes nothing.
* It shows at once, and again every :attr:`TypingIndicators.every` seconds
  (a platform shows one typing action for about five), while ``busy(key)``
  says the session still has a message this process holds unanswered; it
  stops at the first look that finds none, after ``limit`` seconds, or when
  the adapter closes.
* It never delays, fails or reorders a message: it runs in a task of its
  own, and a send that fails is logged at debug level and ends that
  indicator (the reply still comes).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from chatlane.types import SessionKey, Target

__all__ = ["TYPING_EVERY", "TYPING_LIMIT", "TypingIndicators"]

log = logging.getLogger("chatlane.adapters.typing")

TYPING_EVERY = 4.0
"""Seconds between two typing actions: inside the five a platform shows one for."""
TYPING_LIMIT = 600.0
"""Most seconds one indicator runs, however long its session stays busy."""


class TypingIndicators:
    """Shows typing in chats whose sessions are busy (see the module docstring).

    :param send: shows the typing action in a chat and thread once.
    :param busy: whether a session still has a message this process holds unanswered.
    """

    def __init__(
        self,
        send: Callable[[Target], Awaitable[object]],
        busy: Callable[[SessionKey], bool],
        *,
        every: float = TYPING_EVERY,
        limit: float = TYPING_LIMIT,
    ) -> None:
        self._send = send
        self._busy = busy
        self.every = every
        self.limit = limit
        self._running: dict[Target, asyncio.Task[None]] = {}

    def show(self, key: SessionKey, target: Target) -> None:
        """Show typing in ``target`` while ``key`` is busy, unless it already shows."""
        if target in self._running or not self._busy(key):
            return
        task = asyncio.create_task(self._keep(key, target), name=f"chatlane-typing-{target}")
        self._running[target] = task
        task.add_done_callback(lambda _: self._running.pop(target, None))

    def showing(self) -> list[Target]:
        """The chats and threads whose indicator runs now."""
        return list(self._running)

    async def settled(self) -> None:
        """Return once every indicator running now has stopped."""
        await asyncio.gather(*self._running.values(), return_exceptions=True)

    async def aclose(self) -> None:
        """Stop every indicator."""
        tasks = list(self._running.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _keep(self, key: SessionKey, target: Target) -> None:
        ends = time.monotonic() + self.limit
        while self._busy(key) and time.monotonic() < ends:
            try:
                await self._send(target)
            except Exception as error:  # an indicator is never worth a failure
                log.debug("typing in %s failed: %s", target, error)
                return
            await asyncio.sleep(self.every)
