"""Store calls that applied, but whose answer was lost on the way back.

A Redis or PostgreSQL connection that breaks after the server ran a call
leaves its caller with an error for a change the store made. Each test
holds one such call to what its caller was promised: the reply delivered
once, no lease left held, nothing left queued.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from chatlane.errors import SessionBusy, StoreError
from chatlane.identity import SessionKey, SessionSource
from chatlane.runtime import pending
from chatlane.runtime.outcomes import Outcome
from chatlane.runtime.settings import LeaseSettings
from chatlane.runtime.turn import Turn
from chatlane.stores import Lease, MemoryStore, PendingRecord, Taken
from chatlane.stores.codec import decode_message, encode_message
from chatlane.testing import GatewayHarness
from chatlane.types import InboundMessage
from tests.keys import chat_key
from tests.runtime.agents import EchoAgent, UntakenSteers
from tests.runtime.refusing import FailingAdoption, LosingAnswers, Refusing, first_of


async def test_a_commit_whose_answer_was_lost_is_known_for_its_own_and_delivered() -> None:
    store = LosingAnswers(first_of("commit_and_release"))
    async with GatewayHarness(EchoAgent(), store=store) as h:
        sent = await h.send("hello", chat_id="c")
        await h.settle()
        assert store.refused["commit_and_release"] == 1
        assert [o.text for o in h.delivered(chat_id="c")] == ["echo: hello"]
        [outcome] = h.outcomes
        assert (outcome.message_id, outcome.outcome) == (sent.message_id, Outcome.ANSWERED)
        assert await store.pending(sent.session_key) == []
        assert await store.active_sessions() == 0
        await h.send("again", chat_id="c")  # the session is free at once
        await h.settle()
        assert [o.text for o in h.delivered(chat_id="c")] == ["echo: hello", "echo: again"]
        assert [o.outcome for o in h.outcomes] == [Outcome.ANSWERED, Outcome.ANSWERED]


class Switch:
    """Refuses the calls named in :attr:`names` while :attr:`on` (see :class:`LosingAnswers`)."""

    def __init__(self, *names: str) -> None:
        self.names, self.on = set(names), True

    def __call__(self, name: str) -> bool:
        return self.on and name in self.names


LASTING = LeaseSettings(ttl=3600)
"""A lease left behind would hold its session for good: a leak shows as a hang, not a delay."""


async def test_a_message_told_not_taken_is_taken_back_with_its_lease() -> None:
    store = LosingAnswers(first_of("enqueue_and_acquire"))
    async with GatewayHarness(EchoAgent(), store=store, leases=LASTING) as h:
        with pytest.raises(StoreError):
            await h.send("lost", chat_id="c")  # the store queued it and leased its session
        await h.settle()
        key = h.session_key(chat_id="c")
        assert await store.pending(key) == []
        assert await store.active_sessions() == 0
        assert h.outcomes == []  # it was never taken
        assert "chatlane_messages_taken_back_total 1\n" in h.gateway.engine.metrics.render(0, 0)
        await h.send("next", chat_id="c")  # runs at once: no lease to wait out
        assert await h.replies(chat_id="c", count=1) == ["echo: next"]


class HeldUntilGo(EchoAgent):
    """An echo agent whose ``sleep <s>`` turns hold until :attr:`go` is set, then say they
    slept: the turn runs for as long as the test needs, however loaded the machine."""

    def __init__(self) -> None:
        super().__init__()
        self.go = asyncio.Event()

    async def __call__(self, turn: Turn) -> str:
        if not turn.text.startswith("sleep "):
            return await super().__call__(turn)
        await self.go.wait()
        return f"slept {float(turn.text.split()[1]):g}"


async def test_a_message_queued_behind_a_turn_and_told_not_taken_is_taken_back() -> None:
    losing = Switch("enqueue")
    store = LosingAnswers(losing)
    agent = HeldUntilGo()
    async with GatewayHarness(agent, store=store, leases=LASTING) as h:
        await h.send("sleep 0.05", chat_id="c")
        await h.until_running(chat_id="c")
        with pytest.raises(StoreError):
            await h.send("lost", chat_id="c")
        await h.send("/queue lost too", chat_id="c")  # its reply says it was not queued
        losing.on = False
        agent.go.set()
        await h.settle()
        assert await store.pending(h.session_key(chat_id="c")) == []
        assert store.refused["enqueue"] == 2
        assert sorted(o.outcome for o in h.outcomes) == [Outcome.ANSWERED, Outcome.FAILED]
        texts = [o.text for o in h.outbox]
        assert "slept 0.05" in texts
        assert not [text for text in texts if text.startswith("echo: lost")]


async def test_a_retry_of_the_message_takes_over_from_its_withdrawal() -> None:
    losing = Switch("enqueue_and_acquire", "pending")
    store = LosingAnswers(losing)
    source = SessionSource("test", chat_id="c", user_id="u1")
    message = InboundMessage(source, "retried", id="m-retried")
    async with GatewayHarness(EchoAgent(), store=store, leases=LASTING) as h:
        key = h.session_key(chat_id="c")
        elsewhere = await store.acquire(key, "another process", 3600)
        with pytest.raises(StoreError):
            await h.gateway.dispatch(message)  # stored; its answer lost
        losing.names = {"pending"}  # the withdrawal cannot read the queue yet
        await h.gateway.dispatch(message)  # the sender tries again: queued, same record
        losing.on = False
        await h.gateway.engine.withdrawals.settled()
        assert [r.message_id for r in await store.pending(key)] == ["m-retried"]  # kept
        await store.release(elsewhere)
        assert (await h.replies(chat_id="c", count=2))[1] == "echo: retried"
        await h.settle()
        assert [o.message_id for o in h.outcomes] == ["m-retried"]  # taken once, run once
        assert await store.pending(key) == []
        assert h.gateway.engine.metrics.taken_back == 0


class ReadsWhenLet(LosingAnswers):
    """Holds each ``pending`` read until :attr:`go` is set; :attr:`reading` is set meanwhile."""

    def __init__(self, refuses: Callable[[str], bool]) -> None:
        super().__init__(refuses)
        self.reading, self.go = asyncio.Event(), asyncio.Event()

    async def pending(self, key: SessionKey) -> list[PendingRecord]:
        self.reading.set()
        await self.go.wait()
        return await super().pending(key)


class SeesSeqs(EchoAgent):
    """An echo agent that notes the store's seq of each message it answers."""

    def __init__(self) -> None:
        super().__init__()
        self.seqs: list[int] = []

    async def __call__(self, turn: Turn) -> str:
        self.seqs += turn.seqs
        return await super().__call__(turn)


async def test_a_retry_waits_while_the_withdrawal_reads_its_record() -> None:
    store = ReadsWhenLet(first_of("enqueue_and_acquire"))
    agent = SeesSeqs()
    source = SessionSource("test", chat_id="c", user_id="u1")
    message = InboundMessage(source, "retried", id="m-retried")
    async with GatewayHarness(agent, store=store, leases=LASTING) as h:
        with pytest.raises(StoreError):
            await h.gateway.dispatch(message)
        key = h.session_key(chat_id="c")
        [lost] = await MemoryStore.pending(store, key)  # the record the lost try made
        await store.reading.wait()  # the withdrawal reads the queue; its drop comes next
        retry = asyncio.create_task(h.gateway.dispatch(message))
        asyncio.get_running_loop().call_soon(store.go.set)  # after the retry's first step
        assert (await retry).started
        assert await h.replies(chat_id="c", count=1) == ["echo: retried"]
        await h.settle()
        assert h.gateway.engine.metrics.taken_back == 1  # the lost try's record went
        assert agent.seqs == [lost.seq + 1]  # the retry ran on a record of its own
        assert await store.pending(key) == []


async def test_a_waiting_turn_whose_lease_answer_was_lost_takes_it_at_its_next_try() -> None:
    store = LosingAnswers(first_of("acquire_and_read"))
    async with GatewayHarness(EchoAgent(), store=store, leases=LASTING) as h:
        key = h.session_key(chat_id="c")
        elsewhere = await store.acquire(key, "another process", 3600)
        await h.send("waits", chat_id="c")  # queued: the session runs elsewhere
        await store.release(elsewhere)
        assert await h.replies(chat_id="c", count=2) == [
            "Queued for the next turn (this conversation is busy)",
            "echo: waits",
        ]
        assert store.refused["acquire_and_read"] == 1
        await h.settle()
        assert await store.active_sessions() == 0


async def test_a_message_stored_before_its_session_could_be_read_is_taken_back() -> None:
    store = Refusing(first_of("load_persistent"))  # an outage that changes nothing
    async with GatewayHarness(EchoAgent(), store=store, leases=LASTING) as h:
        key = h.session_key(chat_id="c")
        elsewhere = await store.acquire(key, "another process", 3600)
        with pytest.raises(StoreError):  # queued, then the session could not be read
            await h.send("not taken", chat_id="c")
        await h.settle()
        assert await store.pending(key) == []
        assert h.outcomes == []
        await store.release(elsewhere)
        await h.send("taken", chat_id="c")
        assert await h.replies(chat_id="c", count=1) == ["echo: taken"]


class SeesBusy(LosingAnswers):
    """Sets :attr:`busy` each time a waiting turn is refused its lease."""

    def __init__(self, refuses: Callable[[str], bool]) -> None:
        super().__init__(refuses)
        self.busy = asyncio.Event()

    async def acquire_and_read(self, key: SessionKey, *args: Any, **options: Any) -> Taken:
        try:
            return await super().acquire_and_read(key, *args, **options)
        except SessionBusy:
            self.busy.set()
            raise


async def stop_losing_the_drop(h: GatewayHarness, store: SeesBusy) -> tuple[int, Lease]:
    """``a`` waits for the session another process holds, ``b`` behind it; ``/stop``'s
    drop of both applies and its answer is lost. Returns once ``b``'s turn waits for the
    lease as ``a``'s did: ``b``'s seq, and the other process's lease."""
    key = h.session_key(chat_id="c")
    elsewhere = await store.acquire(key, "another process", 3600)
    await h.send("a", chat_id="c")  # its turn waits: the session runs elsewhere
    await store.busy.wait()
    await h.send("b", chat_id="c")  # queued behind it
    [_, b] = [record.seq for record in await store.pending(key)]
    store.busy.clear()
    await h.send("/stop", chat_id="c")
    await store.busy.wait()
    return b, elsewhere


def after(first: str, then: str) -> Callable[[str], bool]:
    """Refuse the first call of ``first``, then the first call of ``then`` after it."""
    refused: list[str] = []

    def refuses(name: str) -> bool:
        wanted = then if refused else first
        if name == wanted and len(refused) < 2:
            refused.append(name)
            return True
        return False

    return refuses


async def test_messages_told_they_still_wait_are_queued_again_and_run() -> None:
    store = SeesBusy(first_of("drop_own"))
    async with GatewayHarness(EchoAgent(), store=store, leases=LASTING) as h:
        key, engine = h.session_key(chat_id="c"), h.gateway.engine
        b, elsewhere = await stop_losing_the_drop(h, store)
        assert [(r.seq, r.owner) for r in await store.pending(key)] == [(b, engine.holder)]
        assert engine.registry.get(key).conversation.kept_seqs == frozenset()  # it is stored
        await store.release(elsewhere)
        await h.settle()
        texts = [o.text for o in h.outbox]
        assert any("Could not drop 1 queued message" in text for text in texts), texts
        assert "echo: b" in texts  # it was told it still waits
        assert {o.outcome for o in h.outcomes} == {Outcome.DROPPED, Outcome.ANSWERED}
        assert await store.pending(key) == []


async def test_a_message_told_it_still_waits_outlives_its_process() -> None:
    store = SeesBusy(first_of("drop_own"))
    async with GatewayHarness(EchoAgent(), store=store, leases=LASTING) as h:
        _, elsewhere = await stop_losing_the_drop(h, store)
    await store.release(elsewhere)
    async with GatewayHarness(EchoAgent(), store=store, leases=LASTING) as restarted:
        assert await restarted.replies(chat_id="c", count=1) == ["echo: b"]


async def test_a_message_whose_queueing_again_was_lost_too_runs_once() -> None:
    store = SeesBusy(after("drop_own", "enqueue"))
    async with GatewayHarness(EchoAgent(), store=store, leases=LASTING) as h:
        key = h.session_key(chat_id="c")
        b, elsewhere = await stop_losing_the_drop(h, store)
        assert store.refused == {"drop_own": 1, "enqueue": 1}
        assert [r.seq for r in await store.pending(key)] == [b]  # it applied: back in place
        assert h.gateway.engine.registry.get(key).conversation.kept_seqs == {b}  # unsure
        await store.release(elsewhere)
        await h.settle()
        assert [o.text for o in h.outbox].count("echo: b") == 1
        assert await store.pending(key) == []


class Unreachable(Refusing):
    """A store whose answers may be lost, refusing calls that surely never reached it."""

    answers_may_be_lost = True


async def test_a_message_that_surely_never_reached_the_store_owes_nothing() -> None:
    store = Unreachable(first_of("enqueue_and_acquire"))
    source = SessionSource("test", chat_id="c", user_id="u1")
    message = InboundMessage(source, "again", id="m-again")
    async with GatewayHarness(EchoAgent(), store=store, leases=LASTING) as h:
        with pytest.raises(StoreError):
            await h.gateway.dispatch(message)
        assert h.gateway.engine.withdrawals.owed == 0  # nothing to take back
        assert (await h.gateway.dispatch(message)).started  # its retry is taken at once
        assert await h.replies(chat_id="c", count=1) == ["echo: again"]


async def test_messages_adopted_by_a_call_whose_answer_was_lost_still_run() -> None:
    """A dead process left messages in three sessions; the gateway's adoption of one
    session applies and its answer is lost. The other two run at once, and the third
    once the next adoption reads it back."""
    store = FailingAdoption(chat_key("b"), applies=True)
    for chat in "abc":
        message = InboundMessage(SessionSource("test", chat_id=chat), f"left in {chat}")
        await store.enqueue(chat_key(chat), message.id, "h-gone", encode_message(message))
    quick = LeaseSettings(ttl=2)  # an adoption every 0.4 s
    async with GatewayHarness(EchoAgent(), store=store, leases=quick) as h:
        for chat in "abc":
            assert await h.replies(chat_id=chat, count=1) == [f"echo: left in {chat}"]
        assert store.failing is None  # the adoption of b did fail


async def test_a_message_adopted_again_where_it_waits_already_is_left_there() -> None:
    """An adoption read back may return a record this process holds already (drawn into
    a turn here meanwhile): it is not queued, opened or run a second time."""
    agent = HeldUntilGo()
    async with GatewayHarness(agent, store=MemoryStore(), leases=LASTING) as h:
        key, engine = h.session_key(chat_id="c"), h.gateway.engine
        await h.send("sleep 1", chat_id="c")
        await h.until_running(chat_id="c")
        await h.send("b", chat_id="c")  # queued behind it
        [_, b] = await engine.store.pending(key)
        message = decode_message(b.payload)
        await engine.adopt(key, message, b.seq)  # as read back: it waits here already
        running = engine.running_turn(key)
        assert running is not None
        await engine.adopt(key, running.messages[0], running.seqs[0])  # it runs here
        assert pending.known(engine.registry.get(key)) == {b.seq}  # b, once; not the running
        agent.go.set()
        await h.settle()
        assert [o.text for o in h.outbox if o.text.startswith(("echo", "slept"))] == [
            "slept 1",
            "echo: b",
        ]
        assert sorted(o.message_id for o in h.outcomes) == sorted(
            [running.message_ids[0], b.message_id]
        )


class ReadsRefusedUntilClose:
    """Loses the answer to the first admission, then refuses every read of a session's
    queue — the withdrawal's — until :attr:`on` is cleared."""

    def __init__(self) -> None:
        self.admission_lost, self.on = False, True
        self.read_refused = asyncio.Event()

    def __call__(self, name: str) -> bool:
        if name == "enqueue_and_acquire" and not self.admission_lost:
            self.admission_lost = True
            return True
        if name == "pending" and self.on:
            self.read_refused.set()
            return True
        return False


async def test_a_withdrawal_still_owed_at_close_is_made_once_more() -> None:
    """The store answers again while the withdrawal waits out the outage; the gateway
    closes before its next try: closing tries it once more, so the record goes."""
    outage = ReadsRefusedUntilClose()
    store = LosingAnswers(outage)
    async with GatewayHarness(EchoAgent(), store=store, leases=LASTING) as h:
        key, withdrawals = h.session_key(chat_id="c"), h.gateway.engine.withdrawals
        with pytest.raises(StoreError):
            await h.send("lost", chat_id="c")  # queued and leased; told not taken
        await outage.read_refused.wait()  # its withdrawal waits out the outage
        close = withdrawals.aclose

        async def closing() -> None:
            outage.on = False  # the store answers again just as the gateway closes
            await close()

        withdrawals.aclose = closing  # type: ignore[method-assign]
    assert await store.pending(key) == []
    assert await store.active_sessions() == 0


async def test_a_withdrawal_the_store_still_refuses_at_close_is_given_up(
    caplog: pytest.LogCaptureFixture,
) -> None:
    outage = ReadsRefusedUntilClose()
    store = LosingAnswers(outage)
    async with GatewayHarness(EchoAgent(), store=store, leases=LASTING) as h:
        key = h.session_key(chat_id="c")
        with pytest.raises(StoreError):
            await h.send("lost", chat_id="c")
        await outage.read_refused.wait()
    outage.on = False  # the store answers again once the gateway is gone
    assert [record.owner for record in await store.pending(key)] == [h.gateway.engine.holder]
    assert "closing with 1 messages not yet taken back" in caplog.text  # it runs once adopted


class DropAnswerLost(MemoryStore):
    """While ``on``: a drop applies and its answer is lost, and queueing a record again
    under its seq is refused (the store wobbles): what the drop took waits in memory alone."""

    answers_may_be_lost = True
    on = False

    async def drop_own(self, key: SessionKey, seqs: Sequence[int], owner: str) -> list[int]:
        dropped = await super().drop_own(key, seqs, owner)
        if self.on:
            raise StoreError("the drop's answer was lost", maybe_applied=True)
        return dropped

    async def enqueue(
        self, key: SessionKey, message_id: str, owner: str, payload: bytes, *, seq: int = 0
    ) -> int:
        if self.on and seq:
            self.on = False
            raise StoreError("queueing it again was refused", maybe_applied=False)
        return await super().enqueue(key, message_id, owner, payload, seq=seq)


async def test_a_steer_waiting_in_memory_alone_is_taken_back_here() -> None:
    """Under ``steer``, ``/unqueue`` takes a message from the store only while it is this
    process's; one that waits in memory alone (the store has no record of it: no other
    process can have it) is this process's too, and leaves with its sender told."""
    store = DropAnswerLost()
    async with GatewayHarness(UntakenSteers(hold=60), busy="steer", store=store) as h:
        key = h.session_key(chat_id="c")
        await h.send("long", chat_id="c")
        await h.until_running(chat_id="c")
        steered = await h.send("steered text", chat_id="c")
        [(seq, _)] = h.gateway.engine.steered(key)
        store.on = True
        await h.send(f"/unqueue #{seq}", chat_id="c")  # it may have applied: it waits again
        assert seq not in {record.seq for record in await store.pending(key)}  # memory alone
        await h.send(f"/unqueue #{seq}", chat_id="c")
        took = f"Took #{seq} back from the running turn"
        await h.wait_for(lambda out: any(o.text.startswith(took) for o in out))
        assert h.gateway.engine.steered(key) == []
        h.gateway.engine.interrupt(key, "done")
        await h.settle()
    [ended] = [o for o in h.outcomes if o.message_id == steered.message_id]
    assert ended.outcome is Outcome.DROPPED
    assert ended.text == "Taken out of the queue, will not run: “steered text”"
