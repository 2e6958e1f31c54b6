"""Background upkeep: fence checks between renewals, and what a failing check does."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import msgspec
import pytest

from chatlane.context import bind_session, get_session_env
from chatlane.errors import StoreError
from chatlane.gateway import Gateway, GatewaySettings
from chatlane.identity import SessionSource
from chatlane.runtime.ending import TurnEnd
from chatlane.runtime.engine import TurnEngine
from chatlane.runtime.leases import LeaseSettings
from chatlane.runtime.settings import RuntimeSettings
from chatlane.runtime.slots import Slots
from chatlane.runtime.turn import Turn
from chatlane.stores import Admission, Lease, MemoryStore, Taken
from chatlane.testing import GatewayHarness
from chatlane.types import InboundMessage, Outbound, OutboundKind, SessionKey
from tests.adapters.test_api import eventually
from tests.keys import chat_key
from tests.runtime.agents import EchoAgent, Recorder


class FlakyReads(MemoryStore):
    """A memory store whose generation reads fail while ``failing`` is set."""

    failing = False

    async def generation(self, key: SessionKey) -> int:
        if self.failing:
            raise StoreError("read failed")
        return await super().generation(key)


async def test_a_failed_fence_check_is_logged_and_changes_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = FlakyReads()
    often = LeaseSettings(fence_check=0.02)
    finish = asyncio.Event()
    runs: list[int] = []

    async def agent(turn: Turn) -> str:
        runs.append(turn.generation)
        await finish.wait()
        return "finished"

    async with GatewayHarness(agent, store=store, leases=often) as h:
        await h.send("go", chat_id="c")
        await h.until_running(chat_id="c")
        with caplog.at_level(logging.WARNING, logger="chatlane.runtime"):
            store.failing = True
            await eventually(lambda: "fence check failed: read failed" in caplog.text)
            store.failing = False
        finish.set()
        assert await h.replies(chat_id="c", count=1) == ["finished"]
        assert runs == [1]  # not fenced: it ran once
        assert h.gateway.engine.metrics.lease_failures == 0


async def test_a_bump_in_the_store_fences_the_running_turn_at_once_and_its_message_reruns() -> None:
    store = MemoryStore()
    recorder = Recorder()
    often = LeaseSettings(fence_check=0.02)
    async with GatewayHarness(EchoAgent(recorder), store=store, leases=often) as h:
        started = await h.send("sleep 10", chat_id="c")
        await h.until_running(chat_id="c")
        bumped = await store.bump_generation(started.session_key)
        turns = recorder.turns[started.session_key]
        await asyncio.wait_for(turns[0].interrupted.wait(), 1)
        await eventually(lambda: len(turns) == 2)  # lost, not stopped: still queued, it reruns
        assert turns[1].generation > bumped > turns[0].generation
        assert h.delivered(chat_id="c") == []
        assert h.gateway.engine.metrics.lease_failures == 1


class UnreachableOnRenew(MemoryStore):
    """Renewals fail as if the store were down; a persistent read would never return."""

    down = False

    async def renew(self, lease: Lease, ttl: float) -> Lease:
        if self.down:
            raise StoreError("connection refused")
        return await super().renew(lease, ttl)

    async def load_persistent(self, key: SessionKey) -> dict[str, Any]:
        if self.down:
            await asyncio.Event().wait()
        return await super().load_persistent(key)


async def test_a_renewal_the_store_cannot_answer_fences_the_turn_without_asking_again() -> None:
    store = UnreachableOnRenew()
    recorder = Recorder()
    fast = LeaseSettings(ttl=0.3, fence_check=0)
    async with GatewayHarness(EchoAgent(recorder), store=store, leases=fast) as h:
        started = await h.send("sleep 10", chat_id="c")
        await h.until_running(chat_id="c")
        store.down = True
        (turn,) = recorder.turns[started.session_key]
        await asyncio.wait_for(turn.interrupted.wait(), 1)
        assert turn.ended_by is TurnEnd.LEASE_LOST
        store.down = False


async def test_background_loops_never_keep_the_context_of_whoever_started_them() -> None:
    seen: list[tuple[OutboundKind, str]] = []
    evicted = asyncio.Event()

    async def deliver(outbound: Outbound) -> None:
        seen.append((outbound.kind, get_session_env("CHATLANE_SESSION_CHAT_ID")))
        if outbound.kind is OutboundKind.NOTICE:
            evicted.set()

    async def agent(turn: Turn) -> str:
        if turn.text == "hang":
            await asyncio.Event().wait()
        return "ok"

    settings = GatewaySettings(runtime=RuntimeSettings(turn_timeout=0.3))
    gateway = Gateway(agent, deliver, settings=settings)
    try:
        with bind_session(SessionSource("web", chat_id="OTHER"), session_key="k"):
            await gateway.dispatch(InboundMessage(SessionSource("web", chat_id="A"), "hi"))
        await gateway.dispatch(InboundMessage(SessionSource("web", chat_id="C"), "hang"))
        await asyncio.wait_for(evicted.wait(), 5)
    finally:
        await gateway.aclose()
    assert seen == [(OutboundKind.REPLY, "A"), (OutboundKind.NOTICE, "C")]
    assert all(chat != "OTHER" for _, chat in seen), seen


class WatchedSlots:
    """Records which chat the lease loop sees bound each time it looks for held leases."""

    def __init__(self, slots: Slots) -> None:
        self.seen: list[str] = []
        self.looked_thrice = asyncio.Event()
        self._holding = slots.holding

    def holding(self) -> list[Turn]:
        self.seen.append(get_session_env("CHATLANE_SESSION_CHAT_ID"))
        if len(self.seen) >= 3:
            self.looked_thrice.set()
        return self._holding()


async def test_the_lease_loop_runs_with_no_session_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    async def deliver(outbound: Outbound) -> None:
        pass

    settings = RuntimeSettings(leases=LeaseSettings(ttl=0.15, fence_check=0))
    engine = TurnEngine(EchoAgent(), deliver, settings=settings)
    watched = WatchedSlots(engine.slots)
    monkeypatch.setattr(engine.slots, "holding", watched.holding)
    source = SessionSource("web", chat_id="OTHER")
    try:
        with bind_session(source, session_key="k"):  # whoever starts the loops
            await engine.submit(chat_key("k"), InboundMessage(source, "sleep 0.3"))
        await asyncio.wait_for(watched.looked_thrice.wait(), 5)
    finally:
        await engine.aclose()
    assert set(watched.seen) == {""}


class RenewalsAnswerLate(MemoryStore):
    """Each renewal is answered only once its lease was released: the race, every time.

    Its leases last a minute whatever the engine asks, so none can expire on a
    loaded machine: a renewal that fails here can only have raced a release.
    """

    def __init__(self) -> None:
        super().__init__()
        self.released: dict[str, asyncio.Event] = {}

    async def acquire(self, key: SessionKey, holder: str, ttl: float, **options: Any) -> Lease:
        lease = await super().acquire(key, holder, 60.0, **options)
        self.released[key] = asyncio.Event()
        return lease

    async def enqueue_and_acquire(
        self,
        key: SessionKey,
        message_id: str,
        owner: str,
        payload: bytes,
        ttl: float,
        **options: Any,
    ) -> Admission:
        """Leases long enough to outlast their late renewals: no lease is about to expire."""
        admission = await super().enqueue_and_acquire(
            key, message_id, owner, payload, 60.0, **options
        )
        self.released[key] = asyncio.Event()
        return admission

    async def acquire_and_read(
        self, key: SessionKey, holder: str, ttl: float, **options: Any
    ) -> Taken:
        taken = await super().acquire_and_read(key, holder, 60.0, **options)
        self.released[key] = asyncio.Event()
        return taken

    async def release(self, lease: Lease) -> None:
        await super().release(lease)
        self.released[lease.key].set()

    async def renew(self, lease: Lease, ttl: float) -> Lease:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.released[lease.key].wait(), 5)
        return await super().renew(lease, 60.0)


async def test_renewals_racing_releases_are_not_lost_leases(
    caplog: pytest.LogCaptureFixture,
) -> None:
    often = LeaseSettings(ttl=0.2, fence_check=0)  # a renewal every 20 ms
    caplog.set_level(logging.WARNING, logger="chatlane.runtime")
    async with GatewayHarness(EchoAgent(), store=RenewalsAnswerLate(), leases=often) as h:
        for round_ in range(20):
            sends = (h.send(f"sleep 0.0{round_ % 5}", chat_id=f"c{i}") for i in range(20))
            await asyncio.gather(*sends)
            await h.settle()
        assert h.gateway.engine.metrics.lease_failures == 0
        assert h.gateway.engine.metrics.turns_finished["answered"] == 400
    assert "lease lost" not in caplog.text  # the WARNING means a real loss


async def test_a_renewal_the_store_refuses_is_one_warning_and_one_failure(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = MemoryStore()
    recorder = Recorder()
    fast = LeaseSettings(ttl=0.3, fence_check=0)
    caplog.set_level(logging.WARNING, logger="chatlane.runtime")
    async with GatewayHarness(EchoAgent(recorder), store=store, leases=fast) as h:
        started = await h.send("sleep 10", chat_id="c")
        turn = await asyncio.wait_for(_running(recorder, started.session_key), 5)
        lease = turn.lease
        assert lease is not None
        await store.release(lease)  # another process's doing, say: the lease is gone
        await asyncio.wait_for(turn.interrupted.wait(), 5)
        assert h.gateway.engine.metrics.lease_failures == 1
    assert caplog.text.count("lease lost") == 1


async def _running(recorder: Recorder, key: SessionKey) -> Turn:
    await eventually(lambda: bool(recorder.turns.get(key)))
    return recorder.turns[key][0]


class SlowToWindDown:
    """Runs until cancelled, then winds down only once the test lets it: a turn whose end
    takes a while (its settling waits on a loaded store, say) while it still holds its lease.
    Its message's next turn answers at once."""

    def __init__(self) -> None:
        self.turns: list[Turn] = []
        self.running = asyncio.Event()
        self.cancelled = asyncio.Event()
        self.let_go = asyncio.Event()

    async def __call__(self, turn: Turn) -> str:
        self.turns.append(turn)
        if len(self.turns) > 1:
            return "run again"
        self.running.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            await self.let_go.wait()
            raise
        return "never"


async def test_a_turn_given_up_for_its_expiring_lease_is_given_up_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    agent = SlowToWindDown()
    quiet = LeaseSettings(ttl=60, fence_check=0)  # no pass of the loops finds it expiring
    caplog.set_level(logging.INFO, logger="chatlane.runtime")
    async with GatewayHarness(agent, leases=quiet) as h:
        await h.send("hello", chat_id="c")
        await agent.running.wait()
        [turn] = agent.turns
        assert turn.lease is not None
        # the expiry pass came late (an overloaded loop): the lease ran out here meanwhile
        turn.renewed(msgspec.structs.replace(turn.lease, expires_at=time.time() - 1))
        upkeep = h.gateway.engine.upkeep
        assert await upkeep.give_up_expiring() == 1
        await agent.cancelled.wait()  # cancelled, and still winding down with its lease
        assert await upkeep.give_up_expiring() == 0
        assert await upkeep.give_up_expiring() == 0
        await upkeep.lease_lost(turn, "its lease could not be renewed", fenced=True)
        assert h.gateway.engine.metrics.lease_failures == 1
        agent.let_go.set()
        assert await h.replies(chat_id="c", count=1) == ["run again"]  # its message, once more
    logged = [record.getMessage() for record in caplog.records]
    assert [m for m in logged if m.startswith("lease lost")] == [f"lease lost: {EXPIRING}"]
    assert [m for m in logged if m.startswith("turn superseded")] == [
        f"turn superseded (lease lost: {EXPIRING})"
    ]


EXPIRING = "its lease is about to expire unrenewed"
