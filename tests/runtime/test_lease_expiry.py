"""A turn never runs past its lease on this host's clock: one turn per session across hosts.

A host cut off from its store never hears back from a renewal; another host
may take the session once the lease expires in the store. The turn must be
stopped before that on its own clock, not when the renewal finally fails. A
lease whose grant reached this host too late (the reply was held up in the
network) never runs an agent at all.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import msgspec

from chatlane.runtime import slots as slots_module
from chatlane.runtime.ending import TurnEnd
from chatlane.runtime.settings import LeaseSettings
from chatlane.runtime.turn import Turn
from chatlane.runtime.upkeep import expiry_margin
from chatlane.stores import MemoryStore
from chatlane.stores.base import Admission, Lease
from chatlane.testing import GatewayHarness
from chatlane.types import SessionKey
from tests.runtime.agents import EchoAgent
from tests.runtime.refusing import Refusing, first_of

SHORT = LeaseSettings(ttl=1.0, fence_check=0.0)


class CutOff(MemoryStore):
    """A store whose renewals and heartbeats never answer while ``cut`` (a network cut)."""

    def __init__(self) -> None:
        super().__init__()
        self.cut = False
        self.hanging = 0
        """Renewals sent during the cut, still waiting for an answer."""

    async def renew_many(self, leases: Sequence[Lease], ttl: float) -> list[Lease | None]:
        if self.cut:
            self.hanging += 1
            await asyncio.Event().wait()  # the answer never comes
        return await super().renew_many(leases, ttl)

    async def heartbeat(self, holder: str, ttl: float) -> None:
        if self.cut:
            await asyncio.Event().wait()
        await super().heartbeat(holder, ttl)


class Stuck:
    """Runs until cancelled the first time, recording when; answers at once after that."""

    def __init__(self, store: CutOff) -> None:
        self.store = store
        self.running = asyncio.Event()
        self.cancelled = asyncio.Event()
        self.hanging_when_cancelled = -1
        self.runs = 0

    async def __call__(self, turn: Turn) -> str:
        self.runs += 1
        if self.runs > 1:
            return "answered on a fresh lease"
        self.running.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.hanging_when_cancelled = self.store.hanging
            self.cancelled.set()
            self.store.cut = False  # the network comes back for the next turn
            raise
        return "never"


async def test_a_turn_cut_off_from_its_store_stops_before_its_lease_expires() -> None:
    store = CutOff()
    agent = Stuck(store)
    async with GatewayHarness(agent, store=store, leases=SHORT) as h:
        await h.send("hello", chat_id="c")
        await agent.running.wait()
        store.cut = True
        async with asyncio.timeout(30):
            await agent.cancelled.wait()
        assert agent.hanging_when_cancelled >= 1  # stopped without the store's word
        assert await h.replies(chat_id="c", count=1) == ["answered on a fresh lease"]
    assert expiry_margin(SHORT) < SHORT.ttl


class LateGrant(MemoryStore):
    """A store whose first lease reaches the gateway only as it is about to expire."""

    def __init__(self) -> None:
        super().__init__()
        self.late: list[int] = []

    async def enqueue_and_acquire(self, key: SessionKey, *args: Any, **kwargs: Any) -> Admission:
        admission = await super().enqueue_and_acquire(key, *args, **kwargs)
        if admission.lease is None or self.late:
            return admission
        self.late.append(admission.lease.generation)
        late = msgspec.structs.replace(admission.lease, expires_at=time.time() + 0.01)
        return msgspec.structs.replace(admission, lease=late)


async def test_a_lease_that_arrives_about_to_expire_runs_no_agent() -> None:
    store = LateGrant()
    leases: list[tuple[int, float]] = []

    async def agent(turn: Turn) -> str:
        assert turn.lease is not None
        leases.append((turn.generation, turn.lease.expires_at - time.time()))
        return "ran once"

    async with GatewayHarness(agent, store=store, leases=SHORT) as h:
        await h.send("hello", chat_id="c")
        assert await h.replies(chat_id="c", count=1) == ["ran once"]
    assert store.late  # the late grant was given
    [(generation, left)] = leases
    assert generation not in store.late  # the agent ran only under a later lease
    assert left > expiry_margin(SHORT)


async def test_a_lease_the_store_could_not_take_back_is_given_back_once_it_answers() -> None:
    """Giving back a stopped turn's lease is retried through the outage: the
    session's next turn runs at once, not after the lease's TTL (an hour here)."""
    store = Refusing(first_of("release"))
    async with GatewayHarness(EchoAgent(), store=store, leases=LeaseSettings(ttl=3600)) as h:
        await h.send("sleep 30", chat_id="c")
        await h.until_running(chat_id="c")
        await h.send("/stop", chat_id="c")
        await h.send("hi", chat_id="c")
        await h.wait_for(lambda outbox: any(o.text == "echo: hi" for o in outbox))
        await h.settle()
        assert (store.refused["release"], await store.active_sessions()) == (1, 0)


class AnswersLate(MemoryStore):
    """Applies a turn's commit at once, then holds its answer until ``answer_sent`` is set,
    as a store under a burst of commits answers late."""

    def __init__(self) -> None:
        super().__init__()
        self.committed = asyncio.Event()
        self.answer_sent = asyncio.Event()

    async def commit_and_release(self, lease: Lease, batch: Any) -> Any:
        result = await super().commit_and_release(lease, batch)
        self.committed.set()
        await self.answer_sent.wait()
        return result


async def test_a_turn_given_up_while_its_commit_is_in_flight_still_delivers_it() -> None:
    """The store holds the answer: were the turn cancelled then, it would never be sent."""
    store = AnswersLate()
    async with GatewayHarness(EchoAgent(), store=store) as h:
        await h.send("hello", chat_id="c")
        await store.committed.wait()
        turn = h.gateway.engine.running_turn(h.session_key(chat_id="c"))
        assert turn is not None
        slots = h.gateway.engine.slots
        slots.supersede(turn, TurnEnd.LEASE_LOST, "its lease is about to expire", grace=0.0)
        slots_module._cancel(turn)  # what the grace's timer does when it runs out
        store.answer_sent.set()
        await h.wait_for(lambda out: any(o.text == "echo: hello" for o in out))
    assert await store.answer(h.outcomes[0].message_id) == "echo: hello"
