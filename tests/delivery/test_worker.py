"""The delivery worker over a store, with a platform stand-in as its sender."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import types
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import pytest

from chatlane.delivery import DeliverySettings
from chatlane.delivery import worker as worker_module
from chatlane.gateway import Gateway
from chatlane.identity import SessionSource
from chatlane.stores import MemoryStore, Store
from chatlane.stores.base import DEAD, DELIVERED, PENDING, Delivery
from chatlane.types import InboundMessage, Outbound, OutboundKind
from tests.clock import Clock
from tests.delivery.platform import PlatformStandIn, permanent, rate_limited, transient
from tests.delivery.waits import eventually
from tests.runtime.agents import EchoAgent

FAST = DeliverySettings(
    poll_interval=0.05,
    first_retry=0.01,
    max_retry=0.05,
    unavailable_first=0.01,
    unavailable_max=0.05,
    claim_ttl=5.0,
    send_timeout=2.0,
)


class Rig:
    """A gateway whose ``chat`` platform sends through the ledger to a stand-in."""

    def __init__(self, store: Store, platform: PlatformStandIn, settings: DeliverySettings) -> None:
        self.store = store
        self.platform = platform
        self.direct: list[Outbound] = []
        self.gateway = Gateway(EchoAgent(), self._deliver, store=store)
        self.gateway.add_sender(platform, settings)

    async def _deliver(self, outbound: Outbound) -> None:
        self.direct.append(outbound)

    async def say(self, text: str, chat: str = "c1") -> str:
        source = SessionSource("chat", chat_id=chat, user_id=f"u-{chat}")
        message = InboundMessage(source, text)
        await self.gateway.dispatch(message)
        return message.id


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    made = Rig(MemoryStore(), PlatformStandIn(), FAST)
    await made.gateway.start()
    yield made
    await made.gateway.aclose()


def settled(store: Store, count: int = 1) -> Callable[[], Awaitable[bool]]:
    """Whether ``count`` deliveries were recorded and each is delivered or dead."""

    async def check() -> bool:
        stats = await store.delivery_stats()
        delivered = len(await store.deliveries(DELIVERED, limit=count + 1))
        return stats.pending == 0 and delivered + stats.dead == count

    return check


class TestTheLedgerPath:
    async def test_a_reply_goes_through_the_ledger_not_the_adapter(self, rig: Rig) -> None:
        await rig.say("hello")
        await rig.platform.until(lambda: len(rig.platform.accepted) == 1)
        assert rig.platform.texts("c1") == ["echo: hello"]
        assert [o.kind for o in rig.direct] == []  # nothing straight to the adapter
        await eventually(rig.gateway.delivery, settled(rig.store))
        [done] = await rig.store.deliveries(DELIVERED)
        assert done.id == rig.platform.accepted[0].delivery_id
        assert rig.gateway.engine.metrics.deliveries["delivered"] == 1

    async def test_a_sender_is_told_when_its_attempt_is_given_up(self, rig: Rig) -> None:
        """The deadline a sender keeps its rate-limit waits inside: ``send_timeout`` from
        the start of the send."""
        before = time.monotonic()
        await rig.say("one")
        await rig.platform.until(lambda: len(rig.platform.accepted) == 1)
        [attempt] = rig.platform.attempts
        assert (
            before + FAST.send_timeout <= attempt.deadline <= time.monotonic() + FAST.send_timeout
        )

    async def test_chunks_and_acks_stay_direct(self, rig: Rig) -> None:
        await rig.say("sleep 30")
        await rig.say("second")  # queued behind the running turn: an ack, sent directly
        assert [o.kind for o in rig.direct] == [OutboundKind.ACK]
        assert await rig.store.deliveries(PENDING) == []

    async def test_replies_to_one_chat_arrive_in_order(self, rig: Rig) -> None:
        rig.platform.failures.extend([transient(), transient()])
        for n in range(5):
            await rig.say(f"m{n}")
        await rig.platform.until(lambda: len(rig.platform.accepted) == 5)
        assert rig.platform.texts("c1") == [f"echo: m{n}" for n in range(5)]


class TestFailures:
    async def test_a_transient_failure_is_retried_with_an_attempt_spent(self, rig: Rig) -> None:
        rig.platform.failures.append(transient())
        await rig.say("hello")
        await rig.platform.until(lambda: len(rig.platform.accepted) == 1)
        assert [a.attempts for a in rig.platform.attempts] == [0, 1]
        assert rig.platform.accepted[0].labelled is False  # it never reached the platform

    async def test_a_send_that_may_have_happened_is_labelled_when_sent_again(
        self, rig: Rig
    ) -> None:
        rig.platform.failures.append(transient(maybe_sent=True))
        await rig.say("hello")
        await rig.platform.until(lambda: len(rig.platform.accepted) == 1)
        assert [a.uncertain for a in rig.platform.attempts] == [False, True]
        assert rig.platform.accepted[0].labelled is True

    async def test_a_permanent_failure_is_dead_lettered_with_its_reason(self, rig: Rig) -> None:
        rig.platform.failures.append(permanent())
        await rig.say("hello")
        await eventually(rig.gateway.delivery, settled(rig.store))
        [dead] = await rig.store.deliveries(DEAD)
        assert dead.reason == "bot blocked by the user"
        assert (await rig.store.delivery_stats()).dead == 1
        assert rig.gateway.engine.metrics.deliveries["dead"] == 1
        assert await rig.store.retry_dead(dead.id)
        await rig.platform.until(lambda: len(rig.platform.accepted) == 1)
        assert rig.platform.texts("c1") == ["echo: hello"]

    async def test_a_refusal_after_part_of_it_went_out_is_labelled_when_redelivered(
        self, rig: Rig
    ) -> None:
        rig.platform.failures.append(permanent(maybe_sent=True))
        await rig.say("hello")
        await eventually(rig.gateway.delivery, settled(rig.store))
        [dead] = await rig.store.deliveries(DEAD)
        assert dead.uncertain is True
        assert await rig.store.retry_dead(dead.id)
        await rig.platform.until(lambda: len(rig.platform.accepted) == 1)
        assert rig.platform.accepted[0].labelled is True

    async def test_a_dead_delivery_does_not_hold_up_the_chat(self, rig: Rig) -> None:
        rig.platform.failures.append(permanent())
        await rig.say("first")
        await rig.say("second")
        await rig.platform.until(lambda: len(rig.platform.accepted) == 1)
        assert rig.platform.texts("c1") == ["echo: second"]

    async def test_attempts_run_out(self) -> None:
        store, platform = MemoryStore(), PlatformStandIn()
        rig = Rig(store, platform, dataclasses.replace(FAST, max_attempts=3))
        platform.failures.extend([transient()] * 5)
        await rig.gateway.start()
        try:
            await rig.say("hello")
            await eventually(rig.gateway.delivery, settled(store))
        finally:
            await rig.gateway.aclose()
        [dead] = await store.deliveries(DEAD)
        assert dead.reason == "gave up after 3 attempts: timeout"
        assert len(platform.attempts) == 3

    async def test_a_last_attempt_that_may_have_sent_is_labelled_when_redelivered(self) -> None:
        store, platform = MemoryStore(), PlatformStandIn()
        rig = Rig(store, platform, dataclasses.replace(FAST, max_attempts=1))
        platform.failures.append(transient(maybe_sent=True))
        await rig.gateway.start()
        try:
            await rig.say("hello")
            await eventually(rig.gateway.delivery, settled(store))
            [dead] = await store.deliveries(DEAD)
            assert (dead.reason, dead.uncertain) == ("gave up after 1 attempts: timeout", True)
            assert await store.retry_dead(dead.id)
            await platform.until(lambda: len(platform.accepted) == 1)
        finally:
            await rig.gateway.aclose()
        assert platform.accepted[0].labelled is True

    async def test_a_rate_limit_is_waited_out_without_an_attempt(self, rig: Rig) -> None:
        rig.platform.failures.append(rate_limited(0.05))
        await rig.say("one")
        await rig.say("two")
        await rig.platform.until(lambda: len(rig.platform.accepted) == 2)
        assert rig.platform.texts("c1") == ["echo: one", "echo: two"]
        assert [a.attempts for a in rig.platform.attempts] == [0, 0, 0]

    async def test_no_attempt_is_spent_while_the_platform_is_down(self, rig: Rig) -> None:
        rig.platform.down = True
        await rig.say("one")
        await rig.say("two")
        await rig.platform.until(lambda: len(rig.platform.attempts) >= 6)
        assert {a.attempts for a in rig.platform.attempts} == {0}
        assert {a.delivery_id for a in rig.platform.attempts} == {
            rig.platform.attempts[0].delivery_id
        }  # the chat's first delivery, again and again: the second waits behind it
        rig.platform.down = False
        await rig.platform.until(lambda: len(rig.platform.accepted) == 2)
        assert rig.platform.texts("c1") == ["echo: one", "echo: two"]
        assert not any(a.labelled for a in rig.platform.accepted)

    async def test_nothing_is_claimed_while_the_sender_is_disconnected(self, rig: Rig) -> None:
        rig.platform.connected = False
        await rig.say("hello")
        await rig.gateway.engine.wait_idle()
        [waiting] = await rig.store.deliveries(PENDING)
        assert waiting.claim == ""
        assert rig.platform.attempts == []
        rig.platform.connected = True
        await rig.platform.until(lambda: len(rig.platform.accepted) == 1)
        assert rig.platform.attempts[0].attempts == 0


class TestProcesses:
    async def test_a_process_without_the_sender_records_and_another_delivers(self) -> None:
        store = MemoryStore()
        direct: list[Outbound] = []

        async def deliver(outbound: Outbound) -> None:
            direct.append(outbound)

        answering = Gateway(EchoAgent(), deliver, store=store)
        answering.ledger_for("chat", FAST)
        await answering.start()
        sending = Rig(store, PlatformStandIn(), FAST)
        await sending.gateway.start()
        try:
            message = InboundMessage(SessionSource("chat", chat_id="c1", user_id="u"), "hi")
            await answering.dispatch(message)
            await sending.platform.until(lambda: len(sending.platform.accepted) == 1)
        finally:
            await answering.aclose()
            await sending.gateway.aclose()
        assert sending.platform.texts("c1") == ["echo: hi"]
        assert direct == []

    async def test_a_sender_that_died_mid_send_is_followed_by_a_labelled_resend(self) -> None:
        store = MemoryStore()
        settings = dataclasses.replace(FAST, claim_ttl=0.3, send_timeout=0.2)
        first = Rig(store, PlatformStandIn(gate=asyncio.Event()), settings)
        await first.gateway.start()
        await first.say("hello")
        await first.platform.until(lambda: len(first.platform.attempts) == 1)
        first.gateway.delivery._task.cancel()  # type: ignore[union-attr]
        for task in list(first.gateway.delivery._in_flight):  # type: ignore[union-attr]
            task.cancel()  # dies mid-send: its claim is never settled
        second = Rig(store, PlatformStandIn(), settings)
        await second.gateway.start()
        try:
            await second.platform.until(lambda: len(second.platform.accepted) == 1)
        finally:
            await second.gateway.aclose()
        assert second.platform.accepted[0].labelled is True
        assert second.platform.texts("c1") == ["echo: hello"]

    async def test_a_claim_that_ran_short_before_its_send_is_released_unsent(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        clock = Clock()  # the worker's clock: it moves only when the store stalls
        monkeypatch.setattr(worker_module, "time", types.SimpleNamespace(monotonic=clock))
        store = _StallingStore(clock)  # the first claim comes back after its life is gone
        settings = dataclasses.replace(FAST, claim_ttl=0.3, send_timeout=0.2)
        rig = Rig(store, PlatformStandIn(), settings)
        await rig.gateway.start()
        try:
            await rig.say("hello")
            await rig.platform.until(lambda: len(rig.platform.accepted) == 1)
            await eventually(rig.gateway.delivery, settled(store))
        finally:
            await rig.gateway.aclose()
        assert store.stalled == 1
        [only] = rig.platform.attempts  # the stalled claim sent nothing: another process
        assert (only.attempts, only.uncertain) == (0, False)  # may hold it by then
        [done] = await store.deliveries(DELIVERED)
        assert done.reason == "its claim ran short before the send began"

    async def test_a_claim_answered_while_the_worker_closes_is_given_back_unsent(self) -> None:
        """Cut off mid-claim, the store would keep a claim nobody holds: the next process
        would wait out its life and label a reply that was never sent."""
        store = _HeldClaimStore()
        first = Rig(store, PlatformStandIn(), FAST)
        await first.gateway.start()
        worker = first.gateway.delivery
        assert worker is not None
        try:
            await first.say("hello")
            await store.claiming.wait()  # the store took the claim; its answer is held
            closing = asyncio.create_task(worker.aclose())
            store.go_on.set()  # the claim's answer resumes after aclose's first step (FIFO)
            await closing
            assert worker.closing
        finally:
            await first.gateway.aclose()
        [waiting] = await store.deliveries(PENDING)
        assert (waiting.claim, waiting.uncertain) == ("", False)
        second = Rig(store, PlatformStandIn(), FAST)
        await second.gateway.start()
        try:
            await second.platform.until(lambda: len(second.platform.accepted) == 1)
        finally:
            await second.gateway.aclose()
        assert second.platform.accepted[0].labelled is False
        assert first.platform.accepted == []

    async def test_many_chats_with_a_flaky_platform_lose_nothing(self) -> None:
        store, platform = MemoryStore(), PlatformStandIn(flaky=0.2)
        rig = Rig(store, platform, dataclasses.replace(FAST, max_attempts=50))
        await rig.gateway.start()
        try:
            chats = [f"c{n}" for n in range(40)]
            for round_ in range(5):
                await asyncio.gather(*(rig.say(f"{chat}-{round_}", chat) for chat in chats))
            await eventually(rig.gateway.delivery, settled(store, 200))
        finally:
            await rig.gateway.aclose()
        for chat in chats:
            wanted = [f"echo: {chat}-{n}" for n in range(5)]
            received = platform.texts(chat)
            assert _without_labelled_repeats(platform, chat) == wanted, received
        assert (await store.delivery_stats()).dead == 0


def _without_labelled_repeats(platform: PlatformStandIn, chat: str) -> list[str]:
    """What ``chat`` received, a labelled repeat of the message before it left out."""
    kept: list[str] = []
    for accepted in (a for a in platform.accepted if a.chat == chat):
        if accepted.labelled and kept and kept[-1] == accepted.text:
            continue
        kept.append(accepted.text)
    return kept


class _StallingStore(MemoryStore):
    """A store whose first claim of deliveries returns only after the claim's whole life
    has passed on ``clock``, as when the claiming process is starved of CPU or stopped."""

    def __init__(self, clock: Clock) -> None:
        super().__init__()
        self.clock = clock
        self.stalled = 0

    async def claim_deliveries(
        self, lanes: Sequence[str], holder: str, ttl: float, limit: int
    ) -> list[Delivery]:
        claimed = await super().claim_deliveries(lanes, holder, ttl, limit)
        if claimed and not self.stalled:
            self.stalled += 1
            self.clock.now += ttl
        return claimed


class _HeldClaimStore(MemoryStore):
    """A store whose first claim that takes something is applied at once, but answered only
    once :attr:`go_on` is set (:attr:`claiming` says it was taken)."""

    def __init__(self) -> None:
        super().__init__()
        self.claiming = asyncio.Event()
        self.go_on = asyncio.Event()

    async def claim_deliveries(
        self, lanes: Sequence[str], holder: str, ttl: float, limit: int
    ) -> list[Delivery]:
        claimed = await super().claim_deliveries(lanes, holder, ttl, limit)
        if claimed and not self.claiming.is_set():
            self.claiming.set()
            await self.go_on.wait()
        return claimed
