"""Busy policies for a session another process runs: what each policy makes of a message."""

from __future__ import annotations

import msgspec
import pytest

from chatlane.identity import SessionSource
from chatlane.runtime.busy import BusyOutcome, BusyPolicy
from chatlane.runtime.elsewhere import (
    interrupt_elsewhere,
    outcome_elsewhere,
    was_interrupted_elsewhere,
)
from chatlane.runtime.turn import Turn, TurnOverrides
from chatlane.state import SessionState
from chatlane.stores import MemoryStore
from chatlane.stores.fields import INTERRUPTED_GENERATION
from chatlane.types import InboundMessage
from tests.keys import chat_key

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
