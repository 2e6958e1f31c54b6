"""The idle-session path: what it skips, and that every way off it still holds.

A message to a session idle here normally takes its lease with it, and its
turn takes that lease, and the stored choices read with it, in one step
without a store call of its own; stored choices that would change nothing
are not taken up again. Each test here checks one of those shortcuts
against the path it stands for, or a way off it: the generation moved on
elsewhere, the stored choices changed, many sessions at once.
"""

from __future__ import annotations

import asyncio
import copy
import time
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from chatlane.identity import SessionSource
from chatlane.runtime.busy import BusyPolicy
from chatlane.runtime.engine import RuntimeSettings, TurnEngine
from chatlane.runtime.persisted import at_rest, refresh_persistent
from chatlane.runtime.turn import Turn, TurnOverrides
from chatlane.state import SERVICE_TIER_UNSET, SessionState, UserGrant
from chatlane.stores import Admission, MemoryStore
from chatlane.stores.codec import encode_message
from chatlane.stores.ids import new_token
from chatlane.testing import GatewayHarness
from chatlane.types import InboundMessage, ModelChoice, Outbound, OutboundKind
from tests.keys import chat_key
from tests.runtime.agents import EchoAgent


async def deliver_nothing(outbound: Outbound) -> None:
    return None


CONVERSATIONS = st.sampled_from(["", "c_1", "c_2"])
STORED = st.fixed_dictionaries(
    {},
    optional={
        "conversation_id": CONVERSATIONS,
        "busy_policy": st.sampled_from([None, "", "queue", "reject"]),
        "model_override": st.sampled_from([None, {"name": "m1"}, "not a model"]),
        "reasoning_override": st.sampled_from([None, "high", 3]),
        "service_tier_override": st.sampled_from([None, "normal", "priority"]),
        "approval_allowlist": st.sampled_from([None, [], ["ls"], ["ls", 4]]),
        "approval_allowlist_by_user": st.sampled_from([None, {}, {"u": ["ls"]}, {"u": "ls"}]),
        "interrupted_generation": st.integers(0, 3),
    },
)


@st.composite
def states(draw: st.DrawFn) -> SessionState:
    """A session as this process may hold it: choices of its own, or none."""
    state = SessionState()
    conversation = state.conversation
    conversation.conversation_id = draw(CONVERSATIONS)
    conversation.model_override = draw(st.sampled_from([None, ModelChoice("m1")]))
    conversation.one_turn_restore = draw(st.sampled_from([None, ("restore", None)]))
    conversation.reasoning_override = draw(st.sampled_from([None, "high"]))
    conversation.service_tier_override = draw(st.sampled_from([SERVICE_TIER_UNSET, None, "x"]))
    conversation.queued_events = draw(st.sampled_from([[], ["event"]]))
    state.persistent.busy_policy = draw(st.sampled_from([None, BusyPolicy.QUEUE]))
    state.persistent.approval_allowlist = draw(st.sampled_from([[], ["ls"]]))
    state.persistent.approval_allowlist_by_user = draw(
        st.sampled_from([(), (UserGrant("u", "ls"),)])
    )
    return state


def without_read_at(state: SessionState) -> SessionState:
    copied = copy.deepcopy(state)
    copied.read_at = 0.0
    return copied


@given(states(), STORED)
def test_choices_at_rest_are_exactly_those_taking_them_up_leaves_as_they_are(
    state: SessionState, stored: dict[str, Any]
) -> None:
    taken = copy.deepcopy(state)
    refresh_persistent(taken, stored)
    if at_rest(state, stored):
        assert without_read_at(taken) == without_read_at(state)


def test_a_choice_on_either_side_is_not_at_rest() -> None:
    state = SessionState()
    assert at_rest(state, {})
    assert at_rest(state, {"interrupted_generation": 2})  # not a choice
    assert not at_rest(state, {"busy_policy": None})  # named: taken up in full
    assert not at_rest(state, {"conversation_id": "c_1"})  # a new conversation elsewhere
    state.persistent.busy_policy = BusyPolicy.QUEUE
    assert not at_rest(state, {})


class Generations:
    """Replies ``ok`` and notes each turn's generation and busy policy."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, str | None]] = []

    async def __call__(self, turn: Turn) -> str:
        policy = turn.session_state.persistent.busy_policy
        self.seen.append((turn.generation, None if policy is None else policy.value))
        return "ok"


async def test_a_generation_moved_on_elsewhere_leaves_the_one_step_path() -> None:
    store = MemoryStore()
    agent = Generations()
    async with GatewayHarness(agent, store=store, reread_stored=0.0) as h:
        await h.send("first", chat_id="c1")
        await h.settle()
        key = h.session_key(chat_id="c1")
        await store.bump_generation(key)  # another process ran the session meanwhile
        await store.bump_generation(key)
        await store.set_persistent(key, None, busy_policy="reject")
        await h.send("second", chat_id="c1")
        await h.settle()
        replies = await h.replies(chat_id="c1", count=2)
    assert replies == ["ok", "ok"]
    assert agent.seen == [(1, None), (4, "reject")]  # the queue was read: still there, it ran


async def test_a_message_dropped_elsewhere_meanwhile_does_not_run() -> None:
    store = MemoryStore()
    agent = Generations()
    async with GatewayHarness(agent, store=store, reread_stored=0.0) as h:
        await h.send("first", chat_id="c1")
        await h.settle()
        key = h.session_key(chat_id="c1")
        await store.bump_generation(key)
        original = store.enqueue_and_acquire

        async def dropped_by_a_stop_elsewhere(*args: Any, **kwargs: Any) -> Any:
            admission = await original(*args, **kwargs)
            await store.drop_pending(key, [admission.seq])  # /stop in another process
            return admission

        store.enqueue_and_acquire = dropped_by_a_stop_elsewhere  # type: ignore[method-assign]
        await h.send("second", chat_id="c1")
        await h.settle()
    assert agent.seen == [(1, None)]


async def test_many_sessions_at_once_each_answer_every_message_once_in_order() -> None:
    sessions, per_session = 40, 5
    release = asyncio.Event()
    started: dict[str, int] = {}

    async def agent(turn: Turn) -> str:
        chat = turn.source.chat_id or ""
        started[chat] = started.get(chat, 0) + 1
        if started[chat] == 1:
            await release.wait()  # every session's first turn waits: the rest queue behind it
        return f"{chat}: {turn.text}"

    async with GatewayHarness(agent, busy="queue", reread_stored=0.0) as h:
        for n in range(per_session):
            for s in range(sessions):
                await h.send(f"m{n}", chat_id=f"c{s}")
        release.set()
        await h.settle()
        for s in range(sessions):
            delivered = h.delivered(chat_id=f"c{s}")
            replies = [o.text for o in delivered if o.kind is OutboundKind.REPLY]
            assert replies == [f"c{s}: m{n}" for n in range(per_session)]
        engine = h.gateway.engine
        for s in range(sessions):
            key = h.session_key(chat_id=f"c{s}")
            assert await engine.store.pending(key) == []
            assert await engine.store.generation(key) == per_session
    assert engine.metrics.turns_started == sessions * per_session


async def given_turn(engine: TurnEngine, *, choices: bool) -> tuple[Turn, Admission]:
    """A claimed turn of a fresh message, and what the store said when it queued it."""
    key = chat_key("c1")
    state = await engine.session(key)
    message = InboundMessage(SessionSource("test", chat_id="c1", user_id="u1"), "hi")
    payload = encode_message(message)
    admission = await engine.leases.admit(
        state, message.id, payload, choices=choices, token=new_token()
    )
    turn = Turn.of(state, (message,), (admission.seq,), TurnOverrides())
    engine.slots.claim(turn)
    return turn, admission


async def test_a_given_lease_with_fresh_choices_is_taken_in_one_step() -> None:
    engine = TurnEngine(EchoAgent(), deliver_nothing, settings=RuntimeSettings(reread_stored=60))
    turn, admission = await given_turn(engine, choices=False)
    turn.session_state.read_at = time.monotonic()  # read just now
    assert engine._take_given_lease(turn, admission) is True
    assert admission.lease is not None
    assert turn.lease == admission.lease
    assert turn.generation == turn.session_state.persistent.run_generation == 1
    await engine.aclose()


async def test_stale_choices_that_did_not_come_with_the_lease_take_the_general_path() -> None:
    engine = TurnEngine(EchoAgent(), deliver_nothing, settings=RuntimeSettings(reread_stored=60))
    turn, admission = await given_turn(engine, choices=False)
    turn.session_state.read_at = time.monotonic() - 61  # went stale since the message came
    assert engine._take_given_lease(turn, admission) is None
    assert turn.lease is None  # nothing was done: the general path takes it all
    assert turn.session_state.turn.lease_tokens == {}
    assert await engine._take_lease(turn, admission) is True
    assert turn.session_state.read_at > time.monotonic() - 1  # read with a call of its own
    await engine.aclose()
