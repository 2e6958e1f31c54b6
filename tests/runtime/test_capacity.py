"""Process-wide limits: the byte count never under-counts, and what it remembers stays bounded."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import cast

import pytest

from chatlane.errors import GatewayFull, MessageTooLarge
from chatlane.identity import SessionSource
from chatlane.runtime.busy import BusyOutcome
from chatlane.runtime.capacity import RECOUNT_FLOOR, Capacity, CapacitySettings, message_bytes
from chatlane.runtime.slots import Slots
from chatlane.runtime.turn import Turn
from chatlane.testing import GatewayHarness
from chatlane.types import InboundMessage
from tests.keys import chat_key
from tests.runtime.agents import EchoAgent

SOURCE = SessionSource("test", chat_id="c", user_id="u")


class Held:
    """What the engine's slots tell a capacity: the messages held, and no live session."""

    def __init__(self, messages: list[InboundMessage]) -> None:
        self.messages = messages

    def held(self) -> list[InboundMessage]:
        return self.messages

    def live_count(self) -> int:
        return 0


def capacity_over(held: list[InboundMessage], settings: CapacitySettings | None = None) -> Capacity:
    return Capacity(settings or CapacitySettings(), cast(Slots, Held(held)))


def admit(capacity: Capacity, message: InboundMessage) -> None:
    capacity.reserve(message, arriving=None)
    capacity.settled(message, arriving=None)


def test_answered_messages_are_forgotten_however_many_came_and_went() -> None:
    held: list[InboundMessage] = []
    capacity = capacity_over(held)
    size = message_bytes(InboundMessage(SOURCE, "hello"))
    for _ in range(20 * RECOUNT_FLOOR):
        admit(capacity, InboundMessage(SOURCE, "hello"))  # answered at once: never held
    assert capacity.counted_bytes <= (RECOUNT_FLOOR + 1) * size


def test_held_messages_stay_counted_through_recounts() -> None:
    held = [InboundMessage(SOURCE, "waiting") for _ in range(3 * RECOUNT_FLOOR)]
    capacity = capacity_over(held)
    for message in held:
        admit(capacity, message)
    for _ in range(10 * RECOUNT_FLOOR):
        admit(capacity, InboundMessage(SOURCE, "passing"))
    assert capacity.counted_bytes >= sum(message_bytes(m) for m in held)


def test_a_message_larger_than_the_byte_limit_alone_is_told_so() -> None:
    """Not "N bytes wait; try again later": no wait makes room for it."""
    message = InboundMessage(SOURCE, "x" * 100)
    capacity = capacity_over([], CapacitySettings(queued_bytes=message_bytes(message) - 1))
    with pytest.raises(MessageTooLarge, match="the message is too large") as refused:
        capacity.reserve(message, arriving=chat_key("big"))
    assert "try again later" not in str(refused.value)
    assert isinstance(refused.value, GatewayFull)  # every adapter refuses it as before
    admit(capacity, InboundMessage(SOURCE, "x" * 50))  # nothing of it was counted


def test_messages_of_one_session_arriving_at_once_count_it_once() -> None:
    capacity = capacity_over([], CapacitySettings(live_sessions=2))
    together = [InboundMessage(SOURCE, "hi") for _ in range(4)]
    for message in together:  # all being stored at once
        capacity.reserve(message, arriving=chat_key("a"))
    capacity.reserve(InboundMessage(SOURCE, "hi"), arriving=chat_key("b"))  # the second session
    with pytest.raises(GatewayFull, match=r"2 sessions are live \(limit 2\)"):
        capacity.reserve(InboundMessage(SOURCE, "hi"), arriving=chat_key("c"))
    for message in together:
        capacity.settled(message, arriving=chat_key("a"))
    capacity.reserve(InboundMessage(SOURCE, "hi"), arriving=chat_key("c"))  # "a" went


async def test_a_burst_to_one_idle_session_at_the_live_limit_is_taken(tmp_path: Path) -> None:
    """Four messages at once to one idle session, on a store whose calls suspend: one live
    session, which the limit of one admits."""
    store = f"sqlite:///{tmp_path / 'burst.db'}"
    limits = CapacitySettings(live_sessions=1)
    async with GatewayHarness(EchoAgent(), store=store, capacity=limits) as h:
        results = await asyncio.gather(*(h.send(f"m{n}", chat_id="c") for n in range(4)))
        assert [r.refused for r in results] == [False] * 4
        await h.settle()
        replies = [o.text for o in h.outbox if o.text.startswith("echo: ")]
    assert sorted(replies) == [f"echo: m{n}" for n in range(4)]


async def test_a_message_the_limits_refuse_leaves_no_session_behind() -> None:
    """Refused names made up by whoever is refused would otherwise fill the session list
    (pushing real idle sessions out) and the operator's view of it."""
    hold = asyncio.Event()

    async def holding(turn: Turn) -> str:
        await hold.wait()
        return "held"

    limits = CapacitySettings(live_sessions=1)
    async with GatewayHarness(holding, capacity=limits) as h:
        await h.send("hold", chat_id="real")
        await h.until_running(chat_id="real")
        for n in range(20):
            with pytest.raises(GatewayFull):
                await h.send("hi", chat_id=f"made-up-{n}")
        assert len(h.gateway.engine.registry) == 1
        hold.set()
        assert await h.replies(chat_id="real", count=1) == ["held"]


def test_the_byte_limit_still_refuses_what_would_pass_it() -> None:
    held: list[InboundMessage] = []
    message = InboundMessage(SOURCE, "x" * 100)
    capacity = capacity_over(held, CapacitySettings(queued_bytes=3 * message_bytes(message)))
    for _ in range(3):
        admitted = InboundMessage(SOURCE, "x" * 100)
        admit(capacity, admitted)
        held.append(admitted)
    with pytest.raises(GatewayFull):
        capacity.reserve(InboundMessage(SOURCE, "x" * 100), arriving=None)


class SteeredHold:
    """Accepts steering; ``hold`` waits until :attr:`opened` (taking nothing itself)."""

    accepts_steering = True

    def __init__(self) -> None:
        self.opened = asyncio.Event()

    async def __call__(self, turn: Turn) -> str:
        if turn.text == "hold":
            await self.opened.wait()
        return f"ran: {turn.text} ({len(turn.steered)} steered)"


@pytest.mark.parametrize("taken", [False, True], ids=["untaken", "taken"])
async def test_steered_messages_count_against_the_byte_limit(taken: bool) -> None:
    """Messages steered into a running turn are held unanswered, whether its agent took them
    or not: a recount finds them, so the byte limit refuses what would pass it."""
    agent = SteeredHold()
    steer = "x" * 1000
    size = message_bytes(InboundMessage(SOURCE, steer))
    limits = CapacitySettings(queued_bytes=message_bytes(InboundMessage(SOURCE, "hold")) + 4 * size)
    async with GatewayHarness(agent, busy="steer", capacity=limits) as h:
        await h.send("hold", chat_id="c")
        await h.until_running(chat_id="c")
        turn = h.gateway.engine.running_turn(h.session_key(chat_id="c"))
        assert turn is not None
        for _ in range(4):
            assert (await h.send(steer, chat_id="c")).outcome is BusyOutcome.STEERED
            if taken:
                assert turn.take_steers() == [steer]  # as its agent would
        with pytest.raises(GatewayFull, match="queued_bytes"):
            await h.send(steer, chat_id="c")
        agent.opened.set()
        await h.settle()
        ran = [o.text for o in h.outbox if o.text.startswith("ran: ")]
    if taken:
        assert ran == ["ran: hold (4 steered)"]
    else:
        assert ran == ["ran: hold (0 steered)", *[f"ran: {steer} (0 steered)"] * 4]
