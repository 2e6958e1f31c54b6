"""Streamed replies shown as one message, edited as the chunks come (Slack, Discord).

What stays true:

* A draft is shown only once a stream has lasted its interval without its
  reply, so a quick reply is posted once, as it is; after that the draft
  message is edited at most once per interval (platforms rate-limit edits,
  and a message that changes faster cannot be read anyway).
* Drafts are best-effort, as streamed chunks are everywhere: a draft that
  cannot be shown or edited stops, and the reply still comes through the
  delivery ledger. :meth:`Draft.finish` returns once no edit is under way, so
  no late edit of the draft can ever overwrite the reply that replaces it.
* There is at most one draft per session: a stream of a newer turn stops the
  draft of an older one. A draft is kept until its reply replaced it, so a
  retried reply still replaces it instead of being posted beside it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from chatlane.errors import DeliveryFailed
from chatlane.types import Outbound, OutboundKind, SessionKey

__all__ = ["EDIT_INTERVAL", "Draft", "Drafts", "Show"]

log = logging.getLogger("chatlane.adapters.drafts")

EDIT_INTERVAL = 1.0
"""Seconds before a stream's first draft, and at least between two edits of it."""

Show = Callable[[str | None, str], Awaitable[str]]
"""Shows a draft's text: posts it (no message id yet) or edits the message it names;
the message's id.

:raises DeliveryFailed: if the platform did not take it.
"""


class Draft:
    """The text streamed so far for one turn, shown as one message edited in place."""

    def __init__(self, show: Show, interval: float = EDIT_INTERVAL) -> None:
        self._show = show
        self._interval = interval
        self._chunks: list[str] = []
        self._changed = asyncio.Event()
        self._closed = asyncio.Event()
        self._shown_at = 0.0
        self.ts: str | None = None
        """The draft message's id (Slack's ``ts``), once it was posted."""
        self._task = asyncio.create_task(self._run())

    def add(self, chunk: str) -> None:
        """Append ``chunk``; it is shown with the next edit."""
        self._chunks.append(chunk)
        self._changed.set()

    def stop(self) -> None:
        """Edit no more (the edit under way, if any, still ends)."""
        self._closed.set()
        self._changed.set()

    async def stopped(self) -> None:
        """Stop, and wait until no edit is under way."""
        self.stop()
        await self._task

    async def finish(self) -> str | None:
        """Stop, and wait until no edit is under way and the interval since the last one
        passed; the draft message's id (None if none was posted)."""
        await self.stopped()
        if self.ts is not None:
            loop = asyncio.get_running_loop()
            await asyncio.sleep(max(0.0, self._shown_at + self._interval - loop.time()))
        return self.ts

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        shown, due = "", loop.time() + self._interval
        while await self._open_until(due):
            await self._changed.wait()
            self._changed.clear()
            text = "".join(self._chunks)
            if self._closed.is_set() or text == shown:
                continue
            try:
                self.ts = await self._show(self.ts, text)
            except DeliveryFailed as error:
                log.info("a streamed draft stopped: %s", error)
                return
            shown, self._shown_at = text, loop.time()
            due = self._shown_at + self._interval

    async def _open_until(self, due: float) -> bool:
        """Wait until the loop's time ``due``; False (at once) once the draft is stopped."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout_at(due):
                await self._closed.wait()
        return not self._closed.is_set()


class Drafts:
    """The drafts of the streams under way, one per session, at most ``kept`` in all."""

    def __init__(self, start: Callable[[Outbound], Draft], kept: int) -> None:
        self._start = start
        self._kept = kept
        self._drafts: dict[SessionKey, tuple[int, Draft]] = {}

    def add(self, chunk: Outbound) -> None:
        """Add a streamed ``chunk`` to its turn's draft, started now if it is the first."""
        generation, draft = self._drafts.get(chunk.session_key, (None, None))
        if draft is None or generation != chunk.generation:
            if draft is not None:
                draft.stop()
            draft = self._start(chunk)
            self._drafts.pop(chunk.session_key, None)
            self._drafts[chunk.session_key] = (chunk.generation, draft)
            self._forget_oldest()
        draft.add(chunk.text)

    def of(self, reply: Outbound) -> Draft | None:
        """The draft ``reply`` completes (a ``REPLY`` of the same session and turn), if any.

        It is kept until :meth:`forget`, so a reply whose send failed replaces it
        on its next attempt too.
        """
        if reply.kind is not OutboundKind.REPLY:
            return None
        generation, draft = self._drafts.get(reply.session_key, (None, None))
        return draft if generation == reply.generation else None

    def forget(self, reply: Outbound) -> None:
        """Keep ``reply``'s draft no longer (it was replaced, or will never be)."""
        if self.of(reply) is not None:
            del self._drafts[reply.session_key]

    def _forget_oldest(self) -> None:
        while len(self._drafts) > self._kept:
            key = next(iter(self._drafts))
            self._drafts.pop(key)[1].stop()

    async def aclose(self) -> None:
        """Stop every draft and wait for the edits under way."""
        drafts, self._drafts = [draft for _, draft in self._drafts.values()], {}
        for draft in drafts:
            draft.stop()
        for draft in drafts:
            await draft.stopped()
