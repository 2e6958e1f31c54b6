"""Requests waiting for their message: woken once for whatever arrived, never by what
they do not read, and ticked by one shared timer."""

from __future__ import annotations

import asyncio

from chatlane.adapters.api_waiters import EventKind, Ticker, Waiter, WaiterEvent
from chatlane.identity import NO_SESSION
from chatlane.types import Outbound, OutboundKind, Target

TARGET = Target("api", "s")


def outbound(kind: OutboundKind, text: str) -> Outbound:
    return Outbound(kind, NO_SESSION, TARGET, text, 1, ("api-1",))


async def test_a_streaming_request_takes_what_arrived_together_in_one_wake() -> None:
    waiter = Waiter("api-1")
    waiting = asyncio.create_task(waiter.wait())
    await asyncio.sleep(0)  # parked on its wake-up
    for text in ("ec", "ho", ": hi"):
        waiter.take(outbound(OutboundKind.CHUNK, text))
    waiter.take(outbound(OutboundKind.NOTICE, "still working"))
    events, ticked = await waiting
    assert [(e.kind, e.text) for e in events] == [
        (EventKind.CHUNK, "ec"),
        (EventKind.CHUNK, "ho"),
        (EventKind.CHUNK, ": hi"),
        (EventKind.COMMENT, "still working"),
    ]
    assert not ticked


async def test_a_plain_request_is_woken_only_by_its_last_event() -> None:
    waiter = Waiter("api-1", stream=False)
    waiting = asyncio.create_task(waiter.wait())
    await asyncio.sleep(0)
    before = waiter.last_progress
    waiter.take(outbound(OutboundKind.CHUNK, "echo"))
    waiter.take(outbound(OutboundKind.NOTICE, "still working"))
    await asyncio.sleep(0)
    assert not waiting.done()
    assert waiter.last_progress >= before  # chunks and notices still count as progress
    waiter.take(outbound(OutboundKind.REPLY, "echo: hi"))
    waiter.push(WaiterEvent(EventKind.TIMEOUT))  # nothing is queued after the last event
    assert await waiting == ([WaiterEvent(EventKind.FINAL, "echo: hi")], False)


async def test_the_ticker_wakes_a_quiet_request_and_stops_when_none_waits() -> None:
    waiters: dict[str, Waiter] = {}
    ticker = Ticker(waiters.values, period=0.02)
    waiter = waiters["api-1"] = Waiter("api-1", stream=False)
    ticker.start()
    ticker.start()  # one timer, however often it is asked for
    async with asyncio.timeout(5):
        assert await waiter.wait() == ([], True)
        assert await waiter.wait() == ([], True)
    del waiters["api-1"]
    assert ticker._handle is not None
    ticker._handle.cancel()
    ticker._tick()  # the firing after the last request left
    assert ticker._handle is None


async def test_a_request_answered_at_once_is_never_ticked() -> None:
    waiters: dict[str, Waiter] = {}
    ticker = Ticker(waiters.values, period=60.0)
    waiter = waiters["api-1"] = Waiter("api-1", stream=False)
    ticker._tick()  # a firing right after it was registered
    assert not waiter.ticked
    waiter.checked_at -= 30.0
    ticker._tick()
    assert await waiter.wait() == ([], True)
    assert ticker._handle is not None
    ticker._handle.cancel()
