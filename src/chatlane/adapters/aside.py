"""Best-effort sends that hold their caller up only briefly.

An adapter's acknowledgement ("Queued for the next turn", sent outside the
delivery ledger) and its own notices to a sender (:func:`sent_aside`) are
made from the path that takes a message in: the busy policy acknowledges a
message before its sender's next one is handed on.
A platform's rate limit waited out there (up to a minute) would hold that
intake up, and with it messages not yet held by chatlane. What stays true:

* Each send runs as a task of its own; its caller waits for it at most
  :data:`PATIENCE` seconds, then goes on while the send finishes. A send that
  goes through at once is done before its caller goes on, so it keeps its
  place before what the caller sends next.
* A send never raises into its caller: the adapter's send logs its own
  failures; anything else is logged here.
* :meth:`Aside.aclose` cancels the sends still running and waits for them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from typing import Any

from chatlane.identity import NO_SESSION
from chatlane.types import Outbound, OutboundKind

__all__ = ["PATIENCE", "Aside", "sent_aside"]

log = logging.getLogger("chatlane.adapters")

PATIENCE = 1.0
"""Seconds a caller waits for a best-effort send before it goes on without it."""


def sent_aside(outbound: Outbound) -> bool:
    """Whether ``outbound`` is sent from the path that takes messages in: an
    acknowledgement, or an adapter's own notice to a sender (no session: a stranger told
    they are not allowed, a file refused, a kind of message not read)."""
    return outbound.kind is OutboundKind.ACK or outbound.session_key == NO_SESSION


class Aside:
    """The best-effort sends of one adapter (see the module docstring)."""

    def __init__(self, patience: float = PATIENCE) -> None:
        self.patience = patience
        self._running: set[asyncio.Task[None]] = set()

    async def deliver(self, outbound: Outbound, sending: Coroutine[Any, Any, None]) -> None:
        """Run ``sending``, the send of ``outbound``: aside if :func:`sent_aside` says so,
        else in the caller, to its end (a reply sent without the ledger keeps its turn's
        order: the turn's next reply comes after it)."""
        if sent_aside(outbound):
            await self.send(sending)
        else:
            await sending

    async def send(self, sending: Coroutine[Any, Any, None]) -> None:
        """Run ``sending``; return once it is done, or after :attr:`patience` seconds."""
        task = asyncio.create_task(self._logged(sending))
        self._running.add(task)
        task.add_done_callback(self._running.discard)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(task), self.patience)

    @property
    def running(self) -> int:
        """How many sends are still running."""
        return len(self._running)

    async def drained(self) -> None:
        """Wait until every send started so far is done (for shutting down in order, tests)."""
        while self._running:
            await asyncio.gather(*self._running, return_exceptions=True)

    async def aclose(self) -> None:
        """Cancel the sends still running and wait for them."""
        running = list(self._running)
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)

    @staticmethod
    async def _logged(sending: Coroutine[Any, Any, None]) -> None:
        try:
            await sending
        except Exception:
            log.exception("a best-effort send failed")
