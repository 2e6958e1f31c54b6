"""What an answered mark tells (:meth:`~chatlane.stores.protocols.SessionData.mark`), and
message ids held by one session at a time, over every backend.

A mark keeps the session whose commit set it and why its turn failed, so every
process tells a failed turn from an answered one and another session's message
from its own; a message id queued by one session is refused to every other.
"""

from __future__ import annotations

import pytest

from chatlane.errors import MessageIdInUse
from chatlane.stores import Store, WriteBatch
from chatlane.stores.base import AnsweredMark
from tests.keys import chat_key
from tests.stores.conftest import Reopen
from tests.stores.contract.common import KEY

OTHER = chat_key("bob")


class TestMarks:
    async def test_a_mark_keeps_its_session(self, store: Store) -> None:
        lease = await store.acquire(KEY, "p1", 5)
        await store.record_reply(KEY, lease.generation, ["m1"], "the reply")
        assert await store.mark("m1") == AnsweredMark("the reply", KEY, "")
        assert await store.mark("never-sent") is None

    async def test_a_failed_turn_is_marked_failed_with_its_reason(self, store: Store) -> None:
        notice = "Sorry — the agent failed on this message (RuntimeError)."
        batch = WriteBatch(answered=["m1", "m2"], answer=notice, failure="RuntimeError")
        await store.commit(KEY, None, batch)
        for message_id in ("m1", "m2"):
            assert await store.mark(message_id) == AnsweredMark(notice, KEY, "RuntimeError")
        assert await store.answer("m1") == notice

    async def test_another_process_reads_the_session_and_the_failure(
        self, store: Store, reopen: Reopen
    ) -> None:
        other = await reopen()
        batch = WriteBatch(answered=["m1"], answer="failed there", failure="Boom")
        await other.commit(OTHER, None, batch)
        mark = await store.mark("m1")
        assert mark == AnsweredMark("failed there", OTHER, "Boom")
        assert mark is not None
        assert not mark.belongs_to(KEY)
        assert mark.belongs_to(OTHER)


class TestIdsAcrossSessions:
    async def test_an_id_queued_by_another_session_is_refused(self, store: Store) -> None:
        seq = await store.enqueue(KEY, "m1", "p1", b"alice's")
        with pytest.raises(MessageIdInUse) as refused:
            await store.enqueue(OTHER, "m1", "p2", b"bob's")
        assert (refused.value.message_id, refused.value.key) == ("m1", OTHER)
        assert await store.pending(OTHER) == []
        [kept] = await store.pending(KEY)
        assert (kept.seq, kept.payload, kept.owner) == (seq, b"alice's", "p1")

    async def test_a_fused_admission_refuses_it_and_takes_no_lease(self, store: Store) -> None:
        await store.enqueue(KEY, "m1", "p1", b"alice's")
        with pytest.raises(MessageIdInUse):
            await store.enqueue_and_acquire(OTHER, "m1", "p2", b"bob's", 5)
        assert await store.pending(OTHER) == []
        assert await store.lease_holder(OTHER) is None
        assert await store.generation(OTHER) == 0
        admission = await store.enqueue_and_acquire(OTHER, "m2", "p2", b"bob's", 5)
        assert admission.lease is not None

    async def test_a_failed_message_does_not_push_out_another_sessions(self, store: Store) -> None:
        seq = await store.enqueue(KEY, "m1", "p1", b"alice's")
        await store.park(KEY, [seq], "lost its lease")
        await store.enqueue(OTHER, "m1", "p2", b"bob's")
        with pytest.raises(MessageIdInUse):
            await store.retry_failed("m1", "p3")
        assert [r.payload for r in await store.pending(OTHER)] == [b"bob's"]
        assert [f.record.key for f in await store.failed()] == [KEY]
