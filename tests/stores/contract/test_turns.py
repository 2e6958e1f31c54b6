"""The contract of :class:`~chatlane.stores.protocols.Turns`, over every backend.

Each test runs twice per backend: with the backend's own fused operations
(one transaction each) and with the forms derived in the protocol from the
separate methods, which must keep the same rules.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from chatlane.errors import (
    ActiveSessionLimit,
    AlreadyAnswered,
    EarlierMessageFirst,
    LeaseError,
    MessageIdInUse,
    SessionBusy,
    StaleGeneration,
    StoreError,
)
from chatlane.identity import SessionKey
from chatlane.runtime.limits import MAX_COUNT, MAX_SECONDS
from chatlane.stores import Admission, Lease, Store, Taken, Turns, WriteBatch
from tests.keys import chat_key
from tests.stores.conftest import Reopen, StoreClock
from tests.stores.contract.common import KEY, ODD_KEYS, entry


class Fused:
    """A turn's fused calls on ``store``: its own, or the protocol's derived forms."""

    def __init__(self, store: Store, derived: bool) -> None:
        self.store = store
        self.derived = derived

    async def enqueue_and_acquire(
        self, key: SessionKey, message_id: str, owner: str, ttl: float = 5, **options: Any
    ) -> Admission:
        payload = f"payload of {message_id}".encode()
        call = Turns.enqueue_and_acquire if self.derived else type(self.store).enqueue_and_acquire
        return await call(self.store, key, message_id, owner, payload, ttl, **options)

    async def acquire_and_read(self, holder: str, key: SessionKey = KEY, **options: Any) -> Taken:
        call = Turns.acquire_and_read if self.derived else type(self.store).acquire_and_read
        return await call(self.store, key, holder, 5, **options)

    async def commit_and_release(self, lease: Lease, batch: WriteBatch) -> bool:
        call = Turns.commit_and_release if self.derived else type(self.store).commit_and_release
        return await call(self.store, lease, batch)


@pytest.fixture(params=["own", "derived"])
def fused(request: pytest.FixtureRequest, store: Store) -> Fused:
    return Fused(store, derived=request.param == "derived")


def held(admission: Admission) -> Lease:
    assert admission.refusal is None
    assert admission.lease is not None
    return admission.lease


def same_holding(lease: Lease, other: Lease) -> bool:
    """Whether two leases are one holding (Redis reads the expiry back to the millisecond)."""
    return (lease.key, lease.holder, lease.token, lease.generation) == (
        other.key,
        other.holder,
        other.token,
        other.generation,
    )


async def queued(store: Store, key: SessionKey = KEY) -> list[str]:
    return [record.message_id for record in await store.pending(key)]


class TestEnqueueAndAcquire:
    async def test_an_idle_session_is_queued_and_taken_at_once(
        self, store: Store, fused: Fused
    ) -> None:
        await store.set_persistent(KEY, None, busy_policy="queue", model={"name": "m1"})
        admission = await fused.enqueue_and_acquire(KEY, "m1", "p1", with_persistent=True)
        lease = held(admission)
        assert (lease.key, lease.holder, lease.generation) == (KEY, "p1", 1)
        assert await store.generation(KEY) == 1
        [record] = await store.pending(KEY)
        assert (record.seq, record.message_id, record.owner) == (admission.seq, "m1", "p1")
        assert record.payload == b"payload of m1"
        assert admission.persistent == await store.load_persistent(KEY)
        assert admission.persistent == {"busy_policy": "queue", "model": {"name": "m1"}}
        with pytest.raises(SessionBusy):
            await store.acquire(KEY, "p2", 5)

    async def test_a_refusal_is_returned_and_the_message_stays_queued(
        self, store: Store, fused: Fused
    ) -> None:
        running = await store.acquire(KEY, "p2", 5)
        admission = await fused.enqueue_and_acquire(KEY, "m1", "p1")
        assert admission.lease is None
        assert isinstance(admission.refusal, SessionBusy)
        assert not isinstance(admission.refusal, EarlierMessageFirst)
        assert admission.refusal.key == KEY
        assert await queued(store) == ["m1"]
        assert await store.generation(KEY) == running.generation
        await store.release(running)
        lease = await store.acquire(KEY, "p1", 5, head_seq=admission.seq)
        assert lease.generation == running.generation + 1

    async def test_an_earlier_message_of_another_holder_still_runs_first(
        self, store: Store, fused: Fused
    ) -> None:
        first = await store.enqueue(KEY, "m1", "p2", b"1")
        admission = await fused.enqueue_and_acquire(KEY, "m2", "p1")
        assert admission.lease is None
        assert isinstance(admission.refusal, EarlierMessageFirst)
        assert await queued(store) == ["m1", "m2"]
        assert admission.seq > first
        assert await store.generation(KEY) == 0
        lease = await store.acquire(KEY, "p2", 5, head_seq=first)
        await store.commit(KEY, lease.generation, WriteBatch(done=[first]))
        await store.release(lease)
        await store.acquire(KEY, "p1", 5, head_seq=admission.seq)

    async def test_a_message_queued_under_another_key_is_refused(
        self, store: Store, fused: Fused
    ) -> None:
        await store.enqueue(KEY, "m1", "p2", b"1")  # the session's only record
        await store.enqueue(chat_key("elsewhere"), "m2", "p1", b"2")
        with pytest.raises(MessageIdInUse):  # its id is another session's: nothing written
            await fused.enqueue_and_acquire(KEY, "m2", "p1")
        assert await queued(store) == ["m1"]
        assert await store.generation(KEY) == 0

    async def test_an_earlier_message_of_its_own_does_not_block(
        self, store: Store, fused: Fused
    ) -> None:
        await store.enqueue(KEY, "m1", "p1", b"1")
        lease = held(await fused.enqueue_and_acquire(KEY, "m2", "p1"))
        assert lease.generation == 1

    async def test_the_active_session_limit_is_a_refusal(self, store: Store, fused: Fused) -> None:
        await store.acquire(chat_key("a"), "p2", 5)
        admission = await fused.enqueue_and_acquire(chat_key("b"), "m1", "p1", max_active=1)
        assert isinstance(admission.refusal, ActiveSessionLimit)
        assert "(1/1)" in str(admission.refusal)
        assert admission.refusal.key == chat_key("b")
        assert await queued(store, chat_key("b")) == ["m1"]
        assert await store.generation(chat_key("b")) == 0
        assert held(await fused.enqueue_and_acquire(chat_key("c"), "m2", "p1", max_active=2))

    async def test_the_largest_settings_are_held(self, store: Store, fused: Fused) -> None:
        """The longest lease TTL and the largest active-session cap a setting takes."""
        options = {"ttl": MAX_SECONDS, "max_active": MAX_COUNT}
        lease = held(await fused.enqueue_and_acquire(KEY, "m1", "p1", **options))
        assert lease.expires_at >= time.time() + MAX_SECONDS - 3600
        admission = await fused.enqueue_and_acquire(KEY, "m2", "p2", **options)
        assert isinstance(admission.refusal, SessionBusy)

    async def test_persistent_fields_only_when_asked(self, store: Store, fused: Fused) -> None:
        await store.set_persistent(KEY, None, busy_policy="reject")
        admission = await fused.enqueue_and_acquire(KEY, "m1", "p1", with_persistent=False)
        assert admission.persistent is None
        assert held(admission)

    async def test_persistent_fields_come_with_a_refusal_too(
        self, store: Store, fused: Fused
    ) -> None:
        await store.set_persistent(KEY, None, busy_policy="reject", big=2**70, odd="\ud800")
        await store.acquire(KEY, "p2", 5)
        admission = await fused.enqueue_and_acquire(KEY, "m1", "p1")
        assert admission.refusal is not None
        assert admission.persistent == {"busy_policy": "reject", "big": 2**70, "odd": "\ud800"}

    async def test_the_fields_returned_are_a_copy(self, store: Store, fused: Fused) -> None:
        await store.set_persistent(KEY, None, d={"ids": [1]})
        admission = await fused.enqueue_and_acquire(KEY, "m1", "p1")
        assert admission.persistent is not None
        admission.persistent["d"]["ids"].append(2)
        admission.persistent["added"] = True
        assert await store.load_persistent(KEY) == {"d": {"ids": [1]}}

    async def test_a_session_never_seen_has_no_fields(self, store: Store, fused: Fused) -> None:
        admission = await fused.enqueue_and_acquire(chat_key("new"), "m1", "p1")
        assert admission.persistent == {}

    async def test_enqueue_stays_idempotent_per_message_id(
        self, store: Store, fused: Fused
    ) -> None:
        first = await fused.enqueue_and_acquire(KEY, "m1", "p1")
        again = await fused.enqueue_and_acquire(KEY, "m1", "p1")
        assert again.seq == first.seq
        assert isinstance(again.refusal, SessionBusy)
        assert await queued(store) == ["m1"]
        assert await store.generation(KEY) == 1

    async def test_concurrent_admissions_queue_all_in_order_and_one_runs(
        self, store: Store, fused: Fused
    ) -> None:
        admissions = await asyncio.gather(
            *(fused.enqueue_and_acquire(KEY, f"m{i}", f"p{i % 3}") for i in range(30))
        )
        seqs = [a.seq for a in admissions]
        assert len(set(seqs)) == 30
        assert [r.seq for r in await store.pending(KEY)] == sorted(seqs)
        winners = [a for a in admissions if a.lease is not None]
        assert len(winners) == 1
        assert all(a.refusal is not None for a in admissions if a is not winners[0])
        assert await store.generation(KEY) == 1

    async def test_one_winner_across_two_processes(
        self, store: Store, fused: Fused, reopen: Reopen
    ) -> None:
        other = Fused(await reopen(), fused.derived)
        admissions = await asyncio.gather(
            *(
                side.enqueue_and_acquire(KEY, f"m{i}", f"p{i}")
                for i, side in enumerate([fused, other] * 8)
            )
        )
        assert sum(a.lease is not None for a in admissions) == 1
        assert sorted(await queued(store)) == sorted(f"m{i}" for i in range(16))

    @pytest.mark.parametrize("key", ODD_KEYS)
    async def test_odd_keys_are_isolated(self, store: Store, fused: Fused, key: SessionKey) -> None:
        await store.set_persistent(key, None, f="odd")
        first = await fused.enqueue_and_acquire(key, "m1", "p1")
        second = await fused.enqueue_and_acquire(SessionKey(f"{key}:x"), "m2", "p1")
        assert (held(first).generation, held(second).generation) == (1, 1)
        assert (first.persistent, second.persistent) == ({"f": "odd"}, {})

    async def test_a_try_again_with_the_same_token_gets_its_own_lease_back(
        self, store: Store, fused: Fused
    ) -> None:
        admission = await fused.enqueue_and_acquire(KEY, "m1", "p1", token="t-1")
        first = held(admission)
        assert first.token == "t-1"
        again = await fused.enqueue_and_acquire(KEY, "m1", "p1", token="t-1")  # answer lost
        assert again.seq == admission.seq
        assert same_holding(held(again), first)
        assert await queued(store) == ["m1"]
        assert await store.generation(KEY) == first.generation
        other = await fused.enqueue_and_acquire(KEY, "m2", "p1", token="t-2")
        assert isinstance(other.refusal, SessionBusy)
        await store.release(first)  # the one holding, whichever try returned it
        with pytest.raises(LeaseError):
            await store.release(first)


class TestAcquireAndRead:
    async def test_a_try_again_with_the_same_token_gets_its_own_lease_back(
        self, store: Store, fused: Fused
    ) -> None:
        taken = await fused.acquire_and_read("p1", max_active=1, token="t-1")
        await store.set_persistent(KEY, None, n=1)
        await store.enqueue(KEY, "m1", "p2", b"")  # refusals that come after the busy check
        later = await store.enqueue(KEY, "m2", "p1", b"")
        again = await fused.acquire_and_read("p1", head_seq=later, max_active=1, token="t-1")
        assert same_holding(again.lease, taken.lease)
        assert again.persistent == {"n": 1}
        with pytest.raises(SessionBusy):
            await fused.acquire_and_read("p1", token="t-2")
        assert await store.generation(KEY) == taken.lease.generation

    async def test_the_lease_comes_with_the_fields(self, store: Store, fused: Fused) -> None:
        await store.set_persistent(KEY, None, busy_policy="steer", n=3)
        taken = await fused.acquire_and_read("p1")
        assert (taken.lease.holder, taken.lease.generation) == ("p1", 1)
        assert (
            taken.persistent == await store.load_persistent(KEY) == {"busy_policy": "steer", "n": 3}
        )
        with pytest.raises(SessionBusy):
            await store.acquire(KEY, "p2", 5)

    async def test_it_refuses_as_acquire_does(self, store: Store, fused: Fused) -> None:
        await store.enqueue(KEY, "m1", "p2", b"")
        later = await store.enqueue(KEY, "m2", "p1", b"")
        with pytest.raises(EarlierMessageFirst):
            await fused.acquire_and_read("p1", head_seq=later)
        await store.acquire(KEY, "p2", 5)
        with pytest.raises(SessionBusy):
            await fused.acquire_and_read("p1", head_seq=later)
        with pytest.raises(ActiveSessionLimit):
            await fused.acquire_and_read("p1", chat_key("other"), max_active=1)
        assert await store.generation(KEY) == 1
        assert await store.generation(chat_key("other")) == 0


class TestCommitAndRelease:
    async def test_the_commit_applies_and_the_session_is_free_at_once(
        self, store: Store, fused: Fused
    ) -> None:
        lease = held(await fused.enqueue_and_acquire(KEY, "m1", "p1"))
        [record] = await store.pending(KEY)
        batch = WriteBatch(
            transcript=[entry("hi", lease.generation), entry("hello", lease.generation, "bot")],
            persistent={"model": "m1"},
            answered=["m1"],
            done=[record.seq],
            answer="hello",
        )
        assert await fused.commit_and_release(lease, batch) is True
        assert [e.content for e in await store.transcript(KEY)] == ["hi", "hello"]
        assert await store.load_persistent(KEY) == {"model": "m1"}
        assert await store.answer("m1") == "hello"
        assert await store.pending(KEY) == []
        assert await store.active_sessions() == 0
        successor = await store.acquire(KEY, "p2", 5)
        assert successor.generation == lease.generation + 1
        with pytest.raises(LeaseError):
            await store.release(lease)

    async def test_the_session_is_free_for_the_next_fused_enqueue(
        self, store: Store, fused: Fused
    ) -> None:
        first = await fused.enqueue_and_acquire(KEY, "m1", "p1")
        done = WriteBatch(answered=["m1"], done=[first.seq])
        assert await fused.commit_and_release(held(first), done)
        second = await fused.enqueue_and_acquire(KEY, "m2", "p2", max_active=1)
        assert held(second).generation == 2

    async def test_a_stale_generation_is_refused_and_releases_nothing(
        self, store: Store, fused: Fused
    ) -> None:
        admission = await fused.enqueue_and_acquire(KEY, "m1", "p1")
        lease = held(admission)
        await store.bump_generation(KEY)
        batch = WriteBatch(
            transcript=[entry("late", lease.generation)],
            persistent={"model": "stale"},
            answered=["m1"],
            done=[admission.seq],
        )
        with pytest.raises(StaleGeneration):
            await fused.commit_and_release(lease, batch)
        assert await store.transcript(KEY) == []
        assert await store.load_persistent(KEY) == {}
        assert not await store.is_answered("m1")
        assert await queued(store) == ["m1"]
        with pytest.raises(SessionBusy):
            await store.acquire(KEY, "p2", 5)
        assert await store.active_sessions() == 1
        await store.release(lease)  # still its holder's to release, once
        await store.acquire(KEY, "p2", 5)

    async def test_a_message_answered_before_is_refused_and_releases_nothing(
        self, store: Store, fused: Fused
    ) -> None:
        await store.commit(KEY, None, WriteBatch(answered=["m1"], answer="first"))
        lease = held(await fused.enqueue_and_acquire(KEY, "m1", "p1"))
        again = WriteBatch(transcript=[entry("second", 1)], answered=["m1"], answer="second")
        with pytest.raises(AlreadyAnswered):
            await fused.commit_and_release(lease, again)
        assert await store.answer("m1") == "first"
        assert await store.transcript(KEY) == []
        with pytest.raises(SessionBusy):
            await store.acquire(KEY, "p2", 5)

    async def test_answered_at_most_once_across_turns(self, store: Store, fused: Fused) -> None:
        first = held(await fused.enqueue_and_acquire(KEY, "m1", "p1"))
        assert await fused.commit_and_release(first, WriteBatch(answered=["m1"], answer="a"))
        rerun = await fused.acquire_and_read("p2")
        with pytest.raises(AlreadyAnswered):
            await fused.commit_and_release(rerun.lease, WriteBatch(answered=["m1"], answer="b"))
        assert await store.answer("m1") == "a"

    async def test_a_value_that_is_not_json_releases_nothing(
        self, store: Store, fused: Fused
    ) -> None:
        lease = held(await fused.enqueue_and_acquire(KEY, "m1", "p1"))
        with pytest.raises(StoreError):
            await fused.commit_and_release(lease, WriteBatch(persistent={"bad": {1, 2}}))
        with pytest.raises(SessionBusy):
            await store.acquire(KEY, "p2", 5)

    async def test_a_lease_released_before_still_commits(self, store: Store, fused: Fused) -> None:
        lease = held(await fused.enqueue_and_acquire(KEY, "m1", "p1"))
        await store.release(lease)
        assert await fused.commit_and_release(lease, WriteBatch(answered=["m1"])) is False
        assert await store.is_answered("m1")

    async def test_an_expired_lease_nobody_took_is_committed_and_released(
        self, store: Store, fused: Fused, clock: StoreClock
    ) -> None:
        lease = held(await fused.enqueue_and_acquire(KEY, "m1", "p1", ttl=0.2))
        await clock.advance(0.35)
        assert await fused.commit_and_release(lease, WriteBatch(answered=["m1"])) is True
        with pytest.raises(LeaseError):
            await store.release(lease)

    async def test_a_successor_is_never_released(
        self, store: Store, fused: Fused, clock: StoreClock
    ) -> None:
        old = held(await fused.enqueue_and_acquire(KEY, "m1", "p1", ttl=0.2))
        await clock.advance(0.35)
        successor = await store.acquire(KEY, "p2", 5)
        with pytest.raises(StaleGeneration):
            await fused.commit_and_release(old, WriteBatch(answered=["m1"]))
        with pytest.raises(SessionBusy):
            await store.acquire(KEY, "p3", 5)
        await store.release(successor)
