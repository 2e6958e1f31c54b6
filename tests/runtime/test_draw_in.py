"""``steer`` and ``collect`` across processes: a message accepted by one process reaches
the turn another process runs through the store, drawn in at that process's fence
check; the process that accepted it runs nothing and ends it with the answer."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

from chatlane.runtime.busy import COLLECTED_ELSEWHERE, STEERED_ELSEWHERE
from chatlane.runtime.leases import LeaseSettings
from chatlane.runtime.outcomes import Outcome
from chatlane.runtime.turn import Turn
from chatlane.stores import MemoryStore, Store
from chatlane.stores.base import PendingRecord, WriteBatch
from chatlane.stores.sqlite import SQLiteStore
from chatlane.testing import GatewayHarness
from chatlane.types import OutboundKind, SessionKey
from tests.runtime.processes import CHECKED_BY_HAND, two_processes


class HoldsForSteers:
    """``long`` holds its turn until released, then replies with what was steered into it
    (``takes=False``: it never takes any); anything else is answered at once."""

    accepts_steering = True

    def __init__(self, *, takes: bool = True) -> None:
        self.takes = takes
        self.release = asyncio.Event()
        self.ran: list[str] = []

    async def __call__(self, turn: Turn) -> str:
        self.ran.append(turn.text)
        if turn.text == "long":
            await self.release.wait()
        steered = turn.take_steers() if self.takes else []
        return " + ".join([turn.text, *steered])


def replies_of(h: GatewayHarness, chat_id: str = "c") -> list[str]:
    return [o.text for o in h.delivered(chat_id=chat_id) if o.kind is OutboundKind.REPLY]


def ends(h: GatewayHarness) -> dict[str, tuple[Outcome, str]]:
    return {o.message_id: (o.outcome, o.text) for o in h.outcomes}


async def test_a_message_sent_to_another_process_is_steered_into_the_running_turn(
    two_stores: tuple[Store, Store],
) -> None:
    here = two_stores[0]
    runner_agent, other_agent = HoldsForSteers(), HoldsForSteers()
    async with two_processes(two_stores, (runner_agent, other_agent), "steer") as (
        runner,
        other,
    ):
        first = await runner.send("long", chat_id="c")
        await runner.until_running(chat_id="c")
        second = await other.send("and this too", chat_id="c")
        assert await other.replies(chat_id="c", count=1) == [STEERED_ELSEWHERE]
        await runner.gateway.engine.upkeep.check_fences()
        runner_agent.release.set()
        assert await runner.replies(chat_id="c", count=1) == ["long + and this too"]
        await other.settle()
        await other.gateway.engine.upkeep.settle_watched()
        assert await here.pending(first.session_key) == []
    assert other_agent.ran == []  # the process that accepted it ran nothing
    assert replies_of(other) == []
    assert ends(other) == {second.message_id: (Outcome.ANSWERED, "long + and this too")}
    assert ends(runner)[first.message_id] == (Outcome.ANSWERED, "long + and this too")
    assert second.message_id not in ends(runner)  # its sender hears from where it was sent


async def test_a_stop_where_a_drawn_in_message_waited_does_not_drop_its_answer(
    two_stores: tuple[Store, Store],
) -> None:
    """``/stop`` reaches the process that accepted a message after another one drew it in and
    answered it, before its waiting turn looked again: not "dropped" there (the count and its
    outcome), but answered, with the answer of record."""
    here, there = two_stores
    runner_agent = HoldsForSteers()
    late = LeaseSettings(fence_check=0, poll=30, max_poll=30)  # `other` looks only much later
    async with (
        GatewayHarness(runner_agent, store=here, busy="steer", leases=CHECKED_BY_HAND) as runner,
        GatewayHarness(HoldsForSteers(), store=there, busy="steer", leases=late) as other,
    ):
        await runner.send("long", chat_id="c")
        await runner.until_running(chat_id="c")
        second = await other.send("steer me", chat_id="c")  # waits there for the lease
        assert await other.replies(chat_id="c", count=1) == [STEERED_ELSEWHERE]
        await runner.gateway.engine.upkeep.check_fences()  # drawn in
        runner_agent.release.set()
        assert await runner.replies(chat_id="c", count=1) == ["long + steer me"]
        await other.send("/stop", chat_id="c")
        replies = await other.replies(chat_id="c", count=2)
        await other.gateway.engine.upkeep.settle_watched()
        await other.settle()
    assert replies[1] == "Nothing was running here. Dropped 0 queued messages."
    [ended] = [o for o in other.outcomes if o.message_id == second.message_id]
    assert (ended.outcome, ended.text) == (Outcome.ANSWERED, "long + steer me")


class Holding(SQLiteStore):
    """The SQLite store, whose next call of a kind its subclass names a test can hold: set
    ``held`` and ``reached``; that call sets ``reached``, then waits for ``held``."""

    held: asyncio.Event | None = None
    reached: asyncio.Event | None = None

    async def _hold(self, *, once: bool = True) -> None:
        held, reached = self.held, self.reached
        if held is not None and reached is not None:
            if once:
                self.held = self.reached = None
            reached.set()
            await held.wait()


class HeldDrop(Holding):
    """Its next drop of queued messages can be held."""

    async def drop_pending(self, key: SessionKey, seqs: Sequence[int]) -> None:
        await self._hold()
        await super().drop_pending(key, seqs)

    async def drop_own(self, key: SessionKey, seqs: Sequence[int], owner: str) -> list[int]:
        await self._hold()
        return await super().drop_own(key, seqs, owner)


async def test_a_stop_racing_a_draw_in_and_its_answer_never_drops_what_was_answered(
    tmp_path: Path,
) -> None:
    """``/stop`` reaches the process whose turn waits for the lease; before its drop reaches
    the store, the process running the session draws the message in and answers it. The
    drop takes only what is still this process's: the message ends answered, not dropped."""
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    here, there = await SQLiteStore.open(url), await HeldDrop.open(url)
    assert isinstance(there, HeldDrop)
    runner_agent = HoldsForSteers()
    late = LeaseSettings(fence_check=0, poll=30, max_poll=30)  # `other` looks only much later
    try:
        async with (
            GatewayHarness(
                runner_agent, store=here, busy="steer", leases=CHECKED_BY_HAND
            ) as runner,
            GatewayHarness(HoldsForSteers(), store=there, busy="steer", leases=late) as other,
        ):
            await runner.send("long", chat_id="c")
            await runner.until_running(chat_id="c")
            second = await other.send("steer me", chat_id="c")  # waits there for the lease
            assert await other.replies(chat_id="c", count=1) == [STEERED_ELSEWHERE]
            held, reached = asyncio.Event(), asyncio.Event()
            there.held, there.reached = held, reached
            stopping = asyncio.create_task(other.send("/stop", chat_id="c"))
            await reached.wait()  # its drop is on its way to the store
            await runner.gateway.engine.upkeep.check_fences()  # drawn in there meanwhile
            runner_agent.release.set()
            assert await runner.replies(chat_id="c", count=1) == ["long + steer me"]
            held.set()
            await stopping
            replies = await other.replies(chat_id="c", count=2)
            await other.gateway.engine.upkeep.settle_watched()
            await other.settle()
        assert replies[1].endswith(" Dropped 0 queued messages.")
        [ended] = [o for o in other.outcomes if o.message_id == second.message_id]
        assert (ended.outcome, ended.text) == (Outcome.ANSWERED, "long + steer me")
    finally:
        await here.close()
        await there.close()


class HeldRead(Holding):
    """Its next read of a session's queue can be held."""

    async def pending(self, key: SessionKey) -> list[PendingRecord]:
        await self._hold()
        return await super().pending(key)


async def test_a_stop_of_a_turn_that_took_the_lease_for_a_message_answered_elsewhere(
    tmp_path: Path,
) -> None:
    """The waiting turn took the lease once the other process's turn, which drew its message
    in and answered it, gave it back; ``/stop`` comes while it reads the queue, before its
    agent: the message ends answered there, not stopped."""
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    here, there = await SQLiteStore.open(url), await HeldRead.open(url)
    assert isinstance(there, HeldRead)
    runner_agent = HoldsForSteers()
    try:
        async with two_processes((here, there), (runner_agent, HoldsForSteers()), "steer") as (
            runner,
            other,
        ):
            await runner.send("long", chat_id="c")
            await runner.until_running(chat_id="c")
            second = await other.send("steer me", chat_id="c")  # waits there for the lease
            assert await other.replies(chat_id="c", count=1) == [STEERED_ELSEWHERE]
            held, reached = asyncio.Event(), asyncio.Event()
            there.held, there.reached = held, reached
            await runner.gateway.engine.upkeep.check_fences()  # drawn in
            runner_agent.release.set()
            assert await runner.replies(chat_id="c", count=1) == ["long + steer me"]
            await reached.wait()  # its turn has the lease and reads the queue
            await other.send("/stop", chat_id="c")
            held.set()
            await other.settle()
            await other.gateway.engine.upkeep.settle_watched()
        [ended] = [o for o in other.outcomes if o.message_id == second.message_id]
        assert (ended.outcome, ended.text) == (Outcome.ANSWERED, "long + steer me")
    finally:
        await here.close()
        await there.close()


async def test_steered_text_the_agent_never_takes_runs_next_in_the_drawing_process(
    two_stores: tuple[Store, Store],
) -> None:
    runner_agent, other_agent = HoldsForSteers(takes=False), HoldsForSteers()
    async with two_processes(two_stores, (runner_agent, other_agent), "steer") as (
        runner,
        other,
    ):
        await runner.send("long", chat_id="c")
        await runner.until_running(chat_id="c")
        second = await other.send("later", chat_id="c")
        await runner.gateway.engine.upkeep.check_fences()
        runner_agent.release.set()
        assert await runner.replies(chat_id="c", count=2) == ["long", "later"]
        await other.settle()
        await other.gateway.engine.upkeep.settle_watched()
    assert runner_agent.ran == ["long", "later"]
    assert other_agent.ran == []
    assert ends(other) == {second.message_id: (Outcome.ANSWERED, "later")}


async def test_a_message_steered_into_a_turn_waiting_here_and_drawn_elsewhere_never_runs_here(
    two_stores: tuple[Store, Store],
) -> None:
    runner_agent, other_agent = HoldsForSteers(), HoldsForSteers()
    async with two_processes(two_stores, (runner_agent, other_agent), "steer") as (
        runner,
        other,
    ):
        await runner.send("long", chat_id="c")
        await runner.until_running(chat_id="c")
        first = await other.send("first", chat_id="c")  # its turn waits for the lease
        assert await other.replies(chat_id="c", count=1) == [STEERED_ELSEWHERE]
        second = await other.send("second", chat_id="c")
        waiting = other.gateway.engine.running_turn(first.session_key)
        assert waiting is not None
        assert [m.id for m, _ in waiting.waiting_steers()] == [second.message_id]  # steered in
        await runner.gateway.engine.upkeep.check_fences()  # draws both in
        runner_agent.release.set()
        assert await runner.replies(chat_id="c", count=1) == ["long + first + second"]
        await other.settle()
        await other.gateway.engine.upkeep.settle_watched()
    assert other_agent.ran == []  # neither ran here: both were answered there
    answered = (Outcome.ANSWERED, "long + first + second")
    assert ends(other) == {first.message_id: answered, second.message_id: answered}


class SaysItsModel(HoldsForSteers):
    """As :class:`HoldsForSteers`, recording the model each turn ran with (``-``: none)."""

    def __init__(self) -> None:
        super().__init__()
        self.models: list[tuple[str, str]] = []

    async def __call__(self, turn: Turn) -> str:
        model = turn.overrides.model
        self.models.append((turn.text, model.name if model else "-"))
        return await super().__call__(turn)


async def test_a_once_model_is_not_used_up_by_a_message_drawn_into_another_process_turn(
    two_stores: tuple[Store, Store],
) -> None:
    """The message's turn here took the lease only to find it answered there: no agent ran
    here, so the ``/model --once`` sent before it is for the next turn that runs one."""
    runner_agent, other_agent = SaysItsModel(), SaysItsModel()
    async with two_processes(two_stores, (runner_agent, other_agent), "steer") as (
        runner,
        other,
    ):
        await runner.send("long", chat_id="c")
        await runner.until_running(chat_id="c")
        await other.send("/model --once special", chat_id="c")
        await other.send("drawn in", chat_id="c")  # its turn waits for the lease
        await runner.gateway.engine.upkeep.check_fences()  # draws it in
        runner_agent.release.set()
        assert await runner.replies(chat_id="c", count=1) == ["long + drawn in"]
        await other.settle()
        await other.gateway.engine.upkeep.settle_watched()
        for text in ("next", "after"):
            await other.send(text, chat_id="c")
            await other.settle()
    assert runner_agent.models == [("long", "-")]
    assert other_agent.models == [("next", "special"), ("after", "-")]


async def test_collected_messages_of_another_process_become_one_turn_after_the_running_one(
    two_stores: tuple[Store, Store],
) -> None:
    runner_agent, other_agent = HoldsForSteers(), HoldsForSteers()
    agents = (runner_agent, other_agent)
    async with two_processes(two_stores, agents, "collect", collect_debounce=0, ack_debounce=0) as (
        runner,
        other,
    ):
        await runner.send("long", chat_id="c")
        await runner.until_running(chat_id="c")
        one = await other.send("one", chat_id="c")
        two = await other.send("two", chat_id="c")
        await other.wait_for(lambda out: any(o.text == COLLECTED_ELSEWHERE for o in out))
        await runner.gateway.engine.upkeep.check_fences()
        runner_agent.release.set()
        assert await runner.replies(chat_id="c", count=2) == ["long", "one\ntwo"]
        await other.settle()
        await other.gateway.engine.upkeep.settle_watched()
    assert runner_agent.ran == ["long", "one\ntwo"]
    assert other_agent.ran == []
    assert ends(other) == {
        one.message_id: (Outcome.ANSWERED, "one\ntwo"),
        two.message_id: (Outcome.ANSWERED, "one\ntwo"),
    }


async def test_a_message_that_asks_to_queue_is_not_drawn_in(
    two_stores: tuple[Store, Store],
) -> None:
    runner_agent, other_agent = HoldsForSteers(), HoldsForSteers()
    async with two_processes(two_stores, (runner_agent, other_agent), "steer") as (
        runner,
        other,
    ):
        await runner.send("long", chat_id="c")
        await runner.until_running(chat_id="c")
        queued = await other.send("/queue in its own turn", chat_id="c")
        await runner.gateway.engine.upkeep.check_fences()
        runner_agent.release.set()
        assert await runner.replies(chat_id="c", count=1) == ["long"]
        await other.wait_for(lambda out: any(o.text == "in its own turn" for o in out))
    assert other_agent.ran == ["in its own turn"]
    assert ends(other)[queued.message_id] == (Outcome.ANSWERED, "in its own turn")


async def test_a_fence_check_reads_queues_only_where_the_session_steers_or_collects() -> None:
    """At thousands of running turns a read each per fence check would starve renewals."""
    for policy, reads in (("steer", 1), ("collect", 1), ("queue", 0), ("rollback", 0)):
        store = CountsQueueReads()
        agent = HoldsForSteers()
        async with GatewayHarness(agent, busy=policy, store=store, leases=CHECKED_BY_HAND) as h:
            await h.send("long", chat_id="c")
            await h.until_running(chat_id="c")
            before = store.reads
            await h.gateway.engine.upkeep.check_fences()
            assert (policy, store.reads - before) == (policy, reads)
            agent.release.set()
            await h.settle()


class CountsQueueReads(MemoryStore):
    """Counts the reads of a session's queue."""

    reads = 0

    async def pending(self, key: SessionKey) -> list[PendingRecord]:
        self.reads += 1
        return await super().pending(key)


async def test_a_side_question_sent_to_another_process_is_answered_there_at_once(
    two_stores: tuple[Store, Store],
) -> None:
    here = two_stores[0]
    runner_agent, other_agent = HoldsForSteers(), HoldsForSteers()
    async with two_processes(two_stores, (runner_agent, other_agent), "steer") as (
        runner,
        other,
    ):
        first = await runner.send("long", chat_id="c")
        await runner.until_running(chat_id="c")
        await other.send("/btw quick one", chat_id="c")
        await other.wait_for(lambda out: any(o.text == "(aside) quick one" for o in out))
        await runner.gateway.engine.upkeep.check_fences()
        runner_agent.release.set()
        assert await runner.replies(chat_id="c", count=1) == ["long"]  # nothing drawn in
        assert [(e.role, e.content) for e in await here.transcript(first.session_key)] == [
            ("user", "long"),
            ("assistant", "long"),
        ]
    assert other_agent.ran == ["quick one"]


class AnsweredMeanwhile:
    """``long`` holds its turn until released; the turn after it (``one`` and ``two``,
    collected) waits until ``go`` is set, so a test can answer ``one`` elsewhere first."""

    def __init__(self) -> None:
        self.release, self.go = asyncio.Event(), asyncio.Event()
        self.ran: list[str] = []

    async def __call__(self, turn: Turn) -> str:
        self.ran.append(turn.text)
        if turn.text == "long":
            await self.release.wait()
        elif turn.text == "one\ntwo":
            await self.go.wait()
        return f"ran {turn.text}"


async def test_a_turn_whose_messages_were_partly_answered_elsewhere_runs_the_rest_again() -> None:
    """Its commit is refused for the answered one; the other is run again, never dropped."""
    store = MemoryStore()
    agent = AnsweredMeanwhile()
    async with GatewayHarness(agent, store=store, busy="collect", collect_debounce=0) as h:
        await h.send("long", chat_id="c")
        await h.until_running(chat_id="c")
        one = await h.send("one", chat_id="c")
        two = await h.send("two", chat_id="c")
        agent.release.set()
        await h.until_running(chat_id="c", text="one\ntwo")
        batch = WriteBatch(answered=[one.message_id], answer="answered elsewhere")
        await store.commit(one.session_key, None, batch)  # as a process taken over would
        agent.go.set()
        await h.settle()
        await h.gateway.engine.upkeep.settle_watched()
        assert await store.pending(one.session_key) == []
    assert agent.ran == ["long", "one\ntwo", "two"]
    assert ends(h)[two.message_id] == (Outcome.ANSWERED, "ran two")
    assert ends(h)[one.message_id] == (Outcome.ANSWERED, "answered elsewhere")


async def test_a_steer_drawn_in_elsewhere_is_not_taken_back_where_it_was_sent(
    two_stores: tuple[Store, Store],
) -> None:
    """``/unqueue`` of a steer another process's running turn drew in: that turn's agent
    may take it any moment, so it stays there; the reply says so, and its sender gets the
    answer it is part of, never "will not run"."""
    runner_agent, other_agent = HoldsForSteers(), HoldsForSteers()
    async with two_processes(two_stores, (runner_agent, other_agent), "steer") as (
        runner,
        other,
    ):
        await runner.send("long", chat_id="c")
        await runner.until_running(chat_id="c")
        first = await other.send("first", chat_id="c")  # its turn waits for the lease
        second = await other.send("second", chat_id="c")  # steered into that turn
        [(seq, _)] = other.gateway.engine.steered(second.session_key)
        await runner.gateway.engine.upkeep.check_fences()  # draws both in
        await other.send(f"/unqueue #{seq}", chat_id="c")
        reply = (await other.replies(chat_id="c", count=2))[-1]
        assert reply == (
            f"Could not take #{seq} back: the turn another gateway process runs took it in"
            " first; its answer comes from there."
        )
        assert other.gateway.engine.steered(second.session_key) == []
        runner_agent.release.set()
        assert await runner.replies(chat_id="c", count=1) == ["long + first + second"]
        await other.settle()
        await other.gateway.engine.upkeep.settle_watched()
    assert other_agent.ran == []
    answered = (Outcome.ANSWERED, "long + first + second")
    assert ends(other) == {first.message_id: answered, second.message_id: answered}


async def test_a_drawn_in_message_its_sender_unqueued_where_it_was_sent_never_runs(
    tmp_path: Path,
) -> None:
    """``/unqueue`` fences nothing: the process that drew the message in learns it was
    dropped only from the store's queue, read before the turn it waited for runs."""
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    here, there = await SQLiteStore.open(url), await SQLiteStore.open(url)
    runner_agent, other_agent = HoldsForSteers(), HoldsForSteers()
    agents = (runner_agent, other_agent)
    try:
        async with two_processes(
            (here, there), agents, "collect", collect_debounce=0, ack_debounce=0
        ) as (runner, other):
            await runner.send("long", chat_id="c")
            await runner.until_running(chat_id="c")
            one = await other.send("one", chat_id="c")  # its turn waits for the lease
            await other.wait_for(lambda out: any(o.text == COLLECTED_ELSEWHERE for o in out))
            two = await other.send("two", chat_id="c")  # queued behind it, here
            [(seq, _)] = other.gateway.engine.queued(two.session_key)
            await runner.gateway.engine.upkeep.check_fences()  # draws both in, collected
            await other.send(f"/unqueue #{seq}", chat_id="c")
            assert ends(other)[two.message_id][0] is Outcome.DROPPED  # "will not run"
            runner_agent.release.set()
            assert await runner.replies(chat_id="c", count=2) == ["long", "one"]
            await other.settle()
            await other.gateway.engine.upkeep.settle_watched()
        assert runner_agent.ran == ["long", "one"]
        assert other_agent.ran == []
        assert ends(other)[one.message_id] == (Outcome.ANSWERED, "one")
    finally:
        await here.close()
        await there.close()


class HeldBump(Holding):
    """Its generation bumps can be held, each while ``held`` is set."""

    async def bump_generation(self, key: SessionKey) -> int:
        await self._hold(once=False)
        return await super().bump_generation(key)


async def test_a_drawn_in_message_stopped_where_it_was_sent_never_runs_before_the_fence(
    tmp_path: Path,
) -> None:
    """``/stop`` drops the message from the store, then bumps the generation: a turn the
    drawing process starts for it in between holds a lease of the old generation."""
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    here, there = await SQLiteStore.open(url), await HeldBump.open(url)
    assert isinstance(there, HeldBump)
    runner_agent, other_agent = HoldsForSteers(takes=False), HoldsForSteers()
    try:
        async with two_processes((here, there), (runner_agent, other_agent), "steer") as (
            runner,
            other,
        ):
            await runner.send("long", chat_id="c")
            await runner.until_running(chat_id="c")
            steered = await other.send("steer me", chat_id="c")  # its turn waits for the lease
            assert await other.replies(chat_id="c", count=1) == [STEERED_ELSEWHERE]
            await runner.gateway.engine.upkeep.check_fences()  # drawn in, never taken
            held, reached = asyncio.Event(), asyncio.Event()
            there.held, there.reached = held, reached
            stop = asyncio.create_task(other.send("/stop", chat_id="c"))
            await there.reached.wait()  # dropped from the store, not yet fenced
            runner_agent.release.set()
            assert await runner.replies(chat_id="c", count=1) == ["long"]
            await runner.settle()
            assert runner_agent.ran == ["long"]
            there.held.set()
            await stop
            await other.settle()
            assert await here.pending(steered.session_key) == []
        assert steered.message_id not in ends(runner)
        assert other_agent.ran == []  # never ran anywhere
    finally:
        await here.close()
        await there.close()
