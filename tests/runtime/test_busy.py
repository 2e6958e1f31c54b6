"""Busy policies: what happens to a message that arrives while a turn runs."""

from __future__ import annotations

import asyncio
import dataclasses
import re
import time
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, cast

import pytest

from chatlane.admin import session_summary
from chatlane.context import current_session
from chatlane.errors import STORE_UNAVAILABLE, ConfigError
from chatlane.identity import ChatType, KeyPolicy, SessionSource
from chatlane.lifecycle import LifecycleOptions
from chatlane.runtime import pending
from chatlane.runtime.arrivals import DROPPED_OLDEST
from chatlane.runtime.busy import (
    BusyContext,
    BusyOutcome,
    BusyPolicy,
    BusySettings,
    Overflow,
    collapsed_note,
    collapsed_text,
    decide,
    resolve_policy,
)
from chatlane.runtime.outcomes import Outcome
from chatlane.runtime.settings import RuntimeSettings
from chatlane.runtime.turn import Turn, turn_source
from chatlane.state import SessionRegistry
from chatlane.testing import GatewayHarness
from chatlane.types import InboundMessage, OutboundKind
from tests.keys import chat_key
from tests.runtime.agents import EchoAgent, Recorder, SteeringAgent, UntakenSteers
from tests.runtime.refusing import Refusing, first_of
from tests.runtime.test_draw_in import HoldsForSteers

if TYPE_CHECKING:
    from chatlane.hub import Hub

IDLE_CTX = BusyContext(
    queued=0,
    queue_cap=32,
    steers_waiting=0,
    internal=False,
    agent_accepts_steering=False,
    from_turn_author=True,
    interrupt_streak=0,
    interrupt_depth=3,
    already_interrupted=False,
    winding_down=False,
)


class TestDecide:
    @pytest.mark.parametrize(
        ("policy", "outcome"),
        [
            (BusyPolicy.QUEUE, BusyOutcome.QUEUED),
            (BusyPolicy.COLLECT, BusyOutcome.MERGED),
            (BusyPolicy.INTERRUPT, BusyOutcome.INTERRUPTING),
            (BusyPolicy.REDIRECT, BusyOutcome.REDIRECTING),
            (BusyPolicy.STEER, BusyOutcome.QUEUED),
            (BusyPolicy.REJECT, BusyOutcome.REJECTED),
        ],
    )
    def test_each_policy(self, policy: BusyPolicy, outcome: BusyOutcome) -> None:
        assert decide(policy, IDLE_CTX) is outcome

    def test_steer_when_agent_accepts(self) -> None:
        assert decide(BusyPolicy.STEER, _ctx(agent_accepts_steering=True)) is BusyOutcome.STEERED

    def test_steer_takes_only_the_running_turns_authors_messages(self) -> None:
        ctx = _ctx(agent_accepts_steering=True, from_turn_author=False)
        assert decide(BusyPolicy.STEER, ctx) is BusyOutcome.QUEUED

    def test_steer_never_overtakes_waiting_messages(self) -> None:
        ctx = _ctx(agent_accepts_steering=True, queued=1)
        assert decide(BusyPolicy.STEER, ctx) is BusyOutcome.QUEUED

    @pytest.mark.parametrize("policy", list(BusyPolicy))
    def test_internal_events_always_queue(self, policy: BusyPolicy) -> None:
        ctx = _ctx(internal=True, agent_accepts_steering=True)
        assert decide(policy, ctx) is BusyOutcome.QUEUED

    @pytest.mark.parametrize(
        ("policy", "outcome"),
        [
            (BusyPolicy.ROLLBACK, BusyOutcome.INTERRUPTING),
            (BusyPolicy.REDIRECT, BusyOutcome.REDIRECTING),
        ],
    )
    def test_interrupt_degrades_to_queue_at_depth(
        self, policy: BusyPolicy, outcome: BusyOutcome
    ) -> None:
        assert decide(policy, _ctx(interrupt_streak=3)) is BusyOutcome.QUEUED
        assert decide(policy, _ctx(interrupt_streak=2)) is outcome

    @pytest.mark.parametrize("policy", [BusyPolicy.ROLLBACK, BusyPolicy.REDIRECT])
    def test_interrupt_queues_while_already_interrupting(self, policy: BusyPolicy) -> None:
        assert decide(policy, _ctx(already_interrupted=True)) is BusyOutcome.QUEUED

    def test_reject_queues_behind_a_turn_that_only_winds_down(self) -> None:
        assert decide(BusyPolicy.REJECT, _ctx(winding_down=True)) is BusyOutcome.QUEUED
        full = _ctx(winding_down=True, queued=32)
        assert decide(BusyPolicy.REJECT, full) is BusyOutcome.QUEUE_FULL

    @pytest.mark.parametrize(
        "policy", [BusyPolicy.QUEUE, BusyPolicy.COLLECT, BusyPolicy.INTERRUPT, BusyPolicy.REDIRECT]
    )
    def test_cap_refuses_with_queue_full(self, policy: BusyPolicy) -> None:
        assert decide(policy, _ctx(queued=32)) is BusyOutcome.QUEUE_FULL

    def test_steers_the_agent_has_not_taken_count_against_the_cap(self) -> None:
        below = _ctx(agent_accepts_steering=True, steers_waiting=31)
        assert decide(BusyPolicy.STEER, below) is BusyOutcome.STEERED
        full = _ctx(agent_accepts_steering=True, steers_waiting=32)
        assert decide(BusyPolicy.STEER, full) is BusyOutcome.QUEUE_FULL
        assert decide(BusyPolicy.QUEUE, _ctx(queued=1, steers_waiting=31)) is BusyOutcome.QUEUE_FULL

    def test_parse_rejects_unknown_policy_clearly(self) -> None:
        with pytest.raises(ConfigError, match="'wait' is not one of: queue, collect"):
            BusyPolicy.parse("wait")


def _ctx(**changes: object) -> BusyContext:
    return dataclasses.replace(IDLE_CTX, **changes)  # type: ignore[arg-type]


class TestResolve:
    settings = BusySettings(
        default=BusyPolicy.QUEUE,
        per_platform={"telegram": BusyPolicy.INTERRUPT},
        per_chat_type={ChatType.GROUP: BusyPolicy.COLLECT},
    )

    def test_default(self) -> None:
        assert resolve_policy(self.settings, SessionSource("web", chat_id="1"), None) == "queue"

    def test_platform(self) -> None:
        source = SessionSource("telegram", chat_id="1")
        assert resolve_policy(self.settings, source, None) is BusyPolicy.INTERRUPT

    def test_chat_type_beats_platform(self) -> None:
        source = SessionSource("telegram", chat_id="1", chat_type=ChatType.GROUP)
        assert resolve_policy(self.settings, source, None) is BusyPolicy.COLLECT

    def test_session_beats_everything(self) -> None:
        source = SessionSource("telegram", chat_id="1", chat_type=ChatType.GROUP)
        assert resolve_policy(self.settings, source, BusyPolicy.REJECT) is BusyPolicy.REJECT


async def test_queue_runs_in_order_and_acks_once_per_debounce() -> None:
    recorder = Recorder()
    async with GatewayHarness(EchoAgent(recorder)) as h:
        await h.send("sleep 0.1", chat_id="c")
        await h.send("a", chat_id="c")
        await h.send("b", chat_id="c")
        replies = await h.replies(chat_id="c", count=4)
        assert replies == ["Queued for the next turn (1 queued)", "slept 0.1", "echo: a", "echo: b"]


async def test_queue_cap_answers_queue_full() -> None:
    async with GatewayHarness(EchoAgent(), queue_cap=2, ack_debounce=0) as h:
        await h.send("sleep 0.1", chat_id="c")
        for text in ("a", "b", "c"):
            await h.send(text, chat_id="c")
        replies = await h.replies(chat_id="c", count=6)
        assert replies[:3] == [
            "Queued for the next turn (1 queued)",
            "Queued for the next turn (2 queued)",
            "Queue full (2 queued) — your message was not run",
        ]
        assert replies[3:] == ["slept 0.1", "echo: a", "echo: b"]
        refusals = [o.refusal for o in h.delivered(chat_id="c")]
        assert refusals == ["", "", "queue_full", "", "", ""]


async def test_collect_merges_into_one_follow_up_after_debounce() -> None:
    recorder = Recorder()
    # "c" must come within the debounce after the first turn ended: a window wide
    # enough for a loaded machine's gap between two sends, not a measure of speed
    async with GatewayHarness(EchoAgent(recorder), busy="collect", collect_debounce=2.0) as h:
        result = await h.send("sleep 0.05", chat_id="c")
        for text in ("a", "b"):
            await h.send(text, chat_id="c")
        await h.replies(chat_id="c", count=2)  # the first turn ended; the debounce is still running
        await h.send("c", chat_id="c")
        replies = await h.replies(chat_id="c", count=3)
        assert replies == ["Added to the next turn (1 collected)", "slept 0.05", "echo: a\nb\nc"]
        merged = recorder.turns[result.session_key][1]
        assert len(merged.messages) == 3


async def test_interrupt_stops_the_run_and_runs_the_new_message() -> None:
    recorder = Recorder()
    async with GatewayHarness(EchoAgent(recorder), busy="interrupt") as h:
        result = await h.send("sleep 5", chat_id="c")
        await h.until_running(chat_id="c")
        await h.send("now", chat_id="c")
        replies = await h.replies(chat_id="c", count=2)
        assert replies == ["Interrupting the current task", "echo: now"]
        first = recorder.turns[result.session_key][0]
        assert first.interrupted.is_set()
        assert not first.is_current()


@pytest.mark.parametrize("busy", ["interrupt", "queue", "collect", "steer", "reject"])
async def test_a_message_sent_again_under_its_id_keeps_its_one_place(busy: str) -> None:
    """A retry of a message that runs, or waits, here (a client's retry under one id,
    which the store queues once) meets no busy policy: it interrupts nothing, takes no
    second place in the queue, is told nothing, and every message runs once."""
    recorder = Recorder()
    source = SessionSource("test", chat_id="c", user_id="u1", chat_type=ChatType.DM)
    running = InboundMessage(source, "sleep 5", id="m-running")
    waiting = InboundMessage(source, "later", id="m-waiting", busy_policy="queue")
    async with GatewayHarness(EchoAgent(recorder), busy=busy) as h:
        first = await h.gateway.dispatch(running)
        await h.until_running(chat_id="c")
        await h.gateway.dispatch(waiting)
        acks = len(h.delivered(chat_id="c"))
        for message in (running, waiting, running, waiting):
            again = await h.gateway.dispatch(message)
            assert again.outcome is BusyOutcome.QUEUED
        state = h.session(first.session_key)
        assert pending.pending_count(state) == 1
        assert not recorder.turns[first.session_key][0].interrupted.is_set()
        assert len(h.delivered(chat_id="c")) == acks  # nothing more was said
        recorder.turns[first.session_key][0].interrupted.set()  # let the held turn end
        replies = await h.replies(chat_id="c", count=acks + 2)
    assert replies[acks:] == ["interrupted", "echo: later"]
    assert [t.text for t in recorder.turns[first.session_key]] == ["sleep 5", "later"]


async def test_interrupt_depth_degrades_to_queue() -> None:
    recorder = Recorder()
    async with GatewayHarness(
        EchoAgent(recorder), busy="interrupt", interrupt_depth=2, ack_debounce=0
    ) as h:
        result = await h.send("sleep 5", chat_id="c")
        for i in range(3):
            await h.until_running(chat_id="c", text=f"sleep {5 + i}")
            await h.send(f"sleep {6 + i}", chat_id="c")
        replies = await h.replies(chat_id="c", count=3)
        assert replies == [
            "Interrupting the current task",
            "Interrupting the current task",
            "Queued for the next turn (1 queued)",
        ]
        assert h.session(result.session_key).conversation.interrupt_streak == 2


async def test_steer_hands_text_to_a_running_agent() -> None:
    async with GatewayHarness(SteeringAgent(), busy="steer", ack_debounce=0) as h:
        await h.send("start", chat_id="c")
        await h.send("left", chat_id="c")
        await h.send("right", chat_id="c")
        replies = await h.replies(chat_id="c", count=3)
        assert replies == [
            "Steered into the current run",
            "Steered into the current run",
            "start + left + right",
        ]


async def test_steer_falls_back_to_queue_without_agent_support() -> None:
    async with GatewayHarness(EchoAgent(), busy="steer") as h:
        await h.send("sleep 0.05", chat_id="c")
        await h.send("later", chat_id="c")
        replies = await h.replies(chat_id="c", count=3)
        assert replies == ["Queued for the next turn (1 queued)", "slept 0.05", "echo: later"]


async def test_untaken_steers_run_as_their_own_turn() -> None:
    async def agent(turn: Turn) -> str:
        await asyncio.sleep(0.05)
        return f"ran {turn.text}"

    agent.accepts_steering = True  # type: ignore[attr-defined]
    async with GatewayHarness(agent, busy="steer") as h:
        await h.send("first", chat_id="c")
        await h.send("steered", chat_id="c")
        replies = await h.replies(chat_id="c", count=3)
        assert replies == ["Steered into the current run", "ran first", "ran steered"]


@pytest.mark.parametrize("behind", ["/queue B", "internal B"])
async def test_untaken_steers_keep_their_place_before_later_messages(behind: str) -> None:
    async with GatewayHarness(UntakenSteers(hold=0.2), busy="steer") as h:
        await h.send("long", chat_id="c")
        await h.until_running(chat_id="c")
        await h.send("A", chat_id="c")  # steered, never taken
        if behind.startswith("/queue"):
            await h.send(behind, chat_id="c")
        else:
            await h.send("B", chat_id="c", internal=True)
        await h.send("C", chat_id="c")
        await asyncio.wait_for(h.settle(), 5)
        count = 6 if behind.startswith("/queue") else 5  # /queue answers; C's ack is debounced
        ran = [r for r in await h.replies(chat_id="c", count=count) if r.startswith("ran ")]
        assert ran == ["ran long", "ran A", "ran B", "ran C"]


async def test_stop_counts_steered_messages_the_agent_never_took() -> None:
    async with GatewayHarness(UntakenSteers(hold=5), busy="steer") as h:
        await h.send("long", chat_id="c")
        await h.until_running(chat_id="c")
        await h.send("A", chat_id="c")  # steered, never taken
        await h.send("/queue B", chat_id="c")
        await h.send("/stop", chat_id="c")
        replies = await h.replies(chat_id="c", count=3)
        assert replies[2] == "Stopped the running turn. Dropped 2 queued messages."
        await h.settle()
        assert not any(r.startswith("ran ") for r in await h.replies(chat_id="c", count=3))


async def test_a_stop_the_store_could_not_follow_still_drops_the_steered_messages() -> None:
    """Steered messages the agent never took leave with the stopped turn even when
    /stop's own drop is refused: the turn's aftermath drops them once the store answers."""
    store = Refusing(first_of("drop_pending"))
    async with GatewayHarness(UntakenSteers(hold=5), busy="steer", store=store) as h:
        await h.send("long", chat_id="c")
        await h.until_running(chat_id="c")
        steered = await h.send("A", chat_id="c")  # steered, never taken
        result = await h.send("/stop", chat_id="c")
        text = f"Stopped the running turn. The rest could not finish: {STORE_UNAVAILABLE}."
        assert (await h.replies(chat_id="c", count=2))[1] == text
        await h.settle()
        assert {o.message_id: o.outcome for o in h.outcomes}[steered.message_id] is Outcome.DROPPED
        assert await store.pending(result.session_key) == []
        assert not any(r.startswith("ran ") for r in await h.replies(chat_id="c", count=2))


async def test_reject_always_answers_and_never_runs() -> None:
    recorder = Recorder()
    async with GatewayHarness(EchoAgent(recorder), busy="reject") as h:
        result = await h.send("sleep 0.05", chat_id="c")
        await h.send("a", chat_id="c")
        await h.send("b", chat_id="c")
        replies = await h.replies(chat_id="c", count=3)
        assert replies == ["Busy — your message was not run"] * 2 + ["slept 0.05"]
        assert len(recorder.turns[result.session_key]) == 1
        assert [o.refusal for o in h.delivered(chat_id="c")] == ["rejected", "rejected", ""]


QUEUED_ONE = "Queued for the next turn (1 queued)"


@pytest.mark.parametrize(
    ("command", "answer"),
    [
        ("/stop", "Stopped the running turn. Dropped 0 queued messages."),
        ("/new", "Started a new conversation."),
    ],
)
async def test_reject_refuses_nothing_for_a_turn_that_was_stopped(
    command: str, answer: str
) -> None:
    """A stopped turn winds down (up to ``interrupt_grace``) in its slot; the message that
    follows the stop waits for it to end and runs, as under every other policy."""
    let_go = asyncio.Event()

    async def agent(turn: Turn) -> str:
        if turn.text == "long":
            await let_go.wait()  # a tool call that does not look at turn.interrupted
        return f"echo: {turn.text}"

    no_confirm = LifecycleOptions(confirm_new=False)
    async with GatewayHarness(agent, busy="reject", lifecycle=no_confirm) as h:
        try:
            await h.send("long", chat_id="c")
            await h.until_running(chat_id="c")
            await h.send(command, chat_id="c")
            after = await h.send("hello again", chat_id="c")
            assert after.outcome is BusyOutcome.QUEUED
            stopped = h.gateway.engine.running_turn(after.session_key)
            assert stopped is not None
            assert stopped.text == "long"  # still winding down
        finally:
            let_go.set()
        await h.settle()
        assert await h.replies(chat_id="c", count=3) == [answer, QUEUED_ONE, "echo: hello again"]
        assert {o.message_id: o.outcome for o in h.outcomes}[after.message_id] is Outcome.ANSWERED


@pytest.mark.parametrize(
    ("busy", "before", "expected"),
    [
        ("reject", [], [QUEUED_ONE, "slept 0.05", "echo: a"]),
        # the queue (cap 1) is full: refused; its ack is within the first's debounce
        ("queue", ["b"], [QUEUED_ONE, "slept 0.05", "echo: b", "echo: a"]),
    ],
)
async def test_a_refusal_the_store_could_not_follow_queues_the_message_instead(
    busy: str, before: list[str], expected: list[str]
) -> None:
    """A refused message leaves the store's queue; one the store could not drop
    stays there, so it waits here too (past the cap) and runs."""
    async with GatewayHarness(
        EchoAgent(), busy=busy, queue_cap=1, store=Refusing(first_of("drop_pending"))
    ) as h:
        await h.send("sleep 0.05", chat_id="c")
        await h.until_running(chat_id="c")
        for text in before:
            await h.send(text, chat_id="c")
        result = await h.send("a", chat_id="c")
        assert result.outcome is BusyOutcome.QUEUED
        assert await h.replies(chat_id="c", count=len(expected)) == expected
        await h.settle()
        [ended] = [o for o in h.outcomes if o.message_id == result.message_id]
        assert ended.outcome is Outcome.ANSWERED


async def test_internal_events_queue_without_interrupting() -> None:
    recorder = Recorder()
    async with GatewayHarness(EchoAgent(recorder), busy="interrupt") as h:
        result = await h.send("sleep 0.05", chat_id="c")
        await h.send("cron result", chat_id="c", internal=True)
        replies = await h.replies(chat_id="c", count=2)
        assert replies == ["slept 0.05", "echo: cron result"]
        assert not recorder.turns[result.session_key][0].interrupted.is_set()


async def test_other_sessions_are_never_delayed_by_a_busy_one() -> None:
    async with GatewayHarness(EchoAgent()) as h:
        await h.send("sleep 5", chat_id="slow")
        await h.send("hi", chat_id="fast")
        assert await h.replies(chat_id="fast", count=1, timeout=1) == ["echo: hi"]


class HoldThenAsk:
    """``hold`` waits for :attr:`go`; ``rm …`` asks for approval of its first message."""

    def __init__(self) -> None:
        self.go = asyncio.Event()
        self.authors: list[list[str | None]] = []

    async def __call__(self, turn: Turn) -> str:
        self.authors.append([m.source.user_id for m in turn.messages])
        if turn.text == "hold":
            await self.go.wait()
            return "held"
        command = turn.messages[0].text
        if command.startswith("rm"):
            approved = await turn.request_approval(command)
            return f"{'approved' if approved else 'denied'}: {command}"
        return f"echo: {turn.text}"


async def test_collect_never_merges_two_authors_and_the_author_approves() -> None:
    agent = HoldThenAsk()
    topic: dict[str, Any] = {"chat_id": "g", "chat_type": "group", "thread_id": "t"}  # shared
    async with GatewayHarness(agent, busy="collect", collect_debounce=0.01) as h:
        await h.send("hold", user_id="alice", **topic)
        await h.send("rm -rf /", user_id="alice", **topic)
        await h.send("and some more", user_id="bob", **topic)
        agent.go.set()
        await h.wait_for(lambda out: any(o.kind is OutboundKind.APPROVAL for o in out))
        await h.send("/approve", user_id="bob", **topic)
        await h.send("/deny", user_id="alice", **topic)
        replies = await h.replies(chat_id="g", thread_id="t", count=6)
        assert not any(r.startswith("Approved") for r in replies), replies
        assert replies[3:] == [
            "Only the person whose message started this turn can answer its approval.",
            "Denied: `rm -rf /`",
            "denied: rm -rf /",
        ]
        replies = await h.replies(chat_id="g", thread_id="t", count=7)
    assert replies[-1] == "echo: and some more"
    assert agent.authors == [["alice"], ["alice"], ["bob"]]


@pytest.mark.parametrize("name", ["rollback", "interrupt", " Interrupt "])
def test_rollback_is_read_by_its_name_and_its_former_one(name: str) -> None:
    assert BusyPolicy.parse(name) is BusyPolicy.ROLLBACK
    assert BusyPolicy["INTERRUPT"] is BusyPolicy.ROLLBACK  # the former name, for library code
    assert "interrupt" not in [policy.value for policy in BusyPolicy]


async def test_a_session_choice_stored_as_interrupt_reads_as_rollback() -> None:
    async with GatewayHarness(EchoAgent()) as h:
        key = h.session_key(chat_id="c")
        await h.gateway.engine.store.set_persistent(key, None, busy_policy="interrupt")
        await h.send("/busy", chat_id="c")
        await h.send("/busy interrupt", chat_id="d")
        assert await h.replies(chat_id="c", count=1) == ["Busy policy: rollback"]
        assert await h.replies(chat_id="d", count=1) == ["Busy policy for this session: rollback"]


class Gate:
    """Holds the turn of ``hold`` until :attr:`opened`; answers ``ran: <text>``."""

    def __init__(self) -> None:
        self.opened = asyncio.Event()

    async def __call__(self, turn: Turn) -> str:
        if turn.text == "hold":
            await self.opened.wait()
        return f"ran: {turn.text}"


class SteeredGate(Gate):
    """A :class:`Gate` whose agent accepts steering but never takes any: what is steered
    into ``hold`` waits there until the gate opens, then runs as its own turn."""

    accepts_steering = True


async def test_steers_the_agent_has_not_taken_count_against_the_queue_cap() -> None:
    """A message is steered only while fewer than queue_cap wait (queued, or steered and not
    taken): past it, it is refused as for a full queue and its sender told, /queue too."""
    gate = SteeredGate()
    async with GatewayHarness(gate, busy="steer", queue_cap=3, ack_debounce=0) as h:
        await h.send("hold", chat_id="c")
        await h.until_running(chat_id="c")
        sent = [await h.send(f"m{n}", chat_id="c") for n in range(5)]
        queued = await h.send("/queue m5", chat_id="c")
        assert [r.outcome for r in [*sent, queued]] == [
            *[BusyOutcome.STEERED] * 3,
            *[BusyOutcome.QUEUE_FULL] * 3,
        ]
        refused = [o for o in h.delivered(chat_id="c") if o.refusal]
        assert [(o.text, o.in_reply_to) for o in refused] == [
            ("Queue full (3 queued) — your message was not run", (r.message_id,))
            for r in [*sent[3:], queued]
        ]
        engine = h.gateway.engine
        assert engine.queue_depth() == 3
        stored = await engine.store.pending(h.session_key(chat_id="c"))
        assert len(stored) == 4  # hold and the three steered
        gate.opened.set()
        await h.settle()
    ran = [o.text for o in h.delivered(chat_id="c") if o.text.startswith("ran: ")]
    assert ran == ["ran: hold", "ran: m0", "ran: m1", "ran: m2"]
    ends = {o.message_id: o.outcome for o in h.outcomes}
    assert [ends[r.message_id] for r in sent[3:]] == [Outcome.REFUSED] * 2


async def test_drop_oldest_drops_the_oldest_steer_the_agent_has_not_taken() -> None:
    gate = SteeredGate()
    async with GatewayHarness(gate, busy="steer", queue_cap=2, overflow="drop-oldest") as h:
        await h.send("hold", chat_id="c")
        await h.until_running(chat_id="c")
        sent = {text: await h.send(text, chat_id="c") for text in ("a", "b", "c")}
        assert [r.outcome for r in sent.values()] == [BusyOutcome.STEERED] * 3
        [notice] = [o for o in h.delivered(chat_id="c") if o.kind is OutboundKind.NOTICE]
        assert notice.text == f"{DROPPED_OLDEST}: “a”"
        assert notice.in_reply_to == (sent["a"].message_id,)
        assert h.gateway.engine.queue_depth() == 2
        gate.opened.set()
        await h.settle()
        assert await h.gateway.engine.store.pending(h.session_key(chat_id="c")) == []
    ran = [o.text for o in h.delivered(chat_id="c") if o.text.startswith("ran: ")]
    assert ran == ["ran: hold", "ran: b", "ran: c"]
    assert {o.message_id: o.outcome for o in h.outcomes}[sent["a"].message_id] is Outcome.DROPPED


async def test_a_steer_the_store_would_not_drop_is_steered_again_in_its_place() -> None:
    gate = SteeredGate()
    store = Refusing(first_of("drop_own"))  # under steer a message leaves only if ours
    async with GatewayHarness(
        gate, busy="steer", store=store, queue_cap=1, overflow="drop-oldest"
    ) as h:
        await h.send("hold", chat_id="c")
        await h.until_running(chat_id="c")
        for text in ("a", "b"):
            assert (await h.send(text, chat_id="c")).outcome is BusyOutcome.STEERED
        turn = h.gateway.engine.running_turn(h.session_key(chat_id="c"))
        assert turn is not None
        assert [m.text for m, _ in turn.waiting_steers()] == ["a", "b"]  # one past the cap
        gate.opened.set()
        await h.settle()
    ran = [o.text for o in h.delivered(chat_id="c") if o.text.startswith("ran: ")]
    assert ran == ["ran: hold", "ran: a", "ran: b"]


async def test_summarize_collapses_the_steers_the_agent_has_not_taken_too() -> None:
    gate = SteeredGate()
    async with GatewayHarness(gate, busy="steer", queue_cap=2, overflow="summarize") as h:
        await h.send("hold", chat_id="c")
        await h.until_running(chat_id="c")
        sent = [await h.send(text, chat_id="c") for text in ("a", "b", "c")]
        assert [r.outcome for r in sent] == [
            BusyOutcome.STEERED,
            BusyOutcome.STEERED,
            BusyOutcome.COLLAPSED,
        ]
        gate.opened.set()
        await h.settle()
    ran = [o.text for o in h.delivered(chat_id="c") if o.text.startswith("ran: ")]
    assert ran == ["ran: hold", f"ran: {collapsed_note(3)}\na\nb\nc"]
    [told] = [o for o in h.delivered(chat_id="c") if o.text == collapsed_text(3)]
    assert told.in_reply_to == tuple(r.message_id for r in sent)
    ends = {o.message_id: o.outcome for o in h.outcomes}
    assert all(ends[r.message_id] is Outcome.ANSWERED for r in sent)


STEERED_LINE = re.compile(r"  #(\d+) \d+s ann: “(.*)” \(steered into the running turn\)")
"""A line of ``/status`` for a message steered into the running turn and not taken yet."""


async def _steered_ids(h: GatewayHarness) -> tuple[str, dict[str, int]]:
    """``/status`` in chat c: its ``queued:`` line, and each untaken steer it lists by its
    preview, with the short id ``/unqueue`` takes."""
    await h.send("/status", chat_id="c")
    status = h.delivered(chat_id="c")[-1].text
    [count] = [line for line in status.splitlines() if line.startswith("queued: ")]
    return count, {text: int(seq) for seq, text in STEERED_LINE.findall(status)}


async def _seqs(h: GatewayHarness) -> dict[str, int]:
    """The store's seq of each message it holds for chat c, by message id."""
    stored = await h.gateway.engine.store.pending(h.session_key(chat_id="c"))
    return {record.message_id: record.seq for record in stored}


async def test_status_counts_and_lists_the_steers_the_agent_has_not_taken() -> None:
    """/status counts what queue_cap counts, as "Queue full" says, and lists each untaken
    steer under its store seq, marked as steered."""
    gate = SteeredGate()
    async with GatewayHarness(gate, busy="steer", queue_cap=2, ack_debounce=0) as h:
        await h.send("hold", chat_id="c")
        await h.until_running(chat_id="c")
        a, b = [await h.send(text, chat_id="c", user_name="ann") for text in ("a", "b")]
        assert (a.outcome, b.outcome) == (BusyOutcome.STEERED, BusyOutcome.STEERED)
        full = await h.send("c", chat_id="c", user_name="ann")
        assert full.outcome is BusyOutcome.QUEUE_FULL
        assert h.delivered(chat_id="c")[-1].text.startswith("Queue full (2 queued)")
        count, steered = await _steered_ids(h)
        assert count == "queued: 2 (2 steered into the running turn, not taken yet)"
        seqs = await _seqs(h)
        assert steered == {"a": seqs[a.message_id], "b": seqs[b.message_id]}
        gate.opened.set()
        await h.settle()


async def test_unqueue_takes_back_a_steer_the_agent_has_not_taken() -> None:
    """/unqueue takes an untaken steer back as it takes a queued message out: its sender is
    told, the store drops it, its agent never gets it, and it no longer counts."""
    gate = SteeredGate()
    async with GatewayHarness(gate, busy="steer", queue_cap=2) as h:
        await h.send("hold", chat_id="c")
        await h.until_running(chat_id="c")
        a, b = [await h.send(text, chat_id="c", user_name="ann") for text in ("a", "b")]
        seqs = await _seqs(h)
        steered = {"a": seqs[a.message_id], "b": seqs[b.message_id]}  # as /status lists them
        await h.send(f"/unqueue #{steered['a']}", chat_id="c")
        notice, answer = h.delivered(chat_id="c")[-2:]
        assert (notice.kind, notice.text) == (
            OutboundKind.NOTICE,
            "Taken out of the queue, will not run: “a”",
        )
        assert notice.in_reply_to == (a.message_id,)
        assert answer.text == (
            f"Took #{steered['a']} back from the running turn (its agent had not taken it): "
            "“a”; its sender was told."
        )
        assert a.message_id not in await _seqs(h)
        assert await _steered_ids(h) == (
            "queued: 1 (1 steered into the running turn, not taken yet)",
            {"b": steered["b"]},
        )
        room = await h.send("d", chat_id="c", user_name="ann")
        assert room.outcome is BusyOutcome.STEERED  # one place was freed
        gate.opened.set()
        await h.settle()
    ran = [o.text for o in h.delivered(chat_id="c") if o.text.startswith("ran: ")]
    assert ran == ["ran: hold", "ran: b", "ran: d"]
    ends = {o.message_id: o.outcome for o in h.outcomes}
    assert (ends[a.message_id], ends[b.message_id]) == (Outcome.DROPPED, Outcome.ANSWERED)


async def test_a_steer_unqueue_could_not_drop_is_steered_again_in_its_place() -> None:
    gate = SteeredGate()
    store = Refusing(first_of("drop_own"))  # under steer a message leaves only if ours
    async with GatewayHarness(gate, busy="steer", store=store, queue_cap=2) as h:
        await h.send("hold", chat_id="c")
        await h.until_running(chat_id="c")
        a, b = [await h.send(text, chat_id="c", user_name="ann") for text in ("a", "b")]
        seqs = await _seqs(h)
        await h.send(f"/unqueue #{seqs[a.message_id]}", chat_id="c")
        assert h.delivered(chat_id="c")[-1].text == (
            f"Could not take #{seqs[a.message_id]} out of the queue ({STORE_UNAVAILABLE}); "
            "it still waits."
        )
        assert store.refused["drop_own"] == 1
        turn = h.gateway.engine.running_turn(h.session_key(chat_id="c"))
        assert turn is not None
        assert [m.text for m, _ in turn.waiting_steers()] == ["a", "b"]  # back before b
        assert await _steered_ids(h) == (
            "queued: 2 (2 steered into the running turn, not taken yet)",
            {"a": seqs[a.message_id], "b": seqs[b.message_id]},
        )
        assert await _seqs(h) == seqs  # the store still holds it
        gate.opened.set()
        await h.settle()
    ran = [o.text for o in h.delivered(chat_id="c") if o.text.startswith("ran: ")]
    assert ran == ["ran: hold", "ran: a", "ran: b"]
    assert not any(o.text.startswith("Taken out of the queue") for o in h.delivered(chat_id="c"))


async def test_drop_oldest_makes_room_and_tells_the_dropped_message_sender() -> None:
    gate = Gate()
    async with GatewayHarness(gate, queue_cap=2, overflow=Overflow.DROP_OLDEST) as h:
        await h.send("hold", chat_id="c")
        await h.until_running(chat_id="c")
        sent = {text: await h.send(text, chat_id="c") for text in ("a", "b", "c")}
        assert [r.outcome for r in sent.values()] == [BusyOutcome.QUEUED] * 3
        [notice] = [o for o in h.delivered(chat_id="c") if o.kind is OutboundKind.NOTICE]
        assert notice.text == f"{DROPPED_OLDEST}: “a”"
        assert notice.in_reply_to == (sent["a"].message_id,)
        gate.opened.set()
        await h.settle()
        key = h.session_key(chat_id="c")
        assert await h.gateway.engine.store.pending(key) == []
    ran = [o.text for o in h.delivered(chat_id="c") if o.text.startswith("ran: ")]
    assert ran == ["ran: hold", "ran: b", "ran: c"]
    ends = {o.message_id: o.outcome for o in h.outcomes}
    assert ends[sent["a"].message_id] is Outcome.DROPPED
    assert ends[sent["c"].message_id] is Outcome.ANSWERED
    assert h.gateway.engine.metrics.busy_outcomes[("dropped_oldest", "queue")] == 1


async def test_a_message_the_store_would_not_drop_still_runs() -> None:
    gate = Gate()
    store = Refusing(first_of("drop_pending"))
    async with GatewayHarness(gate, store=store, queue_cap=1, overflow="drop-oldest") as h:
        await h.send("hold", chat_id="c")
        await h.until_running(chat_id="c")
        for text in ("a", "b"):
            await h.send(text, chat_id="c")
        gate.opened.set()
        await h.settle()
    ran = [o.text for o in h.delivered(chat_id="c") if o.text.startswith("ran: ")]
    assert ran == ["ran: hold", "ran: a", "ran: b"]  # the queue went one past its cap


async def test_summarize_collapses_a_full_queue_into_one_turn_and_tells_each_sender() -> None:
    gate = Gate()
    async with GatewayHarness(
        gate,
        queue_cap=2,
        overflow="summarize",
        key_policy=KeyPolicy(group_sessions_per_user=False),  # one session for the group
    ) as h:
        await h.send("hold", chat_id="g", chat_type="group", user_id="u1")
        await h.until_running(chat_id="g", chat_type="group", user_id="u1")
        sent = [
            await h.send(text, chat_id="g", chat_type="group", user_id=user)
            for text, user in (("a", "u2"), ("b", "u3"), ("c", "u2"))
        ]
        assert [r.outcome for r in sent] == [
            BusyOutcome.QUEUED,
            BusyOutcome.QUEUED,
            BusyOutcome.COLLAPSED,
        ]
        gate.opened.set()
        await h.settle()
    ran = [o.text for o in h.delivered(chat_id="g") if o.text.startswith("ran: ")]
    assert ran == ["ran: hold", f"ran: {collapsed_note(3)}\na\nb\nc"]
    told = [o for o in h.delivered(chat_id="g") if o.text == collapsed_text(3)]
    assert sorted(o.in_reply_to for o in told) == sorted(
        [(sent[0].message_id, sent[2].message_id), (sent[1].message_id,)]
    )  # once per sender, naming each of their collapsed messages
    ends = {o.message_id: o.outcome for o in h.outcomes}
    assert all(ends[r.message_id] is Outcome.ANSWERED for r in sent)


class WhoRuns(Gate):
    """A :class:`Gate` that notes, for each turn, the user its source names and the user
    bound in its context (what a tool sees)."""

    def __init__(self) -> None:
        super().__init__()
        self.users: dict[str, tuple[str | None, str | None]] = {}

    async def __call__(self, turn: Turn) -> str:
        session = current_session()
        self.users[turn.text] = (turn.source.user_id, None if session is None else session.user_id)
        return await super().__call__(turn)


async def test_a_turn_of_several_senders_runs_as_none_of_them() -> None:
    """A full queue collapsed into one turn of two users' messages: neither the agent nor a
    tool sees one of them as its user (the last sender was bound, acting for the first)."""
    agent = WhoRuns()
    async with GatewayHarness(
        agent,
        queue_cap=2,
        overflow="summarize",
        key_policy=KeyPolicy(group_sessions_per_user=False),
    ) as h:
        await h.send("hold", chat_id="g", chat_type="group", user_id="u1")
        await h.until_running(chat_id="g", chat_type="group", user_id="u1")
        for text, user in (("a", "u2"), ("b", "u2"), ("c", "u3")):
            await h.send(text, chat_id="g", chat_type="group", user_id=user)
        gate_text = f"{collapsed_note(3)}\na\nb\nc"
        agent.opened.set()
        await h.settle()
        await h.send("alone", chat_id="g", chat_type="group", user_id="u3")
        await h.settle()
    assert agent.users == {
        "hold": ("u1", "u1"),
        gate_text: (None, ""),  # bound as no user
        "alone": ("u3", "u3"),
    }


async def test_another_persons_message_is_not_steered_into_a_shared_turn() -> None:
    """In a thread shared by several people, a message of someone else's while a turn runs
    waits as its own turn: steered in, its request would run as the turn's author's (and
    only the author could answer its approvals). The author's own message is steered."""
    agent = HoldsForSteers()
    async with GatewayHarness(
        agent, busy="steer", ack_debounce=0, key_policy=KeyPolicy(group_sessions_per_user=False)
    ) as h:
        await h.send("long", chat_id="g", chat_type="group", user_id="alice")
        await h.until_running(chat_id="g", chat_type="group", user_id="alice")
        alice = await h.send("left", chat_id="g", chat_type="group", user_id="alice")
        bob = await h.send("delete my account", chat_id="g", chat_type="group", user_id="bob")
        assert (alice.outcome, bob.outcome) == (BusyOutcome.STEERED, BusyOutcome.QUEUED)
        agent.release.set()
        await h.settle()
    ran = [o.text for o in h.delivered(chat_id="g") if o.kind is OutboundKind.REPLY]
    assert ran == ["long + left", "delete my account"]


def test_a_turn_of_one_senders_messages_keeps_its_user() -> None:
    group = SessionSource("test", chat_id="g", chat_type=ChatType.GROUP, user_id="u", user_name="U")
    mine = (InboundMessage(group, "a"), InboundMessage(group, "b"))
    assert turn_source(mine) is group
    theirs = dataclasses.replace(group, user_id="v", user_name="V")
    both = turn_source((InboundMessage(theirs, "a"), InboundMessage(group, "b")))
    assert both == dataclasses.replace(group, user_id=None, user_name="")


async def test_refuse_new_is_the_default_overflow() -> None:
    gate = Gate()
    async with GatewayHarness(gate, queue_cap=1) as h:
        await h.send("hold", chat_id="c")
        await h.until_running(chat_id="c")
        await h.send("a", chat_id="c")
        refused = await h.send("b", chat_id="c")
        assert refused.outcome is BusyOutcome.QUEUE_FULL
        gate.opened.set()
        await h.settle()
    ran = [o.text for o in h.delivered(chat_id="c") if o.text.startswith("ran: ")]
    assert ran == ["ran: hold", "ran: a"]


async def test_steer_command_steers_one_message_whatever_the_session_policy() -> None:
    async with GatewayHarness(SteeringAgent(), ack_debounce=0) as h:  # the session queues
        await h.send("start", chat_id="c")
        left = await h.send("/steer left", chat_id="c")
        right = await h.send("/steer right", chat_id="c")
        assert (left.outcome, right.outcome) == (BusyOutcome.STEERED, BusyOutcome.STEERED)
        assert (await h.replies(chat_id="c", count=3))[-1] == "start + left + right"
        await h.settle()
    ends = {o.message_id: o.outcome for o in h.outcomes}
    assert ends[left.message_id] is ends[right.message_id] is Outcome.ANSWERED


async def test_now_command_rolls_the_running_turn_back_and_runs_first() -> None:
    async with GatewayHarness(EchoAgent(), ack_debounce=0) as h:  # the session queues
        await h.send("sleep 30", chat_id="c")
        await h.until_running(chat_id="c")
        await h.send("queued behind", chat_id="c")
        urgent = await h.send("/now urgent", chat_id="c")
        assert urgent.outcome is BusyOutcome.INTERRUPTING
        await h.settle()
    texts = [o.text for o in h.delivered(chat_id="c") if o.kind is not OutboundKind.CHUNK]
    assert "Interrupting the current task" in texts
    assert texts.index("echo: queued behind") < texts.index("echo: urgent")
    assert not any(text.startswith("slept") for text in texts)


@pytest.mark.parametrize("command", ["/steer", "/now", "/now   "])
async def test_steer_and_now_without_text_show_their_usage(command: str) -> None:
    async with GatewayHarness(EchoAgent()) as h:
        result = await h.send(command, chat_id="c")
        [reply] = await h.replies(chat_id="c", count=1)
    assert result.command == command.split()[0][1:]
    assert "give the text" in reply
    assert "Usage: /" in reply


async def test_now_on_an_idle_session_is_a_plain_message() -> None:
    async with GatewayHarness(EchoAgent()) as h:
        result = await h.send("/now hello", chat_id="c")
        assert result.started
        assert await h.replies(chat_id="c", count=1) == ["echo: hello"]


async def test_an_idle_session_coalesces_a_senders_split_message() -> None:
    recorder = Recorder()
    async with GatewayHarness(EchoAgent(recorder), coalesce={"test": 0.3}) as h:
        first = await h.send("the first half", chat_id="c")
        second = await h.send("and the second", chat_id="c")
        assert (first.started, first.outcome) == (False, BusyOutcome.MERGED)
        assert second.outcome is BusyOutcome.MERGED
        assert await h.replies(chat_id="c", count=1) == ["echo: the first half\nand the second"]
        await h.settle()
        key = h.session_key(chat_id="c")
        assert await h.gateway.engine.store.pending(key) == []
    ends = {o.message_id: o.outcome for o in h.outcomes}
    assert ends[first.message_id] is ends[second.message_id] is Outcome.ANSWERED


async def test_coalescing_keeps_each_author_apart_and_other_platforms_unchanged() -> None:
    async with GatewayHarness(EchoAgent(), coalesce={"test": 0.3}) as h:
        for user, text in (("ann", "from ann"), ("bob", "from bob"), ("ann", "more from ann")):
            await h.send(text, chat_id="g", chat_type="group", user_id=user)
        plain = await h.send("right away", chat_id="c", platform="web")
        assert plain.started
        replies = await h.replies(chat_id="g", count=2)
    assert sorted(replies) == ["echo: from ann\nmore from ann", "echo: from bob"]


async def test_stop_empties_a_coalescing_buffer() -> None:
    async with GatewayHarness(EchoAgent(), coalesce={"test": 30}) as h:
        held = await h.send("wait for it", chat_id="c")
        await h.send("/stop", chat_id="c")
        [reply] = await h.replies(chat_id="c", count=1)
        assert reply == "Nothing was running here. Dropped 1 queued message."
        await h.send("next", chat_id="c")
        await h.send("/status", chat_id="c")
        status = h.delivered(chat_id="c")[-1].text
        assert status.startswith("Status: collecting messages for the next turn")
        await h.send("/stop", chat_id="c")
    assert {o.message_id: o.outcome for o in h.outcomes}[held.message_id] is Outcome.DROPPED


async def test_a_wait_for_idle_ends_when_a_dropped_buffer_frees_the_last_session() -> None:
    """A session that only waited out a window was the last live one: once /stop
    drops its buffer the engine is idle, and whoever waits for that is told."""
    async with GatewayHarness(EchoAgent(), coalesce={"test": 3600}) as h:
        await h.send("wait for it", chat_id="c")
        waiting = asyncio.Event()

        async def settle() -> None:
            waiting.set()  # what follows runs on until it waits for the engine to be idle
            await h.settle(timeout=30)

        settling = asyncio.create_task(settle())
        await waiting.wait()
        assert not settling.done()
        await h.send("/stop", chat_id="c")
        await settling


def test_a_coalescing_turn_never_waits_past_its_max_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    state = SessionRegistry().get(chat_key("c"))
    source = SessionSource("test", chat_id="c", user_id="u")
    for seq in range(1, 50):  # a steady stream, a message every half second
        pending.collect(state, InboundMessage(source, f"m{seq}"), seq, 1.0, max_wait=5.0)
        [entry] = pending.pending_entries(state)
        assert entry.ready_at == min(clock[0] + 1.0, 1005.0)
        clock[0] += 0.5
    assert entry.delay() == 0  # it starts, however steadily messages came


@pytest.mark.parametrize("window", [-1, float("inf"), float("nan"), "soon", True])
def test_a_bad_coalescing_window_is_named(window: object) -> None:
    with pytest.raises(ConfigError, match=r"coalesce\.telegram"):
        RuntimeSettings(coalesce={"telegram": window})  # type: ignore[dict-item]


def test_the_queue_stays_in_store_order_whatever_order_messages_reach_it() -> None:
    state = SessionRegistry().get(chat_key("c"))
    source = SessionSource("test", chat_id="c", user_id="u")
    for seq in (5, 9, 2, 7):
        pending.enqueue(state, InboundMessage(source, f"m{seq}"), seq)
    pending.collect(state, InboundMessage(source, "m1"), 1, 0.5)  # earlier than all: its own turn
    pending.collect(state, InboundMessage(source, "m10"), 10, 0.5)
    pending.collect(state, InboundMessage(source, "m11"), 11, 0.5)  # joins m10's entry
    assert [entry.seqs for entry in pending.pending_entries(state)] == [
        [1],
        [2],
        [5],
        [7],
        [9],
        [10, 11],
    ]


def test_a_message_inside_a_waiting_turns_span_joins_it_in_its_place() -> None:
    state = SessionRegistry().get(chat_key("c"))
    source = SessionSource("test", chat_id="c", user_id="u")
    for seq in (4, 9):  # collected here, around a message another process accepted
        pending.collect(state, InboundMessage(source, f"m{seq}"), seq, 0.5)
    pending.insert_in_order(state, [InboundMessage(source, "m6")], [6])  # drawn in later
    pending.insert_in_order(state, [InboundMessage(source, "m2")], [2])  # before all: alone
    pending.insert_in_order(state, [InboundMessage(source, "m12")], [12])  # after all: alone
    assert [entry.seqs for entry in pending.pending_entries(state)] == [[2], [4, 6, 9], [12]]
    assert [m.text for m in pending.pending_entries(state)[1].messages] == ["m4", "m6", "m9"]


def test_a_message_of_another_author_never_joins_a_turn_it_falls_inside() -> None:
    state = SessionRegistry().get(chat_key("c"))
    source = SessionSource("test", chat_id="c", user_id="u")
    for seq in (4, 9):
        pending.collect(state, InboundMessage(source, f"m{seq}"), seq, 0.5)
    other = SessionSource("test", chat_id="c", user_id="v")
    pending.insert_in_order(state, [InboundMessage(other, "v6")], [6])
    assert [entry.seqs for entry in pending.pending_entries(state)] == [[4, 9], [6]]


def test_a_message_already_waiting_is_never_queued_twice() -> None:
    state = SessionRegistry().get(chat_key("c"))
    source = SessionSource("test", chat_id="c", user_id="u")
    for seq in (4, 6, 9):
        pending.collect(state, InboundMessage(source, f"m{seq}"), seq, 0.5)
    again = [InboundMessage(source, "m6"), InboundMessage(source, "m7")]
    pending.insert_in_order(state, again, [6, 7])  # adopted back and forth
    pending.insert_in_order(state, [InboundMessage(source, "m9")], [9])
    assert [entry.seqs for entry in pending.pending_entries(state)] == [[4, 6, 7, 9]]


def test_the_next_turn_never_runs_a_message_before_an_earlier_one_waiting_here() -> None:
    state = SessionRegistry().get(chat_key("c"))
    source = SessionSource("test", chat_id="c", user_id="u")
    queue = pending.pending_entries(state)
    queue.append(
        pending.PendingEntry([InboundMessage(source, f"m{s}") for s in (2, 7, 9)], [2, 7, 9])
    )
    queue.append(pending.PendingEntry([InboundMessage(source, "m5")], [5]))  # out of its place
    runs = []
    while queue:
        runs.append(pending.take_next(state).seqs)
    assert runs == [[2], [5], [7, 9]]


async def test_the_session_listing_counts_the_steers_the_agent_has_not_taken() -> None:
    """``chatlane sessions`` and ``inspect`` say how many wait as ``/status`` and the
    queue cap count them: untaken steers too."""
    gate = SteeredGate()
    async with GatewayHarness(gate, busy="steer", queue_cap=5) as h:
        await h.send("hold", chat_id="c")
        await h.until_running(chat_id="c")
        for text in ("a", "b"):
            assert (await h.send(text, chat_id="c")).outcome is BusyOutcome.STEERED
        hub = cast("Hub", SimpleNamespace(gateway=h.gateway))
        summary = session_summary(h.session(h.session_key(chat_id="c")), hub)
        gate.opened.set()
        await h.settle()
    assert (summary["activity"], summary["queued"]) == ("running", 2)
