"""Busy policies for a session another process runs: what each policy makes of a message."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from chatlane.identity import SessionSource
from chatlane.runtime.busy import BusyOutcome, BusyPolicy
from chatlane.runtime.elsewhere import (
    interrupt_elsewhere,
    outcome_elsewhere,
    was_interrupted_elsewhere,
)
from chatlane.runtime.leases import LeaseSettings
from chatlane.runtime.outcomes import Outcome
from chatlane.runtime.turn import Turn, TurnOverrides
from chatlane.state import SessionState
from chatlane.stores import MemoryStore, Store
from chatlane.stores.fields import INTERRUPTED_GENERATION
from chatlane.testing import GatewayHarness
from chatlane.types import InboundMessage
from tests.keys import chat_key
from tests.runtime.agents import EchoAgent

SOURCE = SessionSource("test", chat_id="c", user_id="u")


async def waiting_turn(*, fresh: bool = True, internal: bool = False) -> tuple[SessionState, Turn]:
    state = SessionState(chat_key("c"))
    message = InboundMessage(SOURCE, "hi", internal=internal)
    turn = Turn.of(state, (message,), (1,), TurnOverrides(), refusable=fresh)
    return state, turn


def outcome(policy: BusyPolicy, state: SessionState, turn: Turn, depth: int = 3) -> BusyOutcome:
    return outcome_elsewhere(policy, state, turn, turn.messages[0], queue_cap=32, depth=depth)


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        (BusyPolicy.REJECT, BusyOutcome.REJECTED),
        (BusyPolicy.INTERRUPT, BusyOutcome.INTERRUPTING),
        (BusyPolicy.QUEUE, BusyOutcome.QUEUED),
        (BusyPolicy.COLLECT, BusyOutcome.MERGED),
        (BusyPolicy.STEER, BusyOutcome.QUEUED),  # it waits; the running process draws it in
    ],
)
async def test_a_fresh_message_gets_its_policy(policy: BusyPolicy, expected: BusyOutcome) -> None:
    state, turn = await waiting_turn()
    assert outcome(policy, state, turn) is expected


@pytest.mark.parametrize("policy", [BusyPolicy.REJECT, BusyPolicy.INTERRUPT])
async def test_what_was_accepted_to_run_just_waits(policy: BusyPolicy) -> None:
    state, queued = await waiting_turn(fresh=False)
    assert outcome(policy, state, queued) is BusyOutcome.QUEUED
    state, internal = await waiting_turn(internal=True)
    assert outcome(policy, state, internal) is BusyOutcome.QUEUED


async def test_interrupts_past_the_depth_wait_instead() -> None:
    state, turn = await waiting_turn()
    state.conversation.interrupt_streak = 2
    assert outcome(BusyPolicy.INTERRUPT, state, turn, depth=2) is BusyOutcome.QUEUED
    assert outcome(BusyPolicy.INTERRUPT, state, turn, depth=3) is BusyOutcome.INTERRUPTING


async def test_an_interrupt_names_the_running_generation_and_fences_it() -> None:
    store = MemoryStore()
    key = chat_key("c")
    lease = await store.acquire(key, "h-runner", 30)
    assert await interrupt_elsewhere(store, key) == lease.generation
    assert await store.generation(key) == lease.generation + 1
    assert (await store.load_persistent(key))[INTERRUPTED_GENERATION] == lease.generation
    _, turn = await waiting_turn()
    turn.bind_lease(lease)
    assert await was_interrupted_elsewhere(store, turn)
    _, later = await waiting_turn()  # a later turn of the session was not the one interrupted
    later.bind_lease(msgspec.structs.replace(lease, generation=lease.generation + 1))
    assert not await was_interrupted_elsewhere(store, later)


class FinishesOnceInterrupted:
    """Answers each message once ``landed`` is set (the interrupt from elsewhere reached
    the store), so its reply comes to be committed after the turn was fenced."""

    def __init__(self) -> None:
        self.landed = asyncio.Event()
        self.ran: list[str] = []

    async def __call__(self, turn: Turn) -> str:
        self.ran.append(turn.text)
        await self.landed.wait()
        return f"answer: {turn.text}"


async def test_a_reply_fenced_by_an_interrupt_elsewhere_ends_interrupted(
    two_stores: tuple[Store, Store],
) -> None:
    """The agent finished while the interrupt landed; the commit, not a fence check, finds
    out: the turn ends interrupted, its message is done, not run again."""
    agent = FinishesOnceInterrupted()
    unchecked = LeaseSettings(ttl=60, fence_check=0)  # no fence check, no renewal meanwhile
    here, there = two_stores
    async with (
        GatewayHarness(agent, store=here, busy="rollback", leases=unchecked) as runner,
        GatewayHarness(EchoAgent(), store=there, busy="rollback") as other,
    ):
        first = await runner.send("first", chat_id="c")
        await runner.until_running(chat_id="c")
        await other.send("hello", chat_id="c")
        assert await other.replies(chat_id="c", count=1) == ["Interrupting the current task"]
        agent.landed.set()
        assert await other.replies(chat_id="c", count=2) == [
            "Interrupting the current task",
            "echo: hello",
        ]
        await runner.settle()
        assert agent.ran == ["first"]
        assert runner.delivered(chat_id="c") == []
        outcomes = [(o.message_id, o.outcome) for o in runner.outcomes]
        assert outcomes == [(first.message_id, Outcome.INTERRUPTED)]
        assert await here.pending(first.session_key) == []
