"""Leases for turns: taking a session's lease, keeping it alive, and giving it back.

The :class:`LeaseKeeper` is the engine's only path to the store's leases.
What stays true:

* A turn runs only under a lease; the lease's generation becomes the turn's
  generation, so the store refuses the writes of any turn it has fenced off.
* Every lease a process holds is renewed in one store call
  (:meth:`~chatlane.stores.base.Store.renew_many`) every
  :attr:`LeaseSettings.renew_every` seconds (``ttl / 10``), beside the
  process's heartbeat and never behind other store work. A renewal the store
  refuses marks the turn lost at once. A renewal the store cannot answer
  (an outage) changes nothing until the lease's expiry passes on this host's
  clock; from then the turn is stale (a process paused past its TTL fences
  itself before it can deliver anything).
* Each lease is released exactly once, through ``TurnState.lease_tokens``
  keyed by generation: a displaced turn's unwind frees only its own lease.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable, Iterable

from chatlane.errors import (
    ActiveSessionLimit,
    ChatlaneError,
    LeaseError,
    LeaseLost,
    SessionBusy,
    StoreError,
)
from chatlane.logs import turn_fields
from chatlane.runtime.backoff import MAX_DELAY, retryable
from chatlane.runtime.settings import LeaseSettings
from chatlane.state import SessionState
from chatlane.stores.base import Lease, Store

log = logging.getLogger("chatlane.runtime")


def new_holder_id() -> str:
    """A process's identity in the store: unique per process start."""
    return f"h-{secrets.token_hex(6)}"


class AcquireWait:
    """Why a turn is still waiting for its lease, reported once per reason."""

    def __init__(self) -> None:
        self.reported: set[type[ChatlaneError]] = set()

    def first(self, error: ChatlaneError) -> bool:
        """Whether this is the first time ``error``'s kind of wait happened."""
        kind = type(error)
        if kind in self.reported:
            return False
        self.reported.add(kind)
        return True


class BeatGaps:
    """The gaps between this process's successful heartbeats: the last and the largest."""

    def __init__(self) -> None:
        self.last_at: float | None = None
        self.longest = 0.0
        self.count = 0

    def record(self, moment: float) -> None:
        """A heartbeat reached the store at ``moment`` (``time.monotonic()``)."""
        if self.last_at is not None:
            self.longest = max(self.longest, moment - self.last_at)
        self.last_at = moment
        self.count += 1


class LeaseKeeper:
    """Acquires, renews and releases the leases of one process's turns."""

    def __init__(self, store: Store, holder: str, settings: LeaseSettings) -> None:
        self.store = store
        self.holder = holder
        self.settings = settings
        self.beats = BeatGaps()

    async def acquire(
        self,
        state: SessionState,
        head_seq: int | None,
        still_wanted: Callable[[], bool],
        on_wait: Callable[[ChatlaneError, AcquireWait], object],
    ) -> Lease | None:
        """Wait for ``state``'s lease; ``None`` if ``still_wanted()`` turns false first.

        A store that cannot be reached is waited out (:mod:`chatlane.runtime.backoff`).
        ``on_wait`` is told each time the session is busy elsewhere or at the
        active-session limit; it decides what to say (and may stop wanting).
        """
        wait, delay, longest = AcquireWait(), self.settings.poll, self.settings.max_poll
        while still_wanted():
            try:
                return await self._try(state, head_seq)
            except (ActiveSessionLimit, SessionBusy) as error:
                on_wait(error, wait)
            except StoreError as error:
                if not retryable(error):
                    raise
                if wait.first(error):
                    fields = turn_fields(state.key)
                    log.warning("taking the lease failed, retrying: %s", error, extra=fields)
                longest = MAX_DELAY  # an outage: back off further than a busy session
            await asyncio.sleep(delay)
            delay = min(delay * 2, longest)
        return None

    async def _try(self, state: SessionState, head_seq: int | None) -> Lease:
        settings = self.settings
        lease = await self.store.acquire(
            state.key,
            self.holder,
            settings.ttl,
            head_seq=head_seq,
            max_active=settings.max_active_sessions,
        )
        state.turn.store_lease_token(lease.generation, lease)
        return lease

    async def release(self, state: SessionState, generation: int) -> None:
        """Release the lease taken for ``generation``, if it is still held (once only)."""
        lease = state.turn.release_lease_token(generation)
        if lease is None:
            return
        try:
            await self.store.release(lease)
        except LeaseError as error:
            log.info("lease already gone: %s", error, extra=turn_fields(state.key, generation))

    async def renew_all(self, leases: Iterable[Lease]) -> list[Lease | None]:
        """Renew ``leases`` in one store call, in order: the renewed lease, or ``None`` if lost.

        :raises ChatlaneError: the store could not be asked (an outage): the
            leases hold until they expire on this host's clock.
        """
        held = list(leases)
        return await self.store.renew_many(held, self.settings.ttl) if held else []

    async def moved_on(self, leases: Iterable[Lease]) -> list[bool]:
        """For each lease, in order, whether the store's generation moved past it.

        :raises ChatlaneError: if the store cannot be read.
        """
        held = list(leases)
        stored = await self.store.generations([lease.key for lease in held])
        return [current > lease.generation for lease, current in zip(held, stored, strict=True)]

    async def heartbeat(self) -> None:
        """Tell the store this process is alive for the next ``ttl``; note the gap since the last.

        :raises ChatlaneError: the store could not be reached.
        """
        await self.store.heartbeat(self.holder, self.settings.ttl)
        self.beats.record(time.monotonic())

    async def sign_off(self) -> None:
        """Tell the store this process is gone, so its messages can be adopted at once."""
        try:
            await self.store.heartbeat(self.holder, 0.0)
        except ChatlaneError as error:
            log.warning("could not sign off from the store: %s", error)


def locally_expired(lease: Lease | None) -> bool:
    """Whether this host's clock says ``lease`` has expired (a paused process finds out here)."""
    return lease is not None and lease.expires_at <= time.time()


__all__ = [
    "AcquireWait",
    "BeatGaps",
    "LeaseKeeper",
    "LeaseLost",
    "LeaseSettings",
    "locally_expired",
]
