"""Waiting on the delivery ledger: checked again after each settlement, never on a timer."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from chatlane.delivery import DeliveryWorker
from chatlane.hub import Hub
from chatlane.stores.base import DELIVERED

WAIT = 20.0
"""Seconds a wait may take before the test fails (a loaded machine is slow, never stuck)."""


async def eventually(
    worker: DeliveryWorker | None, predicate: Callable[[], Awaitable[bool]]
) -> None:
    """Wait until ``predicate`` holds, checking it again after each of ``worker``'s settlements."""
    assert worker is not None
    async with asyncio.timeout(WAIT):
        while True:
            settlement = worker.next_settlement()
            if await predicate():
                return
            await settlement.wait()


async def delivered(hub: Hub, count: int) -> bool:
    """Whether ``hub``'s store holds ``count`` delivered deliveries."""
    return len(await hub.store.deliveries(DELIVERED)) == count


async def dead(hub: Hub, count: int) -> bool:
    """Whether ``hub``'s store holds ``count`` dead deliveries."""
    return (await hub.store.delivery_stats()).dead == count
