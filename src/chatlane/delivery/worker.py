"""The delivery worker: sends what the ledger holds, until each platform has accepted it.

What stays true:

* A delivery is sent only under a claim of this process (the store hands a
  delivery to one claim at a time), and marked delivered only after its
  sender returned — the platform accepted it.
* A send begins only while its claim has at least
  :attr:`DeliverySettings.send_timeout` left on this host's clock (counted
  from before the claim was asked for), so it ends or is abandoned before the
  claim can pass to another process. A process that stalled after claiming
  (starved of CPU, stopped) releases the delivery unsent instead of sending
  it after a labelled re-send from elsewhere. Only a stall in the middle of a
  send can still let its copy arrive after that re-send.
* Deliveries to one target are sent one at a time, in recording order (the
  store claims only a target's oldest pending delivery, and only once its
  claim is settled).
* Every failure is settled by its kind (:mod:`chatlane.errors`):
  :class:`~chatlane.errors.PermanentDelivery` is dead-lettered with its
  reason; :class:`~chatlane.errors.RateLimited` waits the platform's
  ``retry_after``; :class:`~chatlane.errors.PlatformUnavailable` (and a
  sender that is not connected) spends no attempt and pauses the lane with a
  growing backoff; anything else — a timeout included — is retried with
  exponential backoff and jitter, and dead-lettered after
  :attr:`DeliverySettings.max_attempts`.
* Retries run while the process lives, not only at start-up: the worker
  claims what is due whenever it is woken (a recording, a settled delivery)
  and at least every :attr:`DeliverySettings.poll_interval`.
* A delivery whose earlier attempt may have reached the platform (a timeout,
  a process that died mid-send, part of a long reply that went out before a
  later part was refused) is handed to its sender with
  :attr:`Attempt.uncertain` set, so the sender labels the re-send or lets the
  platform deduplicate by :attr:`Attempt.delivery_id` — a dead letter the
  operator redelivers too: its last attempt's ``maybe_sent`` is settled with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import NamedTuple, Protocol, runtime_checkable

import msgspec

from chatlane.delivery.ledger import outbound_of
from chatlane.errors import (
    ConfigError,
    PermanentDelivery,
    PlatformUnavailable,
    RateLimited,
    StoreError,
    TransientDelivery,
)
from chatlane.runtime.backoff import retry_store
from chatlane.runtime.limits import Count, PositiveSeconds, Seconds, check_bounds
from chatlane.stores.base import Delivery, Settlement, SettlementKind, Store
from chatlane.types import Outbound

__all__ = ["Attempt", "DeliverySettings", "DeliveryWorker", "Sender"]

log = logging.getLogger("chatlane.delivery")


@dataclass(frozen=True, slots=True)
class DeliverySettings:
    """How the worker claims, sends and retries (``[delivery]`` in the configuration).

    The claim outlives the send (``claim_ttl`` > ``send_timeout``), so a claim
    expires only when its sender died or lost the store.
    """

    enabled: bool = True
    """Whether ``chatlane serve`` sends through the ledger (off: straight to the adapter)."""
    claim_ttl: PositiveSeconds = 60.0
    """Seconds a claim holds: longer than any send, so only a dead sender's claim expires."""
    send_timeout: PositiveSeconds = 30.0
    """Seconds one send may take before it counts as a transient failure that may have sent."""
    poll_interval: PositiveSeconds = 1.0
    """Most seconds between two looks at the ledger (recordings here wake it at once)."""
    claim_batch: Count = 32
    """Most deliveries claimed at a time."""
    max_in_flight: Count = 64
    """Most sends at once (each to its own target)."""
    first_retry: Seconds = 1.0
    """Seconds before the first retry of a failed send; doubled per attempt (with jitter)."""
    max_retry: Seconds = 300.0
    """The longest wait between two attempts."""
    max_attempts: Count = 10
    """Failed attempts after which a delivery is dead-lettered."""
    unavailable_first: PositiveSeconds = 1.0
    """Seconds a lane pauses when its platform is first found down; doubled while it stays down."""
    unavailable_max: PositiveSeconds = 60.0
    """The longest pause of a lane whose platform is down."""
    close_grace: Seconds = 5.0
    """Seconds sends in flight get to finish when the worker closes."""

    def __post_init__(self) -> None:
        check_bounds(self)
        if self.send_timeout >= self.claim_ttl:
            raise ConfigError(
                f"delivery.send_timeout ({self.send_timeout:g}) must be shorter than "
                f"delivery.claim_ttl ({self.claim_ttl:g})"
            )


class Attempt(NamedTuple):
    """What a sender is told about the delivery it sends."""

    delivery_id: str
    """Stable across attempts: an idempotency key for platforms that take one."""
    uncertain: bool
    """An earlier attempt may have reached the platform: label the re-send, or deduplicate."""
    attempts: int
    """Failed attempts so far."""
    deadline: float = math.inf
    """``time.monotonic()`` at which the worker gives the send up (its ``send_timeout``):
    a sender waits out a rate limit only if the send after it can end before this."""


@runtime_checkable
class Sender(Protocol):
    """An adapter's side of the ledger: it sends one delivery, or raises why not."""

    platform: str

    def ready(self) -> bool:
        """Whether the adapter is connected and can send now."""
        ...

    async def send(self, outbound: Outbound, attempt: Attempt) -> None:
        """Send ``outbound``; return only once the platform accepted all of it.

        :raises DeliveryFailed: one of its subclasses, saying what to do.
        """
        ...


class _Pause(NamedTuple):
    until: float
    """``time.monotonic()`` before which the lane is not claimed."""
    backoff: float


class DeliveryWorker:
    """Claims due deliveries for its senders' lanes and settles each send.

    :param count: told each settlement's outcome (``delivered``, ``retried``,
        ``released``, ``dead``), for metrics.
    """

    def __init__(
        self,
        store: Store,
        holder: str,
        settings: DeliverySettings | None = None,
        *,
        count: Callable[[str], None] | None = None,
    ) -> None:
        self.store = store
        self.holder = holder
        self.settings = settings or DeliverySettings()
        self._count = count
        self._senders: dict[str, Sender] = {}
        self._paused: dict[str, _Pause] = {}
        self._in_flight: dict[asyncio.Task[None], Delivery] = {}
        self._woken = asyncio.Event()
        self._settled = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closing = False

    @property
    def senders(self) -> Mapping[str, Sender]:
        """The senders by platform (lane)."""
        return self._senders

    def add(self, sender: Sender) -> None:
        """Send ``sender.platform``'s deliveries with ``sender``."""
        self._senders[sender.platform] = sender

    def next_settlement(self) -> asyncio.Event:
        """An event set once the next settlement has been written to the store (or failed to be).

        For whoever waits on the ledger's progress (a drain, a test) without
        polling it: take the event, check the store, then wait on the event,
        so a settlement between the check and the wait is not missed.
        """
        return self._settled

    @property
    def closing(self) -> bool:
        """Whether :meth:`aclose` began: nothing more is claimed."""
        return self._closing

    def poke(self) -> None:
        """Look at the ledger now: something was recorded or settled."""
        self._woken.set()

    def start(self) -> None:
        """Begin claiming (idempotent)."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="chatlane-delivery")

    async def aclose(self) -> None:
        """Stop claiming; give sends in flight :attr:`DeliverySettings.close_grace` to finish.

        A claim the store is answering is let finish (within the grace too), and
        what it took is released unsent: cut off, the store would keep a claim
        nobody holds, and its deliveries would wait out ``claim_ttl`` and go out
        labelled as re-sends. A send cut off here is released as one that may
        have reached its platform, so the next sender labels it.
        """
        self._closing = True
        self._woken.set()
        if self._task is not None:
            done, _ = await asyncio.wait([self._task], timeout=self.settings.close_grace)
            if not done:
                self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._in_flight:
            await asyncio.wait(list(self._in_flight), timeout=self.settings.close_grace)
        cut = dict(self._in_flight)
        for task in cut:
            task.cancel()
        await asyncio.gather(*cut, return_exceptions=True)
        if cut:
            released = [_release(d, "the sender shut down", maybe_sent=True) for d in cut.values()]
            with contextlib.suppress(StoreError):
                await self.store.settle_deliveries(released)

    # -- the loop ------------------------------------------------------------------

    async def _run(self) -> None:
        settings = self.settings
        while not self._closing:
            self._woken.clear()
            room = settings.max_in_flight - len(self._in_flight)
            lanes = self._ready_lanes()
            deadline = time.monotonic() + settings.claim_ttl - settings.send_timeout
            claimed = await self._claim(lanes, min(settings.claim_batch, room)) if lanes else []
            if self.closing:  # while the store answered
                await self._give_back(claimed)
                return
            for delivery in claimed:
                task = asyncio.create_task(self._deliver(delivery, deadline))
                self._in_flight[task] = delivery
                task.add_done_callback(self._finished)
            if claimed and len(claimed) == min(settings.claim_batch, room):
                continue  # more may be due
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._woken.wait(), self._next_look())

    async def _give_back(self, claimed: list[Delivery]) -> None:
        """Release ``claimed`` unsent, claimable at once (the worker is closing)."""
        if claimed:
            released = [_release(d, "the sender shut down before sending") for d in claimed]
            with contextlib.suppress(StoreError):
                await self.store.settle_deliveries(released)

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._in_flight.pop(task, None)
        self._woken.set()  # its target's next delivery may be due

    def _ready_lanes(self) -> list[str]:
        moment = time.monotonic()
        return [
            lane
            for lane, sender in self._senders.items()
            if sender.ready() and self._paused.get(lane, _UNPAUSED).until <= moment
        ]

    def _next_look(self) -> float:
        """Seconds until the worker looks again unless woken: the poll, or a pause's end."""
        moment = time.monotonic()
        ends = [p.until - moment for p in self._paused.values() if p.until > moment]
        return min([self.settings.poll_interval, *ends])

    async def _claim(self, lanes: list[str], limit: int) -> list[Delivery]:
        if limit <= 0:
            return []
        try:
            return await self.store.claim_deliveries(
                lanes, self.holder, self.settings.claim_ttl, limit
            )
        except StoreError as error:
            log.warning("could not claim deliveries: %s", error)
            return []

    # -- one delivery --------------------------------------------------------------

    async def _deliver(self, delivery: Delivery, deadline: float) -> None:
        """Send ``delivery`` if it can begin before ``deadline`` (``time.monotonic()``), and
        settle it."""
        settlement = await self._attempt(delivery, deadline)
        if self._count is not None:
            self._count(_OUTCOMES[settlement.kind])
        try:
            await retry_store(
                lambda: self.store.settle_deliveries([settlement]),
                wanted=lambda: not self._closing,
                what="settling a delivery",
            )
        except StoreError as error:  # its claim expires; the next sender labels the re-send
            log.warning("could not settle delivery %s: %s", delivery.id, error)
        settled, self._settled = self._settled, asyncio.Event()
        settled.set()

    async def _attempt(self, delivery: Delivery, deadline: float) -> Settlement:
        """Send ``delivery`` once and say how it ended."""
        sender = self._senders.get(delivery.lane)
        if sender is None or not sender.ready():
            return _release(delivery, "the sender is not connected", delay=self._pause(delivery))
        if time.monotonic() > deadline:  # the claim may run out mid-send: claim it afresh
            return _release(delivery, "its claim ran short before the send began")
        try:
            outbound = outbound_of(delivery)
        except msgspec.DecodeError as error:
            return _dead(delivery, f"damaged record: {error}")
        timeout = self.settings.send_timeout
        attempt = Attempt(
            delivery.id, delivery.uncertain, delivery.attempts, time.monotonic() + timeout
        )
        try:
            await asyncio.wait_for(sender.send(outbound, attempt), timeout)
        except PermanentDelivery as error:
            log.warning("delivery %s is undeliverable: %s", delivery.id, error)
            return _dead(delivery, str(error), maybe_sent=error.maybe_sent)
        except RateLimited as error:
            return _release(delivery, str(error), delay=error.retry_after)
        except PlatformUnavailable as error:
            return _release(delivery, str(error), delay=self._pause(delivery))
        except TransientDelivery as error:
            return self._retry(delivery, str(error), error.maybe_sent)
        except TimeoutError:
            return self._retry(delivery, "the send timed out", maybe_sent=True)
        except Exception as error:  # an adapter's bug must not stop deliveries
            log.exception("delivery %s failed", delivery.id)
            return self._retry(delivery, f"{type(error).__name__}: {error}", maybe_sent=True)
        self._paused.pop(delivery.lane, None)
        return Settlement(delivery.id, delivery.claim, SettlementKind.DELIVERED)

    def _retry(self, delivery: Delivery, reason: str, maybe_sent: bool) -> Settlement:
        """An attempt spent: again after a backoff, or dead after the last attempt."""
        spent = delivery.attempts + 1
        if spent >= self.settings.max_attempts:
            gave_up = f"gave up after {spent} attempts: {reason}"
            return _dead(delivery, gave_up, maybe_sent=maybe_sent)
        delay = min(self.settings.first_retry * 2 ** (spent - 1), self.settings.max_retry)
        delay *= random.uniform(0.5, 1.0)
        return Settlement(
            delivery.id, delivery.claim, SettlementKind.RETRY, delay, reason, maybe_sent
        )

    def _pause(self, delivery: Delivery) -> float:
        """Pause ``delivery``'s lane (its platform is down): seconds until it is tried again."""
        settings, lane = self.settings, delivery.lane
        previous = self._paused.get(lane)
        backoff = (
            settings.unavailable_first
            if previous is None
            else min(previous.backoff * 2, settings.unavailable_max)
        )
        if previous is None or previous.until <= time.monotonic():
            self._paused[lane] = _Pause(time.monotonic() + backoff, backoff)
            return backoff
        return max(previous.until - time.monotonic(), 0.0)


_UNPAUSED = _Pause(0.0, 0.0)
_OUTCOMES = {
    SettlementKind.DELIVERED: "delivered",
    SettlementKind.RETRY: "retried",
    SettlementKind.RELEASE: "released",
    SettlementKind.DEAD: "dead",
}


def _release(
    delivery: Delivery, reason: str, *, delay: float = 0.0, maybe_sent: bool = False
) -> Settlement:
    """Not sent (or not known to be): claimable again after ``delay``, no attempt spent."""
    return Settlement(
        delivery.id, delivery.claim, SettlementKind.RELEASE, delay, reason, maybe_sent
    )


def _dead(delivery: Delivery, reason: str, *, maybe_sent: bool = False) -> Settlement:
    """Given up on; ``maybe_sent`` (some of it may have reached the platform) stays with it,
    so a redelivery of the dead letter is labelled."""
    return Settlement(
        delivery.id, delivery.claim, SettlementKind.DEAD, reason=reason, maybe_sent=maybe_sent
    )
