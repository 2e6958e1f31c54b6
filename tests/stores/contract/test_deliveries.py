"""The contract of :class:`~chatlane.stores.protocols.Deliveries`, over every backend.

Tests that let time pass use the ``clock`` fixture (real waits on Redis and
PostgreSQL, so TTLs and delays here stay short).
"""

from __future__ import annotations

import asyncio

import pytest

from chatlane.errors import StaleGeneration
from chatlane.runtime.limits import MAX_COUNT, MAX_SECONDS
from chatlane.stores import (
    Delivery,
    DeliveryDraft,
    Settlement,
    SettlementKind,
    Store,
    WriteBatch,
)
from chatlane.stores.base import DEAD, DELIVERED, PENDING
from tests.stores.conftest import Reopen, StoreClock
from tests.stores.contract.common import KEY, entry

LANE = "telegram"
ODD = ["a:b:c", "k{with}braces", "spaces and\nnewline", "ключ🙂", "x" * 300, '["tg","-1",""]']
"""Lanes and targets with separators, braces, whitespace, non-ASCII, length and JSON."""


def draft(delivery_id: str, target: str = "chat-1", lane: str = LANE) -> DeliveryDraft:
    return DeliveryDraft(delivery_id, lane, target, f"payload of {delivery_id}".encode())


async def claim(
    store: Store, holder: str = "p1", ttl: float = 5, limit: int = 10
) -> list[Delivery]:
    return await store.claim_deliveries([LANE], holder, ttl, limit)


def ids(deliveries: list[Delivery]) -> list[str]:
    return [delivery.id for delivery in deliveries]


def settle(delivery: Delivery, kind: SettlementKind, **fields: object) -> Settlement:
    return Settlement(delivery.id, delivery.claim, kind, **fields)  # type: ignore[arg-type]


class TestRecordAndClaim:
    async def test_a_claim_takes_each_targets_oldest_oldest_first(self, store: Store) -> None:
        await store.record_deliveries([draft("a1", "A"), draft("b1", "B"), draft("a2", "A")])
        await store.record_deliveries([draft("c1", "C")])
        claimed = await claim(store)
        assert ids(claimed) == ["a1", "b1", "c1"]
        first = claimed[0]
        assert (first.lane, first.target, first.payload) == (LANE, "A", b"payload of a1")
        assert (first.state, first.attempts, first.holder, first.uncertain) == (
            PENDING,
            0,
            "p1",
            False,
        )
        assert first.claim
        assert len({d.claim for d in claimed}) == 3
        assert first.seq < claimed[1].seq < claimed[2].seq
        assert first.created_at > 0

    async def test_a_claim_takes_no_more_than_its_limit(self, store: Store) -> None:
        await store.record_deliveries([draft(f"d{n}", f"T{n}") for n in range(5)])
        assert ids(await claim(store, limit=2)) == ["d0", "d1"]
        assert ids(await claim(store, limit=10)) == ["d2", "d3", "d4"]
        assert await claim(store) == []

    async def test_the_largest_settings_are_held(self, store: Store) -> None:
        """A claim as long and a batch as large as a setting may make them."""
        await store.record_deliveries([draft("d1", "A")])
        [claimed] = await claim(store, ttl=MAX_SECONDS, limit=MAX_COUNT)
        assert claimed.id == "d1"
        assert await claim(store, ttl=MAX_SECONDS, limit=MAX_COUNT) == []

    async def test_a_claim_takes_only_its_lanes(self, store: Store) -> None:
        await store.record_deliveries([draft("t", "A"), draft("w", "B", lane="web:B")])
        assert ids(await store.claim_deliveries(["web:B"], "p1", 5, 10)) == ["w"]
        assert ids(await store.claim_deliveries(["web:X"], "p1", 5, 10)) == []
        assert ids(await claim(store)) == ["t"]

    async def test_a_lane_named_twice_is_claimed_once(self, store: Store) -> None:
        await store.record_deliveries([draft("a1", "A"), draft("b1", "B")])
        claimed = await store.claim_deliveries([LANE, LANE], "p1", 5, 10)
        assert ids(claimed) == ["a1", "b1"]

    async def test_recording_is_idempotent_per_id(self, store: Store) -> None:
        await store.record_deliveries([draft("a1")])
        await store.record_deliveries([draft("a1"), DeliveryDraft("a1", LANE, "other", b"x")])
        [only] = await store.deliveries(PENDING)
        assert (only.id, only.target, only.payload) == ("a1", "chat-1", b"payload of a1")

    @pytest.mark.parametrize("odd", ODD)
    async def test_odd_lanes_and_targets_stay_their_own(self, store: Store, odd: str) -> None:
        await store.record_deliveries([draft("odd", odd, lane=odd), draft("plain", "chat-1")])
        [claimed] = await store.claim_deliveries([odd], "p1", 5, 10)
        assert (claimed.id, claimed.lane, claimed.target) == ("odd", odd, odd)
        assert ids(await claim(store)) == ["plain"]


class TestOrderPerTarget:
    async def test_a_later_delivery_waits_for_the_earlier(self, store: Store) -> None:
        await store.record_deliveries([draft("a1"), draft("a2")])
        [first] = await claim(store)
        assert await claim(store) == []
        assert await store.settle_deliveries([settle(first, SettlementKind.DELIVERED)]) == [True]
        assert ids(await claim(store)) == ["a2"]

    async def test_a_retried_delivery_still_goes_first(
        self, store: Store, clock: StoreClock
    ) -> None:
        await store.record_deliveries([draft("a1"), draft("a2")])
        [first] = await claim(store)
        await store.settle_deliveries([settle(first, SettlementKind.RETRY, delay=0.2)])
        assert await claim(store) == []  # a1 waits out its delay, and a2 waits for a1
        await clock.advance(0.3)
        again = await claim(store)
        assert ids(again) == ["a1"]
        assert again[0].attempts == 1

    async def test_a_dead_delivery_no_longer_blocks_its_target(self, store: Store) -> None:
        await store.record_deliveries([draft("a1"), draft("a2")])
        [first] = await claim(store)
        await store.settle_deliveries([settle(first, SettlementKind.DEAD, reason="chat not found")])
        assert ids(await claim(store)) == ["a2"]


class TestClaims:
    async def test_a_live_claim_is_never_handed_out_twice(
        self, store: Store, reopen: Reopen
    ) -> None:
        other = await reopen()
        await store.record_deliveries([draft(f"d{n}", f"T{n % 7}") for n in range(40)])
        handed: list[str] = []
        for _ in range(8):
            claimers = enumerate([store, other] * 3)
            rounds = await asyncio.gather(
                *(s.claim_deliveries([LANE], f"h{i}", 30, 3) for i, s in claimers)
            )
            batch = [d for claimed in rounds for d in claimed]
            handed += ids(batch)
            assert len({d.target for d in batch}) == len(batch)  # one per target at a time
            settled = await store.settle_deliveries(
                [settle(d, SettlementKind.DELIVERED) for d in batch]
            )
            assert all(settled)
        assert sorted(handed) == sorted(f"d{n}" for n in range(40))

    async def test_an_expired_claim_is_claimed_again_as_uncertain(
        self, store: Store, clock: StoreClock
    ) -> None:
        await store.record_deliveries([draft("a1")])
        [first] = await claim(store, ttl=0.2)
        await clock.advance(0.3)
        [again] = await claim(store, holder="p2")
        assert (again.id, again.holder, again.uncertain, again.attempts) == ("a1", "p2", True, 0)
        assert again.claim != first.claim
        assert await store.settle_deliveries([settle(first, SettlementKind.DELIVERED)]) == [False]
        assert await store.settle_deliveries([settle(again, SettlementKind.DELIVERED)]) == [True]

    async def test_a_late_settle_applies_while_nobody_claimed_again(
        self, store: Store, clock: StoreClock
    ) -> None:
        await store.record_deliveries([draft("a1")])
        [first] = await claim(store, ttl=0.2)
        await clock.advance(0.3)
        assert await store.settle_deliveries([settle(first, SettlementKind.DELIVERED)]) == [True]
        assert await claim(store) == []

    async def test_a_claim_settles_once(self, store: Store) -> None:
        await store.record_deliveries([draft("a1"), draft("b1", "B")])
        first, second = await claim(store)
        results = await store.settle_deliveries(
            [
                settle(first, SettlementKind.DELIVERED),
                settle(first, SettlementKind.DEAD, reason="again"),
                Settlement(second.id, "not-its-token", SettlementKind.DELIVERED),
                Settlement("never-recorded", second.claim, SettlementKind.DELIVERED),
            ]
        )
        assert results == [True, False, False, False]
        assert (await store.delivery("a1")).state == DELIVERED  # type: ignore[union-attr]
        assert (await store.delivery("b1")).state == PENDING  # type: ignore[union-attr]


class TestSettlements:
    async def test_delivered_is_kept_as_delivered(self, store: Store) -> None:
        await store.record_deliveries([draft("a1")])
        [first] = await claim(store)
        await store.settle_deliveries([settle(first, SettlementKind.DELIVERED)])
        done = await store.delivery("a1")
        assert done is not None
        assert (done.state, done.claim) == (DELIVERED, "")
        assert done.settled_at >= done.created_at
        assert ids(await store.deliveries(DELIVERED)) == ["a1"]
        assert await store.deliveries(PENDING) == []

    async def test_a_retry_spends_an_attempt_and_remembers_why(
        self, store: Store, clock: StoreClock
    ) -> None:
        await store.record_deliveries([draft("a1")])
        [first] = await claim(store)
        await store.settle_deliveries(
            [settle(first, SettlementKind.RETRY, delay=0.2, reason="timeout", maybe_sent=True)]
        )
        waiting = await store.delivery("a1")
        assert waiting is not None
        assert (waiting.state, waiting.attempts, waiting.claim) == (PENDING, 1, "")
        assert (waiting.reason, waiting.uncertain) == ("timeout", True)
        assert waiting.next_at > waiting.created_at
        await clock.advance(0.3)
        [again] = await claim(store)
        assert (again.attempts, again.uncertain) == (1, True)

    async def test_a_release_spends_no_attempt(self, store: Store) -> None:
        await store.record_deliveries([draft("a1")])
        [first] = await claim(store)
        await store.settle_deliveries([settle(first, SettlementKind.RELEASE, reason="down")])
        [again] = await claim(store)
        assert (again.attempts, again.uncertain, again.reason) == (0, False, "down")

    async def test_a_dead_delivery_is_listed_counted_and_retried(self, store: Store) -> None:
        await store.record_deliveries([draft("a1"), draft("b1", "B")])
        first, _ = await claim(store)
        await store.settle_deliveries([settle(first, SettlementKind.DEAD, reason="bot blocked")])
        [dead] = await store.deliveries(DEAD)
        assert (dead.id, dead.reason, dead.state) == ("a1", "bot blocked", DEAD)
        stats = await store.delivery_stats()
        assert (stats.pending, stats.dead) == (1, 1)
        assert stats.oldest_pending_at == (await store.delivery("b1")).created_at  # type: ignore[union-attr]
        assert await store.retry_dead("a1") is True
        assert await store.retry_dead("a1") is False  # pending now, not dead
        assert await store.retry_dead("b1") is False
        assert await store.retry_dead("unknown") is False
        [revived] = await claim(store)
        assert (revived.id, revived.state, revived.attempts) == ("a1", PENDING, 0)
        assert (await store.delivery_stats()).dead == 0

    async def test_a_dead_delivery_that_may_have_been_sent_is_redelivered_as_uncertain(
        self, store: Store
    ) -> None:
        """Part of it went out before the refusal (or an earlier attempt may have sent it):
        its redelivery is labelled. One that never reached the platform stays certain."""
        await store.record_deliveries([draft("a1", "A"), draft("b1", "B"), draft("c1", "C")])
        partly, unsent, earlier = await claim(store)
        await store.settle_deliveries(
            [
                settle(partly, SettlementKind.DEAD, reason="bot blocked", maybe_sent=True),
                settle(unsent, SettlementKind.DEAD, reason="chat not found"),
                settle(earlier, SettlementKind.RELEASE, maybe_sent=True),
            ]
        )
        [earlier] = await claim(store)
        await store.settle_deliveries([settle(earlier, SettlementKind.DEAD, reason="refused")])
        dead = {d.id: d.uncertain for d in await store.deliveries(DEAD)}
        assert dead == {"a1": True, "b1": False, "c1": True}
        for delivery_id in dead:
            assert await store.retry_dead(delivery_id)
        revived = {d.id: (d.uncertain, d.attempts) for d in await claim(store)}
        assert revived == {"a1": (True, 0), "b1": (False, 0), "c1": (True, 0)}

    async def test_stats_of_an_empty_ledger(self, store: Store) -> None:
        stats = await store.delivery_stats()
        assert (stats.pending, stats.oldest_pending_at, stats.dead) == (0, 0.0, 0)
        assert await store.delivery("nothing") is None


class TestWithTheCommit:
    async def test_a_commit_records_its_deliveries(self, store: Store) -> None:
        lease = await store.acquire(KEY, "p1", 5)
        batch = WriteBatch(transcript=[entry("hi", 1)], deliveries=[draft("r1"), draft("r2")])
        assert not batch.is_empty()
        assert await store.commit_and_release(lease, batch) is True
        assert ids(await store.deliveries(PENDING)) == ["r1", "r2"]

    async def test_a_stale_commit_records_nothing(self, store: Store) -> None:
        lease = await store.acquire(KEY, "p1", 5)
        await store.bump_generation(KEY)
        with pytest.raises(StaleGeneration):
            await store.commit(KEY, lease.generation, WriteBatch(deliveries=[draft("r1")]))
        assert await store.deliveries(PENDING) == []
        assert await store.delivery("r1") is None

    async def test_the_ledger_survives_a_restart(self, store: Store, reopen: Reopen) -> None:
        await store.record_deliveries([draft("a1"), draft("a2")])
        [first] = await claim(store)
        again = await reopen()
        assert await again.claim_deliveries([LANE], "p2", 5, 10) == []  # a1's claim is live
        await again.settle_deliveries([settle(first, SettlementKind.DELIVERED)])
        assert ids(await again.claim_deliveries([LANE], "p2", 5, 10)) == ["a2"]


class TestPruning:
    async def test_heartbeats_prune_settled_deliveries_after_their_retention(
        self, store: Store, clock: StoreClock
    ) -> None:
        store.delivered_retention = 0.1
        store.answered_retention = 0.1
        await store.record_deliveries([draft("a1"), draft("b1", "B"), draft("c1", "C")])
        a1, b1, _ = await claim(store)
        await store.settle_deliveries(
            [settle(a1, SettlementKind.DELIVERED), settle(b1, SettlementKind.DEAD, reason="x")]
        )
        await clock.advance(0.2)
        await store.heartbeat("p1", 5)
        assert await store.delivery("a1") is None
        assert await store.delivery("b1") is None
        assert (await store.delivery("c1")) is not None  # pending: never pruned
