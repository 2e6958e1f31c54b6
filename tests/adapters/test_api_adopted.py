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
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from msgspec.structs import replace

from chatlane.adapters.api import KEPT_SEPARATOR
from chatlane.config import Config
from chatlane.errors import StoreError
from chatlane.identity import SessionKey, SessionSource
from chatlane.runtime.outcomes import MessageOutcome, Outcome, OutcomeLedger
from chatlane.runtime.settings import LeaseSettings, RuntimeSettings
from chatlane.runtime.turn import Turn
from chatlane.runtime.watch import settle_watched
from chatlane.stores import MemoryStore, Store, WriteBatch
from chatlane.stores.base import PendingRecord
from chatlane.types import Agent, InboundMessage
from tests.adapters.test_api import Served, cancel, eventually, make_config, serve
from tests.keys import chat_key

SESSION = "adopted"
KEY = chat_key(SESSION, "api")
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
        serve(config_a, run, store=shared) as first,
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
        serve(config_a, run, store=shared) as first,
        serve(config_b, answering(whole), store=shared) as second,
    ):
        asked = asyncio.create_task(first.ask_streaming("hello", SESSION))
        await first.running(SESSION)
        async with asyncio.timeout(10):
            await run.streamed.wait()
        await pause(first, second)
        assert "".join(await asked) == whole


# -- what the store says became of a watched message ------------------------------------


class Unreadable(MemoryStore):
    async def pending(self, key: SessionKey) -> list[PendingRecord]:
        raise StoreError("the store is out of reach")


def watching(message_id: str = "m1") -> tuple[OutcomeLedger, list[MessageOutcome]]:
    """A ledger holding ``message_id`` open and watched, and the outcomes it emits."""
    heard: list[MessageOutcome] = []
    ledger = OutcomeLedger(heard.append)
    ledger.open(KEY, InboundMessage(SessionSource("api", chat_id=SESSION), "hi", id=message_id))
    ledger.watch([message_id])
    return ledger, heard


async def test_an_unreadable_store_ends_nothing() -> None:
    ledger, heard = watching()
    with pytest.raises(StoreError):
        await settle_watched(Unreadable(), ledger)
    assert heard == []
    assert ledger.is_open("m1")


async def test_a_message_queued_for_another_process_stays_watched() -> None:
    store = MemoryStore()
    await store.enqueue(KEY, "m1", "h-there", b"")
    ledger, heard = watching()
    assert await settle_watched(store, ledger) == 0
    assert heard == []
    assert ledger.watched() == {"m1": KEY}


async def test_a_message_the_store_neither_answered_nor_queues_was_dropped() -> None:
    ledger, heard = watching()
    await settle_watched(MemoryStore(), ledger)
    assert [(o.message_id, o.outcome) for o in heard] == [("m1", Outcome.DROPPED)]


async def test_a_message_answered_elsewhere_gets_the_kept_answer() -> None:
    store = MemoryStore()
    await store.commit(KEY, None, WriteBatch(answered=["m1"], answer="kept"))
    ledger, heard = watching()
    await settle_watched(store, ledger)
    assert [(o.outcome, o.text) for o in heard] == [(Outcome.ANSWERED, "kept")]
    assert not ledger.is_open("m1")


async def test_a_message_set_aside_elsewhere_failed_with_its_reason() -> None:
    store = MemoryStore()
    seq = await store.enqueue(KEY, "m1", "h-there", b"")
    await store.park(KEY, [seq], "its turn lost its lease 3 times")
    ledger, heard = watching()
    await settle_watched(store, ledger)
    assert [(o.outcome, o.reason) for o in heard] == [
        (Outcome.FAILED, "its turn lost its lease 3 times")
    ]


# -- a request another process's running turn drew in --------------------------------


class HeldOnLong:
    """Holds the turn of ``long`` until released, then answers with what was steered in."""

    accepts_steering = True

    def __init__(self) -> None:
        self.release = asyncio.Event()

    async def __call__(self, turn: Turn) -> str:
        if turn.text == "long":
            await self.release.wait()
        return " + ".join([f"ran {turn.text}", *turn.take_steers()])


async def test_a_request_steered_into_another_process_turn_is_not_cancelled(
    tmp_path: Path,
) -> None:
    """Under ``steer`` the turn another gateway runs draws in what this one queued, and its
    agent may take it any moment: a cancel is refused (409), and the request gets the
    answer it is part of."""
    base = make_config(tmp_path, busy="steer")
    by_hand = dataclasses.replace(base.runtime, leases=LeaseSettings(fence_check=0))
    config = replace(base, runtime=by_hand)
    shared = f"sqlite:///{tmp_path / 'shared.db'}"
    runner_agent = HeldOnLong()
    async with (
        serve(config, runner_agent, store=shared) as runner,
        serve(config, HeldOnLong(), store=shared) as other,
    ):
        held = asyncio.create_task(runner.ask("long", SESSION))
        await runner.running(SESSION)
        first = asyncio.create_task(other.ask("first", SESSION))  # waits for the lease
        await eventually(lambda: other.adapter.waiting == 1)
        queue = {"X-Chatlane-Busy": "queue"}
        queued = asyncio.create_task(other.ask("queued", SESSION, extra_headers=queue))
        await eventually(lambda: other.adapter.waiting == 2)
        stream = await other.client.chat.completions.create(
            model="chatlane",
            messages=[{"role": "user", "content": "then this"}],
            user=SESSION,
            stream=True,
        )
        chunks = aiter(stream)
        completion = (await anext(chunks)).id  # queued here, behind "queued"
        await runner.hub.gateway.engine.upkeep.check_fences()  # draws in both steers
        answer = await cancel(other, completion)
        assert (answer.status_code, answer.json()["error"]["code"]) == (409, "completion_running")
        assert "another gateway process" in answer.json()["error"]["message"]
        runner_agent.release.set()
        whole = "ran long + first + then this"
        assert await held == whole
        assert await first == whole
        told = "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])
        assert told == whole
        assert await queued == "ran queued"
