"""A turn waiting for a lease another process holds runs once it is released, not a poll later.

Two gateways share one store's data, as two processes do: on PostgreSQL each
has a store of its own on one schema (they hear each other through
``LISTEN``/``NOTIFY``); in memory they share the store. Their poll delay is a
minute (``poll`` = ``max_poll`` = 60 s) and every test runs under a timeout of
a few seconds: a waiting turn that ran in time was woken, it did not poll.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest

from chatlane.errors import EarlierMessageFirst
from chatlane.identity import ChatType, SessionSource, build_session_key
from chatlane.runtime.busy import BUSY_ELSEWHERE
from chatlane.runtime.outcomes import Outcome
from chatlane.runtime.settings import LeaseSettings
from chatlane.runtime.turn import Turn
from chatlane.stores import MemoryStore, Store
from chatlane.stores.postgres import PostgresStore
from chatlane.stores.postgres import wakeups as pg_wakeups
from chatlane.stores.postgres.url import parse_url
from chatlane.testing import GatewayHarness
from chatlane.types import InboundMessage, SessionKey
from tests.adapters.test_api import eventually
from tests.stores.conftest import forget_store, own_schema

SLOW_POLL = LeaseSettings(poll=60.0, max_poll=60.0)
"""Waits that only a wake-up ends within any test's time."""


class Gate:
    """An agent whose turns wait until the test opens the gate (``echo: <text>`` then)."""

    def __init__(self) -> None:
        self.open = asyncio.Event()
        self.entered = asyncio.Event()

    async def __call__(self, turn: Turn) -> str:
        self.entered.set()
        await self.open.wait()
        return f"echo: {turn.text}"


async def echo(turn: Turn) -> str:
    for _ in range(random.randrange(4)):  # turns end in a varying order, not after a time
        await asyncio.sleep(0)
    return f"echo: {turn.text}"


@pytest.fixture(params=["memory", "postgres"])
async def stores(request: pytest.FixtureRequest) -> AsyncIterator[tuple[Store, Store]]:
    """Two processes' stores of one data set."""
    if request.param == "memory":
        shared = MemoryStore()
        yield shared, shared
        return
    url = own_schema(request.getfixturevalue("postgres_url"), "wake_engine")
    first, second = await PostgresStore.open(url), await PostgresStore.open(url)
    yield first, second
    await first.close()
    await second.close()
    await forget_store(url)


async def test_a_waiting_turn_runs_once_the_other_process_releases(
    stores: tuple[Store, Store],
) -> None:
    gate = Gate()
    async with (
        GatewayHarness(gate, store=stores[0], leases=SLOW_POLL) as running,
        GatewayHarness(echo, store=stores[1], leases=SLOW_POLL) as waiting,
        asyncio.timeout(10),
    ):
        await running.send("first", chat_id="c")
        await gate.entered.wait()
        await waiting.send("second", chat_id="c")
        assert await waiting.replies(chat_id="c", count=1) == [BUSY_ELSEWHERE]
        gate.open.set()
        assert await running.replies(chat_id="c", count=1) == ["echo: first"]
        assert await waiting.replies(chat_id="c", count=2) == [BUSY_ELSEWHERE, "echo: second"]


async def test_several_sessions_on_two_gateways_answer_every_message_once(
    stores: tuple[Store, Store],
) -> None:
    chats, rounds = [f"c{n}" for n in range(6)], 5
    async with (
        GatewayHarness(echo, store=stores[0], leases=SLOW_POLL, ack_debounce=0) as one,
        GatewayHarness(echo, store=stores[1], leases=SLOW_POLL, ack_debounce=0) as two,
        asyncio.timeout(30),
    ):
        sent: list[str] = []
        sends = []
        for r in range(rounds):
            for n, chat in enumerate(chats):
                for h, name in ((one, "one"), (two, "two")):
                    text = f"{chat} {name} {r} {n}"
                    sent.append(text)
                    sends.append(h.send(text, chat_id=chat))
        random.shuffle(sends)
        await asyncio.gather(*sends)
        expected = {f"echo: {text}" for text in sent}

        def answers() -> list[str]:
            delivered = [o.text for h in (one, two) for o in h.outbox]
            return [text for text in delivered if text.startswith("echo: ")]

        await eventually(lambda: len(answers()) >= len(sent))
        await one.settle()
        await two.settle()
    assert sorted(answers()) == sorted(expected)  # every message once, none twice
    outcomes = [o for h in (one, two) for o in h.outcomes]
    assert len(outcomes) == len(sent)
    assert {o.outcome for o in outcomes} == {Outcome.ANSWERED}


class LateAnswer(MemoryStore):
    """A memory store that holds back its answer to one message's admission (applied) until
    told: as the answer of a call a pool sent first that came back after a later call's."""

    def __init__(self, held: str) -> None:
        super().__init__()
        self.held = held
        self.applied, self.answering = asyncio.Event(), asyncio.Event()
        self.earlier_first = 0

    async def enqueue_and_acquire(
        self, key: SessionKey, message_id: str, *args: Any, **kwargs: Any
    ) -> Any:
        admission = await super().enqueue_and_acquire(key, message_id, *args, **kwargs)
        if message_id == self.held:
            self.applied.set()
            await self.answering.wait()
        return admission

    async def acquire_and_read(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().acquire_and_read(*args, **kwargs)
        except EarlierMessageFirst:
            self.earlier_first += 1
            raise


def echoes(harness: GatewayHarness) -> list[str]:
    return [o.text for o in harness.outbox if o.text.startswith("echo: ")]


async def test_an_earlier_message_answered_late_goes_first_without_waiting_for_a_wakeup() -> None:
    """Process one's first message is answered after its second, whose turn started and
    waits for the lease; process two's message lies between the two. Each waits on the
    other's earlier message, and no store event will come: process one's turn must see
    its own earlier message queued behind it, and give way at once."""
    store = LateAnswer(held="first")
    source = SessionSource("test", chat_id="c", user_id="u1", chat_type=ChatType.DM)
    key = build_session_key(source)
    elsewhere = await store.acquire(key, "a third process", 3600)
    async with (
        GatewayHarness(echo, store=store, leases=SLOW_POLL) as one,
        GatewayHarness(echo, store=store, leases=SLOW_POLL) as two,
        asyncio.timeout(20),
    ):
        first = asyncio.create_task(one.gateway.dispatch(InboundMessage(source, "1", id="first")))
        await store.applied.wait()  # seq 1, its answer held back
        await two.gateway.dispatch(InboundMessage(source, "2", id="between"))  # seq 2
        await one.gateway.dispatch(InboundMessage(source, "3", id="second"))  # seq 3: waits
        await store.release(elsewhere)  # both ask; each finds the other's earlier message
        await eventually(lambda: store.earlier_first >= 2)
        store.answering.set()  # seq 1 reaches process one, behind its waiting turn
        await first
        await eventually(lambda: len(echoes(one)) == 2 and len(echoes(two)) == 1)
    assert echoes(one) == ["echo: 1", "echo: 3"]
    assert echoes(two) == ["echo: 2"]
    assert [e.content for e in await store.transcript(key) if e.role == "user"] == ["1", "2", "3"]


@pytest.fixture
async def postgres_pair(postgres_url: str) -> AsyncIterator[tuple[PostgresStore, PostgresStore]]:
    url = own_schema(postgres_url, "wake_down")
    first, second = await PostgresStore.open(url), await PostgresStore.open(url)
    yield first, second
    await first.close()
    await second.close()
    await forget_store(url)


async def test_without_its_listener_a_waiting_turn_polls_and_the_listener_returns(
    postgres_pair: tuple[PostgresStore, PostgresStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    running_store, waiting_store = postgres_pair
    listener = waiting_store.listener
    reconnect = pg_wakeups.connect

    async def unreachable(*args: Any, **kwargs: Any) -> Any:
        raise OSError("no route to host")

    monkeypatch.setattr(pg_wakeups, "connect", unreachable)
    connection = await asyncpg.connect(parse_url(running_store.url).dsn)
    try:
        await connection.fetchval("SELECT pg_terminate_backend($1)", listener.server_pid)
    finally:
        await connection.close()
    gate = Gate()
    quick = LeaseSettings(poll=0.05, max_poll=0.2)
    async with (
        GatewayHarness(gate, store=running_store, leases=SLOW_POLL) as running,
        GatewayHarness(echo, store=waiting_store, leases=quick) as waiting,
        asyncio.timeout(10),
    ):
        await eventually(lambda: not listener.listening)
        await running.send("first", chat_id="c")
        await gate.entered.wait()
        await waiting.send("second", chat_id="c")
        assert await waiting.replies(chat_id="c", count=1) == [BUSY_ELSEWHERE]
        gate.open.set()
        assert await waiting.replies(chat_id="c", count=2) == [BUSY_ELSEWHERE, "echo: second"]
        assert not listener.listening  # it ran by polling
        monkeypatch.setattr(pg_wakeups, "connect", reconnect)
        await eventually(lambda: listener.listening)
    assert listener.opened == 2
