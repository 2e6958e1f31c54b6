"""The contract of :class:`~chatlane.stores.protocols.PendingQueue`, over every backend.

Tests that let time pass use the ``clock`` fixture: it moves the memory and
SQLite stores' clock at once, and waits for real with Redis, which reads its
server's ``TIME`` (so TTLs here stay short).
"""

from __future__ import annotations

import asyncio

import pytest

from chatlane.errors import SessionBusy
from chatlane.stores import Store
from tests.keys import chat_key
from tests.stores.conftest import Reopen, StoreClock
from tests.stores.contract.common import KEY


class TestPendingQueue:
    async def test_store_order_and_idempotence(self, store: Store) -> None:
        seqs = [await store.enqueue(KEY, f"m{i}", "p1", f"{i}".encode()) for i in range(5)]
        assert seqs == sorted(seqs)
        assert len(set(seqs)) == 5
        assert await store.enqueue(KEY, "m2", "p9", b"dup") == seqs[2]
        records = await store.pending(KEY)
        assert [r.message_id for r in records] == [f"m{i}" for i in range(5)]
        assert records[2].payload == b"2"
        assert records[2].owner == "p1"

    async def test_binary_payload_round_trips(self, store: Store) -> None:
        payload = bytes(range(256))
        await store.enqueue(KEY, "m1", "p1", payload)
        assert (await store.pending(KEY))[0].payload == payload

    async def test_pending_keys_and_drop(self, store: Store) -> None:
        a, b = chat_key("a"), chat_key("b")
        seq = await store.enqueue(a, "m1", "p1", b"")
        await store.enqueue(b, "m2", "p1", b"")
        assert sorted(await store.pending_keys()) == [a, b]
        await store.drop_pending(a, [seq])
        assert await store.pending_keys() == [b]
        assert await store.pending(a) == []

    async def test_drop_own_removes_only_what_its_owner_still_owns(self, store: Store) -> None:
        """What another process adopted meanwhile stays, its to run; the last record of a
        session leaves the list of sessions with records."""
        seqs = [await store.enqueue(KEY, f"m{i}", "p1", b"") for i in range(4)]
        assert await store.adopt(KEY, [seqs[1]], "p1", "p2") == [seqs[1]]
        assert await store.drop_own(KEY, [*reversed(seqs), seqs[3] + 99], "p1") == [
            seqs[0],
            seqs[2],
            seqs[3],
        ]
        assert [(r.seq, r.owner) for r in await store.pending(KEY)] == [(seqs[1], "p2")]
        assert await store.drop_own(KEY, seqs, "p1") == []  # asked again: nothing left of p1's
        assert await store.drop_own(KEY, [], "p2") == []
        assert await store.drop_own(KEY, [seqs[1]], "p2") == [seqs[1]]
        assert await store.pending_keys() == []

    async def test_concurrent_enqueues_get_distinct_ordered_seqs(self, store: Store) -> None:
        seqs = await asyncio.gather(*(store.enqueue(KEY, f"m{i}", "p", b"") for i in range(40)))
        assert len(set(seqs)) == 40
        assert [r.seq for r in await store.pending(KEY)] == sorted(seqs)

    async def test_a_message_queued_again_under_its_seq_takes_its_place(self, store: Store) -> None:
        seqs = [await store.enqueue(KEY, f"m{i}", "p1", f"{i}".encode()) for i in range(3)]
        await store.drop_pending(KEY, seqs[:2])  # a drop that applied, its answer lost
        assert await store.enqueue(KEY, "m1", "p1", b"1", seq=seqs[1]) == seqs[1]
        records = await store.pending(KEY)
        assert [(r.message_id, r.seq) for r in records] == [("m1", seqs[1]), ("m2", seqs[2])]
        assert (records[0].owner, records[0].payload) == ("p1", b"1")
        with pytest.raises(SessionBusy):  # another process's later message waits for it
            await store.acquire(KEY, "p2", 5, head_seq=seqs[2])
        assert await store.enqueue(KEY, "m3", "p1", b"3") > seqs[2]

    async def test_a_message_still_queued_keeps_its_record_when_queued_again(
        self, store: Store
    ) -> None:
        seq = await store.enqueue(KEY, "m1", "p1", b"first")
        assert await store.enqueue(KEY, "m1", "p2", b"again", seq=seq) == seq
        [record] = await store.pending(KEY)
        assert (record.seq, record.owner, record.payload) == (seq, "p1", b"first")

    async def test_a_message_queued_again_survives_a_restart(
        self, store: Store, reopen: Reopen
    ) -> None:
        seq = await store.enqueue(KEY, "m1", "p1", b"kept")
        await store.drop_pending(KEY, [seq])
        await store.enqueue(KEY, "m1", "p1", b"kept", seq=seq)
        await store.close()
        again = await reopen()
        assert [(r.seq, r.payload) for r in await again.pending(KEY)] == [(seq, b"kept")]


class TestOwnership:
    async def test_own_earlier_messages_do_not_block(self, store: Store) -> None:
        await store.enqueue(KEY, "m1", "p1", b"")
        second = await store.enqueue(KEY, "m2", "p1", b"")
        await store.acquire(KEY, "p1", 5, head_seq=second)

    async def test_adopt_moves_only_records_of_the_old_owner(self, store: Store) -> None:
        a = await store.enqueue(KEY, "m1", "dead", b"")
        b = await store.enqueue(KEY, "m2", "alive", b"")
        assert await store.adopt(KEY, [a, b], "dead", "me") == [a]
        assert [r.owner for r in await store.pending(KEY)] == ["me", "alive"]
        assert await store.adopt(KEY, [a], "dead", "other") == []
        await store.acquire(KEY, "me", 5, head_seq=a)

    async def test_a_fenced_adoption_takes_nothing_once_the_generation_moved_on(
        self, store: Store
    ) -> None:
        seq = await store.enqueue(KEY, "m1", "other", b"")
        lease = await store.acquire(KEY, "me", 5, head_seq=seq)
        await store.bump_generation(KEY)  # another process fenced the turn
        stale = lease.generation
        assert await store.adopt(KEY, [seq], "other", "me", generation=stale) == []
        assert [r.owner for r in await store.pending(KEY)] == ["other"]
        current = await store.generation(KEY)
        assert await store.adopt(KEY, [seq], "other", "me", generation=current) == [seq]
        assert [r.owner for r in await store.pending(KEY)] == ["me"]

    async def test_concurrent_adoption_gives_each_record_to_one(self, store: Store) -> None:
        seqs = [await store.enqueue(KEY, f"m{i}", "dead", b"") for i in range(10)]
        results = await asyncio.gather(*(store.adopt(KEY, seqs, "dead", f"p{i}") for i in range(5)))
        adopted = [seq for result in results for seq in result]
        assert sorted(adopted) == seqs


class TestAdoptOrphans:
    async def test_adopt_orphans_takes_only_dead_owners_records_in_order(
        self, store: Store, clock: StoreClock
    ) -> None:
        await store.heartbeat("alive", 30)
        await store.heartbeat("dead", 0.05)
        x, y = chat_key("x"), chat_key("y")
        x1 = await store.enqueue(x, "m1", "dead", b"1")
        await store.enqueue(x, "m2", "alive", b"2")
        x3 = await store.enqueue(x, "m3", "never-beat", b"3")
        await store.enqueue(y, "m4", "me", b"4")
        await clock.advance(0.15)
        await store.heartbeat("me", 30)
        adopted = await store.adopt_orphans("me", 10)
        assert [(r.key, r.seq, r.owner, r.payload) for r in adopted] == [
            (x, x1, "me", b"1"),
            (x, x3, "me", b"3"),
        ]
        assert [r.owner for r in await store.pending(x)] == ["me", "alive", "me"]
        assert await store.adopt_orphans("other", 10) == []

    async def test_adopt_orphans_is_bounded_by_sessions_and_each_record_goes_once(
        self, store: Store
    ) -> None:
        for adopter in ("me", "p0", "p1", "p2"):
            await store.heartbeat(adopter, 30)
        for i in range(12):
            await store.enqueue(chat_key(f"s{i:02}"), f"m{i}", "dead", b"")
            await store.enqueue(chat_key(f"s{i:02}"), f"n{i}", "dead", b"")
        first = await store.adopt_orphans("me", 5)
        assert len({r.key for r in first}) == 5
        assert len(first) == 10
        rest = await asyncio.gather(*(store.adopt_orphans(f"p{i}", 100) for i in range(3)))
        ids = [r.message_id for r in first] + [r.message_id for rs in rest for r in rs]
        assert sorted(ids) == sorted([f"m{i}" for i in range(12)] + [f"n{i}" for i in range(12)])


class TestFailed:
    async def test_a_parked_message_leaves_the_queue_and_is_kept_with_its_reason(
        self, store: Store, clock: StoreClock
    ) -> None:
        first = await store.enqueue(KEY, "m1", "p1", b"payload")
        second = await store.enqueue(KEY, "m2", "p1", b"")
        await store.park(KEY, [first], "lost its lease 3 times")
        assert [r.seq for r in await store.pending(KEY)] == [second]
        (failed,) = await store.failed()
        assert failed.reason == "lost its lease 3 times"
        assert (failed.record.seq, failed.record.message_id) == (first, "m1")
        assert failed.record.payload == b"payload"
        assert failed.failed_at > 0
        await store.heartbeat("p1", 0.01)
        await clock.advance(0.05)
        adopted = await store.adopt_orphans("p2", 10)
        assert [r.message_id for r in adopted] == ["m2"]

    async def test_a_failed_message_no_longer_holds_back_later_ones(self, store: Store) -> None:
        first = await store.enqueue(KEY, "m1", "other", b"")
        second = await store.enqueue(KEY, "m2", "me", b"")
        await store.park(KEY, [first], "failed")
        await store.acquire(KEY, "me", 5, head_seq=second)

    async def test_retry_puts_it_back_under_its_seq_once(self, store: Store) -> None:
        first = await store.enqueue(KEY, "m1", "p1", b"payload")
        await store.park(KEY, [first], "failed")
        await store.park(KEY, [first], "parked twice")  # no longer pending: nothing happens
        record = await store.retry_failed("m1", "p2")
        assert record is not None
        assert (record.seq, record.owner, record.payload) == (first, "p2", b"payload")
        assert [(r.seq, r.owner) for r in await store.pending(KEY)] == [(first, "p2")]
        assert await store.failed() == []
        assert await store.retry_failed("m1", "p3") is None
        assert await store.retry_failed("nothing", "p3") is None

    async def test_a_retry_replaces_the_message_queued_again_since(self, store: Store) -> None:
        first = await store.enqueue(KEY, "m1", "p1", b"first")
        await store.park(KEY, [first], "failed")
        again = await store.enqueue(KEY, "m1", "p1", b"again")  # delivered again: queued anew
        assert again != first
        record = await store.retry_failed("m1", "p2")
        assert record is not None
        assert record.seq == first
        kept = [(r.seq, r.message_id, r.owner, r.payload) for r in await store.pending(KEY)]
        assert kept == [(first, "m1", "p2", b"first")]
        assert await store.enqueue(KEY, "m1", "p1", b"x") == first  # still queued: one record
        await store.drop_pending(KEY, [first])
        assert await store.pending(KEY) == []
        assert await store.pending_keys() == []

    async def test_failed_lists_oldest_first_within_the_limit(self, store: Store) -> None:
        for i in range(3):
            seq = await store.enqueue(chat_key(f"k{i}"), f"m{i}", "p", b"")
            await store.park(chat_key(f"k{i}"), [seq], f"reason {i}")
        assert [f.reason for f in await store.failed(2)] == ["reason 0", "reason 1"]
        assert await store.failed(0) == []

    async def test_failed_messages_survive_a_restart(self, store: Store, reopen: Reopen) -> None:
        seq = await store.enqueue(KEY, "m1", "p1", b"x")
        await store.park(KEY, [seq], "failed")
        await store.close()
        again = await reopen()
        assert [f.record.message_id for f in await again.failed()] == ["m1"]
