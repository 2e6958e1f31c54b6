"""The scheduler: auto-resets on time, jobs to their targets, completions, exactly-once ticks."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import importlib
import logging
import time
import types
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import msgspec
import pytest

from chatlane.autoreset import (
    Activity,
    ActivityTracker,
    AutoResetPolicy,
    AutoResetSettings,
    daily_boundary,
    due_reason,
    resolve,
)
from chatlane.commands import CommandRouter
from chatlane.context import current_cron_target, get_session_env
from chatlane.cron import LOCAL, CronExpression, Interval, Job, JobRun, Schedule
from chatlane.errors import ConfigError, InvalidSessionKey, StoreError
from chatlane.gateway import DispatchResult, Gateway
from chatlane.identity import ChatType, SessionSource, check_session_key
from chatlane.lifecycle import EndReason, LifecycleOptions
from chatlane.redaction import CREDENTIALS_REFUSED
from chatlane.runtime.turn import Turn
from chatlane.scheduler import CRON_COMMAND, Scheduler, SchedulerSettings
from chatlane.scheduling.silent import CRON_ID, DONE_ID, silent_filter
from chatlane.stores import MemoryStore
from chatlane.stores.base import Conversation, Lease
from chatlane.stores.codec import encode_message
from chatlane.testing import GatewayHarness
from chatlane.types import Agent, InboundMessage, Outbound, OutboundKind, SessionKey, Target
from tests.clock import Clock
from tests.keys import chat_key
from tests.runtime.agents import EchoAgent
from tests.runtime.refusing import LosingAnswers, Refusing, first_of

IDLE_NOTICE = (
    "This conversation was idle for 0.3s, so it was closed. Your next message starts a new one."
)
RESET_NOTICE = (
    "This conversation was idle for 1s, so it was closed. Your next message starts a new one."
)
IDLE_NOTICE_60 = (
    "This conversation was idle for 1m, so it was closed. Your next message starts a new one."
)
DAILY_NOTICE = "The daily reset closed this conversation. Your next message starts a new one."
START = dt.datetime(2024, 1, 1, 3, 58, tzinfo=dt.UTC).timestamp()
AHEAD = dt.datetime(2100, 1, 1, 3, 58, tzinfo=dt.UTC).timestamp()
"""A start ahead of the wall clock, with which the store stamps transcripts: auto-reset
treats a transcript entry newer than the activity it knows as talk through another process."""


class FakeClock:
    """Epoch seconds that move only when a test says so."""

    def __init__(self, start: float = START) -> None:
        self.moment = start

    def __call__(self) -> float:
        return self.moment

    def advance(self, seconds: float) -> None:
        self.moment += seconds


class Passes:
    """A scheduler's loop passes as they finish, each with the moment it started on
    ``clock`` (the scheduler's own): what a pass would start, it has started by then."""

    def __init__(
        self,
        scheduler: Scheduler,
        monkeypatch: pytest.MonkeyPatch,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._scheduler = scheduler
        self._run_once = scheduler.run_once
        self._clock = clock
        self.started: list[float] = []
        """When each finished pass started, in order."""
        self._finished = asyncio.Event()
        monkeypatch.setattr(scheduler, "run_once", self._run)

    async def _run(self) -> None:
        moment = self._clock()  # no later than the pass's own reading
        await self._run_once()
        self.started.append(moment)
        self._finished.set()

    async def past(self, moment: float, timeout: float = 5.0) -> None:  # noqa: ASYNC109
        """Wait until a pass that started at ``moment`` or later finished, then until the
        resets and jobs it started (any started before it too) finished."""
        async with asyncio.timeout(timeout):
            while True:
                self._finished.clear()
                if self.started and self.started[-1] >= moment:
                    break
                await self._finished.wait()
            await self._scheduler.wait_idle()


def idle(seconds: float = 0.3, **policy: Any) -> SchedulerSettings:
    default = AutoResetPolicy(idle_after=seconds, **policy)
    return SchedulerSettings(AutoResetSettings(default), period=0.02)


@asynccontextmanager
async def scheduled(
    scheduler: Scheduler, agent: Agent | None = None, **harness: Any
) -> AsyncIterator[GatewayHarness]:
    """A harness whose gateway runs ``scheduler`` (its loop started)."""
    async with GatewayHarness(agent or EchoAgent(), **harness) as h:
        h.gateway.use_scheduler(scheduler)
        await scheduler.start()
        yield h


def texts(h: GatewayHarness, chat_id: str, thread_id: str | None = None) -> list[str]:
    return [o.text for o in h.delivered(chat_id=chat_id, thread_id=thread_id)]


# -- auto-reset: pure parts ------------------------------------------------------------------


class TestPolicies:
    def test_chat_type_beats_platform_beats_default(self) -> None:
        by_default, by_platform, by_type = (AutoResetPolicy(idle_after=s) for s in (1, 2, 3))
        settings = AutoResetSettings(
            by_default, per_platform={"tg": by_platform}, per_chat_type={ChatType.GROUP: by_type}
        )
        assert resolve(settings, SessionSource("web", chat_id="c")) is by_default
        assert resolve(settings, SessionSource("tg", chat_id="c")) is by_platform
        group = SessionSource("tg", chat_id="c", chat_type=ChatType.GROUP)
        assert resolve(settings, group) is by_type

    def test_off_by_default(self) -> None:
        policy = resolve(AutoResetSettings(), SessionSource("web", chat_id="c"))
        assert not policy.enabled

    @pytest.mark.parametrize(
        "kwargs",
        [
            {"idle_after": 0},
            {"idle_after": -1.0},
            {"idle_after": float("inf")},
            {"idle_after": float("nan")},
            {"daily_at_hour": 24},
        ],
    )
    def test_invalid_policy(self, kwargs: dict[str, Any]) -> None:
        with pytest.raises(ConfigError):
            AutoResetPolicy(**kwargs)

    def test_daily_boundary(self) -> None:
        four = dt.datetime(2024, 1, 2, 4, tzinfo=dt.UTC).timestamp()
        assert daily_boundary(four, 4, dt.UTC) == four
        assert daily_boundary(four + 3600, 4, dt.UTC) == four
        assert daily_boundary(four - 1, 4, dt.UTC) == four - 86400
        berlin = dt.timezone(dt.timedelta(hours=1))
        assert daily_boundary(four, 4, berlin) == four - 3600

    def test_due_reason(self) -> None:
        source = SessionSource("web", chat_id="c")
        both = AutoResetPolicy(idle_after=60, daily_at_hour=4)
        boundary = dt.datetime(2024, 1, 2, 4, tzinfo=dt.UTC).timestamp()
        assert due_reason(both, Activity(source, boundary + 1), boundary + 30, dt.UTC) is None
        assert due_reason(both, Activity(source, boundary + 1), boundary + 61, dt.UTC) is (
            EndReason.IDLE
        )
        daily = AutoResetPolicy(daily_at_hour=4)
        assert due_reason(daily, Activity(source, boundary - 5), boundary + 1, dt.UTC) is (
            EndReason.DAILY
        )
        assert due_reason(daily, Activity(source, boundary - 5), boundary - 1, dt.UTC) is None
        remembered = Activity(source, boundary + 9, daily_due=True)
        assert due_reason(daily, remembered, boundary + 10, dt.UTC) is EndReason.DAILY


class TestTracker:
    def test_bounded_least_recently_active_dropped(self) -> None:
        tracker = ActivityTracker(cap=2)
        keys = {name: chat_key(name, "web") for name in "abc"}
        for i, name in enumerate("abac"):
            tracker.touch(keys[name], SessionSource("web", chat_id=name), float(i))
        assert [key for key, _ in tracker.snapshot()] == [keys["a"], keys["c"]]
        assert len(tracker) == 2

    def test_refresh_only_tracked_and_forget(self) -> None:
        tracker = ActivityTracker()
        key = chat_key("x", "web")
        tracker.refresh(key, 5.0)
        assert tracker.get(key) is None
        tracker.touch(key, SessionSource("web", chat_id="x"), 1.0)
        tracker.refresh(key, 5.0)
        entry = tracker.get(key)
        assert entry is not None
        assert entry.last_at == 5.0
        tracker.forget(key)
        assert len(tracker) == 0

    def test_invalid_cap(self) -> None:
        with pytest.raises(ConfigError):
            ActivityTracker(cap=0)


# -- auto-reset: behaviour --------------------------------------------------------------------


class GatedTranscript(MemoryStore):
    """A memory store whose ``hold_read``-th transcript read (counting from 1) waits for a test."""

    def __init__(self) -> None:
        super().__init__()
        self.hold_read = 0
        self.reads = 0
        self.holding = asyncio.Event()
        self.let_go = asyncio.Event()

    async def transcript(self, *args: Any, **kwargs: Any) -> list[Any]:
        if self.hold_read:
            self.reads += 1
            if self.reads == self.hold_read:
                self.holding.set()
                await self.let_go.wait()
        return await super().transcript(*args, **kwargs)


class LeaseLookGate(MemoryStore):
    """A memory store that holds an auto-reset just after its first look at a session's
    lease (whichever call makes it), until the test lets it go."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(clock=clock)
        self.looked = asyncio.Event()
        self.let_go = asyncio.Event()

    async def lease_holder(self, key: SessionKey) -> str | None:
        holder = await super().lease_holder(key)
        await self._hold()
        return holder

    async def acquire(self, key: SessionKey, holder: str, ttl: float, **kwargs: Any) -> Lease:
        lease = await super().acquire(key, holder, ttl, **kwargs)
        await self._hold()
        return lease

    async def _hold(self) -> None:
        task = asyncio.current_task()
        resetting = task is not None and task.get_name().startswith("chatlane-reset")
        if resetting and not self.looked.is_set():
            self.looked.set()
            await self.let_go.wait()


class TestIdleReset:
    async def test_fires_without_a_new_message_in_the_sessions_own_thread(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        store = MemoryStore()
        scheduler = Scheduler(idle())
        passes = Passes(scheduler, monkeypatch)
        async with scheduled(scheduler, store=store) as h:
            loop = asyncio.get_running_loop()
            started = loop.time()
            result = await h.send("hello", chat_id="g", chat_type="group", thread_id="t1")
            await h.send("other", chat_id="g", chat_type="group", thread_id="t2")
            old = await store.conversation(result.session_key)
            replies = await h.replies(chat_id="g", thread_id="t1", count=2)
            assert replies == ["echo: hello", IDLE_NOTICE]
            assert loop.time() - started >= 0.3
            assert (await store.conversation(result.session_key)).id != old.id
            await h.replies(chat_id="g", thread_id="t2", count=2)
            await passes.past(time.time() + 0.4)  # a second idle reset of either would be due
            assert texts(h, "g", "t1") == ["echo: hello", IDLE_NOTICE]
            assert texts(h, "g", "t2") == ["echo: other", IDLE_NOTICE]
            assert texts(h, "g") == []
            assert len(scheduler.tracker) == 0

    async def test_deferred_while_a_turn_runs(self, monkeypatch: pytest.MonkeyPatch) -> None:
        store = MemoryStore()
        release = asyncio.Event()

        async def held(turn: Turn) -> str:
            await release.wait()  # the turn runs until the test lets it answer
            return "done"

        scheduler = Scheduler(idle())
        passes = Passes(scheduler, monkeypatch)
        async with scheduled(scheduler, held, store=store) as h:
            result = await h.send("hold", chat_id="c")
            conversation = await store.conversation(result.session_key)
            # a pass after the session's idle window (0.3 s) passed while it runs
            await passes.past(time.time() + 0.6)
            assert h.session(result.session_key).turn.is_running
            assert h.outbox == []
            release.set()
            replies = await h.replies(chat_id="c", count=2)
            assert replies == ["done", IDLE_NOTICE]
            ended = await store.conversations(result.session_key)
            assert conversation.id in [c.id for c in ended if c.ended_at]

    async def test_a_message_sent_while_the_reset_checks_the_store_calls_it_off(self) -> None:
        store = GatedTranscript()
        async with scheduled(Scheduler(idle()), store=store) as h:
            result = await h.send("hello", chat_id="c")
            await h.replies(chat_id="c", count=1)
            old = await store.conversation(result.session_key)
            store.hold_read = 2  # the reset's second look: inside the before-reset check
            await asyncio.wait_for(store.holding.wait(), 3)
            await h.send("sleep 0.2", chat_id="c")  # arrives while the reset awaits the store
            store.let_go.set()
            assert await h.replies(chat_id="c", count=2) == ["echo: hello", "slept 0.2"]
            assert (await store.conversation(result.session_key)).id == old.id
            assert IDLE_NOTICE not in texts(h, "c")[:2]

    @pytest.mark.parametrize("busy", ["reject", "queue", "rollback"])
    async def test_a_message_arriving_while_the_reset_looks_at_the_lease_runs_as_usual(
        self, busy: str
    ) -> None:
        clock = FakeClock(time.time())
        store = LeaseLookGate(clock)
        scheduler = Scheduler(idle(1.0), now=clock)
        async with GatewayHarness(EchoAgent(), store=store, busy=busy) as h:
            h.gateway.use_scheduler(scheduler)  # passes are run by hand
            result = await h.send("hello", chat_id="c")
            await h.replies(chat_id="c", count=1)
            old = await store.conversation(result.session_key)
            clock.advance(2)
            await scheduler.run_once()
            await asyncio.wait_for(store.looked.wait(), 5)
            sent = await h.send("are you there?", chat_id="c")
            assert (sent.refused, sent.started) == (False, True)
            replies = await h.replies(chat_id="c", count=2)
            assert replies == ["echo: hello", "echo: are you there?"]
            store.let_go.set()
            await scheduler.wait_idle()  # the reset is called off: the session is active again
            await h.settle()
            assert texts(h, "c") == ["echo: hello", "echo: are you there?"]
            assert (await store.conversation(result.session_key)).id == old.id

    async def test_notify_off_resets_silently(self) -> None:
        store = MemoryStore()
        hook = HookCalled()
        scheduler = Scheduler(idle(notify=False))
        lifecycle = LifecycleOptions(before_reset=hook)
        async with scheduled(scheduler, store=store, lifecycle=lifecycle) as h:
            result = await h.send("hello", chat_id="c")
            old = await store.conversation(result.session_key)
            await h.replies(chat_id="c", count=1)
            await asyncio.wait_for(hook.called.wait(), 2)
            await scheduler.wait_idle()
            assert len(scheduler.tracker) == 0
            assert (await store.conversation(result.session_key)).id != old.id
            assert texts(h, "c") == ["echo: hello"]

    async def test_per_platform_off(self) -> None:
        off = AutoResetSettings(
            AutoResetPolicy(idle_after=0.3), per_platform={"quiet": AutoResetPolicy()}
        )
        async with scheduled(Scheduler(SchedulerSettings(off, period=0.02))) as h:
            await h.send("a", chat_id="c1", platform="quiet")
            await h.send("b", chat_id="c2")
            await h.replies(chat_id="c2", count=2)
            assert texts(h, "c1") == ["echo: a"]

    async def test_before_reset_gets_the_ending_conversation(self) -> None:
        store = MemoryStore()
        seen: list[tuple[SessionKey, EndReason, list[str]]] = []

        async def archive(key: SessionKey, reason: EndReason, conversation: Conversation) -> None:
            entries = await store.transcript(key, conversation.id)
            seen.append((key, reason, [e.content for e in entries]))

        lifecycle = LifecycleOptions(before_reset=archive)
        async with scheduled(Scheduler(idle()), store=store, lifecycle=lifecycle) as h:
            result = await h.send("hello", chat_id="c")
            await h.replies(chat_id="c", count=2)
            assert seen == [(result.session_key, EndReason.IDLE, ["hello", "echo: hello"])]

    async def test_called_off_when_the_user_comes_back_during_the_hook(self) -> None:
        store = MemoryStore()
        calls: list[str] = []

        async def slow_archive(key: SessionKey, reason: EndReason, conv: Conversation) -> None:
            calls.append(conv.id)
            if len(calls) == 1:
                await h.send("back", chat_id="c")

        lifecycle = LifecycleOptions(before_reset=slow_archive)
        async with scheduled(Scheduler(idle()), store=store, lifecycle=lifecycle) as h:
            result = await h.send("hello", chat_id="c")
            replies = await h.replies(chat_id="c", count=3)
            assert replies == ["echo: hello", "echo: back", IDLE_NOTICE]
            transcript = await store.transcript(result.session_key, calls[0])
            assert [e.content for e in transcript] == ["hello", "echo: hello", "back", "echo: back"]
            assert calls == [calls[0], calls[0]]

    async def test_a_failing_hook_leaves_the_conversation(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        store = MemoryStore()

        broken = HookCalled(RuntimeError("archive down"))
        lifecycle = LifecycleOptions(before_reset=broken)
        scheduler = Scheduler(idle())
        passes = Passes(scheduler, monkeypatch)
        async with scheduled(scheduler, store=store, lifecycle=lifecycle) as h:
            result = await h.send("hello", chat_id="c")
            old = await store.conversation(result.session_key)
            await h.replies(chat_id="c", count=1)
            await asyncio.wait_for(broken.called.wait(), 2)
            await scheduler.wait_idle()
            await passes.past(time.time())  # a pass since, which would have tried again
            assert broken.calls == 1
            assert len(scheduler.tracker) == 0
            assert (await store.conversation(result.session_key)).id == old.id
            assert texts(h, "c") == ["echo: hello"]


class HoldingStore(MemoryStore):
    """A memory store whose chosen calls wait in :meth:`hold` until ``opened``: ``held`` of
    them wait now, ``most`` waited at once."""

    def __init__(self) -> None:
        super().__init__()
        self.opened = asyncio.Event()
        self.held = 0
        self.most = 0
        self._changed = asyncio.Condition()

    async def hold(self) -> None:
        async with self._changed:
            self.held += 1
            self.most = max(self.most, self.held)
            self._changed.notify_all()
        await self.opened.wait()
        self.held -= 1

    async def until_held(self, count: int) -> None:
        """Return once ``count`` calls wait (never, past the cap that keeps them fewer)."""
        async with asyncio.timeout(5), self._changed:
            await self._changed.wait_for(lambda: self.held >= count)


class ResetGate(HoldingStore):
    """Holds each auto-reset at its look at the session's lease until ``opened``."""

    async def lease_holder(self, key: SessionKey) -> str | None:
        task = asyncio.current_task()
        if task is not None and task.get_name().startswith("chatlane-reset"):
            await self.hold()
        return await super().lease_holder(key)


class TestResetBursts:
    async def test_no_more_resets_are_under_way_at_once_than_the_cap(self) -> None:
        clock, store = FakeClock(AHEAD), ResetGate()
        settings = SchedulerSettings(AutoResetSettings(AutoResetPolicy(idle_after=60)), reset_cap=3)
        scheduler = Scheduler(settings, now=clock)
        chats = [f"c{i}" for i in range(8)]
        async with GatewayHarness(EchoAgent(), store=store) as h:
            h.gateway.use_scheduler(scheduler)
            for chat in chats:
                await h.send("hello", chat_id=chat)
                await h.replies(chat_id=chat, count=1)
            clock.advance(61)
            await scheduler.run_once()
            await store.until_held(3)
            assert store.held == 3
            store.opened.set()
            await scheduler.wait_idle()
            for chat in chats:
                assert await h.replies(chat_id=chat, count=2) == ["echo: hello", IDLE_NOTICE_60]
        assert store.most == 3


class HookCalled:
    """A before_reset hook that records its calls, and fails with ``error`` if given."""

    def __init__(self, error: Exception | None = None) -> None:
        self.called = asyncio.Event()
        self.error = error
        self.calls = 0

    async def __call__(self, key: SessionKey, reason: EndReason, conv: Conversation) -> None:
        self.calls += 1
        self.called.set()
        if self.error is not None:
            raise self.error


class TestDailyReset:
    async def test_at_the_hour_every_session_active_since_the_last_one(self) -> None:
        clock = FakeClock(AHEAD)
        settings = SchedulerSettings(AutoResetSettings(AutoResetPolicy(daily_at_hour=4)))
        scheduler = Scheduler(settings, now=clock)
        store = MemoryStore()
        async with GatewayHarness(EchoAgent(), store=store) as h:
            h.gateway.use_scheduler(scheduler)
            early = await h.send("early", chat_id="a")
            await h.replies(chat_id="a", count=1)
            old = await store.conversation(early.session_key)
            clock.advance(60)
            await scheduler.run_once()
            assert texts(h, "a") == ["echo: early"]
            clock.advance(61)
            await h.send("late", chat_id="b")
            await h.replies(chat_id="b", count=1)
            await scheduler.run_once()
            await scheduler.wait_idle()
            assert texts(h, "a") == ["echo: early", DAILY_NOTICE]
            assert texts(h, "b") == ["echo: late"]
            assert (await store.conversation(early.session_key)).id != old.id
            clock.advance(86400)
            await scheduler.run_once()
            await scheduler.wait_idle()
            assert texts(h, "b") == ["echo: late", DAILY_NOTICE]

    async def test_deferred_while_busy_then_done(self) -> None:
        clock = FakeClock(AHEAD)
        settings = SchedulerSettings(AutoResetSettings(AutoResetPolicy(daily_at_hour=4)))
        scheduler = Scheduler(settings, now=clock)
        async with GatewayHarness(EchoAgent()) as h:
            h.gateway.use_scheduler(scheduler)
            await h.send("sleep 0.3", chat_id="a")
            clock.advance(180)
            await scheduler.run_once()
            await scheduler.wait_idle()
            assert h.outbox == []
            assert await h.replies(chat_id="a", count=1) == ["slept 0.3"]
            await h.settle()
            await scheduler.run_once()
            await scheduler.wait_idle()
            assert texts(h, "a") == ["slept 0.3", DAILY_NOTICE]


class TestResetAcrossProcesses:
    """Two harnesses sharing one store stand for two processes; only the first auto-resets."""

    @pytest.fixture(autouse=True)
    def clock(self) -> FakeClock:
        """One clock for the scheduler and the store, as the wall clock is in production."""
        return FakeClock(time.time())

    @asynccontextmanager
    async def two(self, clock: FakeClock) -> AsyncIterator[tuple[GatewayHarness, GatewayHarness]]:
        store = MemoryStore(clock=clock)
        scheduler = Scheduler(idle(1.0), now=clock)
        async with (
            GatewayHarness(EchoAgent(), store=store) as here,
            GatewayHarness(EchoAgent(), store=store) as there,
        ):
            here.gateway.use_scheduler(scheduler)
            yield here, there

    async def talk_here_then_there(
        self, here: GatewayHarness, there: GatewayHarness, clock: FakeClock
    ) -> DispatchResult:
        """ "hello" here, "still here" there 0.5 s later, then 0.7 s of quiet."""
        result = await here.send("hello", chat_id="c")
        await here.replies(chat_id="c", count=1)
        clock.advance(0.5)
        await there.send("still here", chat_id="c")
        await there.replies(chat_id="c", count=1)
        clock.advance(0.7)
        return result

    async def pass_of(self, h: GatewayHarness) -> None:
        scheduler = h.gateway.scheduler
        assert scheduler is not None
        await scheduler.run_once()
        await scheduler.wait_idle()

    async def test_a_turn_running_in_the_other_process_is_not_cut(self, clock: FakeClock) -> None:
        async with self.two(clock) as (here, there):
            result = await here.send("hello", chat_id="c")
            await here.replies(chat_id="c", count=1)
            old = await here.gateway.engine.store.conversation(result.session_key)
            await there.send("sleep 0.3", chat_id="c")
            clock.advance(2)
            await self.pass_of(here)
            assert await there.replies(chat_id="c", count=1) == ["slept 0.3"]
            store = here.gateway.engine.store
            assert (await store.conversation(result.session_key)).id == old.id
            transcript = await store.transcript(result.session_key, old.id)
            assert [e.content for e in transcript][-2:] == ["sleep 0.3", "slept 0.3"]
            await self.pass_of(here)
            assert texts(here, "c") == ["echo: hello"]
            clock.advance(2)
            await self.pass_of(here)
            assert texts(here, "c") == ["echo: hello", RESET_NOTICE]
            assert (await store.conversation(result.session_key)).id != old.id

    async def test_talk_through_the_other_process_postpones_it(self, clock: FakeClock) -> None:
        async with self.two(clock) as (here, there):
            result = await self.talk_here_then_there(here, there, clock)
            await self.pass_of(here)
            assert texts(here, "c") == ["echo: hello"]
            clock.advance(0.7)
            await self.pass_of(here)
            assert texts(here, "c") == ["echo: hello", RESET_NOTICE]
            scheduler = here.gateway.scheduler
            assert scheduler is not None
            assert len(scheduler.tracker) == 0
            ended = (await here.gateway.engine.store.conversations(result.session_key))[1]
            assert ended.ended_at

    async def test_one_idle_conversation_is_reset_once_by_two_processes(
        self, clock: FakeClock
    ) -> None:
        async with self.two(clock) as (here, there):
            there.gateway.use_scheduler(Scheduler(idle(1.0), now=clock))
            result = await self.talk_here_then_there(here, there, clock)
            await self.pass_of(here)  # postponed: talk went through there
            clock.advance(1.0)
            await self.pass_of(there)  # there resets first ...
            await self.pass_of(here)  # ... and here finds a newer conversation: nothing to do
            notices = [*texts(here, "c"), *texts(there, "c")].count(RESET_NOTICE)
            assert notices == 1
            conversations = await here.gateway.engine.store.conversations(result.session_key)
            assert len(conversations) == 2

    async def test_a_completion_is_not_talk(self, clock: FakeClock) -> None:
        async with self.two(clock) as (here, _):
            result = await here.send("hello", chat_id="c")
            await here.replies(chat_id="c", count=1)
            clock.advance(0.5)
            scheduler = here.gateway.scheduler
            assert scheduler is not None
            await scheduler.notify_completion(result.session_key, "build done")
            await here.replies(chat_id="c", count=2)
            await here.settle()
            clock.advance(0.7)
            await self.pass_of(here)
            assert texts(here, "c") == ["echo: hello", "echo: build done", RESET_NOTICE]

    async def test_a_message_waiting_in_the_store_holds_it_off(self, clock: FakeClock) -> None:
        async with self.two(clock) as (here, there):
            result = await here.send("hello", chat_id="c")
            await here.replies(chat_id="c", count=1)
            store = here.gateway.engine.store
            message = InboundMessage(SessionSource("test", chat_id="c"), "later", id="m-there")
            await store.enqueue(
                result.session_key, message.id, there.gateway.engine.holder, encode_message(message)
            )
            clock.advance(2)
            await self.pass_of(here)
            assert texts(here, "c") == ["echo: hello"]
            assert [r.message_id for r in await store.pending(result.session_key)] == ["m-there"]

    async def test_a_lease_held_elsewhere_holds_it_off(self, clock: FakeClock) -> None:
        async with self.two(clock) as (here, there):
            result = await here.send("hello", chat_id="c")
            await here.replies(chat_id="c", count=1)
            store = here.gateway.engine.store
            lease = await store.acquire(result.session_key, there.gateway.engine.holder, 30.0)
            clock.advance(2)
            await self.pass_of(here)
            assert texts(here, "c") == ["echo: hello"]
            await store.release(lease)
            await self.pass_of(here)
            assert texts(here, "c") == ["echo: hello", RESET_NOTICE]


# -- cron jobs ---------------------------------------------------------------------------------


class TestJobs:
    async def test_concurrent_jobs_each_see_and_reach_their_own_target(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setenv("CHATLANE_SESSION_CHAT_ID", "stale-from-env")
        clock = FakeClock()
        both_inside = asyncio.Barrier(2)
        seen: dict[str, list[tuple[object, ...]]] = {}

        async def action(run: JobRun) -> None:
            record = seen.setdefault(run.job.id, [])
            record.append(_context())
            async with asyncio.timeout(2):
                await both_inside.wait()
            record.append(_context())
            await scheduler.submit_prompt(run)

        jobs = [
            Job("* * * * *", "ping A", "test:chatA", id="a"),
            Job("* * * * *", "ping B", "test:chatB:th1", id="b"),
        ]
        scheduler = Scheduler(jobs=jobs, action=action, now=clock)
        async with GatewayHarness(EchoAgent()) as h:
            h.gateway.use_scheduler(scheduler)
            await scheduler.sync()
            clock.advance(120)
            await scheduler.run_once()
            assert await h.replies(chat_id="chatA", count=1) == ["echo: ping A"]
            assert await h.replies(chat_id="chatB", thread_id="th1", count=1) == ["echo: ping B"]
            await scheduler.wait_idle()
        assert seen["a"] == [("test", "chatA", "", "chatA", "")] * 2
        assert seen["b"] == [("test", "chatB", "th1", "chatB", "")] * 2

    async def test_the_loop_fires_jobs_on_its_own(self, monkeypatch: pytest.MonkeyPatch) -> None:
        clock = FakeClock()
        scheduler = Scheduler(
            SchedulerSettings(period=0.02), jobs=[Job("every 30s", "tick", "test:c")], now=clock
        )
        passes = Passes(scheduler, monkeypatch, clock)
        async with scheduled(scheduler) as h:
            await passes.past(clock())  # the loop looked at the clock: nothing due yet
            await h.settle()
            assert h.outbox == []
            clock.advance(30)
            assert await h.replies(chat_id="c", count=1) == ["echo: tick"]
            clock.advance(30)
            assert await h.replies(chat_id="c", count=2) == ["echo: tick"] * 2

    async def test_silent_result_delivers_nothing(self) -> None:
        clock = FakeClock()
        scheduler = Scheduler(jobs=[Job("* * * * *", "quiet", "test:c")], now=clock)
        store = MemoryStore()
        async with GatewayHarness(silent_agent, store=store) as h:
            h.gateway.use_scheduler(scheduler)
            await scheduler.sync()
            clock.advance(120)
            await scheduler.run_once()
            await scheduler.wait_idle()
            await h.settle()
            assert h.outbox == []
            key = h.session_key(chat_id="c")
            assert [e.content for e in await store.transcript(key)] == ["quiet", "[SILENT]"]
            await h.send("quiet", chat_id="c")
            assert await h.replies(chat_id="c", count=1) == ["[SILENT]"]

    async def test_streamed_job_replies_arrive_whole(self) -> None:
        clock = FakeClock()
        scheduler = Scheduler(jobs=[Job("* * * * *", "stream", "test:c")], now=clock)
        async with GatewayHarness(streaming_agent) as h:
            h.gateway.use_scheduler(scheduler)
            await scheduler.sync()
            clock.advance(120)
            await scheduler.run_once()
            assert await h.replies(chat_id="c", count=1) == ["one two"]
            await h.settle()
            assert [o.kind for o in h.outbox] == [OutboundKind.REPLY]

    async def test_local_job_is_stored_not_delivered(self) -> None:
        clock = FakeClock()
        store = MemoryStore()
        scheduler = Scheduler(jobs=[Job("* * * * *", "nightly", LOCAL, id="n")], now=clock)
        agent = EchoAgent()
        async with GatewayHarness(agent, store=store) as h:
            h.gateway.use_scheduler(scheduler)
            await scheduler.sync()
            clock.advance(120)
            await scheduler.run_once()
            await scheduler.wait_idle()
            await h.settle()
            assert h.outbox == []
            entries = await store.transcript(SessionKey("main:cron:local:n"))
            assert [e.content for e in entries] == ["nightly", "echo: nightly"]
            assert list(agent.recorder.turns) == ["main:cron:local:n"]

    async def test_api_add_list_remove(self) -> None:
        clock = FakeClock()
        configured = Job("@daily", "report", "test:c")
        scheduler = Scheduler(jobs=[configured], now=clock)
        async with GatewayHarness(EchoAgent()) as h:
            h.gateway.use_scheduler(scheduler)
            await scheduler.sync()
            job = await scheduler.add_job("every 5m", "poll", "test:c:t")
            assert [j.id for j in scheduler.list_jobs()] == [configured.id, job.id]
            assert scheduler.next_run(job.id) == clock() + 300
            with pytest.raises(ConfigError):
                await scheduler.add_job("every never", "poll")
            with pytest.raises(ConfigError, match="configuration"):
                await scheduler.remove_job(configured.id)
            assert await scheduler.remove_job(job.id)
            assert not await scheduler.remove_job(job.id)
            assert [j.id for j in scheduler.list_jobs()] == [configured.id]

    def test_configured_ids_must_be_unique(self) -> None:
        with pytest.raises(ConfigError, match="share the id"):
            Scheduler(jobs=[Job("@daily", "a", id="x"), Job("@hourly", "b", id="x")])


class FieldsRead(MemoryStore):
    """A memory store that counts the persistent fields its reads hand back: what a
    backend reads and decodes for them."""

    def __init__(self) -> None:
        super().__init__()
        self.fields = 0

    async def load_persistent(self, key: SessionKey) -> dict[str, Any]:
        found = await super().load_persistent(key)
        self.fields += len(found)
        return found

    async def load_fields(self, key: SessionKey, names: Sequence[str]) -> dict[str, Any]:
        found = await super().load_fields(key, names)
        self.fields += len(found)
        return found


class ClaimGate(HoldingStore):
    """Holds every claim of a job's tick at its lease until ``opened``, once ``armed`` (a
    job's creation takes that lease too)."""

    armed = False

    async def acquire(self, key: SessionKey, holder: str, ttl: float, **kwargs: Any) -> Lease:
        if self.armed and ":scheduler:job:" in key:
            await self.hold()
        return await super().acquire(key, holder, ttl, **kwargs)


class TestBursts:
    """Many ticks due at once: each claim costs the same, and few are claimed at a time."""

    async def test_claims_of_ticks_due_together_read_one_job_each(self) -> None:
        clock, store, runs = FakeClock(), FieldsRead(), []

        async def action(run: JobRun) -> None:
            runs.append(run.job.id)

        scheduler = Scheduler(action=action, now=clock)
        async with GatewayHarness(EchoAgent(), store=store) as h:
            h.gateway.use_scheduler(scheduler)
            for i in range(60):
                await scheduler.add_job("* * * * *", f"job {i}", f"test:c{i}")
            clock.advance(120)
            store.fields = 0
            await scheduler.run_once()
            await scheduler.wait_idle()
        assert len(runs) == 60
        # each claim: the job's own field and its claim's last tick (not every job: 60 x 60)
        assert store.fields <= 2 * 60

    async def test_syncs_parse_a_schedule_many_jobs_share_once(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Every sync reads every stored job again; checking that ``*/7 * * * *`` ever
        matches costs a day's minutes, and was paid again for each job at each sync."""
        scheduler = Scheduler()
        async with GatewayHarness(EchoAgent()) as h:
            h.gateway.use_scheduler(scheduler)
            for i in range(40):
                await scheduler.book.save(Job("*/7 * * * *", f"job {i}", id=f"j{i}"))
            parses: list[str] = []
            parse = CronExpression.parse

            def counted(text: str) -> CronExpression:
                parses.append(text)
                return parse(text)

            monkeypatch.setattr(CronExpression, "parse", counted)
            for _ in range(3):
                await scheduler.sync()
            assert len(scheduler.list_jobs()) == 40
        assert len(parses) <= 1  # none, if an earlier test parsed it already

    async def test_no_more_ticks_are_claimed_at_once_than_the_cap(self) -> None:
        clock, store, runs = FakeClock(), ClaimGate(), []

        async def action(run: JobRun) -> None:
            runs.append(run.job.id)

        scheduler = Scheduler(SchedulerSettings(firing_cap=4), action=action, now=clock)
        async with GatewayHarness(EchoAgent(), store=store) as h:
            h.gateway.use_scheduler(scheduler)
            for i in range(12):
                await scheduler.add_job("* * * * *", f"job {i}", f"test:c{i}")
            store.armed = True
            clock.advance(120)
            await scheduler.run_once()
            await store.until_held(4)
            assert store.held == 4
            store.opened.set()
            await scheduler.wait_idle()
        assert sorted(runs) == sorted(job.id for job in scheduler.list_jobs())
        assert store.most == 4


def noting(runs: list[tuple[str, float]], name: str) -> Any:
    """A job action that notes each tick it runs in ``runs``, as ``name``'s."""

    async def action(run: JobRun) -> None:
        runs.append((name, run.tick))

    return action


class TestClockSteps:
    """The wall clock stepped a day ahead (a bad NTP step), then put right."""

    TEN = dt.datetime(2025, 3, 1, 10, 0, tzinfo=dt.UTC).timestamp()
    HOUR, DAY = 3600.0, 86400.0

    @staticmethod
    async def pass_at(scheduler: Scheduler, clock: Clock, moment: float) -> None:
        clock.now = moment
        await scheduler.run_once()
        await scheduler.wait_idle()

    async def test_a_job_runs_on_time_again_once_the_clock_is_put_right(self) -> None:
        ten, hour, day = self.TEN, self.HOUR, self.DAY
        clock = Clock()
        clock.now = ten - 60
        scheduler = Scheduler(jobs=[Job("@hourly", "ping", "test:c", id="hourly")], now=clock)
        async with GatewayHarness(EchoAgent()) as h:
            h.gateway.use_scheduler(scheduler)  # passes are run by hand
            await scheduler.sync()
            await self.pass_at(scheduler, clock, ten + 30)
            assert await h.replies(chat_id="c", count=1) == ["echo: ping"]
            await self.pass_at(scheduler, clock, ten + day + 60)  # 11:00 is past: it runs
            assert await h.replies(chat_id="c", count=2) == ["echo: ping"] * 2
            assert scheduler.next_run("hourly") == ten + day + hour
            await self.pass_at(scheduler, clock, ten + 120)  # put right
            assert scheduler.next_run("hourly") == ten + hour
            await self.pass_at(scheduler, clock, ten + hour + 30)  # 11:00 ran: not again
            assert scheduler.next_run("hourly") == ten + 2 * hour
            await self.pass_at(scheduler, clock, ten + 2 * hour + 30)
            assert await h.replies(chat_id="c", count=3) == ["echo: ping"] * 3
            assert scheduler.next_run("hourly") == ten + 3 * hour
            await h.settle()
            assert texts(h, "c") == ["echo: ping"] * 3

    async def test_a_tick_claimed_while_the_clock_was_ahead_holds_back_nothing(self) -> None:
        """The clock stays a day ahead over a tick: tomorrow's 11:00 is claimed. Put right,
        today's ticks run all the same, never held back until tomorrow 11:00 has passed."""
        ten, hour, day = self.TEN, self.HOUR, self.DAY
        clock = Clock()
        clock.now = ten - 60
        scheduler = Scheduler(jobs=[Job("@hourly", "ping", "test:c", id="hourly")], now=clock)
        async with GatewayHarness(EchoAgent()) as h:
            h.gateway.use_scheduler(scheduler)  # passes are run by hand
            await scheduler.sync()
            await self.pass_at(scheduler, clock, ten + 30)  # 10:00
            await self.pass_at(scheduler, clock, ten + day + 60)  # 11:00 today, late
            await self.pass_at(scheduler, clock, ten + day + hour + 30)  # 11:00 tomorrow
            assert await h.replies(chat_id="c", count=3) == ["echo: ping"] * 3
            await self.pass_at(scheduler, clock, ten + 2 * hour + 30)  # put right, 12:00:30
            assert scheduler.next_run("hourly") == ten + 3 * hour
            await self.pass_at(scheduler, clock, ten + 3 * hour + 30)  # 13:00 runs
            assert await h.replies(chat_id="c", count=4) == ["echo: ping"] * 4
            assert scheduler.next_run("hourly") == ten + 4 * hour
            await h.settle()
            assert texts(h, "c") == ["echo: ping"] * 4

    async def test_each_tick_runs_once_beside_a_host_whose_clock_stays_ahead(
        self, tmp_path: Path
    ) -> None:
        """Another host's claim ahead of this clock always stands: its clock may still be
        ahead, as here (400 s, for 20 minutes of an every-minute job)."""
        url = f"sqlite:///{tmp_path / 'chatlane.db'}"
        right, ahead = Clock(), Clock()
        right.now, ahead.now = self.TEN, self.TEN + 400
        runs: list[tuple[str, float]] = []
        first = Scheduler(action=noting(runs, "right"), now=right)
        second = Scheduler(action=noting(runs, "ahead"), now=ahead)
        async with (
            GatewayHarness(EchoAgent(), store=url) as a,
            GatewayHarness(EchoAgent(), store=url) as b,
        ):
            a.gateway.use_scheduler(first)
            b.gateway.use_scheduler(second)
            first.book.clock, second.book.clock = "host-a", "host-b"
            await first.add_job("every 1m", "ping", "test:c")
            await second.sync()
            for _ in range(20 * 6):  # a pass every 10 s
                right.now += 10
                ahead.now += 10
                for scheduler in (first, second):
                    await scheduler.run_once()
                    await scheduler.wait_idle()
        ticks = [tick for _, tick in runs]
        assert len(ticks) == len(set(ticks))  # none twice
        assert len(ticks) >= 20

    async def test_the_job_list_is_reloaded_at_once_once_the_clock_is_put_right(self) -> None:
        ten, day = self.TEN, self.DAY
        clock = Clock()
        clock.now = ten
        scheduler = Scheduler(now=clock)
        async with GatewayHarness(EchoAgent()) as h:
            h.gateway.use_scheduler(scheduler)
            await scheduler.sync()
            await self.pass_at(scheduler, clock, ten + day)  # loaded by the wrong clock
            clock.now = ten + 30  # put right; then another process stores a job
            await scheduler.book.save(Job("@hourly", "pong", "test:c", id="there"))
            await self.pass_at(scheduler, clock, ten + 31)
            assert [job.id for job in scheduler.list_jobs()] == ["there"]
            assert scheduler.next_run("there") == ten + self.HOUR


class TestBadJobs:
    """One job that cannot be scheduled never stops the others, nor the loop, nor /cron."""

    async def test_a_stored_endless_interval_breaks_nothing(self) -> None:
        store = MemoryStore()
        origin = msgspec.to_builtins(SessionSource("test", chat_id="c"))
        endless: dict[str, Any] = {"schedule": "every " + "9" * 400 + "s", "prompt": "boom"}
        endless |= {"target": "origin", "origin": origin, "id": "bad", "created_at": START}
        await store.set_persistent(SessionKey("main:scheduler"), None, **{"job:bad": endless})
        clock = FakeClock()
        async with scheduled(
            Scheduler(SchedulerSettings(period=0.02), now=clock), store=store
        ) as h:
            await h.send("/cron add every 1m ping", chat_id="c")
            await h.send("/cron list", chat_id="c")
            added, listing = await h.replies(chat_id="c", count=2)
            assert added.startswith("Added job ")
            assert "ping" in listing
            assert "boom" not in listing
            clock.advance(60)
            assert (await h.replies(chat_id="c", count=3))[2] == "echo: ping"

    async def test_a_job_whose_first_tick_fails_is_not_stored(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        scheduler = Scheduler(now=FakeClock())
        async with GatewayHarness(EchoAgent()) as h:
            h.gateway.use_scheduler(scheduler)
            monkeypatch.setattr(Interval, "next_after", _overflow)
            with pytest.raises(OverflowError):
                await scheduler.add_job("every 1m", "poll")
            assert await scheduler.book.load() == {}
            assert scheduler.list_jobs() == []

    async def test_a_job_that_cannot_be_scheduled_leaves_the_others(
        self, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
    ) -> None:
        caplog.set_level(logging.WARNING, "chatlane.scheduler")
        scheduler = Scheduler(now=FakeClock())
        async with GatewayHarness(EchoAgent()) as h:
            h.gateway.use_scheduler(scheduler)
            await scheduler.book.save(Job("every 1m", "bad", id="bad"))
            await scheduler.book.save(Job("@daily", "good", id="good"))
            monkeypatch.setattr(Interval, "next_after", _overflow)
            await scheduler.sync()
            assert [job.id for job in scheduler.list_jobs()] == ["good"]
            assert "job bad (every 1m) cannot be scheduled" in caplog.text

    async def test_the_loop_outlives_a_failed_pass(
        self, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
    ) -> None:
        caplog.set_level(logging.WARNING, "chatlane.scheduler")
        scheduler = Scheduler(SchedulerSettings(period=0.01))
        passes: list[None] = []
        third = asyncio.Event()

        async def flaky() -> None:
            passes.append(None)
            if len(passes) == 1:
                raise RuntimeError("a bug in one pass")
            if len(passes) == 3:
                third.set()

        monkeypatch.setattr(scheduler, "run_once", flaky)
        async with scheduled(scheduler):
            await asyncio.wait_for(third.wait(), 2)
        (failed,) = [r for r in caplog.records if r.getMessage() == "scheduler pass failed"]
        assert failed.exc_info is not None

    async def test_remove_while_a_sync_drops_the_job(self, monkeypatch: pytest.MonkeyPatch) -> None:
        scheduler = Scheduler(now=FakeClock())
        async with GatewayHarness(EchoAgent()) as h:
            h.gateway.use_scheduler(scheduler)
            job = await scheduler.add_job("every 1m", "poll")
            delete = scheduler.book.delete

            async def delete_then_sync(job_id: str) -> None:
                await delete(job_id)
                await scheduler.sync()  # as another task's sync would, while remove waits

            monkeypatch.setattr(scheduler.book, "delete", delete_then_sync)
            assert await scheduler.remove_job(job.id)
            assert scheduler.list_jobs() == []

    async def test_a_job_with_no_run_left_is_logged(
        self, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
    ) -> None:
        caplog.set_level(logging.WARNING, "chatlane.scheduler")
        scheduler = Scheduler(jobs=[Job("every 1h", "report", id="r")], now=FakeClock())
        monkeypatch.setattr(Interval, "next_after", _never)
        async with GatewayHarness(EchoAgent()) as h:
            h.gateway.use_scheduler(scheduler)
            await scheduler.sync()
            assert scheduler.next_run("r") is None
        assert "job r (every 1h) has no run left" in caplog.text

    async def test_a_tick_past_the_calendar_is_listed(self) -> None:
        store = MemoryStore()
        origin = msgspec.to_builtins(SessionSource("test", chat_id="c"))
        late: dict[str, Any] = {"schedule": "every 1m", "prompt": "late", "target": "origin"}
        late |= {"origin": origin, "id": "late", "created_at": 1e300}
        await store.set_persistent(SessionKey("main:scheduler"), None, **{"job:late": late})
        async with scheduled(Scheduler(), store=store) as h:
            await h.send("/cron list", chat_id="c")
            (listing,) = await h.replies(chat_id="c", count=1)
            assert listing.startswith("Jobs of this chat:\nlate every 1m — next at epoch second 1")


def _overflow(self: Schedule, moment: float, *, anchor: float = 0.0, tz: Any = None) -> float:
    raise OverflowError("int too large to convert to float")


def _never(self: Schedule, moment: float, *, anchor: float = 0.0, tz: Any = None) -> None:
    return None


def _context() -> tuple[object, ...]:
    target = current_cron_target()
    assert target is not None
    return (
        target.platform,
        target.chat_id,
        target.thread_id,
        get_session_env("CHATLANE_CRON_AUTO_DELIVER_CHAT_ID"),
        get_session_env("CHATLANE_SESSION_CHAT_ID"),
    )


async def silent_agent(turn: Turn) -> str:
    return "[SILENT]" if turn.text == "quiet" else f"echo: {turn.text}"


async def streaming_agent(turn: Turn) -> AsyncIterator[str]:
    for chunk in ("one", " two"):
        yield chunk


# -- /cron -------------------------------------------------------------------------------------


class TestCronCommand:
    async def test_a_prompt_with_a_credential_is_refused_unrepeated(self) -> None:
        scheduler = Scheduler(SchedulerSettings(period=0.02), now=FakeClock())
        async with scheduled(scheduler) as h:
            await h.send("/cron add every 1h post it with token=hunter2hunter2", chat_id="c")
            (reply,) = await h.replies(chat_id="c", count=1)
            assert reply.startswith(CREDENTIALS_REFUSED)
            assert "hunter2" not in reply
            assert scheduler.list_jobs() == []

    async def test_add_from_a_chat_captures_its_origin(self) -> None:
        clock = FakeClock()
        scheduler = Scheduler(SchedulerSettings(period=0.02), now=clock)
        async with scheduled(scheduler) as h:
            where: dict[str, Any] = {"chat_id": "g", "chat_type": "group", "thread_id": "t"}
            await h.send('/cron add "*/5 * * * *" what is the weather?', **where, user_id="ann")
            (reply,) = await h.replies(chat_id="g", thread_id="t", count=1)
            assert reply.startswith("Added job ")
            assert "next run 2024-01-01 04:00 UTC" in reply
            (job,) = scheduler.list_jobs()
            assert job.target == "origin"
            assert job.prompt == "what is the weather?"
            assert job.origin == SessionSource(
                "test", chat_id="g", chat_type=ChatType.GROUP, thread_id="t", user_id="ann"
            )
            clock.advance(120)
            replies = await h.replies(chat_id="g", thread_id="t", count=2)
            assert replies[1] == "echo: what is the weather?"

    async def test_list_and_remove_are_per_chat(self) -> None:
        async with scheduled(Scheduler()) as h:
            await h.send("/cron add every 10m stretch", chat_id="a")
            await h.send("/cron list", chat_id="b")
            await h.send("/cron list", chat_id="a")
            added, listing = await h.replies(chat_id="a", count=2)
            job_id = added.split()[2]
            assert listing.startswith("Jobs of this chat:\n" + job_id + " every 10m — next ")
            assert listing.endswith(" — stretch")
            assert await h.replies(chat_id="b", count=1) == [
                "No jobs for this chat. Add one with /cron add."
            ]
            await h.send(f"/cron remove {job_id}", chat_id="b")
            refused = (await h.replies(chat_id="b", count=2))[1]
            assert refused.startswith(f"this chat has no job '{job_id}'")
            await h.send(f"/cron remove {job_id}", chat_id="a")
            assert (await h.replies(chat_id="a", count=3))[2] == f"Removed job {job_id}."
            assert h.gateway.scheduler is not None
            assert h.gateway.scheduler.list_jobs() == []

    async def test_a_chat_may_have_only_so_many_jobs(self) -> None:
        async with scheduled(Scheduler(SchedulerSettings(chat_job_cap=1))) as h:
            await h.send("/cron add every 1h one", chat_id="a")
            await h.send("/cron add every 1h two", chat_id="a")
            await h.send("/cron add every 1h three", chat_id="b")
            refused = (await h.replies(chat_id="a", count=2))[1]
            assert refused.startswith("This chat already has the most jobs it may have (1)")
            assert h.gateway.scheduler is not None
            assert [j.prompt for j in h.gateway.scheduler.list_jobs()] == ["one", "three"]

    async def test_the_cap_holds_for_adds_sent_at_once(self, tmp_path: Path) -> None:
        scheduler = Scheduler(SchedulerSettings(chat_job_cap=3))
        async with scheduled(scheduler, store=f"sqlite:///{tmp_path / 'jobs.db'}") as h:
            await asyncio.gather(
                *(h.send(f"/cron add @yearly job{n}", chat_id="a") for n in range(8))
            )
            replies = await h.replies(chat_id="a", count=8)
            assert sum(reply.startswith("Added job ") for reply in replies) == 3
            assert h.gateway.scheduler is not None
            assert len(h.gateway.scheduler.list_jobs()) == 3

    @pytest.mark.parametrize(
        "text",
        [
            "/cron",
            "/cron add",
            '/cron add "* * *" hi',
            '/cron add "*/5 * * * *"',
            '/cron add "*/5 * * * * hi',
            "/cron add tomorrow hi",
            "/cron add every 0s hi",
            "/cron add every 5m \u200b",  # an invisible prompt
            "/cron add every 5m " + "x" * 4001,  # longer than a prompt may be
            "/cron add every \u0665m hi",  # an Arabic-Indic 5
            "/cron list extra",
            "/cron remove",
            "/cron remove a b",
            "/cron frobnicate",
        ],
    )
    async def test_malformed_arguments_get_the_usage_line(self, text: str) -> None:
        async with scheduled(Scheduler()) as h:
            await h.send(text, chat_id="c")
            (reply,) = await h.replies(chat_id="c", count=1)
            assert '\nUsage: /cron add "<minute hour day month weekday>" <prompt>' in ("\n" + reply)
            assert h.gateway.scheduler is not None
            assert h.gateway.scheduler.list_jobs() == []

    async def test_without_a_scheduler(self) -> None:
        async with GatewayHarness(EchoAgent()) as h:
            await h.send("/cron list", chat_id="c")
            assert await h.replies(chat_id="c", count=1) == [
                "Scheduled jobs are not enabled on this gateway."
            ]


# -- background completions --------------------------------------------------------------------


class TestCompletions:
    async def test_queues_behind_the_running_turn_without_an_ack(self) -> None:
        async with scheduled(Scheduler()) as h:
            result = await h.send("sleep 0.3", chat_id="c", thread_id="t")
            scheduler = h.gateway.scheduler
            assert scheduler is not None
            assert await scheduler.notify_completion(result.session_key, "build done") is not None
            replies = await h.replies(chat_id="c", thread_id="t", count=2)
            assert replies == ["slept 0.3", "echo: build done"]

    async def test_by_source_and_by_untracked_key(self) -> None:
        async with scheduled(Scheduler()) as h:
            scheduler = h.gateway.scheduler
            assert scheduler is not None
            source = SessionSource("test", chat_id="c1", chat_type=ChatType.GROUP, user_id="u")
            await scheduler.notify_completion(source, "one")
            await scheduler.notify_completion(check_session_key("main:test:thread:c2:t9"), "two")
            assert await h.replies(chat_id="c1", count=1) == ["echo: one"]
            assert await h.replies(chat_id="c2", thread_id="t9", count=1) == ["echo: two"]
            with pytest.raises(InvalidSessionKey):
                await scheduler.notify_completion(SessionKey("not-a-key"), "three")

    async def test_silent_completion(self) -> None:
        async with scheduled(Scheduler(), silent_agent) as h:
            scheduler = h.gateway.scheduler
            assert scheduler is not None
            await scheduler.notify_completion(SessionSource("test", chat_id="c"), "quiet")
            await h.settle()
            assert h.outbox == []


# -- restarts and several processes ---------------------------------------------------------------


class TestDurability:
    async def test_a_job_survives_a_restart(self, tmp_path: Path) -> None:
        url = f"sqlite:///{tmp_path / 'chatlane.db'}"
        clock = FakeClock()
        async with scheduled(Scheduler(now=clock), store=url) as h:
            await h.send("/cron add every 1m stand up", chat_id="c")
            (added,) = await h.replies(chat_id="c", count=1)
        job_id = added.split()[2]
        clock.advance(30)
        restarted = Scheduler(SchedulerSettings(period=0.02), now=clock)
        async with scheduled(restarted, store=url) as h:
            assert [job.id for job in restarted.list_jobs()] == [job_id]
            clock.advance(60)
            assert await h.replies(chat_id="c", count=1) == ["echo: stand up"]

    async def test_each_tick_runs_once_across_two_processes(self, tmp_path: Path) -> None:
        url = f"sqlite:///{tmp_path / 'chatlane.db'}"
        clock = FakeClock()
        runs: list[tuple[str, float]] = []
        first = Scheduler(action=noting(runs, "first"), now=clock)
        second = Scheduler(action=noting(runs, "second"), now=clock)
        async with (
            GatewayHarness(EchoAgent(), store=url) as a,
            GatewayHarness(EchoAgent(), store=url) as b,
        ):
            a.gateway.use_scheduler(first)
            b.gateway.use_scheduler(second)
            await first.add_job("every 1m", "count", "test:c")
            await second.sync()
            for _ in range(6):
                clock.advance(60)
                await asyncio.gather(first.run_once(), second.run_once())
                await asyncio.gather(first.wait_idle(), second.wait_idle())
                await second.run_once()
                await second.wait_idle()
        ticks = [tick for _, tick in runs]
        assert len(ticks) == 6
        assert ticks == sorted(set(ticks))

    async def test_two_processes_never_give_two_jobs_one_id(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The second process draws the id the first one's job has (it has not read that
        job yet): it draws again, and each chat keeps its own job."""
        url = f"sqlite:///{tmp_path / 'chatlane.db'}"
        drawn = iter(["abc123", "abc123", "def456"])
        draws = types.SimpleNamespace(token_hex=lambda _: next(drawn))
        monkeypatch.setattr("chatlane.scheduling.loop.secrets", draws)
        first, second = Scheduler(now=FakeClock()), Scheduler(now=FakeClock())
        async with (
            GatewayHarness(EchoAgent(), store=url) as a,
            GatewayHarness(EchoAgent(), store=url) as b,
        ):
            a.gateway.use_scheduler(first)
            b.gateway.use_scheduler(second)
            alice = await first.add_job("every 1m", "for alice", "test:alice")
            bob = await second.add_job("every 1m", "for bob", "test:bob")
            await first.sync()
            await second.sync()
            jobs = {job.id: job.prompt for job in first.list_jobs()}
            assert jobs == {job.id: job.prompt for job in second.list_jobs()}
        assert (alice.id, bob.id) == ("abc123", "def456")
        assert jobs == {"abc123": "for alice", "def456": "for bob"}

    async def test_a_job_stored_again_under_its_id_is_scheduled_anew(self, tmp_path: Path) -> None:
        url = f"sqlite:///{tmp_path / 'chatlane.db'}"
        scheduler = Scheduler(now=FakeClock())
        async with GatewayHarness(EchoAgent(), store=url) as h:
            h.gateway.use_scheduler(scheduler)
            job = await scheduler.add_job("every 1m", "old", "test:c")
            await scheduler.book.save(dataclasses.replace(job, prompt="new"))
            await scheduler.sync()
            assert [j.prompt for j in scheduler.list_jobs()] == ["new"]

    async def test_a_job_whose_save_answer_was_lost_is_added_once(self) -> None:
        """The save applied and its answer was lost: the job is there, and ``add_job`` says
        so instead of failing (``/cron add`` would say it failed for a job that runs)."""
        store = LosingAnswers(first_of("set_persistent"))
        scheduler = Scheduler(now=FakeClock())
        async with GatewayHarness(EchoAgent(), store=store) as h:
            h.gateway.use_scheduler(scheduler)
            job = await scheduler.add_job("every 1m", "ping", "test:c")
            await scheduler.sync()
        assert store.refused["set_persistent"] == 1
        assert [j.id for j in scheduler.list_jobs()] == [job.id]

    async def test_a_job_whose_save_was_refused_is_not_added(self) -> None:
        store = Refusing(first_of("set_persistent"))
        scheduler = Scheduler(now=FakeClock())
        async with GatewayHarness(EchoAgent(), store=store) as h:
            h.gateway.use_scheduler(scheduler)
            with pytest.raises(StoreError):
                await scheduler.add_job("every 1m", "ping", "test:c")
            await scheduler.sync()
        assert scheduler.list_jobs() == []


class TestWiring:
    def test_one_gateway_per_scheduler(self) -> None:
        scheduler = Scheduler()
        Gateway(EchoAgent(), _drop, scheduler=scheduler)
        with pytest.raises(RuntimeError, match="another gateway"):
            Gateway(EchoAgent(), _drop, scheduler=scheduler)

    def test_a_router_without_cron_stays_without(self) -> None:
        gateway = Gateway(EchoAgent(), _drop, router=CommandRouter(), scheduler=Scheduler())
        assert gateway.router.get("cron") is None
        default = Gateway(EchoAgent(), _drop, scheduler=Scheduler())
        assert default.router.get("cron") not in (None, CRON_COMMAND)

    async def test_unattached(self) -> None:
        assert Scheduler().list_jobs() == []
        with pytest.raises(RuntimeError, match="attach"):
            await Scheduler().add_job("@daily", "hi")

    async def test_gateway_starts_and_stops_it(self) -> None:
        clock = FakeClock()
        delivered: list[str] = []
        arrived = asyncio.Event()

        async def deliver(outbound: Outbound) -> None:
            delivered.append(outbound.text)
            arrived.set()

        scheduler = Scheduler(
            SchedulerSettings(period=0.02), jobs=[Job("every 10s", "hi", "test:c")], now=clock
        )
        gateway = Gateway(EchoAgent(), deliver, scheduler=scheduler)
        await gateway.start()
        clock.advance(10)
        await asyncio.wait_for(arrived.wait(), 2)
        assert delivered == ["echo: hi"]
        await gateway.aclose()
        clock.advance(10)  # the next tick is due, but no loop is left to see it
        assert [t for t in asyncio.all_tasks() if t.get_name() == "chatlane-scheduler"] == []
        assert delivered == ["echo: hi"]


async def _drop(outbound: Outbound) -> None:
    return None


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("chatlane.scheduler", "chatlane.scheduling.loop"),
        ("chatlane.cron", "chatlane.scheduling.cron"),
        ("chatlane.autoreset", "chatlane.scheduling.autoreset"),
        ("chatlane.cron_chat", "chatlane.scheduling.chat"),
        ("chatlane.scheduling_config", "chatlane.scheduling.settings"),
    ],
)
def test_the_old_module_names_export_the_same_objects(old: str, new: str) -> None:
    before, after = importlib.import_module(old), importlib.import_module(new)
    for name in before.__all__:
        assert getattr(before, name) is getattr(after, name), name


class TestSilentFilter:
    """The scheduler's outbound filter: what it holds back, and which replies count as talk."""

    @staticmethod
    def outbound(kind: OutboundKind, text: str, *ids: str, key: str = "k") -> Outbound:
        return Outbound(kind, SessionKey(key), Target("web", "c"), text, 1, ids)

    def test_holds_back_and_notes_exactly_what_the_rules_say(self) -> None:
        noted: list[Outbound] = []
        keep = silent_filter("ns:cron:local:", noted.append)
        person, job, done = "m1", f"{CRON_ID}j", f"{DONE_ID}d"
        cases = [
            (self.outbound(OutboundKind.REPLY, "hi", person), True, True),
            (self.outbound(OutboundKind.CHUNK, "h", person), True, False),
            (self.outbound(OutboundKind.NOTICE, "busy", person), True, False),
            (self.outbound(OutboundKind.REPLY, " [SILENT] ", job), False, False),
            (self.outbound(OutboundKind.REPLY, "[SILENT]", done), False, False),
            (self.outbound(OutboundKind.REPLY, "[SILENT]", person), True, True),
            (self.outbound(OutboundKind.REPLY, "result", job), True, False),
            (self.outbound(OutboundKind.CHUNK, "res", job), False, False),
            (self.outbound(OutboundKind.REPLY, "[SILENT]", job, done), False, False),
            (self.outbound(OutboundKind.REPLY, "both", job, person), True, True),
            (self.outbound(OutboundKind.REPLY, "hi", person, key="ns:cron:local:x"), False, False),
            (self.outbound(OutboundKind.REPLY, "none"), True, True),
        ]
        for outbound, kept, talk in cases:
            noted.clear()
            assert keep(outbound) is kept, outbound
            assert noted == ([outbound] if talk else []), outbound
