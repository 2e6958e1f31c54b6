"""The store contract, run over every backend through the one ``store`` fixture."""

from __future__ import annotations

import asyncio

import pytest

from chatlane.errors import (
    ActiveSessionLimit,
    AlreadyAnswered,
    LeaseError,
    LeaseLost,
    SessionBusy,
    StaleGeneration,
)
from chatlane.stores import Store, TranscriptEntry, WriteBatch
from tests.stores.conftest import Reopen, stored_answered_ids, stored_liveness

KEY = "main:test:dm:c1"
ODD_KEYS = ["main:tg:group:-1%3A2::7", "k{with}braces", "spaces and\nnewline", "ключ🙂", "a" * 300]


def entry(content: str, generation: int, role: str = "user") -> TranscriptEntry:
    return TranscriptEntry(role, content, generation)


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

    async def test_one_winner_among_concurrent_acquires(self, store: Store) -> None:
        results = await asyncio.gather(
            *(store.acquire(KEY, f"p{i}", 5) for i in range(30)), return_exceptions=True
        )
        winners = [r for r in results if not isinstance(r, BaseException)]
        assert len(winners) == 1
        assert all(isinstance(r, SessionBusy) for r in results if r not in winners)

    async def test_expired_lease_can_be_taken(self, store: Store) -> None:
        old = await store.acquire(KEY, "p1", 0.2)
        await asyncio.sleep(0.35)
        new = await store.acquire(KEY, "p2", 5)
        assert new.generation == old.generation + 1

    async def test_renew_extends(self, store: Store) -> None:
        lease = await store.acquire(KEY, "p1", 0.4)
        await asyncio.sleep(0.2)
        renewed = await store.renew(lease, 2)
        assert renewed.expires_at > lease.expires_at
        await asyncio.sleep(0.4)
        with pytest.raises(SessionBusy):
            await store.acquire(KEY, "p2", 5)

    async def test_renew_after_takeover_is_lost(self, store: Store) -> None:
        lease = await store.acquire(KEY, "p1", 0.2)
        await asyncio.sleep(0.35)
        await store.acquire(KEY, "p2", 5)
        with pytest.raises(LeaseLost):
            await store.renew(lease, 5)

    async def test_renew_after_expiry_is_lost(self, store: Store) -> None:
        lease = await store.acquire(KEY, "p1", 0.2)
        await asyncio.sleep(0.35)
        with pytest.raises(LeaseLost):
            await store.renew(lease, 5)

    async def test_renew_after_bump_is_lost(self, store: Store) -> None:
        lease = await store.acquire(KEY, "p1", 5)
        assert await store.bump_generation(KEY) == 2
        with pytest.raises(LeaseLost):
            await store.renew(lease, 5)

    async def test_stale_release_never_frees_the_successor(self, store: Store) -> None:
        old = await store.acquire(KEY, "p1", 0.2)
        await asyncio.sleep(0.35)
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

    async def test_max_active_caps_running_sessions(self, store: Store) -> None:
        await store.acquire("a", "p1", 5, max_active=2)
        await store.acquire("b", "p1", 5, max_active=2)
        with pytest.raises(ActiveSessionLimit, match=r"\(2/2\)"):
            await store.acquire("c", "p2", 5, max_active=2)
        assert await store.active_sessions() == 2
        assert await store.generation("c") == 0

    async def test_expired_leases_do_not_count_as_active(self, store: Store) -> None:
        await store.acquire("a", "p1", 0.2)
        await asyncio.sleep(0.35)
        assert await store.active_sessions() == 0
        await store.acquire("b", "p1", 5, max_active=1)

    async def test_unknown_key_has_generation_zero(self, store: Store) -> None:
        assert await store.generation("never-seen") == 0

    async def test_generations_reads_many_keys_in_order(self, store: Store) -> None:
        odd = ODD_KEYS[-1]
        for _ in range(3):
            await store.bump_generation(odd)
        await store.bump_generation(KEY)
        keys = [f"k{n}" for n in range(1200)]  # more than one IN list / one MGET
        await store.bump_generation(keys[700])
        wanted = [odd, "never-seen", KEY, odd, *keys]
        found = await store.generations(wanted)
        assert found[:4] == [3, 0, 1, 3]
        assert found[4:] == [1 if n == 700 else 0 for n in range(1200)]
        assert await store.generations([]) == []

    @pytest.mark.parametrize("key", ODD_KEYS)
    async def test_odd_keys_are_isolated(self, store: Store, key: str) -> None:
        await store.acquire(key, "p1", 5)
        other = await store.acquire(key + ":x", "p1", 5)
        assert other.generation == 1
        with pytest.raises(SessionBusy):
            await store.acquire(key, "p2", 5)


class TestCommit:
    async def test_current_generation_applies(self, store: Store) -> None:
        lease = await store.acquire(KEY, "p1", 5)
        batch = WriteBatch(transcript=[entry("hi", lease.generation)], persistent={"model": "m1"})
        await store.commit(KEY, lease.generation, batch)
        assert [e.content for e in await store.transcript(KEY)] == ["hi"]
        assert await store.load_persistent(KEY) == {"model": "m1"}

    async def test_stale_generation_is_refused_whole(self, store: Store) -> None:
        seq = await store.enqueue(KEY, "m1", "p1", b"x")
        lease = await store.acquire(KEY, "p1", 5)
        await store.bump_generation(KEY)
        batch = WriteBatch(
            transcript=[entry("late", lease.generation)],
            persistent={"model": "stale"},
            answered=["m1"],
            done=[seq],
        )
        with pytest.raises(StaleGeneration) as raised:
            await store.commit(KEY, lease.generation, batch)
        assert (raised.value.generation, raised.value.current) == (1, 2)
        assert await store.transcript(KEY) == []
        assert await store.load_persistent(KEY) == {}
        assert not await store.is_answered("m1")
        assert [r.seq for r in await store.pending(KEY)] == [seq]

    async def test_unfenced_commit(self, store: Store) -> None:
        await store.commit(KEY, None, WriteBatch(persistent={"busy_policy": "reject"}))
        assert await store.load_persistent(KEY) == {"busy_policy": "reject"}

    async def test_a_message_is_answered_at_most_once(self, store: Store) -> None:
        lease = await store.acquire(KEY, "p1", 5)
        await store.record_reply(KEY, lease.generation, ["m1", "m2"], "first answer")
        with pytest.raises(AlreadyAnswered) as raised:
            await store.record_reply(KEY, lease.generation, ["m3", "m2"], "second answer")
        assert raised.value.message_ids == ["m2"]
        assert [e.content for e in await store.transcript(KEY)] == ["first answer"]
        assert await store.is_answered("m1")
        assert not await store.is_answered("m3")

    async def test_an_answered_mark_is_forgotten_after_its_retention(self, store: Store) -> None:
        store.answered_retention = 1.0
        await store.commit(KEY, None, WriteBatch(answered=["old"]))
        await asyncio.sleep(0.5)
        await store.commit(KEY, None, WriteBatch(answered=["new"]))
        with pytest.raises(AlreadyAnswered):
            await store.commit(KEY, None, WriteBatch(answered=["old"]))
        await asyncio.sleep(0.7)  # "old" is past its retention, "new" is not
        await store.heartbeat("p1", 5)
        assert not await store.is_answered("old")
        assert await store.is_answered("new")
        with pytest.raises(AlreadyAnswered):
            await store.commit(KEY, None, WriteBatch(answered=["new"]))
        await store.commit(KEY, None, WriteBatch(answered=["old"]))  # a mark of its own again
        assert await store.is_answered("old")

    async def test_a_heartbeat_deletes_marks_past_their_retention(self, store: Store) -> None:
        store.answered_retention = 0.6
        await store.commit(KEY, None, WriteBatch(answered=["m1", "m2"]))
        await asyncio.sleep(0.7)
        await store.commit(KEY, None, WriteBatch(answered=["m3"]))
        assert sorted(await stored_answered_ids(store)) == ["m1", "m2", "m3"]
        await store.heartbeat("p1", 5)
        assert await stored_answered_ids(store) == ["m3"]

    async def test_done_removes_pending(self, store: Store) -> None:
        first = await store.enqueue(KEY, "m1", "p1", b"1")
        await store.enqueue(KEY, "m2", "p1", b"2")
        lease = await store.acquire(KEY, "p1", 5)
        await store.commit(KEY, lease.generation, WriteBatch(done=[first]))
        assert [r.message_id for r in await store.pending(KEY)] == ["m2"]

    async def test_persistent_values_round_trip(self, store: Store) -> None:
        values = {
            "s": "héllo 🙂\x00",
            "i": 2**40,
            "f": 1.5,
            "t": True,
            "n": None,
            "l": [1, "two", None],
            "d": {"nested": {"x": [1]}},
        }
        await store.set_persistent(KEY, None, **values)
        await store.set_persistent(KEY, None, s="replaced")
        assert await store.load_persistent(KEY) == {**values, "s": "replaced"}

    async def test_generation_fencing_is_per_key(self, store: Store) -> None:
        lease = await store.acquire(KEY, "p1", 5)
        await store.bump_generation("other")
        await store.append_transcript(KEY, lease.generation, entry("ok", lease.generation))
        assert len(await store.transcript(KEY)) == 1


class TestAnswers:
    """What a message was answered with, readable from any process while its mark is kept."""

    async def test_each_answered_message_tells_its_answer(self, store: Store) -> None:
        lease = await store.acquire(KEY, "p1", 5)
        await store.record_reply(KEY, lease.generation, ["m1", "m2"], "the reply")
        assert await store.answer("m1") == "the reply"
        assert await store.answer("m2") == "the reply"
        assert await store.answer("never-sent") is None

    @pytest.mark.parametrize("text", ["", "line one\nline two", "ответ 🙂", "x" * 70_000])
    async def test_the_answer_round_trips(self, store: Store, text: str) -> None:
        await store.commit(KEY, None, WriteBatch(answered=["m1"], answer=text))
        assert await store.answer("m1") == text

    async def test_a_batch_without_answer_text_answers_with_empty_text(self, store: Store) -> None:
        await store.commit(KEY, None, WriteBatch(answered=["m1"]))
        assert await store.answer("m1") == ""

    async def test_a_refused_commit_records_no_answer(self, store: Store) -> None:
        lease = await store.acquire(KEY, "p1", 5)
        await store.bump_generation(KEY)
        stale = WriteBatch(answered=["m1"], answer="stale")
        with pytest.raises(StaleGeneration):
            await store.commit(KEY, lease.generation, stale)
        assert await store.answer("m1") is None
        await store.commit(KEY, None, WriteBatch(answered=["m1"], answer="kept"))
        with pytest.raises(AlreadyAnswered):
            await store.commit(KEY, None, WriteBatch(answered=["m2", "m1"], answer="again"))
        assert await store.answer("m1") == "kept"
        assert await store.answer("m2") is None

    async def test_the_answer_is_forgotten_with_its_mark(self, store: Store) -> None:
        await store.commit(KEY, None, WriteBatch(answered=["old"], answer="first"))
        store.answered_retention = -1.0  # every mark is past its retention now
        assert await store.answer("old") is None  # even before a heartbeat prunes it
        await store.heartbeat("p1", 5)
        assert await stored_answered_ids(store) == []
        store.answered_retention = 60.0
        assert await store.answer("old") is None  # the text went with the mark
        await store.commit(KEY, None, WriteBatch(answered=["old"], answer="second"))
        assert await store.answer("old") == "second"

    async def test_a_mark_past_its_retention_does_not_block_a_new_answer(
        self, store: Store
    ) -> None:
        store.answered_retention = 0.005
        await store.commit(KEY, None, WriteBatch(answered=["old"], answer="first"))
        await asyncio.sleep(0.05)  # "old" is past its retention; no heartbeat pruned it
        await store.commit(KEY, None, WriteBatch(answered=["old"], answer="second"))
        store.answered_retention = 60.0
        assert await store.answer("old") == "second"

    async def test_another_process_reads_the_answer(self, store: Store, reopen: Reopen) -> None:
        other = await reopen()
        lease = await other.acquire(KEY, "p2", 5)
        await other.record_reply(KEY, lease.generation, ["m1"], "answered over there")
        assert await store.answer("m1") == "answered over there"


class TestTranscripts:
    async def test_entries_in_order_with_limit(self, store: Store) -> None:
        for i in range(5):
            await store.append_transcript(KEY, None, entry(f"m{i}", 0))
        assert [e.content for e in await store.transcript(KEY, limit=3)] == ["m2", "m3", "m4"]
        full = await store.transcript(KEY)
        assert [e.content for e in full] == [f"m{i}" for i in range(5)]
        conversation = await store.conversation(KEY)
        assert all(e.conversation_id == conversation.id and e.created_at > 0 for e in full)

    async def test_fields_round_trip(self, store: Store) -> None:
        original = TranscriptEntry("assistant", "ответ\n🙂", 7, message_id="m-9")
        await store.append_transcript(KEY, None, original)
        [stored] = await store.transcript(KEY)
        assert (stored.role, stored.content, stored.generation, stored.message_id) == (
            "assistant",
            "ответ\n🙂",
            7,
            "m-9",
        )

    async def test_sessions_have_separate_transcripts(self, store: Store) -> None:
        await store.append_transcript("a", None, entry("for a", 0))
        await store.append_transcript("b", None, entry("for b", 0))
        assert [e.content for e in await store.transcript("a")] == ["for a"]


class TestConversations:
    async def test_current_is_stable(self, store: Store) -> None:
        first = await store.conversation(KEY)
        assert (await store.conversation(KEY)).id == first.id
        assert first.ended_at == 0.0
        assert first.key == KEY

    async def test_new_ends_the_current(self, store: Store) -> None:
        old = await store.conversation(KEY)
        await store.append_transcript(KEY, None, entry("old talk", 0))
        new = await store.new_conversation(KEY, title="fresh start")
        assert new.id != old.id
        assert new.title == "fresh start"
        assert (await store.conversation(KEY)).id == new.id
        assert await store.transcript(KEY) == []
        listed = await store.conversations(KEY)
        assert [c.id for c in listed] == [new.id, old.id]
        assert listed[1].ended_at > 0

    async def test_resume_switches_back(self, store: Store) -> None:
        old = await store.conversation(KEY)
        await store.append_transcript(KEY, None, entry("old talk", 0))
        await store.new_conversation(KEY)
        resumed = await store.resume_conversation(KEY, old.id)
        assert resumed.id == old.id
        assert resumed.ended_at == 0.0
        assert [e.content for e in await store.transcript(KEY)] == ["old talk"]

    async def test_resume_unknown_raises_key_error(self, store: Store) -> None:
        with pytest.raises(KeyError):
            await store.resume_conversation(KEY, "c_nope")

    async def test_resume_of_another_sessions_conversation_is_refused(self, store: Store) -> None:
        theirs = await store.conversation("someone-else")
        with pytest.raises(KeyError):
            await store.resume_conversation(KEY, theirs.id)


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
        a = await store.enqueue("a", "m1", "p1", b"")
        await store.enqueue("b", "m2", "p1", b"")
        assert sorted(await store.pending_keys()) == ["a", "b"]
        await store.drop_pending("a", [a])
        assert await store.pending_keys() == ["b"]
        assert await store.pending("a") == []

    async def test_concurrent_enqueues_get_distinct_ordered_seqs(self, store: Store) -> None:
        seqs = await asyncio.gather(*(store.enqueue(KEY, f"m{i}", "p", b"") for i in range(40)))
        assert len(set(seqs)) == 40
        assert [r.seq for r in await store.pending(KEY)] == sorted(seqs)


class TestLiveness:
    async def test_heartbeat_expires(self, store: Store) -> None:
        await store.heartbeat("p1", 0.2)
        await store.heartbeat("p2", 5)
        assert await store.alive(["p1", "p2", "p3"]) == {"p1": True, "p2": True, "p3": False}
        await asyncio.sleep(0.35)
        assert (await store.alive(["p1"]))["p1"] is False


async def test_close_is_idempotent(store: Store) -> None:
    await store.close()
    await store.close()


class TestAcrossProcesses:
    """A second store object on the same URL stands for another process (or a restart)."""

    async def test_one_winner_across_two_instances(self, store: Store, reopen: Reopen) -> None:
        other = await reopen()
        results = await asyncio.gather(
            *(s.acquire(KEY, f"p{i}", 5) for i, s in enumerate([store, other] * 10)),
            return_exceptions=True,
        )
        assert sum(not isinstance(r, BaseException) for r in results) == 1

    async def test_everything_survives_a_restart(self, store: Store, reopen: Reopen) -> None:
        lease = await store.acquire(KEY, "p1", 5)
        await store.commit(
            KEY,
            lease.generation,
            WriteBatch(
                transcript=[entry("hello", lease.generation)],
                persistent={"model": "m1"},
                answered=["m0"],
            ),
        )
        old = await store.conversation(KEY)
        await store.new_conversation(KEY, "second")
        seq = await store.enqueue(KEY, "m1", "p1", b"payload")
        await store.bump_generation(KEY)
        await store.close()

        again = await reopen()
        assert await again.generation(KEY) == 2
        assert await again.load_persistent(KEY) == {"model": "m1"}
        assert [c.title for c in await again.conversations(KEY)] == ["second", ""]
        assert [e.content for e in await again.transcript(KEY, old.id)] == ["hello"]
        assert [(r.seq, r.payload) for r in await again.pending(KEY)] == [(seq, b"payload")]
        assert await again.is_answered("m0")

    async def test_generations_are_never_reused_after_restart(
        self, store: Store, reopen: Reopen
    ) -> None:
        lease = await store.acquire(KEY, "p1", 0.1)
        await store.close()
        await asyncio.sleep(0.2)
        again = await reopen()
        assert (await again.acquire(KEY, "p2", 5)).generation == lease.generation + 1


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

    async def test_concurrent_adoption_gives_each_record_to_one(self, store: Store) -> None:
        seqs = [await store.enqueue(KEY, f"m{i}", "dead", b"") for i in range(10)]
        results = await asyncio.gather(*(store.adopt(KEY, seqs, "dead", f"p{i}") for i in range(5)))
        adopted = [seq for result in results for seq in result]
        assert sorted(adopted) == seqs


class TestBatchedUpkeep:
    async def test_renew_many_renews_what_is_held_and_reports_what_is_lost(
        self, store: Store
    ) -> None:
        kept = await store.acquire("a", "p1", 5)
        fenced = await store.acquire("b", "p1", 5)
        await store.bump_generation("b")
        expired = await store.acquire("c", "p1", 0.05)
        await asyncio.sleep(0.15)
        renewed = await store.renew_many([kept, fenced, expired], 30)
        assert renewed[1:] == [None, None]
        first = renewed[0]
        assert first is not None
        assert (first.token, first.generation) == (kept.token, kept.generation)
        assert first.expires_at > kept.expires_at + 20
        assert await store.renew_many([], 5) == []
        with pytest.raises(SessionBusy):
            await store.acquire("a", "p2", 5)

    async def test_adopt_orphans_takes_only_dead_owners_records_in_order(
        self, store: Store
    ) -> None:
        await store.heartbeat("alive", 30)
        await store.heartbeat("dead", 0.05)
        x1 = await store.enqueue("x", "m1", "dead", b"1")
        await store.enqueue("x", "m2", "alive", b"2")
        x3 = await store.enqueue("x", "m3", "never-beat", b"3")
        await store.enqueue("y", "m4", "me", b"4")
        await asyncio.sleep(0.15)
        await store.heartbeat("me", 30)
        adopted = await store.adopt_orphans("me", 10)
        assert [(r.key, r.seq, r.owner, r.payload) for r in adopted] == [
            ("x", x1, "me", b"1"),
            ("x", x3, "me", b"3"),
        ]
        assert [r.owner for r in await store.pending("x")] == ["me", "alive", "me"]
        assert await store.adopt_orphans("other", 10) == []

    async def test_adopt_orphans_is_bounded_by_sessions_and_each_record_goes_once(
        self, store: Store
    ) -> None:
        for adopter in ("me", "p0", "p1", "p2"):
            await store.heartbeat(adopter, 30)
        for i in range(12):
            await store.enqueue(f"s{i:02}", f"m{i}", "dead", b"")
            await store.enqueue(f"s{i:02}", f"n{i}", "dead", b"")
        first = await store.adopt_orphans("me", 5)
        assert len({r.key for r in first}) == 5
        assert len(first) == 10
        rest = await asyncio.gather(*(store.adopt_orphans(f"p{i}", 100) for i in range(3)))
        ids = [r.message_id for r in first] + [r.message_id for rs in rest for r in rs]
        assert sorted(ids) == sorted([f"m{i}" for i in range(12)] + [f"n{i}" for i in range(12)])


class TestFailed:
    async def test_a_parked_message_leaves_the_queue_and_is_kept_with_its_reason(
        self, store: Store
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
        await asyncio.sleep(0.05)
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

    async def test_failed_lists_oldest_first_within_the_limit(self, store: Store) -> None:
        for i in range(3):
            seq = await store.enqueue(f"k{i}", f"m{i}", "p", b"")
            await store.park(f"k{i}", [seq], f"reason {i}")
        assert [f.reason for f in await store.failed(2)] == ["reason 0", "reason 1"]
        assert await store.failed(0) == []

    async def test_failed_messages_survive_a_restart(self, store: Store, reopen: Reopen) -> None:
        seq = await store.enqueue(KEY, "m1", "p1", b"x")
        await store.park(KEY, [seq], "failed")
        await store.close()
        again = await reopen()
        assert [f.record.message_id for f in await again.failed()] == ["m1"]


class TestPruning:
    async def test_heartbeats_prune_long_expired_heartbeats_and_leases(
        self, store: Store, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        for module in ("memory", "sqlite"):
            monkeypatch.setattr(f"chatlane.stores.{module}.PRUNE_AFTER", 0.0)
        await store.heartbeat("gone", 0.01)
        await store.acquire(KEY, "gone", 0.01)
        await store.heartbeat("alive", 30)
        await store.acquire("held", "alive", 30)
        await asyncio.sleep(0.05)
        await store.heartbeat("me", 5)
        assert await stored_liveness(store) == (["alive", "me"], ["held"])
