"""The contract of :class:`~chatlane.stores.protocols.SessionData`, over every backend.

Tests that let time pass use the ``clock`` fixture: it moves the memory and
SQLite stores' clock at once, and waits for real with Redis, which reads its
server's ``TIME`` (so TTLs here stay short).
"""

from __future__ import annotations

import math

import pytest

from chatlane.errors import (
    AlreadyAnswered,
    StaleGeneration,
    StoreError,
)
from chatlane.stores import Store, TranscriptEntry, WriteBatch
from chatlane.stores.protocols import SessionData
from chatlane.types import SessionKey
from tests.keys import chat_key
from tests.stores.conftest import Reopen, StoreClock, stored_answered_ids
from tests.stores.contract.common import KEY, entry


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
        assert (raised.value.key, raised.value.generation, raised.value.current) == (KEY, 1, 2)
        assert raised.value.session_key == KEY
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
        assert (raised.value.key, raised.value.message_ids) == (KEY, ["m2"])
        assert [e.content for e in await store.transcript(KEY)] == ["first answer"]
        assert await store.is_answered("m1")
        assert not await store.is_answered("m3")

    async def test_the_refusal_names_the_answered_ids_as_the_batch_does(self, store: Store) -> None:
        await store.commit(KEY, None, WriteBatch(answered=["m1", "m2"]))
        with pytest.raises(AlreadyAnswered) as raised:
            await store.commit(KEY, None, WriteBatch(answered=["m2", "m3", "m1", "m2"]))
        assert raised.value.message_ids == ["m2", "m1", "m2"]
        assert not await store.is_answered("m3")

    async def test_an_answered_mark_is_forgotten_after_its_retention(
        self, store: Store, clock: StoreClock
    ) -> None:
        store.answered_retention = 2.0  # "new" outlives a second's delay on a real clock
        await store.commit(KEY, None, WriteBatch(answered=["old"]))
        await clock.advance(1.1)
        await store.commit(KEY, None, WriteBatch(answered=["new"]))
        with pytest.raises(AlreadyAnswered):
            await store.commit(KEY, None, WriteBatch(answered=["old"]))
        await clock.advance(1.0)  # "old" is past its retention, "new" is not
        await store.heartbeat("p1", 5)
        assert not await store.is_answered("old")
        assert await store.is_answered("new")
        with pytest.raises(AlreadyAnswered):
            await store.commit(KEY, None, WriteBatch(answered=["new"]))
        await store.commit(KEY, None, WriteBatch(answered=["old"]))  # a mark of its own again
        assert await store.is_answered("old")

    async def test_a_heartbeat_deletes_marks_past_their_retention(
        self, store: Store, clock: StoreClock
    ) -> None:
        store.answered_retention = 0.6
        await store.commit(KEY, None, WriteBatch(answered=["m1", "m2"]))
        await clock.advance(0.7)
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
        await store.bump_generation(chat_key("other"))
        await store.append_transcript(KEY, lease.generation, entry("ok", lease.generation))
        assert len(await store.transcript(KEY)) == 1


class TestValues:
    """Persistent values are JSON, kept apart from the caller's objects, in every backend."""

    @pytest.mark.parametrize("bad", [{1, 2}, b"bytes", object(), float, 1j])
    async def test_a_value_that_is_not_json_is_refused_whole(
        self, store: Store, bad: object
    ) -> None:
        with pytest.raises(StoreError, match=r"'when'.*not JSON-compatible"):
            await store.set_persistent(KEY, None, ok=1, when=bad)
        assert await store.load_persistent(KEY) == {}

    async def test_json_shapes_come_back_as_json(self, store: Store) -> None:
        odd = {"inf": float("inf"), "big": 2**100, "lone": "\ud800"}
        await store.set_persistent(KEY, None, t=(1, "two"), d={1: "one"}, nan=float("nan"), **odd)
        loaded = await store.load_persistent(KEY)
        assert math.isnan(loaded.pop("nan"))
        assert loaded == {"t": [1, "two"], "d": {"1": "one"}, **odd}

    async def test_changing_what_was_written_changes_nothing_stored(self, store: Store) -> None:
        value: dict[str, list[int]] = {"ids": [1]}
        batch = WriteBatch(persistent={"d": value})
        await store.commit(KEY, None, batch)
        value["ids"].append(2)
        value["new"] = []
        batch.persistent["d"] = "replaced"
        assert await store.load_persistent(KEY) == {"d": {"ids": [1]}}

    async def test_changing_what_was_read_changes_nothing_stored(self, store: Store) -> None:
        await store.set_persistent(KEY, None, d={"ids": [1]}, l=[1])
        read = await store.load_persistent(KEY)
        read["d"]["ids"].append(2)
        read["l"].clear()
        read["added"] = True
        assert await store.load_persistent(KEY) == {"d": {"ids": [1]}, "l": [1]}


class TestLoadFields:
    """Some of a key's persistent fields, read alone: as ``load_persistent`` has them."""

    @pytest.mark.parametrize("form", ["own", "derived"])
    async def test_the_named_fields_that_are_stored_come_back(
        self, store: Store, form: str
    ) -> None:
        load = SessionData.load_fields if form == "derived" else type(store).load_fields
        await store.set_persistent(KEY, None, a=1, b={"x": [1]}, gone=None, c="three")
        await store.set_persistent(chat_key("other"), None, a="not this key's")
        asked = ["b", "gone", "never", "a", "a"]
        assert await load(store, KEY, asked) == {"a": 1, "b": {"x": [1]}, "gone": None}
        assert await load(store, KEY, []) == {}
        assert await load(store, chat_key("unknown"), ["a"]) == {}

    async def test_changing_what_was_read_changes_nothing_stored(self, store: Store) -> None:
        await store.set_persistent(KEY, None, d={"ids": [1]})
        read = await store.load_fields(KEY, ["d"])
        read["d"]["ids"].append(2)
        assert await store.load_fields(KEY, ["d"]) == {"d": {"ids": [1]}}


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
        self, store: Store, clock: StoreClock
    ) -> None:
        store.answered_retention = 1.0
        await store.commit(KEY, None, WriteBatch(answered=["old"], answer="first"))
        await clock.advance(1.5)  # "old" is past its retention; no heartbeat pruned it
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

    async def test_interleaved_conversations_keep_their_own_entries_in_order(
        self, store: Store
    ) -> None:
        """Appends to several sessions take turns, a session starts a new conversation and
        resumes its first; every conversation's last entries, at every limit, are its own."""
        keys = [chat_key(f"talk-{n}") for n in range(3)]
        written: dict[str, list[str]] = {}

        async def say(key: SessionKey, *texts: str) -> None:
            await store.append_transcript(key, None, *(entry(t, 0) for t in texts))
            written.setdefault((await store.conversation(key)).id, []).extend(texts)

        first = {key: (await store.conversation(key)).id for key in keys}
        for turn in range(4):
            for n, key in enumerate(keys):
                await say(key, f"{n}.{turn}", f"{n}.{turn} answer")
        await store.new_conversation(keys[0])
        await say(keys[0], "fresh")
        for n, key in enumerate(keys):
            await say(key, f"{n}.later")
        await store.resume_conversation(keys[0], first[keys[0]])
        await say(keys[0], "back", "back answer")
        assert len(written) == len(keys) + 1
        owner = {c.id: key for key in keys for c in await store.conversations(key)}
        for conversation, texts in written.items():
            key = owner[conversation]
            for limit in (1, 2, 3, len(texts), len(texts) + 5):
                stored = await store.transcript(key, conversation, limit)
                assert [e.content for e in stored] == texts[-limit:]
                assert {e.conversation_id for e in stored} == {conversation}
        assert await store.transcript(keys[1], "c_no_such_conversation") == []

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
        await store.append_transcript(chat_key("a"), None, entry("for a", 0))
        await store.append_transcript(chat_key("b"), None, entry("for b", 0))
        assert [e.content for e in await store.transcript(chat_key("a"))] == ["for a"]
