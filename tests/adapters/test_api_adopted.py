"""A request whose message another gateway process adopted and answered gets that answer.

Two gateways share one SQLite store in this process. The first one's pause
(a ``SIGSTOP`` past the lease TTL, as ``tests/test_serve.py`` does with real
processes) is played through the store: its heartbeat runs out, so the second
adopts its message, and its lease is taken (a generation bump), so its own
turn is fenced and forgets the message. The request waiting on the first
gateway must get the second one's answer — never "dropped".
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from msgspec.structs import replace

from chatlane.adapters.api import KEPT_SEPARATOR
from chatlane.adapters.api_fates import Fate, fate_in_store
from chatlane.adapters.api_waiters import (
    NOT_RUN_TEXT,
    EventKind,
    Waiter,
    WaiterEvent,
    WaiterTracker,
)
from chatlane.config import Config
from chatlane.errors import StoreError
from chatlane.runtime.engine import TurnEngine
from chatlane.runtime.settings import LeaseSettings, RuntimeSettings
from chatlane.runtime.turn import Turn
from chatlane.stores import MemoryStore, Store, WriteBatch
from chatlane.stores.base import PendingRecord
from chatlane.types import Agent, Outbound
from tests.adapters.test_api import Served, eventually, make_config, serve

SESSION = "adopted"
KEY = f"main:api:dm:{SESSION}"
STREAMED = "first run: "


class FencedRun:
    """The first gateway's agent: streams the start of an answer, then never finishes."""

    def __init__(self) -> None:
        self.streamed = asyncio.Event()

    async def __call__(self, turn: Turn) -> AsyncIterator[str]:
        yield STREAMED
        self.streamed.set()
        await asyncio.Event().wait()  # until its turn is fenced and cancelled


def answering(text: str) -> Agent:
    async def agent(turn: Turn) -> str:
        return text

    return agent


def configs(tmp_path: Path) -> tuple[Config, Config]:
    """The paused gateway renews rarely (its one heartbeat is at start); the other adopts often."""
    base = make_config(tmp_path)
    paused = RuntimeSettings(leases=LeaseSettings(ttl=60.0), interrupt_grace=0.1)
    adopter = RuntimeSettings(leases=LeaseSettings(ttl=0.6), interrupt_grace=0.1)
    return replace(base, runtime=paused), replace(base, runtime=adopter)


async def pause(first: Served, second: Served) -> None:
    """Play ``first`` being paused past its TTL while ``second`` takes its message over."""
    store = first.hub.gateway.engine.store
    holder = first.hub.gateway.engine.holder
    adopter = second.hub.gateway.engine.holder
    await eventually(lambda: alive(store, holder))
    await store.heartbeat(holder, 0)  # its heartbeat ran out
    await eventually(lambda: owned_by(store, adopter))
    await store.bump_generation(KEY)  # and its lease was taken


async def alive(store: Store, holder: str) -> bool:
    return (await store.alive([holder]))[holder]


async def owned_by(store: Store, holder: str) -> bool:
    return [r.owner for r in await store.pending(KEY)] == [holder]


@pytest.mark.parametrize("stream", [False, True])
async def test_the_adopting_process_answer_reaches_the_first_request(
    tmp_path: Path, stream: bool
) -> None:
    run = FencedRun()
    config_a, config_b = configs(tmp_path)
    shared = f"sqlite:///{tmp_path / 'shared.db'}"
    async with (
        serve(config_a, run, store=shared, settle_grace=0.2) as first,
        serve(config_b, answering("answered by the adopter"), store=shared) as second,
    ):
        ask = first.ask_streaming if stream else first.ask
        asked = asyncio.create_task(ask("hello", SESSION))
        await first.running(SESSION)
        async with asyncio.timeout(10):
            await run.streamed.wait()
        await pause(first, second)
        answer = await asked
    if stream:
        assert "".join(answer) == STREAMED + KEPT_SEPARATOR + "answered by the adopter"
    else:
        assert answer == "answered by the adopter"


async def test_a_kept_answer_that_extends_the_stream_sends_only_the_rest(tmp_path: Path) -> None:
    run = FencedRun()
    config_a, config_b = configs(tmp_path)
    shared = f"sqlite:///{tmp_path / 'shared.db'}"
    whole = STREAMED + "and the rest"
    async with (
        serve(config_a, run, store=shared, settle_grace=0.2) as first,
        serve(config_b, answering(whole), store=shared) as second,
    ):
        asked = asyncio.create_task(first.ask_streaming("hello", SESSION))
        await first.running(SESSION)
        async with asyncio.timeout(10):
            await run.streamed.wait()
        await pause(first, second)
        assert "".join(await asked) == whole


# -- what the store says, and what the tracker makes of it ------------------------------


async def test_the_store_tells_each_fate() -> None:
    store = MemoryStore()
    await store.enqueue(KEY, "mine", "h-here", b"")
    await store.enqueue(KEY, "theirs", "h-there", b"")
    await store.commit(KEY, None, WriteBatch(answered=["done"], answer="the answer"))
    fates = {m: await fate_in_store(store, "h-here", KEY, m) for m in ("mine", "theirs", "done")}
    assert fates["mine"].fate is Fate.HERE
    assert fates["theirs"].fate is Fate.ELSEWHERE
    assert (fates["done"].fate, fates["done"].answer) == (Fate.ANSWERED, "the answer")
    assert (await fate_in_store(store, "h-here", KEY, "dropped")).fate is Fate.GONE


class Unreadable(MemoryStore):
    async def pending(self, key: str) -> list[PendingRecord]:
        raise StoreError("the store is out of reach")


async def followed(store: Store, *, notice: str | None = None, ticks: int = 3) -> list[WaiterEvent]:
    """What a waiter whose message is nowhere in the engine receives over a few ticks."""

    async def deliver(outbound: Outbound) -> None:
        return None

    engine = TurnEngine(answering("unused"), deliver, store=store, holder="h-here")
    tracker = WaiterTracker(engine, ceiling=3600.0, settle_grace=0.0)
    waiter = Waiter("m1", session_key=KEY, accepted=True, notice=notice)
    for _ in range(ticks):
        await tracker.follow(waiter)
    return list(waiter.events)


async def test_an_unreadable_store_keeps_the_request_waiting() -> None:
    assert await followed(Unreadable()) == []
    notice = "Sorry — the agent failed on this message (RuntimeError)."
    assert await followed(Unreadable(), notice=notice) == [WaiterEvent(EventKind.FINAL, notice)]


async def test_a_message_queued_for_another_process_keeps_the_request_waiting() -> None:
    store = MemoryStore()
    await store.enqueue(KEY, "m1", "h-there", b"")
    assert await followed(store, notice="a notice while it ran") == []


async def test_a_message_the_store_neither_answered_nor_queues_was_dropped() -> None:
    assert await followed(MemoryStore()) == [WaiterEvent(EventKind.FINAL, NOT_RUN_TEXT)]


async def test_a_message_answered_elsewhere_gets_the_kept_answer() -> None:
    store = MemoryStore()
    await store.commit(KEY, None, WriteBatch(answered=["m1"], answer="kept"))
    assert await followed(store) == [WaiterEvent(EventKind.KEPT, "kept")]
