"""The contract of :class:`~chatlane.stores.protocols.Leases`, over every backend.

Tests that let time pass use the ``clock`` fixture: it moves the memory and
SQLite stores' clock at once, and waits for real with Redis, which reads its
server's ``TIME`` (so TTLs here stay short).
"""

from __future__ import annotations

import asyncio
import time

import pytest

from chatlane.errors import (
    ActiveSessionLimit,
    EarlierMessageFirst,
    LeaseError,
    LeaseLost,
    SessionBusy,
)
from chatlane.identity import SessionKey
from chatlane.runtime.limits import MAX_COUNT, MAX_SECONDS
from chatlane.stores import Store, WriteBatch
from tests.keys import chat_key
from tests.stores.conftest import StoreClock
from tests.stores.contract.common import KEY, ODD_KEYS


class TestLeases:
    async def test_acquire_bumps_the_generation(self, store: Store) -> None:
        first = await store.acquire(KEY, "p1", 5)
        await store.release(first)
        second = await store.acquire(KEY, "p1", 5)
        assert (first.generation, second.generation) == (1, 2)
        assert first.token != second.token
        assert second.holder == "p1"
        assert second.key == KEY
        assert await store.generation(KEY) == 2

    async def test_held_lease_makes_the_session_busy(self, store: Store) -> None:
        await store.acquire(KEY, "p1", 5)
        with pytest.raises(SessionBusy):
            await store.acquire(KEY, "p2", 5)
        assert await store.generation(KEY) == 1

    async def test_a_caller_token_makes_a_try_again_idempotent(self, store: Store) -> None:
        first = await store.acquire(KEY, "p1", 5, token="t-1")
        again = await store.acquire(KEY, "p1", 5, token="t-1")  # the first one's answer lost
        assert (again.token, again.generation) == ("t-1", first.generation)
        assert await store.generation(KEY) == first.generation
        with pytest.raises(SessionBusy):
            await store.acquire(KEY, "p2", 5, token="t-2")
        await store.renew(again, 5)
        await store.release(again)
        assert (await store.acquire(KEY, "p2", 5, token="t-2")).generation == 2

    async def test_a_token_finds_the_lease_as_it_stands_whoever_asks(self, store: Store) -> None:
        first = await store.acquire(KEY, "p1", 5, token="t-1")
        again = await store.acquire(KEY, "p2", 5, token="t-1")
        assert (again.holder, again.token, again.generation) == ("p1", "t-1", first.generation)
        assert await store.lease_holder(KEY) == "p1"

    async def test_one_winner_among_concurrent_acquires(self, store: Store) -> None:
        results = await asyncio.gather(
            *(store.acquire(KEY, f"p{i}", 5) for i in range(30)), return_exceptions=True
        )
        winners = [r for r in results if not isinstance(r, BaseException)]
        assert len(winners) == 1
        assert all(isinstance(r, SessionBusy) for r in results if r not in winners)

    async def test_expired_lease_can_be_taken(self, store: Store, clock: StoreClock) -> None:
        old = await store.acquire(KEY, "p1", 0.2)
        await clock.advance(0.35)
        new = await store.acquire(KEY, "p2", 5)
        assert new.generation == old.generation + 1

    async def test_renew_extends(self, store: Store, clock: StoreClock) -> None:
        lease = await store.acquire(KEY, "p1", 0.4)
        await clock.advance(0.2)
        renewed = await store.renew(lease, 2)
        assert renewed.expires_at > lease.expires_at
        await clock.advance(0.4)
        with pytest.raises(SessionBusy):
            await store.acquire(KEY, "p2", 5)

    async def test_renew_after_takeover_is_lost(self, store: Store, clock: StoreClock) -> None:
        lease = await store.acquire(KEY, "p1", 0.2)
        await clock.advance(0.35)
        await store.acquire(KEY, "p2", 5)
        with pytest.raises(LeaseLost):
            await store.renew(lease, 5)

    async def test_renew_after_expiry_is_lost(self, store: Store, clock: StoreClock) -> None:
        lease = await store.acquire(KEY, "p1", 0.2)
        await clock.advance(0.35)
        with pytest.raises(LeaseLost):
            await store.renew(lease, 5)

    async def test_renew_after_bump_is_lost(self, store: Store) -> None:
        lease = await store.acquire(KEY, "p1", 5)
        assert await store.bump_generation(KEY) == 2
        with pytest.raises(LeaseLost):
            await store.renew(lease, 5)

    async def test_stale_release_never_frees_the_successor(
        self, store: Store, clock: StoreClock
    ) -> None:
        old = await store.acquire(KEY, "p1", 0.2)
        await clock.advance(0.35)
        await store.acquire(KEY, "p2", 5)
        with pytest.raises(LeaseLost):
            await store.release(old)
        with pytest.raises(SessionBusy):
            await store.acquire(KEY, "p3", 5)

    async def test_double_release_is_misuse(self, store: Store) -> None:
        lease = await store.acquire(KEY, "p1", 5)
        await store.release(lease)
        with pytest.raises(LeaseError) as raised:
            await store.release(lease)
        assert not isinstance(raised.value, LeaseLost)

    async def test_bumped_lease_can_still_be_released_by_its_holder(self, store: Store) -> None:
        lease = await store.acquire(KEY, "p1", 5)
        await store.bump_generation(KEY)
        await store.release(lease)
        assert (await store.acquire(KEY, "p2", 5)).generation == 3

    async def test_head_seq_keeps_store_order(self, store: Store) -> None:
        first = await store.enqueue(KEY, "m1", "p1", b"1")
        second = await store.enqueue(KEY, "m2", "p2", b"2")
        with pytest.raises(SessionBusy):
            await store.acquire(KEY, "p2", 5, head_seq=second)
        lease = await store.acquire(KEY, "p1", 5, head_seq=first)
        await store.commit(KEY, lease.generation, WriteBatch(done=[first]))
        await store.release(lease)
        await store.acquire(KEY, "p2", 5, head_seq=second)

    async def test_an_earlier_message_of_another_holder_is_its_own_refusal(
        self, store: Store
    ) -> None:
        await store.enqueue(KEY, "m1", "p1", b"1")
        later = await store.enqueue(KEY, "m2", "p2", b"2")
        with pytest.raises(EarlierMessageFirst, match=r"an earlier message of .* runs first"):
            await store.acquire(KEY, "p2", 5, head_seq=later)
        assert await store.generation(KEY) == 0
        await store.acquire(KEY, "p1", 5)
        with pytest.raises(SessionBusy) as raised:
            await store.acquire(KEY, "p2", 5, head_seq=later)
        assert not isinstance(raised.value, EarlierMessageFirst)

    async def test_an_earlier_message_refuses_when_the_head_is_no_longer_queued(
        self, store: Store
    ) -> None:
        await store.enqueue(KEY, "m1", "p1", b"1")  # the session's only record
        head = await store.enqueue(KEY, "m2", "p2", b"2")
        await store.drop_pending(KEY, [head])  # answered with a notice, or drawn elsewhere
        with pytest.raises(EarlierMessageFirst):
            await store.acquire(KEY, "p2", 5, head_seq=head)
        assert await store.generation(KEY) == 0

    async def test_max_active_caps_running_sessions(self, store: Store) -> None:
        await store.acquire(chat_key("a"), "p1", 5, max_active=2)
        await store.acquire(chat_key("b"), "p1", 5, max_active=2)
        with pytest.raises(ActiveSessionLimit, match=r"\(2/2\)"):
            await store.acquire(chat_key("c"), "p2", 5, max_active=2)
        assert await store.active_sessions() == 2
        assert await store.generation(chat_key("c")) == 0

    async def test_the_largest_settings_are_held(self, store: Store) -> None:
        """A lease, renewal and heartbeat as long as a setting may make them, under the
        largest active-session cap: every store holds them."""
        lease = await store.acquire(KEY, "p1", MAX_SECONDS, max_active=MAX_COUNT)
        assert lease.expires_at >= time.time() + MAX_SECONDS - 3600
        [renewed] = await store.renew_many([lease], MAX_SECONDS)
        assert renewed is not None
        await store.heartbeat("p1", MAX_SECONDS)
        assert await store.active_sessions() == 1
        with pytest.raises(SessionBusy):
            await store.acquire(KEY, "p2", 5, max_active=MAX_COUNT)
        await store.release(renewed)

    async def test_expired_leases_do_not_count_as_active(
        self, store: Store, clock: StoreClock
    ) -> None:
        await store.acquire(chat_key("a"), "p1", 0.2)
        await clock.advance(0.35)
        assert await store.active_sessions() == 0
        await store.acquire(chat_key("b"), "p1", 5, max_active=1)

    async def test_unknown_key_has_generation_zero(self, store: Store) -> None:
        assert await store.generation(chat_key("never-seen")) == 0

    async def test_generations_reads_many_keys_in_order(self, store: Store) -> None:
        odd = ODD_KEYS[-1]
        for _ in range(3):
            await store.bump_generation(odd)
        await store.bump_generation(KEY)
        keys = [chat_key(f"k{n}") for n in range(1200)]  # more than one IN list / one MGET
        await store.bump_generation(keys[700])
        wanted = [odd, chat_key("never-seen"), KEY, odd, *keys]
        found = await store.generations(wanted)
        assert found[:4] == [3, 0, 1, 3]
        assert found[4:] == [1 if n == 700 else 0 for n in range(1200)]
        assert await store.generations([]) == []

    @pytest.mark.parametrize("key", ODD_KEYS)
    async def test_odd_keys_are_isolated(self, store: Store, key: SessionKey) -> None:
        await store.acquire(key, "p1", 5)
        other = await store.acquire(SessionKey(f"{key}:x"), "p1", 5)
        assert other.generation == 1
        with pytest.raises(SessionBusy):
            await store.acquire(key, "p2", 5)


class TestLeaseHolder:
    """``lease_holder`` reads who runs a session; reading it never takes or changes anything."""

    async def test_names_the_live_lease_holder_until_it_is_released(self, store: Store) -> None:
        assert await store.lease_holder(KEY) is None  # never ran
        lease = await store.acquire(KEY, "p|1", 5)
        assert await store.lease_holder(KEY) == "p|1"
        await store.bump_generation(KEY)  # fenced, but still held by its holder
        assert await store.lease_holder(KEY) == "p|1"
        await store.release(lease)
        assert await store.lease_holder(KEY) is None

    async def test_an_expired_lease_has_no_holder(self, store: Store, clock: StoreClock) -> None:
        await store.acquire(KEY, "p1", 0.2)
        await clock.advance(0.35)
        assert await store.lease_holder(KEY) is None  # expired, not yet taken over
        await store.acquire(KEY, "p2", 5)
        assert await store.lease_holder(KEY) == "p2"

    async def test_reading_takes_nothing(self, store: Store) -> None:
        await store.bump_generation(KEY)
        assert await store.lease_holder(KEY) is None
        assert await store.generation(KEY) == 1
        assert await store.active_sessions() == 0
        lease = await store.acquire(KEY, "p1", 5)  # the reader's look never stands in the way
        assert lease.generation == 2
        assert await store.lease_holder(KEY) == "p1"
        with pytest.raises(SessionBusy):
            await store.acquire(KEY, "p2", 5)
        assert await store.generation(KEY) == 2

    @pytest.mark.parametrize("key", ODD_KEYS)
    async def test_odd_keys_are_isolated(self, store: Store, key: SessionKey) -> None:
        await store.acquire(key, "p1", 5)
        assert await store.lease_holder(SessionKey(f"{key}:x")) is None
        assert await store.lease_holder(key) == "p1"


class TestRefusalsNameTheirSession:
    """Every refusal carries the session's key (and the lease's generation) as attributes."""

    KEY = ODD_KEYS[0]

    async def test_busy_refusals_carry_the_key(self, store: Store) -> None:
        await store.enqueue(self.KEY, "m1", "p1", b"1")
        later = await store.enqueue(self.KEY, "m2", "p2", b"2")
        with pytest.raises(EarlierMessageFirst) as earlier:
            await store.acquire(self.KEY, "p2", 5, head_seq=later)
        await store.acquire(self.KEY, "p1", 5, max_active=1)
        with pytest.raises(SessionBusy) as running:
            await store.acquire(self.KEY, "p2", 5)
        with pytest.raises(ActiveSessionLimit) as limited:
            await store.acquire(chat_key("other"), "p2", 5, max_active=1)
        assert (earlier.value.key, running.value.key, limited.value.key) == (
            self.KEY,
            self.KEY,
            chat_key("other"),
        )
        assert str(running.value) == f"session {self.KEY!r} is running elsewhere"

    async def test_lease_errors_carry_the_key_and_generation(
        self, store: Store, clock: StoreClock
    ) -> None:
        await store.bump_generation(self.KEY)
        old = await store.acquire(self.KEY, "p1", 0.2)
        await clock.advance(0.35)
        new = await store.acquire(self.KEY, "p2", 5)
        with pytest.raises(LeaseLost) as renewed:
            await store.renew(old, 5)
        with pytest.raises(LeaseLost) as released:
            await store.release(old)
        await store.release(new)
        with pytest.raises(LeaseError) as twice:
            await store.release(new)
        found = [(e.value.key, e.value.generation) for e in (renewed, released, twice)]
        assert found == [(self.KEY, 2), (self.KEY, 2), (self.KEY, 3)]


class TestRenewMany:
    async def test_renew_many_renews_what_is_held_and_reports_what_is_lost(
        self, store: Store, clock: StoreClock
    ) -> None:
        kept = await store.acquire(chat_key("a"), "p1", 5)
        fenced = await store.acquire(chat_key("b"), "p1", 5)
        await store.bump_generation(chat_key("b"))
        expired = await store.acquire(chat_key("c"), "p1", 0.05)
        await clock.advance(0.15)
        renewed = await store.renew_many([kept, fenced, expired], 30)
        assert renewed[1:] == [None, None]
        first = renewed[0]
        assert first is not None
        assert (first.token, first.generation) == (kept.token, kept.generation)
        assert first.expires_at > kept.expires_at + 20
        assert await store.renew_many([], 5) == []
        with pytest.raises(SessionBusy):
            await store.acquire(chat_key("a"), "p2", 5)

    async def test_a_lost_lease_stays_lost_beside_its_successor(self, store: Store) -> None:
        old = await store.acquire(KEY, "p1", 5)
        await store.release(old)
        new = await store.acquire(KEY, "p1", 5)
        renewed = await store.renew_many([old, new, old], 30)
        assert [None if r is None else r.token for r in renewed] == [None, new.token, None]
        with pytest.raises(LeaseLost):
            await store.renew(old, 5)
