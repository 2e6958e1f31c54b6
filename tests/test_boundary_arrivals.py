"""Conversation boundaries (``/new``, ``/reset``, ``/resume``, an auto-reset) at their
edges. Messages that arrive while one runs wait, whatever the busy policy, and run in
the new conversation — never in the old one, never dropped with it, never unanswered;
one that fails part way never carries the old conversation's choices into a new one."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from chatlane import lifecycle
from chatlane.errors import GatewayFull, StoreError
from chatlane.identity import SessionSource
from chatlane.lifecycle import BeforeReset, EndReason, LifecycleOptions
from chatlane.runtime.busy import BusyOutcome, Overflow, ack_text
from chatlane.runtime.capacity import CapacitySettings
from chatlane.runtime.settings import LeaseSettings
from chatlane.runtime.turn import Turn
from chatlane.stores import MemoryStore
from chatlane.stores.base import Conversation, Lease
from chatlane.stores.codec import encode_message
from chatlane.stores.fields import CONVERSATION_ID
from chatlane.stores.sqlite import SQLiteStore
from chatlane.testing import GatewayHarness
from chatlane.types import InboundMessage, OutboundKind, SessionKey
from tests.runtime.agents import EchoAgent, settings_agent


class Gated:
    """An await a test holds: ``entered`` once reached, goes on once ``opened``."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.opened = asyncio.Event()

    async def wait(self) -> None:
        self.entered.set()
        await self.opened.wait()


def held_by(hook: Gated) -> BeforeReset:
    """A ``before_reset`` hook that waits until the test opens ``hook``."""

    async def summarize(key: SessionKey, reason: EndReason, ending: Conversation) -> None:
        await hook.wait()

    return summarize


class GatedConversations(SQLiteStore):
    """The SQLite store, whose start of a new conversation a test can hold."""

    gate: Gated | None = None

    async def new_conversation(self, key: SessionKey, title: str = "") -> Conversation:
        if self.gate is not None:
            await self.gate.wait()
        return await super().new_conversation(key, title)


def seen_by(runs: list[str]):  # type: ignore[no-untyped-def]
    """An agent noting the text, model and reasoning each turn ran with."""

    async def agent(turn: Turn) -> str:
        model = turn.overrides.model
        runs.append(
            f"{turn.text} | {model.name if model else 'default'} | {turn.overrides.reasoning}"
        )
        return f"echo {turn.text}"

    return agent


async def test_a_message_sent_while_the_hook_runs_starts_the_new_conversation() -> None:
    hook = Gated()

    async def summarize(key: SessionKey, reason: EndReason, ending: Conversation) -> None:
        await hook.wait()  # say, a model summarizing the ending conversation

    runs: list[str] = []
    options = LifecycleOptions(confirm_new=False, before_reset=summarize)
    async with GatewayHarness(seen_by(runs), lifecycle=options) as h:
        await h.send("/model old-model", chat_id="c")
        await h.send("old talk", chat_id="c")
        await h.replies(chat_id="c", count=2)
        new = asyncio.create_task(h.send("/new", chat_id="c"))
        await hook.entered.wait()
        before = await h.gateway.engine.store.conversation(h.session_key(chat_id="c"))
        sent = await h.send("hi, new topic", chat_id="c")
        assert not sent.started  # it waits for the boundary
        hook.opened.set()
        await new
        await h.wait_for(lambda out: any(o.text == "echo hi, new topic" for o in out))
        replies = [o.text for o in h.outbox]
        await h.settle()
        after = await h.gateway.engine.store.conversation(h.session_key(chat_id="c"))
    assert "Started a new conversation." in replies
    assert "echo hi, new topic" in replies
    assert runs[-1] == "hi, new topic | default | None"  # the new conversation's choices
    assert after.id != before.id
    assert [o.outcome for o in h.outcomes if o.message_id == sent.message_id] == ["answered"]


@pytest.mark.parametrize("busy", ["queue", "steer", "rollback", "reject", "collect"])
async def test_a_message_arriving_while_the_store_starts_the_conversation_runs_in_it(
    tmp_path: Path, busy: str
) -> None:
    store = await GatedConversations.open(f"sqlite:///{tmp_path / 'chat.db'}")
    assert isinstance(store, GatedConversations)
    runs: list[str] = []
    options = LifecycleOptions(confirm_new=False)
    try:
        async with GatewayHarness(seen_by(runs), store=store, busy=busy, lifecycle=options) as h:
            await h.send("/model old-model", chat_id="c")
            await h.send("/reasoning high", chat_id="c")
            await h.send("secret of the old conversation", chat_id="c")
            await h.replies(chat_id="c", count=3)
            store.gate = gate = Gated()
            new = asyncio.create_task(h.send("/new", chat_id="c"))
            await gate.entered.wait()
            await h.send("first of the new conversation", chat_id="c")
            gate.opened.set()
            await new
            await h.wait_for(
                lambda out: any(o.text == "echo first of the new conversation" for o in out)
            )
            await h.settle()
            key = h.session_key(chat_id="c")
            transcript = [entry.content for entry in await store.transcript(key)]
    finally:
        await store.close()
    assert runs[-1] == "first of the new conversation | default | None"
    assert "secret of the old conversation" not in transcript
    assert transcript == ["first of the new conversation", "echo first of the new conversation"]


async def test_what_waited_before_the_boundary_is_dropped_and_what_came_after_runs() -> None:
    hook = Gated()

    summarize = held_by(hook)

    async def agent(turn: Turn) -> str:
        if turn.text == "long task":
            await turn.interrupted.wait()  # stopped by /new
        return f"echo {turn.text}"

    options = LifecycleOptions(confirm_new=False, before_reset=summarize)
    async with GatewayHarness(agent, busy="steer", lifecycle=options) as h:
        await h.send("long task", chat_id="c")
        await h.until_running(chat_id="c", text="long task")
        before = [await h.send(text, chat_id="c") for text in ("queued before /new", "again")]
        new = asyncio.create_task(h.send("/new", chat_id="c"))
        await hook.entered.wait()
        after = await h.send("sent after /new", chat_id="c")  # steers nothing of the old turn
        hook.opened.set()
        await new
        await h.wait_for(lambda out: any(o.text == "echo sent after /new" for o in out))
        await h.settle()
    texts = [o.text for o in h.outbox]
    assert any(t.startswith("Started a new conversation. Dropped 2 queued") for t in texts)
    assert "echo long task" not in texts
    outcomes = {o.message_id: o.outcome for o in h.outcomes}
    assert [outcomes[sent.message_id] for sent in before] == ["dropped", "dropped"]
    assert outcomes[after.message_id] == "answered"


async def test_a_failed_boundary_lets_what_arrived_run_in_the_conversation_it_kept() -> None:
    hook = Gated()

    async def failing(key: SessionKey, reason: EndReason, ending: Conversation) -> None:
        await hook.wait()
        raise RuntimeError("the summary could not be written")

    runs: list[str] = []
    options = LifecycleOptions(confirm_new=False, before_reset=failing)
    async with GatewayHarness(seen_by(runs), lifecycle=options) as h:
        new = asyncio.create_task(h.send("/new", chat_id="c"))
        await hook.entered.wait()
        await h.send("still here", chat_id="c")
        hook.opened.set()
        await new
        await h.wait_for(lambda out: any(o.text == "echo still here" for o in out))
        await h.settle()
    assert runs == ["still here | default | None"]


class FailsToName(MemoryStore):
    """Fails the write that names the session's new conversation, once."""

    failing = False

    async def set_persistent(self, key: SessionKey, generation: int | None, **fields: Any) -> Any:
        if self.failing and CONVERSATION_ID in fields:
            self.failing = False
            raise StoreError("the connection was lost")
        return await super().set_persistent(key, generation, **fields)


async def test_a_boundary_failing_part_way_carries_no_old_choice_into_the_new_one() -> None:
    store = FailsToName()
    options = LifecycleOptions(confirm_new=False)
    async with GatewayHarness(settings_agent, store=store, lifecycle=options, reread_stored=0) as h:
        key = h.session_key(chat_id="c")
        await h.send("/model old-model", chat_id="c")
        await h.send("/reasoning high", chat_id="c")
        before = (await store.conversation(key)).id
        store.failing = True
        await h.send("/new", chat_id="c")
        assert (await store.conversation(key)).id != before  # the store did start it
        await h.send("next", chat_id="c")
        replies = await h.replies(chat_id="c", count=4)
    assert "could not finish" in replies[2]
    assert "old-model" not in replies[3], replies[3]
    assert "high" not in replies[3], replies[3]


async def test_a_full_queue_collapses_nothing_of_the_ending_conversation_into_an_arrival() -> None:
    """Under ``summarize`` a full queue becomes one turn: not with what the boundary drops."""
    hook = Gated()

    summarize = held_by(hook)

    async def agent(turn: Turn) -> str:
        if turn.text == "long task":
            await turn.interrupted.wait()
        return f"echo {turn.text}"

    options = LifecycleOptions(confirm_new=False, before_reset=summarize)
    async with GatewayHarness(
        agent, queue_cap=2, overflow=Overflow.SUMMARIZE, lifecycle=options
    ) as h:
        await h.send("long task", chat_id="c")
        await h.until_running(chat_id="c", text="long task")
        await h.send("q1", chat_id="c")
        await h.send("q2", chat_id="c")  # the queue is full
        new = asyncio.create_task(h.send("/new", chat_id="c"))
        await hook.entered.wait()
        after = await h.send("sent after /new", chat_id="c")
        hook.opened.set()
        await new
        await h.wait_for(lambda out: any(o.text == "echo sent after /new" for o in out))
        await h.settle()
    assert any(o.text.endswith("Dropped 2 queued messages.") for o in h.outbox)
    assert {o.message_id: o.outcome for o in h.outcomes}[after.message_id] == "answered"


async def test_a_session_a_boundary_holds_counts_as_live_for_the_limits() -> None:
    hook = Gated()

    summarize = held_by(hook)

    options = LifecycleOptions(confirm_new=False, before_reset=summarize)
    limits = CapacitySettings(live_sessions=1)
    async with GatewayHarness(EchoAgent(), lifecycle=options, capacity=limits) as h:
        engine = h.gateway.engine
        new = asyncio.create_task(h.send("/new", chat_id="a"))
        await hook.entered.wait()
        waiting = await h.send("for the new conversation", chat_id="a")
        assert engine.slots.live_count() == 1
        assert [m.id for m in engine.slots.held()] == [waiting.message_id]
        with pytest.raises(GatewayFull):
            await h.send("another session", chat_id="b")
        hook.opened.set()
        await new
        await h.wait_for(lambda out: any(o.text == "echo: for the new conversation" for o in out))


class ReleasesLate(MemoryStore):
    """Holds the next lease release, and the next drop from the queue, on their gates."""

    def __init__(self) -> None:
        super().__init__()
        self.releasing: Gated | None = None
        self.dropping: Gated | None = None

    async def release(self, lease: Lease) -> Any:
        gate, self.releasing = self.releasing, None
        if gate is not None:
            await gate.wait()
        return await super().release(lease)

    async def drop_pending(self, key: SessionKey, seqs: Any) -> Any:
        gate, self.dropping = self.dropping, None
        if gate is not None:
            await gate.wait()
        return await super().drop_pending(key, seqs)


async def test_a_turn_evicted_during_a_boundary_leaves_its_slot_held() -> None:
    """The watchdog frees a stuck turn's slot and awaits its release: nothing may start
    meanwhile in the conversation that is ending."""
    hook = Gated()
    runs: list[str] = []

    summarize = held_by(hook)

    async def agent(turn: Turn) -> str:
        model = turn.overrides.model
        runs.append(f"{turn.text} | {model.name if model else 'default'}")
        if turn.text == "stuck":
            await asyncio.Event().wait()  # no progress: the watchdog evicts it
        return f"echo {turn.text}"

    store = ReleasesLate()
    options = LifecycleOptions(confirm_new=False, before_reset=summarize)
    async with GatewayHarness(agent, store=store, lifecycle=options, turn_timeout=0.3) as h:
        await h.send("/model old-model", chat_id="c")
        await h.send("stuck", chat_id="c")
        await h.until_running(chat_id="c", text="stuck")
        store.releasing, store.dropping = releasing, dropping = Gated(), Gated()
        new = asyncio.create_task(h.send("/new", chat_id="c"))
        await hook.entered.wait()
        await releasing.entered.wait()  # the watchdog evicted it and waits in the release
        await dropping.entered.wait()  # and the cancelled turn's own aftermath waits
        sent = await h.send("sent during /new", chat_id="c")
        assert not sent.started
        releasing.opened.set()
        dropping.opened.set()
        hook.opened.set()
        await new
        await h.wait_for(lambda out: any(o.text == "echo sent during /new" for o in out))
    assert runs[-1] == "sent during /new | default"


async def test_a_hook_that_never_returns_gives_the_session_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(lifecycle, "HOOK_TIMEOUT", 0.05)

    async def hangs(key: SessionKey, reason: EndReason, ending: Conversation) -> None:
        await asyncio.Event().wait()  # a summarizing model that never answers

    options = LifecycleOptions(confirm_new=False, before_reset=hangs)
    async with GatewayHarness(EchoAgent(), lifecycle=options) as h:
        new = asyncio.create_task(h.send("/new", chat_id="c"))
        await h.send("hello?", chat_id="c")
        await new
        await h.wait_for(lambda out: any(o.text == "echo: hello?" for o in out))
    failed = [o.text for o in h.outbox if o.text.startswith("/new could not finish")]
    assert failed == [
        "/new could not finish: the conversation could not be closed in time (0.05s); try again."
    ]


@pytest.mark.parametrize("busy", ["queue", "steer", "collect", "rollback", "redirect"])
async def test_what_another_process_takes_during_the_hook_runs_in_the_new_conversation(
    tmp_path: Path, busy: str
) -> None:
    hook = Gated()
    runs: list[str] = []

    summarize = held_by(hook)

    store = await SQLiteStore.open(f"sqlite:///{tmp_path / 'shared.db'}")
    options = LifecycleOptions(confirm_new=False, before_reset=summarize)
    try:
        async with (
            GatewayHarness(seen_by(runs), store=store, busy=busy, lifecycle=options) as here,
            GatewayHarness(seen_by(runs), store=store, busy=busy, lifecycle=options) as there,
        ):
            await here.send("/model old-model", chat_id="c")
            await here.send("old talk", chat_id="c")
            await here.replies(chat_id="c", count=2)
            new = asyncio.create_task(here.send("/new", chat_id="c"))
            await hook.entered.wait()  # the boundary holds the session in the store
            await there.send("sent to the other process", chat_id="c")
            await there.wait_for(lambda out: any(o.kind is OutboundKind.ACK for o in out))
            hook.opened.set()
            await new
            await there.wait_for(
                lambda out: any(o.text == "echo sent to the other process" for o in out)
            )
            replies = await here.replies(chat_id="c", count=3)
            await there.settle()
            key = here.session_key(chat_id="c")
            transcript = [entry.content for entry in await store.transcript(key)]
    finally:
        await store.close()
    assert replies[-1] == "Started a new conversation."
    assert runs[-1] == "sent to the other process | default | None"
    assert transcript == ["sent to the other process", "echo sent to the other process"]


async def test_the_reply_counts_what_other_processes_had_taken() -> None:
    hook = Gated()
    running_elsewhere = asyncio.Event()

    summarize = held_by(hook)

    async def agent(turn: Turn) -> str:
        if turn.text == "running in the other process":
            running_elsewhere.set()
            await turn.interrupted.wait()
        return f"echo {turn.text}"

    store = MemoryStore()
    options = LifecycleOptions(confirm_new=False, before_reset=summarize)
    async with (
        GatewayHarness(agent, store=store, lifecycle=options) as here,
        GatewayHarness(agent, store=store, lifecycle=options) as there,
    ):
        await there.send("running in the other process", chat_id="c")
        await running_elsewhere.wait()  # it holds the lease: the boundary cannot
        new = asyncio.create_task(here.send("/new", chat_id="c"))
        await hook.entered.wait()
        hook.opened.set()
        await new
        replies = await here.replies(chat_id="c", count=1)
    assert replies == [
        "Started a new conversation. Dropped 0 queued messages, "
        "and 1 message other gateway processes had taken."
    ]


class CountingRenewals(MemoryStore):
    """The memory store, telling a test once a lease of ``key`` was renewed ``enough`` times."""

    def __init__(self, enough: int) -> None:
        super().__init__()
        self.enough, self.renewed = enough, asyncio.Event()
        self.count = 0

    async def renew_many(self, leases: Sequence[Lease], ttl: float) -> list[Lease | None]:
        renewed = await super().renew_many(leases, ttl)
        self.count += sum(1 for lease in renewed if lease is not None)
        if self.count >= self.enough:
            self.renewed.set()
        return renewed


async def test_the_hold_outlasts_its_lease_ttl_and_a_reject_elsewhere_is_told() -> None:
    """The boundary's lease is renewed while its hook runs past the lease's TTL, so the
    other process still finds the session held; under ``reject`` there, its message is
    refused out loud (it cannot tell a boundary from a turn), never run in the old one."""
    fast = LeaseSettings(ttl=0.3, poll=0.01)
    store = CountingRenewals(enough=10)  # ten renewals at ttl/10: a whole TTL and more
    runs: list[str] = []
    hook = Gated()

    summarize = held_by(hook)

    options = LifecycleOptions(confirm_new=False, before_reset=summarize)
    async with (
        GatewayHarness(seen_by(runs), store=store, lifecycle=options, leases=fast) as here,
        GatewayHarness(seen_by(runs), store=store, busy="reject", leases=fast) as there,
    ):
        new = asyncio.create_task(here.send("/new", chat_id="c"))  # its first message
        await hook.entered.wait()
        async with asyncio.timeout(10):  # renewed or not, a lease TTL is long past by then
            await store.renewed.wait()
        await there.send("sent to the other process", chat_id="c")
        refused = await there.replies(chat_id="c", count=1)
        hook.opened.set()
        await new
        await there.send("after it", chat_id="c")
        await there.wait_for(lambda out: any(o.text == "echo after it" for o in out))
    assert refused == [ack_text(BusyOutcome.REJECTED, 0)]
    assert runs == ["after it | default | None"]


async def test_the_hold_drops_what_other_processes_queued_before_it_not_after() -> None:
    hook = Gated()

    summarize = held_by(hook)

    store = MemoryStore()
    options = LifecycleOptions(confirm_new=False, before_reset=summarize)
    async with (
        GatewayHarness(EchoAgent(), store=store, lifecycle=options) as here,
        GatewayHarness(EchoAgent(), store=store) as there,
    ):
        key, elsewhere = here.session_key(chat_id="c"), there.gateway.engine.holder

        async def queued_there(text: str) -> int:
            source = SessionSource("test", chat_id="c", user_id="u1")
            message = InboundMessage(source, text, id=f"m-{text}")
            return await store.enqueue(key, message.id, elsewhere, encode_message(message))

        await queued_there("before")
        new = asyncio.create_task(here.send("/new", chat_id="c"))
        await hook.entered.wait()
        after = await queued_there("after")
        hook.opened.set()
        await new
        replies = await here.replies(chat_id="c", count=1)
        left = [record.seq for record in await store.pending(key)]
    assert replies == [
        "Started a new conversation. Dropped 0 queued messages, "
        "and 1 message other gateway processes had taken."
    ]
    assert left == [after]


async def test_two_boundaries_here_share_the_hold_until_the_last_ends() -> None:
    runs: list[str] = []
    hooks = [Gated(), Gated()]
    entered: list[Gated] = []

    async def summarize(key: SessionKey, reason: EndReason, ending: Conversation) -> None:
        hook = hooks[len(entered)]
        entered.append(hook)
        await hook.wait()

    store = MemoryStore()
    options = LifecycleOptions(confirm_new=False, before_reset=summarize)
    async with (
        GatewayHarness(seen_by(runs), store=store, lifecycle=options) as here,
        GatewayHarness(seen_by(runs), store=store) as there,
    ):
        key = here.session_key(chat_id="c")
        first = asyncio.create_task(here.send("/new", chat_id="c"))
        await hooks[0].entered.wait()
        second = asyncio.create_task(here.send("/reset", chat_id="c"))
        await hooks[1].entered.wait()
        hooks[0].opened.set()
        await first  # the second still holds the session
        await there.send("sent to the other process", chat_id="c")
        await there.wait_for(lambda out: any(o.kind is OutboundKind.ACK for o in out))
        assert runs == []
        hooks[1].opened.set()
        await second
        await there.wait_for(
            lambda out: any(o.text == "echo sent to the other process" for o in out)
        )
        await there.settle()
        transcript = [entry.content for entry in await store.transcript(key)]
        holder = await store.lease_holder(key)
    assert runs == ["sent to the other process | default | None"]
    assert transcript == ["sent to the other process", "echo sent to the other process"]
    assert holder is None


async def test_a_hold_another_process_fenced_drops_what_ran_there_meanwhile() -> None:
    """Another process's interrupt (``rollback``) fences the boundary's lease: it is renewed
    no more and expires, and that process's message runs there, in the ending
    conversation. The boundary then no longer counts on its hold: it stops that turn and
    drops the message, counted, instead of leaving it to run a second time."""
    fast = LeaseSettings(ttl=0.3, poll=0.01)
    hook, running_there, calls = Gated(), asyncio.Event(), collections.Counter[str]()

    summarize = held_by(hook)

    async def agent(turn: Turn) -> str:
        calls[turn.text] += 1
        running_there.set()
        await turn.interrupted.wait()
        return f"echo {turn.text}"

    store = MemoryStore()
    options = LifecycleOptions(confirm_new=False, before_reset=summarize)
    async with (
        GatewayHarness(EchoAgent(), store=store, lifecycle=options, leases=fast) as here,
        GatewayHarness(agent, store=store, busy="rollback", leases=fast) as there,
    ):
        new = asyncio.create_task(here.send("/new", chat_id="c"))
        await hook.entered.wait()
        await there.send("sent to the other process", chat_id="c")
        await running_there.wait()  # the hold's lease expired, unrenewed
        hook.opened.set()
        await new
        replies = await here.replies(chat_id="c", count=1)
        await there.settle()
    assert replies == [
        "Started a new conversation. Dropped 0 queued messages, "
        "and 1 message other gateway processes had taken."
    ]
    assert calls == {"sent to the other process": 1}


async def test_a_process_closing_during_a_boundary_gives_its_hold_back() -> None:
    hook = Gated()

    summarize = held_by(hook)

    store = MemoryStore()
    options = LifecycleOptions(confirm_new=False, before_reset=summarize)
    here = GatewayHarness(EchoAgent(), store=store, lifecycle=options)
    async with here:
        key = here.session_key(chat_id="c")
        new = asyncio.create_task(here.send("/new", chat_id="c"))
        await hook.entered.wait()
        assert await store.lease_holder(key) == here.gateway.engine.holder
    holder = await store.lease_holder(key)  # closed with its /new still in the hook
    hook.opened.set()
    await asyncio.gather(new, return_exceptions=True)
    assert holder is None
