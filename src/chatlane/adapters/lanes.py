"""Jobs run in the background, in order within a lane (a conversation), in parallel across.

Chat adapters hand each event's work to :class:`Lanes` so that a platform's
events for one conversation reach chatlane in the order they arrived, however
long one of them takes, while other conversations go on. What must not wait
for a conversation's queue runs beside the lanes (:meth:`Lanes.beside`),
tracked with them. A shutdown may give the jobs under way a while to end
(:meth:`Lanes.aclose`) before it cancels what is left.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["Job", "Lanes"]

log = logging.getLogger("chatlane.adapters")

Job = Coroutine[object, object, None]
T = TypeVar("T")


class Lanes:
    """Jobs run in the background, one at a time per lane, in the order they were given."""

    def __init__(self, name: str = "chat") -> None:
        self._name = name
        self._last: dict[str, asyncio.Task[None]] = {}
        self._running: set[asyncio.Task[Any]] = set()

    def run(self, lane: str, job: Job) -> asyncio.Task[None]:
        """Run ``job`` once the jobs given before it in ``lane`` ended; its task."""
        task = asyncio.create_task(self._after(self._last.get(lane), job))
        self._last[lane] = task
        self._keep(lane, task)
        return task

    def beside(self, job: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        """Run ``job`` at once, in no lane (it waits for no job, and no job waits for it
        unless it awaits its task); drained and closed with the lanes' jobs. Its task."""
        task = asyncio.create_task(job)
        self._keep(None, task)
        return task

    def _keep(self, lane: str | None, task: asyncio.Task[Any]) -> None:
        self._running.add(task)
        task.add_done_callback(lambda done: self._done(lane, done))

    async def _after(self, earlier: asyncio.Task[None] | None, job: Job) -> None:
        """``job``, once ``earlier`` ended (however it ended); closed unrun if cancelled first."""
        try:
            if earlier is not None:
                await asyncio.wait([earlier])
        except BaseException:
            job.close()
            raise
        await job

    def _done(self, lane: str | None, task: asyncio.Task[Any]) -> None:
        self._running.discard(task)
        if lane is not None and self._last.get(lane) is task:
            del self._last[lane]
        if not task.cancelled() and task.exception() is not None:
            log.error("a %s job could not be done", self._name, exc_info=task.exception())

    async def drained(self) -> None:
        """Wait until every job given so far (and any given meanwhile) ended."""
        while self._running:
            await asyncio.wait(list(self._running))

    async def aclose(self, within: float = 0.0) -> None:
        """Wait up to ``within`` seconds for the jobs given so far (and any given meanwhile)
        to end, then cancel those not done and wait until they ended; a job given up after
        such a wait is logged."""
        if within > 0:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(within):
                    await self.drained()
        running = list(self._running)
        if running and within > 0:
            log.warning(
                "%d %s jobs not done after %gs were cancelled", len(running), self._name, within
            )
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
