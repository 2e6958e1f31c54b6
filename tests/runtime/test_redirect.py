"""The ``redirect`` busy policy: a newer message stops the running turn at a safe
point, what it did is kept (its reply marked cut short), and the message runs next
with all of it as context. A turn that finds no safe point is rolled back."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from chatlane.runtime.busy import BusyOutcome, BusyPolicy
from chatlane.runtime.outcomes import Outcome
from chatlane.runtime.output import CUT_SHORT, cut_short
from chatlane.runtime.settings import LeaseSettings
from chatlane.runtime.turn import Turn
from chatlane.stores import MemoryStore, Store
from chatlane.testing import GatewayHarness
from chatlane.types import OutboundKind, SessionKey
from tests.runtime.agents import approving_agent

REDIRECTING = "Redirecting: the current reply stops here, your message is next"


class HistoryAgent:
    """``long``: streams ``part one`` then waits for the turn to be told to stop before
    streaming more (a chunk it would show after that is never shown). Anything else:
    replies with the conversation it was given, as history the store holds."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.seen: dict[SessionKey, list[tuple[str, str]]] = {}

    def __call__(self, turn: Turn) -> AsyncIterator[str] | asyncio.Future[str]:
        if turn.text == "long":
            return self._long(turn)
        return asyncio.ensure_future(self._recall(turn))

    async def _long(self, turn: Turn) -> AsyncIterator[str]:
        yield "part one"
        await turn.interrupted.wait()
        yield " and part two"  # too late: the turn was redirected

    async def _recall(self, turn: Turn) -> str:
        entries = await self.store.transcript(turn.session_key)
        self.seen[turn.session_key] = [(e.role, e.content) for e in entries]
        return f"saw {len(entries)} entries, then {turn.text}"


def replies_of(h: GatewayHarness, chat_id: str) -> list[str]:
    return [o.text for o in h.delivered(chat_id=chat_id) if o.kind is OutboundKind.REPLY]


async def test_the_partial_reply_and_its_input_are_kept_and_the_new_message_sees_them() -> None:
    store = MemoryStore()
    agent = HistoryAgent(store)
    async with GatewayHarness(agent, busy="redirect", store=store, ack_debounce=0) as h:
        first = await h.send("long", chat_id="c")
        await h.until_running(chat_id="c")
        second = await h.send("actually, do this", chat_id="c")
        assert second.outcome is BusyOutcome.REDIRECTING
        await h.settle()
        key = first.session_key
        transcript = [(e.role, e.content) for e in await store.transcript(key)]
    kept = cut_short("part one")
    assert kept == f"part one\n\n{CUT_SHORT}"
    assert agent.seen[key] == [("user", "long"), ("assistant", kept)]
    assert transcript == [
        ("user", "long"),
        ("assistant", kept),
        ("user", "actually, do this"),
        ("assistant", "saw 2 entries, then actually, do this"),
    ]
    assert replies_of(h, "c") == [kept, "saw 2 entries, then actually, do this"]
    acks = [o.text for o in h.delivered(chat_id="c") if o.kind is OutboundKind.ACK]
    assert acks == [REDIRECTING]
    ends = {o.message_id: o.outcome for o in h.outcomes}
    assert ends[first.message_id] is ends[second.message_id] is Outcome.ANSWERED


class Stubborn:
    """``stuck``: ignores every request to stop (no safe point) until cancelled."""

    def __init__(self) -> None:
        self.cancelled = asyncio.Event()

    async def __call__(self, turn: Turn) -> str:
        if turn.text == "stuck":
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        return f"echo: {turn.text}"


async def test_a_turn_without_a_safe_point_is_rolled_back_after_the_grace() -> None:
    store = MemoryStore()
    agent = Stubborn()
    async with GatewayHarness(
        agent, busy="redirect", store=store, interrupt_grace=0.05, ack_debounce=0
    ) as h:
        first = await h.send("stuck", chat_id="c")
        await h.until_running(chat_id="c")
        await h.send("next", chat_id="c")
        await h.settle()
        transcript = [(e.role, e.content) for e in await store.transcript(first.session_key)]
    assert agent.cancelled.is_set()
    assert transcript == [("user", "next"), ("assistant", "echo: next")]  # nothing of "stuck"
    ends = {o.message_id: o.outcome for o in h.outcomes}
    assert ends[first.message_id] is Outcome.INTERRUPTED


async def asks_first(turn: Turn) -> str:
    """``approve <command>`` asks for approval; anything else is echoed."""
    if turn.text.startswith("approve "):
        return await approving_agent(turn)
    return f"echo: {turn.text}"


async def test_an_approval_wait_is_a_safe_point() -> None:
    async with GatewayHarness(asks_first, busy="redirect", ack_debounce=0) as h:
        await h.send("approve rm -rf /tmp/x", chat_id="c")
        await h.wait_for(lambda out: any(o.kind is OutboundKind.APPROVAL for o in out))
        await h.send("never mind", chat_id="c")
        await h.settle()
    assert replies_of(h, "c") == [cut_short("denied: rm -rf /tmp/x"), "echo: never mind"]


@pytest.mark.parametrize(
    ("session_policy", "outcome"),
    [("redirect", BusyOutcome.REDIRECTING), ("queue", BusyOutcome.INTERRUPTING)],
)
async def test_now_interrupts_by_the_sessions_flavour(
    session_policy: str, outcome: BusyOutcome
) -> None:
    store = MemoryStore()
    async with GatewayHarness(HistoryAgent(store), busy=session_policy, store=store) as h:
        await h.send("long", chat_id="c")
        await h.until_running(chat_id="c")
        urgent = await h.send("/now urgent", chat_id="c")
        assert urgent.outcome is outcome
        await h.settle()


async def test_a_second_message_while_redirecting_waits_behind_the_first() -> None:
    store = MemoryStore()
    async with GatewayHarness(HistoryAgent(store), busy="redirect", store=store) as h:
        first = await h.send("long", chat_id="c")
        await h.until_running(chat_id="c")
        a = await h.send("a", chat_id="c")
        b = await h.send("b", chat_id="c")
        assert (a.outcome, b.outcome) == (BusyOutcome.REDIRECTING, BusyOutcome.QUEUED)
        await h.settle()
        transcript = await store.transcript(first.session_key)
    users = [e.content for e in transcript if e.role == "user"]
    assert users == ["long", "a", "b"]


async def test_many_sessions_redirected_at_once_each_keep_only_their_own_work() -> None:
    store = MemoryStore()
    sessions = [f"c{n}" for n in range(60)]
    async with GatewayHarness(HistoryAgent(store), busy="redirect", store=store) as h:
        keys = [(await h.send("long", chat_id=c)).session_key for c in sessions]
        await asyncio.gather(*(h.until_running(chat_id=c) for c in sessions))
        await asyncio.gather(*(h.send(f"new for {c}", chat_id=c) for c in sessions))
        await h.settle()
        for chat, key in zip(sessions, keys, strict=True):
            transcript = [(e.role, e.content) for e in await store.transcript(key)]
            assert transcript == [
                ("user", "long"),
                ("assistant", cut_short("part one")),
                ("user", f"new for {chat}"),
                ("assistant", f"saw 2 entries, then new for {chat}"),
            ]


def test_redirect_and_steer_backlog_are_read_by_name() -> None:
    assert BusyPolicy.parse("Redirect") is BusyPolicy.REDIRECT
    assert BusyPolicy.parse("steer-backlog") is BusyPolicy.STEER
    assert BusyPolicy.STEER_BACKLOG.value == "steer"


async def test_a_redirect_reaches_a_turn_another_process_runs(
    two_stores: tuple[Store, Store],
) -> None:
    here, there = two_stores
    runner_agent, other_agent = HistoryAgent(here), HistoryAgent(there)
    async with (
        GatewayHarness(runner_agent, store=here, busy="redirect") as runner,
        GatewayHarness(other_agent, store=there, busy="redirect") as other,
    ):
        first = await runner.send("long", chat_id="c")
        await runner.until_running(chat_id="c")
        await runner.wait_for(lambda out: any(o.text == "part one" for o in out))
        second = await other.send("over here: do this instead", chat_id="c")
        replies = await other.replies(chat_id="c", count=2, timeout=10)
        assert replies == [REDIRECTING, "saw 2 entries, then over here: do this instead"]
        await runner.settle()
        key = first.session_key
        kept = cut_short("part one")
        assert other_agent.seen[key] == [("user", "long"), ("assistant", kept)]
        assert replies_of(runner, "c") == [kept]  # its own reply, cut short, still delivered
        assert await here.pending(key) == []
    ends = {o.message_id: o.outcome for o in (*runner.outcomes, *other.outcomes)}
    assert ends[first.message_id] is ends[second.message_id] is Outcome.ANSWERED


async def waits_to_be_stopped(turn: Turn) -> str:
    await turn.interrupted.wait()
    return "stopped"


class CountsReads(MemoryStore):
    """Counts the reads of a session's stored fields."""

    reads = 0

    async def load_persistent(self, key: SessionKey) -> dict[str, object]:
        self.reads += 1
        return await super().load_persistent(key)


@pytest.mark.parametrize(("policy", "reads"), [("redirect", 1), ("queue", 0), ("rollback", 0)])
async def test_a_fence_check_reads_for_redirects_only_where_the_session_redirects(
    policy: str, reads: int
) -> None:
    """At thousands of running turns a read each per fence check would starve renewals:
    only a session whose own policy is ``redirect`` is watched for one."""
    store = CountsReads()
    checked_here_only = LeaseSettings(fence_check=0)  # no background check meanwhile
    async with GatewayHarness(
        waits_to_be_stopped, busy=policy, store=store, leases=checked_here_only
    ) as h:
        await h.send("hold on", chat_id="c")
        await h.until_running(chat_id="c")
        before = store.reads
        await h.gateway.engine.upkeep.check_fences()
        assert store.reads - before == reads
        await h.send("/stop", chat_id="c")
