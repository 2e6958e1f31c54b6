"""Leases for turns: taking a session's lease, keeping it alive, and giving it back.

The :class:`LeaseKeeper` is the engine's only path to the store's leases.
What stays true:

* A turn runs only under a lease; the lease's generation becomes the turn's
  generation, so the store refuses the writes of any turn it has fenced off.
* A held lease is renewed about every ``ttl / 3``. A renewal that fails — the
  lease expired, was taken over, its generation was bumped, or the store is
  unreachable — marks the turn lost at once; so does a lease whose expiry has
  passed on this host's clock (a process paused past its TTL fences itself
  before it can deliver anything).
* Each lease is released exactly once, through ``TurnState.lease_tokens``
  keyed by generation: a displaced turn's unwind frees only its own lease.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from chatlane.errors import ActiveSessionLimit, ChatlaneError, LeaseError, LeaseLost, SessionBusy
from chatlane.logs import turn_fields
from chatlane.runtime.limits import require_numbers
from chatlane.state import SessionState
from chatlane.stores.base import Lease, Store

log = logging.getLogger("chatlane.runtime")


def new_holder_id() -> str:
    """A process's identity in the store: unique per process start."""
    return f"h-{secrets.token_hex(6)}"


@dataclass(frozen=True, slots=True)
class LeaseSettings:
    """How turns hold leases.

    :param ttl: seconds a lease lives without renewal.
    :param max_active_sessions: sessions that may run at once across every
        process sharing the store (0 = unlimited).
    :param poll: first wait (seconds) before retrying a busy session; doubles
        up to ``max_poll``.
    :param fence_check: seconds between two checks that each running turn's
        generation still holds in the store (one batched read), so a
        turn another process fenced — ``/stop`` or ``/new`` sent there — is
        interrupted at once instead of at its next renewal; 0 leaves it to the
        renewal (every ``ttl / 3``).
    """

    ttl: float = 30.0
    max_active_sessions: int = 0
    poll: float = 0.005
    max_poll: float = 0.25
    fence_check: float = 0.5

    def __post_init__(self) -> None:
        require_numbers(
            self,
            positive=("ttl", "poll", "max_poll"),
            non_negative=("max_active_sessions", "fence_check"),
            whole=("max_active_sessions",),
        )


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


class LeaseKeeper:
    """Acquires, renews and releases the leases of one process's turns."""

    def __init__(self, store: Store, holder: str, settings: LeaseSettings) -> None:
        self.store = store
        self.holder = holder
        self.settings = settings

    async def acquire(
        self,
        state: SessionState,
        head_seq: int | None,
        still_wanted: Callable[[], bool],
        on_wait: Callable[[ChatlaneError, AcquireWait], object],
    ) -> Lease | None:
        """Wait for ``state``'s lease; ``None`` if ``still_wanted()`` turns false first.

        ``on_wait`` is told each time the session is busy elsewhere or at the
        active-session limit; it decides what to say (and may stop wanting).
        """
        wait, delay = AcquireWait(), self.settings.poll
        while still_wanted():
            try:
                return await self._try(state, head_seq)
            except (ActiveSessionLimit, SessionBusy) as error:
                on_wait(error, wait)
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.settings.max_poll)
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

    async def renew_all(self, leases: Iterable[Lease]) -> list[Lease | BaseException]:
        """Renew ``leases``, in order: the renewed lease, or why it was lost.

        :class:`LeaseLost` means the store answered that the lease is gone
        (taken over, or fenced by a generation bump); any other error means
        the store could not be asked, and counts as lost too.
        """
        held = list(leases)
        results = await asyncio.gather(
            *(self.store.renew(lease, self.settings.ttl) for lease in held),
            return_exceptions=True,
        )
        for lease, result in zip(held, results, strict=True):
            if not isinstance(result, Lease):
                log.warning(
                    "lease lost: %r", result, extra=turn_fields(lease.key, lease.generation)
                )
        return results

    async def moved_on(self, leases: Iterable[Lease]) -> list[bool]:
        """For each lease, in order, whether the store's generation moved past it.

        :raises ChatlaneError: if the store cannot be read.
        """
        held = list(leases)
        stored = await self.store.generations([lease.key for lease in held])
        return [current > lease.generation for lease, current in zip(held, stored, strict=True)]

    async def heartbeat(self) -> None:
        """Tell the store this process is alive for the next ``ttl``."""
        await self.store.heartbeat(self.holder, self.settings.ttl)

    async def sign_off(self) -> None:
        """Tell the store this process is gone, so its messages can be adopted at once."""
        try:
            await self.store.heartbeat(self.holder, 0.0)
        except ChatlaneError as error:
            log.warning("could not sign off from the store: %s", error)


def locally_expired(lease: Lease | None) -> bool:
    """Whether this host's clock says ``lease`` has expired (a paused process finds out here)."""
    return lease is not None and lease.expires_at <= time.time()


__all__ = ["AcquireWait", "LeaseKeeper", "LeaseLost", "LeaseSettings", "locally_expired"]
