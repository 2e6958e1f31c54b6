"""The turn engine: one turn per session, generations, fencing, eviction."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from operator import attrgetter
from typing import Any

import pytest

from chatlane.context import current_session
from chatlane.errors import StaleGeneration
from chatlane.gateway import Gateway, GatewaySettings
from chatlane.identity import SessionSource
from chatlane.runtime import pending
from chatlane.runtime import turn as turn_module
from chatlane.runtime import upkeep as upkeep_module
from chatlane.runtime.busy import BusyOutcome
from chatlane.runtime.settings import RuntimeSettings
from chatlane.runtime.turn import AS_DEFINED, PLAIN_READS, Turn
from chatlane.stores import Admission, Lease, MemoryStore
from chatlane.testing import GatewayHarness
from chatlane.types import InboundMessage, Outbound, OutboundKind, SessionKey
from tests.runtime.agents import EchoAgent, Recorder, hold, streaming_agent


async def test_reply_reaches_the_chat_it_came_from() -> None:
    async with GatewayHarness(EchoAgent()) as h:
        await h.send("hi", chat_id="c1")
        await h.send("yo", chat_id="c2")
        assert await h.replies(chat_id="c1", count=1) == ["echo: hi"]
        assert await h.replies(chat_id="c2", count=1) == ["echo: yo"]


async def test_thread_replies_stay_in_their_thread() -> None:
    async with GatewayHarness(EchoAgent()) as h:
        await h.send("a", chat_id="g", chat_type="group", thread_id="t1")
        await h.send("b", chat_id="g", chat_type="group", thread_id="t2")
        assert await h.replies(chat_id="g", thread_id="t1", count=1) == ["echo: a"]
        assert await h.replies(chat_id="g", thread_id="t2", count=1) == ["echo: b"]
        assert h.delivered(chat_id="g") == []


async def test_streamed_chunks_then_whole_reply() -> None:
    async with GatewayHarness(streaming_agent) as h:
        await h.send("one two", chat_id="c")
        assert await h.replies(chat_id="c", count=1) == ["echo: one two "]
        kinds = [o.kind for o in h.delivered(chat_id="c")]
        assert kinds == [OutboundKind.CHUNK] * 3 + [OutboundKind.REPLY]


async def test_a_turn_of_messages_that_take_whole_replies_sends_no_chunks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    touched: list[str] = []
    touch = Turn.touch

    def counted(turn: Turn) -> None:
        touched.append(turn.source.chat_id or "")
        touch(turn)

    monkeypatch.setattr(Turn, "touch", counted)
    async with GatewayHarness(streaming_agent) as h:
        await h.send("one two", chat_id="c", whole_reply=True)
        await h.send("one two", chat_id="d")
        assert await h.replies(chat_id="c", count=1) == ["echo: one two "]
        assert [o.kind for o in h.delivered(chat_id="c")] == [OutboundKind.REPLY]
        assert await h.replies(chat_id="d", count=1) == ["echo: one two "]
        assert [o.kind for o in h.delivered(chat_id="d")] == [OutboundKind.CHUNK] * 3 + [
            OutboundKind.REPLY
        ]
    # every chunk held back still marked the turn's progress, as a chunk sent out does
    assert touched.count("c") == touched.count("d") >= 3


async def test_chunks_go_out_once_a_message_that_takes_them_is_steered_in() -> None:
    steered_in = asyncio.Event()

    async def agent(turn: Turn) -> AsyncIterator[str]:
        yield "before "
        await steered_in.wait()
        yield f"after {' '.join(turn.take_steers())}"

    agent.accepts_steering = True  # type: ignore[attr-defined]
    async with GatewayHarness(agent, busy="steer", ack_debounce=0) as h:
        await h.send("go", chat_id="c", whole_reply=True)
        await h.until_running(chat_id="c")
        await h.send("more", chat_id="c")
        steered_in.set()
        replies = await h.replies(chat_id="c", count=2)
        assert replies == ["Steered into the current run", "before after more"]
        chunks = [o.text for o in h.delivered(chat_id="c") if o.kind is OutboundKind.CHUNK]
        assert chunks == ["after more"]


async def test_messages_arriving_together_never_both_start() -> None:
    recorder = Recorder()
    async with GatewayHarness(EchoAgent(recorder), ack_debounce=0) as h:
        results = await asyncio.gather(*(h.send(f"m{i}", chat_id="c") for i in range(10)))
        assert sum(r.started for r in results) == 1
        await h.replies(chat_id="c", count=19)
        key = results[0].session_key
        assert recorder.max_active[key] == 1
        assert [t.text for t in recorder.turns[key]] == [f"m{i}" for i in range(10)]


async def test_generations_only_grow() -> None:
    recorder = Recorder()
    async with GatewayHarness(EchoAgent(recorder)) as h:
        for count, text in enumerate(("a", "b", "c"), start=1):
            result = await h.send(text, chat_id="c")
            await h.replies(chat_id="c", count=count)
        await h.send("/stop", chat_id="c")
        await h.send("d", chat_id="c")
        await h.replies(chat_id="c", count=5)
        generations = [t.generation for t in recorder.turns[result.session_key]]
        assert generations == [1, 2, 3, 5]
        assert h.session(result.session_key).persistent.run_generation == 5


async def test_turn_context_is_bound_and_cleared() -> None:
    recorder = Recorder()
    async with GatewayHarness(EchoAgent(recorder)) as h:
        await asyncio.gather(*(h.send("x", chat_id=f"c{i}") for i in range(50)))
        for i in range(50):
            await h.replies(chat_id=f"c{i}", count=1)
    assert recorder.cross_talk == []


async def test_stale_turn_output_is_fenced() -> None:
    release = asyncio.Event()
    fence_errors: list[StaleGeneration] = []

    async def agent(turn: Turn) -> AsyncIterator[str]:
        yield "before "
        await release.wait()
        try:
            turn.fence("state write")
        except StaleGeneration as error:
            fence_errors.append(error)
        yield "after"

    async with GatewayHarness(agent) as h:
        result = await h.send("go", chat_id="c")
        await h.until_running(chat_id="c")
        h.gateway.engine.interrupt(result.session_key)
        release.set()
        await h.settle()
        texts = [o.text for o in h.delivered(chat_id="c")]
        assert texts == ["before "]
    assert fence_errors
    assert fence_errors[0].generation == 1
    assert h.gateway.engine.metrics.stale_refused == 1  # the reply, after the interrupt


async def test_agent_failure_becomes_a_notice_and_session_goes_on() -> None:
    calls = 0

    async def agent(turn: Turn) -> str:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("boom")
        return "fine"

    async with GatewayHarness(agent) as h:
        await h.send("a", chat_id="c")
        await h.send("b", chat_id="c")
        replies = await h.replies(chat_id="c", count=3)
        assert replies[0] == "Queued for the next turn (1 queued)"
        assert replies[1].startswith("Sorry — the agent failed")
        assert "RuntimeError" in replies[1]
        assert replies[2] == "fine"


async def test_an_agent_that_calls_exit_fails_its_turn_not_the_gateway() -> None:
    """A tool's ``sys.exit()`` (argparse on bad arguments) is the agent's failure: let out
    of the turn's task, asyncio would stop every session's turns."""
    other_running, release = asyncio.Event(), asyncio.Event()

    async def agent(turn: Turn) -> str:
        if turn.text == "tool --bogus":
            sys.exit(2)
        other_running.set()
        await release.wait()
        return f"echo: {turn.text}"

    async with GatewayHarness(agent) as h:
        await h.send("a long question", chat_id="other")
        await other_running.wait()
        await h.send("tool --bogus", chat_id="c")
        [notice] = await h.replies(chat_id="c", count=1)
        release.set()
        [answer] = await h.replies(chat_id="other", count=1)
        await h.send("and now?", chat_id="c")
        [_, again] = await h.replies(chat_id="c", count=2)
    assert notice == "Sorry — the agent failed on this message (SystemExit)."
    assert answer == "echo: a long question"
    assert again == "echo: and now?"


async def test_agent_returning_wrong_type_gets_a_notice() -> None:
    async def agent(turn: Turn) -> str:
        return 42  # type: ignore[return-value]

    async with GatewayHarness(agent) as h:
        await h.send("a", chat_id="c")
        [reply] = await h.replies(chat_id="c", count=1)
        assert "TypeError" in reply


async def test_async_generator_agent_is_streamed() -> None:
    async def agent(turn: Turn) -> AsyncIterator[str]:
        yield "x"
        yield "y"

    async with GatewayHarness(agent) as h:
        await h.send("a", chat_id="c")
        assert await h.replies(chat_id="c", count=1) == ["xy"]


async def test_delivery_failure_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    async with GatewayHarness(EchoAgent()) as h:
        engine = h.gateway.engine

        async def broken(_: object) -> None:
            raise ConnectionError("adapter down")

        engine.outlet._deliver = broken
        await h.send("a", chat_id="c")
        await h.settle()
        assert "delivery failed" in caplog.text
        assert engine.running_turn(h.session_key(chat_id="c")) is None


class FrozenMonotonic:
    """The ``time`` module as turns and their watchdog read it (see :meth:`patch`):
    ``monotonic()`` moves only when the test moves :attr:`now`; the rest is the real module."""

    def __init__(self) -> None:
        self.now = time.monotonic()

    def monotonic(self) -> float:
        return self.now

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)

    @classmethod
    def patch(cls, monkeypatch: pytest.MonkeyPatch) -> FrozenMonotonic:
        """Progress stamps (``Turn.touch``) and the watchdog's reading on one frozen clock."""
        clock = cls()
        monkeypatch.setattr(turn_module, "time", clock)
        monkeypatch.setattr(upkeep_module, "time", clock)
        return clock


class SlowRelease(MemoryStore):
    """A release answered only once :attr:`after` is done (the task of the turn it releases).

    ``applies_first``: it takes effect at once, so whatever runs meanwhile finds the lease
    free while its releaser still waits; otherwise it takes effect only then too, so
    whatever asks for the lease meanwhile overtakes it, as on a store with several
    connections.
    """

    def __init__(self, *, applies_first: bool) -> None:
        super().__init__()
        self.applies_first = applies_first
        self.after: asyncio.Task[None] | None = None

    async def release(self, lease: Lease) -> None:
        if self.applies_first:
            await super().release(lease)
        waited, self.after = self.after, None
        if waited is not None:
            await asyncio.wait({waited})
        if not self.applies_first:
            await super().release(lease)


class TestEviction:
    async def test_stuck_turn_is_evicted_and_cannot_touch_successor(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """On a clock only the test moves: the stuck turn is evicted once the test moves it
        past the timeout; its successor, started after that, is never (however slow the
        machine)."""
        clock = FrozenMonotonic.patch(monkeypatch)
        recorder = Recorder()
        late: list[str] = []
        answer, let_go = asyncio.Event(), asyncio.Event()

        async def agent(turn: Turn) -> str:
            recorder.enter(turn)
            if turn.text == "stuck":
                while not let_go.is_set():  # ignores interrupts and cancellation
                    try:
                        await let_go.wait()
                    except asyncio.CancelledError:
                        late.append("cancelled")
                return "late reply"
            while not answer.is_set():  # makes progress until the test lets it answer
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(answer.wait(), 0.05)
                turn.touch()
            return "fresh"

        async with GatewayHarness(agent, turn_timeout=0.2, ack_debounce=0) as h:
            try:
                result = await h.send("stuck", chat_id="c")
                await h.until_running(chat_id="c")
                await h.send("next", chat_id="c")
                await h.replies(chat_id="c", count=1)  # "next" is queued behind "stuck"
                assert await h.gateway.engine.evict_stuck() == 0  # no time has passed
                clock.now += 0.3
                await h.gateway.engine.evict_stuck()  # (unless the watchdog's own look came first)
                replies = await h.replies(chat_id="c", count=2)
                assert replies[1].startswith("The running turn made no progress")
                state = h.session(result.session_key)
                stuck = recorder.turns[result.session_key][0].task
                assert stuck is not None
                let_go.set()
                async with asyncio.timeout(10):  # the stuck task finishes while "next" still runs
                    await asyncio.wait({stuck})
                successor = h.gateway.engine.running_turn(result.session_key)
                assert successor is not None
                assert successor.generation == 3
                assert state.turn.lease_tokens == {3: successor.lease}
                assert "late reply" not in [o.text for o in h.delivered(chat_id="c")]
                answer.set()
                assert await h.replies(chat_id="c", count=3, timeout=3) == [
                    replies[0],
                    replies[1],
                    "fresh",
                ]
            finally:  # a failure must not leave the stuck turn waiting (and the run hung)
                let_go.set()
                answer.set()
        assert late == ["cancelled"]

    async def test_progress_keeps_a_long_turn_alive(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """On a clock only the test moves: a turn that makes progress every 0.9 s outlives
        its 1 s timeout five times over; one that makes none is evicted after 1.1 s."""
        clock = FrozenMonotonic.patch(monkeypatch)
        steps: asyncio.Queue[None] = asyncio.Queue()

        async def agent(turn: Turn) -> AsyncIterator[str]:
            if turn.text == "stall":
                await asyncio.Event().wait()  # no progress at all
            for i in range(6):
                await steps.get()  # a chunk each time the test says
                yield str(i)

        def chunks(made: int) -> Callable[[list[Outbound]], bool]:
            """Whether ``made`` chunks were delivered: the turn made progress that often."""
            return lambda outbox: sum(o.kind is OutboundKind.CHUNK for o in outbox) == made

        async with GatewayHarness(agent, turn_timeout=1) as h:
            engine = h.gateway.engine
            await h.send("long", chat_id="c")
            await h.until_running(chat_id="c")
            for made in range(1, 7):
                clock.now += 0.9  # most of the timeout since the last progress
                assert await engine.evict_stuck() == 0
                steps.put_nowait(None)
                await h.wait_for(chunks(made))
            assert await h.replies(chat_id="c", count=1) == ["012345"]  # 5.4 s after it began
            await h.send("stall", chat_id="c")
            await h.until_running(chat_id="c", text="stall")
            clock.now += 0.9
            assert await engine.evict_stuck() == 0
            clock.now += 0.2  # 1.1 s without progress
            await engine.evict_stuck()  # (unless the watchdog's own look came first)
            assert await h.replies(chat_id="c", count=2) == [
                "012345",
                "The running turn made no progress for 1s and was stopped.",
            ]

    async def test_an_eviction_racing_the_evicted_turns_end_starts_one_next_turn(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The evicted turn's task ends while its eviction waits for the store's answer to
        the release; both then start the session's next turn. One does: the slot holds
        the turn that runs, the message after it waits, and a ``rollback`` message
        interrupts the turn that runs."""
        clock = FrozenMonotonic.patch(monkeypatch)
        store = SlowRelease(applies_first=True)
        recorder = Recorder()

        async def agent(turn: Turn) -> str:
            recorder.enter(turn)
            if turn.text == "stuck":
                await asyncio.Event().wait()  # no progress; ends when cancelled
            if turn.text == "m2":
                await turn.interrupted.wait()
            return f"done {turn.text}"

        async with GatewayHarness(
            agent, store=store, busy="rollback", turn_timeout=0.2, ack_debounce=0
        ) as h:
            engine = h.gateway.engine
            result = await h.send("stuck", chat_id="c")
            await h.until_running(chat_id="c")
            await h.send("/queue m2", chat_id="c")
            await h.send("/queue m3", chat_id="c")
            key = result.session_key
            store.after = recorder.turns[key][0].task
            clock.now += 0.3  # this call evicts it, not the watchdog: no await since
            assert await engine.evict_stuck() == 1
            running = engine.running_turn(key)
            assert running is not None
            assert running.text == "m2"
            assert engine.slots.running_count() == 1
            assert pending.pending_count(h.session(key)) == 1  # m3 waits for its turn
            await h.until_running(chat_id="c", text="m2")
            urgent = await h.send("urgent", chat_id="c")
            assert urgent.outcome == BusyOutcome.INTERRUPTING
            await h.settle()
        assert [turn.text for turn in recorder.turns[key]] == ["stuck", "m2", "m3", "urgent"]
        assert await h.replies(chat_id="c", count=6) == [
            "Queued for the next turn (1 queued)",
            "Queued for the next turn (2 queued)",
            "The running turn made no progress for 0.2s and was stopped.",
            "Interrupting the current task",
            "done m3",
            "done urgent",
        ]


async def test_a_turn_never_takes_its_own_process_release_for_a_turn_elsewhere(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The evicted turn's end starts the next turn while the eviction's release is still on
    its way: the next turn waits for that answer, and is not refused its session by a
    lease of its own process (a false "busy", the busy policy applied)."""
    clock = FrozenMonotonic.patch(monkeypatch)
    store = SlowRelease(applies_first=False)
    recorder = Recorder()

    async def agent(turn: Turn) -> str:
        recorder.enter(turn)
        if turn.text == "stuck":
            await asyncio.Event().wait()  # no progress; ends when cancelled
        return f"done {turn.text}"

    async with GatewayHarness(
        agent, store=store, busy="rollback", turn_timeout=0.2, ack_debounce=0
    ) as h:
        result = await h.send("stuck", chat_id="c")
        await h.until_running(chat_id="c")
        await h.send("/queue m2", chat_id="c")
        store.after = recorder.turns[result.session_key][0].task
        clock.now += 0.3
        assert await h.gateway.engine.evict_stuck() == 1
        await h.settle()
    assert await h.replies(chat_id="c", count=3) == [
        "Queued for the next turn (1 queued)",
        "The running turn made no progress for 0.2s and was stopped.",
        "done m2",
    ]


async def test_interrupted_agent_that_ignores_it_is_cancelled_after_grace() -> None:
    cancelled = asyncio.Event()

    async def agent(turn: Turn) -> str:
        if turn.text == "stubborn":
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                cancelled.set()
                raise
        return f"ran {turn.text}"

    async with GatewayHarness(agent, busy="interrupt", interrupt_grace=0.1) as h:
        await h.send("stubborn", chat_id="c")
        await h.until_running(chat_id="c")
        await h.send("next", chat_id="c")
        assert await h.replies(chat_id="c", count=2) == [
            "Interrupting the current task",
            "ran next",
        ]
        assert cancelled.is_set()


async def test_shutdown_fences_running_turns() -> None:
    answered: list[str] = []

    async def agent(turn: Turn) -> str:
        answered.append(await hold(turn, 5))
        return answered[-1]

    h = GatewayHarness(agent)
    async with h:
        await h.send("sleep", chat_id="c")
        await h.until_running(chat_id="c")
    # closing waited for the turn, which answered when it was interrupted: nothing got out
    assert answered == ["interrupted"]
    assert h.delivered(chat_id="c") == []


async def test_deliver_runs_with_the_reply_session_bound_and_the_caller_stays_clean() -> None:
    seen: dict[str, str] = {}
    done = asyncio.Event()

    async def deliver(outbound: Outbound) -> None:
        bound = current_session()
        seen[outbound.in_reply_to[0]] = bound.chat_id if bound else ""
        if len(seen) == 3:
            done.set()

    async def agent(turn: Turn) -> str:
        await asyncio.sleep(0.01)
        return "ok"

    gateway = Gateway(agent, deliver)
    messages = [InboundMessage(SessionSource("test", chat_id=c), "hi") for c in ("a", "b", "c")]
    for message in messages:
        await gateway.dispatch(message)
    assert current_session() is None  # dispatching bound nothing in the caller's context
    await asyncio.wait_for(done.wait(), 2)
    assert seen == {m.id: m.source.chat_id for m in messages}
    await gateway.aclose()


class FirstReleaseHangs(MemoryStore):
    """Its first ``release`` hangs until cancelled (``hanging`` is set meanwhile)."""

    def __init__(self) -> None:
        super().__init__()
        self.hanging = asyncio.Event()

    async def release(self, lease: Lease) -> None:
        if not self.hanging.is_set():
            self.hanging.set()
            await asyncio.Event().wait()
        await super().release(lease)


async def test_closing_releases_the_lease_of_a_turn_cancelled_while_giving_it_back() -> None:
    """An agent that ignores ``interrupted`` is cancelled after its grace; closing then
    cancels its task again while the turn gives its lease back. The lease is still given
    back (it was lost with its token, and the next process waited out its TTL)."""
    store = FirstReleaseHangs()
    started = asyncio.Event()

    async def ignores_interrupts(turn: Turn) -> str:
        started.set()
        await asyncio.Event().wait()
        return "never"

    async def deliver(outbound: Outbound) -> None:
        pass

    settings = GatewaySettings(runtime=RuntimeSettings(interrupt_grace=0.05))
    gateway = Gateway(ignores_interrupts, deliver, settings=settings, store=store)
    message = InboundMessage(SessionSource("test", chat_id="c"), "hi")
    key = (await gateway.dispatch(message)).session_key
    await started.wait()
    turn = gateway.engine.running_turn(key)
    assert turn is not None
    task = turn.task
    assert task is not None
    await gateway.aclose()
    assert store.hanging.is_set()
    assert task.done()
    assert await store.lease_holder(key) is None
    assert [r.message_id for r in await store.pending(key)] == [message.id]  # kept


async def test_a_release_cancelled_mid_call_still_gives_the_lease_back() -> None:
    """An eviction cancels a turn while the turn gives its lease back, and releases it too:
    the lease is given back (before, its token was lost, and it stayed till its TTL)."""
    store = FirstReleaseHangs()
    started, gate = asyncio.Event(), asyncio.Event()

    async def agent(turn: Turn) -> str:
        started.set()
        await gate.wait()
        return "ok"

    async def deliver(outbound: Outbound) -> None:
        pass

    gateway = Gateway(agent, deliver, store=store)
    message = InboundMessage(SessionSource("test", chat_id="c"), "hi")
    key = (await gateway.dispatch(message)).session_key
    await started.wait()
    engine = gateway.engine
    turn = engine.running_turn(key)
    assert turn is not None
    state, generation = turn.session_state, turn.generation
    own = asyncio.create_task(engine.leases.release(state, generation))
    await store.hanging.wait()
    own.cancel()
    await asyncio.gather(own, return_exceptions=True)
    await engine.leases.release(state, generation)  # the eviction's finds it given back
    await engine.leases.settled()
    assert await store.lease_holder(key) is None
    assert not engine.leases.holds(state, generation)
    gate.set()
    await gateway.aclose()


class LateLease(MemoryStore):
    """Its first lease, given with the message it queues, comes only once ``gate`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.held = asyncio.Event()

    async def enqueue_and_acquire(self, *args: Any, **kwargs: Any) -> Admission:
        admission = await super().enqueue_and_acquire(*args, **kwargs)
        if not self.held.is_set():
            self.held.set()
            await self.gate.wait()
        return admission


async def test_a_lease_older_than_the_local_generation_does_not_run_the_turn(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = LateLease()
    recorder = Recorder()
    async with GatewayHarness(EchoAgent(recorder), store=store) as h:
        sending = asyncio.create_task(h.send("hello", chat_id="c"))
        await store.held.wait()  # the store is handing out generation 1
        state = h.session(h.session_key(chat_id="c"))
        state.persistent.bump_generation()
        state.persistent.bump_generation()  # this process moved on to 2 meanwhile
        store.gate.set()
        started = await sending
        assert await h.replies(chat_id="c", count=1) == ["echo: hello"]
        (turn,) = recorder.turns[started.session_key]
        assert turn.generation == 2
        assert h.gateway.engine.metrics.turns_finished == {"lease lost": 1, "answered": 1}
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


class StuckSettling(MemoryStore):
    """``drop_pending`` never returns for the tasks in ``stuck`` (the store stopped answering)."""

    def __init__(self) -> None:
        super().__init__()
        self.stuck: set[asyncio.Task[Any]] = set()
        self.hanging = asyncio.Event()

    async def drop_pending(self, key: SessionKey, seqs: Sequence[int]) -> None:
        if asyncio.current_task() in self.stuck:
            self.hanging.set()
            await asyncio.Event().wait()
        await super().drop_pending(key, seqs)


async def test_shutdown_releases_the_lease_of_a_turn_cut_off_while_settling() -> None:
    store = StuckSettling()

    async def agent(turn: Turn) -> str:
        await turn.interrupted.wait()
        task = asyncio.current_task()
        assert task is not None
        store.stuck.add(task)  # settling this stopped turn will hang
        return "stopped"

    async with GatewayHarness(agent, store=store, interrupt_grace=0.05) as h:
        started = await h.send("go", chat_id="c")
        await h.until_running(chat_id="c")
        await h.send("/stop", chat_id="c")
        await store.hanging.wait()
    lease = await store.acquire(started.session_key, "next-process", 10)
    assert lease.holder == "next-process"


@pytest.mark.parametrize(
    "name",
    [
        "generation",
        "seqs",
        "lease",
        "ended_by",
        "answered",
        "finished",
        "reruns",
        "task",
        "messages",
        "message_ids",
        "source",
        "overrides",
        "steered",
        "session_key",
        "session_state",
        "interrupted",
        "started_at",
    ],
)
async def test_an_agent_cannot_assign_what_the_engine_keeps(name: str) -> None:
    refused: list[str] = []

    async def agent(turn: Turn) -> str:
        try:
            setattr(turn, name, getattr(turn, name))
        except AttributeError:
            refused.append(name)
        return f"gen {turn.generation}"

    async with GatewayHarness(agent) as h:
        await h.send("hi", chat_id="c")
        assert await h.replies(chat_id="c", count=1) == ["gen 1"]
    assert refused == [name]


async def test_each_plain_read_reads_what_its_definition_reads() -> None:
    seen: list[Turn] = []

    async def agent(turn: Turn) -> str:
        seen.append(turn)
        return "ok"

    async with GatewayHarness(agent) as h:
        await h.send("hi", chat_id="c")
        await h.replies(chat_id="c", count=1)
        await h.settle()
    [turn] = seen
    for path in PLAIN_READS.values():  # a distinct value behind each path: no two reads agree
        owner, _, field = path.rpartition(".")
        target = turn if not owner else attrgetter(owner)(turn)
        if field not in ("key", "_state"):  # the state stays real: its key is read through it
            setattr(target, field, object())
    assert set(PLAIN_READS) == set(AS_DEFINED)
    for name in PLAIN_READS:
        defined = AS_DEFINED[name].fget
        assert defined is not None
        assert getattr(turn, name) is defined(turn), name
        assert getattr(Turn, name).__doc__ == AS_DEFINED[name].__doc__


async def test_queue_depth_counts_the_messages_waiting_behind_running_turns() -> None:
    release = asyncio.Event()

    async def agent(turn: Turn) -> str:
        await release.wait()
        return "done"

    async with GatewayHarness(agent, busy="queue") as h:
        for text in ("one", "two", "three"):
            await h.send(text, chat_id="a")
        await h.send("alone", chat_id="b")
        for n in range(50):  # idle sessions the registry holds count for nothing
            await h.send("/busy", chat_id=f"idle{n}")
        assert h.gateway.engine.queue_depth() == 2
        release.set()
        await h.settle()
        assert h.gateway.engine.queue_depth() == 0
