"""An engine's background work: lease renewals, fence checks, heartbeats, adoption, eviction.

Two loops run per engine, started with its first message and cancelled when
it closes. What stays true:

* Every lease a running turn holds is renewed every ``ttl / 3``, before the
  heartbeat and adoption (the lease expires first). A lease the store refuses
  to renew is reported lost; the engine fences its turn.
* Between renewals, every ``fence_check`` seconds, each running turn's
  generation is compared with the store's (one batched read for all of them,
  :meth:`~chatlane.stores.base.Store.generations`): a turn another process
  fenced (``/stop`` or ``/new`` sent there, or an interrupt) is reported at
  once, not at the next renewal. A failed check is logged and
  changes nothing; the renewal still catches the turn.
* A turn that made no progress for ``turn_timeout`` is handed to the engine to
  evict (the watchdog runs only when ``turn_timeout > 0``).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

from chatlane.errors import ChatlaneError, LeaseLost
from chatlane.runtime.leases import LeaseKeeper
from chatlane.runtime.recovery import adopt_orphans
from chatlane.runtime.turn import Turn
from chatlane.stores.base import Lease
from chatlane.types import InboundMessage, SessionKey

log = logging.getLogger("chatlane.runtime")


@dataclass(frozen=True, slots=True)
class UpkeepHooks:
    """What the upkeep asks of its engine.

    :param turns: the turns holding a current lease right now.
    :param renewed: ``turn``'s lease was renewed as ``lease``.
    :param lost: ``turn``'s lease is gone (``why`` is for the log): fence it.
        When the store said so (``fenced``), another process may have fenced
        it to interrupt it, and the engine asks the store; when the store
        could not be reached, it does not wait on it again.
    :param evict: ``turn`` made no progress for too long: evict it.
    :param adopt: run a message adopted from a dead process.
    :param closed: whether the engine is closing (the loops end).
    """

    turns: Callable[[], list[Turn]]
    renewed: Callable[[Turn, Lease], None]
    lost: Callable[[Turn, str, bool], Awaitable[None]]
    evict: Callable[[Turn], Awaitable[None]]
    adopt: Callable[[SessionKey, InboundMessage, int], Awaitable[None]]
    closed: Callable[[], bool]


class Upkeep:
    """Runs the background loops of one engine (see the module docstring)."""

    def __init__(self, leases: LeaseKeeper, hooks: UpkeepHooks, *, turn_timeout: float) -> None:
        self._leases = leases
        self._hooks = hooks
        self._turn_timeout = turn_timeout
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def tasks(self) -> list[asyncio.Task[None]]:
        """The running loops (empty before :meth:`start`)."""
        return self._tasks

    def start(self) -> None:
        """Start the loops, once, each in a fresh context: no session is bound there.

        They serve every session, so they never keep a copy of whichever
        caller (perhaps inside a session's binding) happened to start them.
        """
        if self._tasks:
            return
        loops = [(self._keep_leases(), "chatlane-leases")]
        if self._turn_timeout > 0:
            loops.append((self._watch(), "chatlane-watchdog"))
        for loop, name in loops:
            task = asyncio.create_task(loop, name=name, context=contextvars.Context())
            self._tasks.append(task)

    async def _keep_leases(self) -> None:
        settings = self._leases.settings
        period = settings.ttl / 3
        tick = min(settings.fence_check or period, period)
        renew_at = 0.0
        while not self._hooks.closed():
            if time.monotonic() >= renew_at:
                renew_at = time.monotonic() + period - tick / 2
                await self.renew_once()
            else:
                await self.check_fences()
            await asyncio.sleep(tick)

    async def renew_once(self) -> None:
        """Renew held leases first (they expire), then the heartbeat, then adopt orphans."""
        held = self._hooks.turns()
        renewed = await self._leases.renew_all(_leases_of(held))
        for turn, result in zip(held, renewed, strict=True):
            if isinstance(result, Lease):
                self._hooks.renewed(turn, result)
            else:
                fenced = isinstance(result, LeaseLost)
                await self._hooks.lost(turn, f"its lease could not be renewed: {result}", fenced)
        try:
            await self._leases.heartbeat()
            await adopt_orphans(self._leases.store, self._leases.holder, self._hooks.adopt)
        except ChatlaneError as error:
            log.warning("heartbeat or adoption failed: %s", error)

    async def check_fences(self) -> None:
        """Report each running turn whose generation another process moved past."""
        held = self._hooks.turns()
        if not held:
            return
        try:
            moved = await self._leases.moved_on(_leases_of(held))
        except ChatlaneError as error:
            log.warning("fence check failed: %s", error)
            return
        for turn, gone in zip(held, moved, strict=True):
            if gone and turn.is_current():
                await self._hooks.lost(turn, "fenced by another process", True)

    async def _watch(self) -> None:
        period = min(self._turn_timeout / 4, 1.0)
        while not self._hooks.closed():
            await asyncio.sleep(period)
            await self.evict_stuck()

    async def evict_stuck(self) -> int:
        """Evict every turn that made no progress for ``turn_timeout``; return how many."""
        deadline = time.monotonic() - self._turn_timeout
        stuck = [turn for turn in self._hooks.turns() if turn.last_progress < deadline]
        for turn in stuck:
            await self._hooks.evict(turn)
        return len(stuck)


def _leases_of(turns: Iterable[Turn]) -> list[Lease]:
    return [turn.lease for turn in turns if turn.lease is not None]
