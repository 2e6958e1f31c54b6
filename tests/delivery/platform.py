"""A stand-in for a chat platform, as a delivery worker's sender sees it.

It records what it accepted, and fails on demand the ways platforms fail:
transiently (once, or a share of sends at random), permanently, with a 429,
or while it is down. Every attempt is announced, so tests wait on what
happened, never on time.
"""

from __future__ import annotations

import asyncio
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from chatlane.delivery import Attempt
from chatlane.delivery.ledger import RESENT_LABEL
from chatlane.errors import (
    DeliveryFailed,
    PermanentDelivery,
    PlatformUnavailable,
    RateLimited,
    TransientDelivery,
)
from chatlane.types import Outbound


@dataclass
class Accepted:
    """One message the platform took."""

    chat: str
    text: str
    delivery_id: str
    labelled: bool


@dataclass
class PlatformStandIn:
    """A sender whose platform accepts, fails or is down, as the test says."""

    platform: str = "chat"
    connected: bool = True
    down: bool = False
    flaky: float = 0.0
    """The share of sends that fail transiently (after reaching the platform half the time)."""
    seed: int = 7
    accepted: list[Accepted] = field(default_factory=list)
    attempts: list[Attempt] = field(default_factory=list)
    failures: deque[DeliveryFailed] = field(default_factory=deque)
    """Failures to raise, one per send, before any send succeeds again."""
    gate: asyncio.Event | None = None
    """When set, each send waits for it (a send in flight)."""
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self._random = random.Random(self.seed)

    def ready(self) -> bool:
        return self.connected

    async def send(self, outbound: Outbound, attempt: Attempt) -> None:
        self.attempts.append(attempt)
        self._changed.set()
        if self.gate is not None:
            await self.gate.wait()
        if self.down:
            raise PlatformUnavailable("the platform is down")
        if self.failures:
            raise self.failures.popleft()
        if self.flaky and self._random.random() < self.flaky:
            reached = self._random.random() < 0.5
            if reached:
                self._accept(outbound, attempt)
            raise TransientDelivery("flaky platform", maybe_sent=reached)
        self._accept(outbound, attempt)

    def _accept(self, outbound: Outbound, attempt: Attempt) -> None:
        chat = outbound.target.chat_id or ""
        self.accepted.append(Accepted(chat, outbound.text, attempt.delivery_id, attempt.uncertain))
        self._changed.set()

    def texts(self, chat: str) -> list[str]:
        """What ``chat`` received, in order."""
        return [a.text for a in self.accepted if a.chat == chat]

    async def until(self, done: Callable[[], bool]) -> None:
        """Return once ``done()`` holds after some send (10 s at most)."""
        async with asyncio.timeout(10):
            while not done():
                self._changed.clear()
                await self._changed.wait()


def transient(maybe_sent: bool = False) -> TransientDelivery:
    return TransientDelivery("timeout", maybe_sent=maybe_sent)


def permanent(maybe_sent: bool = False) -> PermanentDelivery:
    return PermanentDelivery("bot blocked by the user", maybe_sent=maybe_sent)


def rate_limited(seconds: float) -> RateLimited:
    return RateLimited("flood control", seconds)


__all__ = ["RESENT_LABEL", "Accepted", "PlatformStandIn", "permanent", "rate_limited", "transient"]
