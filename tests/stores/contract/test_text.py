"""What text every backend keeps, across the protocols: every ``str`` a store keeps as
text comes back exactly as given, NUL (U+0000) included, whichever call wrote it; a text
holding a lone surrogate, which no UTF-8 carries, is refused by every call alike.

A NUL reaches the store with a user's message (the gateway takes it as it came), an id or
a key a platform made, or an agent's reply; PostgreSQL's ``text`` cannot hold one, so
that store escapes it (:mod:`chatlane.stores.postgres.text`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest

from chatlane.errors import StoreError
from chatlane.identity import SessionKey
from chatlane.stores import DeliveryDraft, Store, TranscriptEntry, WriteBatch
from chatlane.stores.base import PENDING
from chatlane.testing import GatewayHarness
from chatlane.types import Attachment, AttachmentKind
from tests.keys import odd_keys
from tests.runtime.agents import EchoAgent
from tests.stores.conftest import StoreClock
from tests.stores.contract.common import KEY

NUL_KEY = odd_keys("main:test:dm:a\x00b\x01\x01c")[0]

CLOSE_CALLS = [
    "\x00",
    "\x01",
    "\x01\x01",
    "\x01\x02",
    "\x00\x01",
    "\x01\x00",
    "\x02",
    "\x01\x01\x01",
]
"""Texts an escape of NUL could take for one another: each must stay itself."""


class TestNul:
    async def test_a_message_with_nul_is_answered_and_kept(self, store: Store) -> None:
        async with GatewayHarness(EchoAgent(), store=store) as h:
            await h.send("a\x00b", chat_id="c\x00")
            assert await h.replies(chat_id="c\x00", count=1) == ["echo: a\x00b"]
            await h.settle()
            key = h.session_key(chat_id="c\x00")
            kept = [e.content for e in await store.transcript(key)]
            assert kept == ["a\x00b", "echo: a\x00b"]

    async def test_a_turn_keeps_nul_in_everything_it_writes(self, store: Store) -> None:
        key, message_id = NUL_KEY, "m\x001"
        admission = await store.enqueue_and_acquire(key, message_id, "p1", b"\x00", 5)
        lease = admission.lease
        assert lease is not None
        assert (lease.key, [r.message_id for r in await store.pending(key)]) == (key, [message_id])
        entries = [
            TranscriptEntry("user", "a\x00b", lease.generation, message_id=message_id),
            TranscriptEntry("assistant", "reply \x00\x01", lease.generation),
        ]
        drafts = [DeliveryDraft("d\x00", "lane\x00", "target\x00", b"\x00")]
        batch = WriteBatch(
            transcript=entries,
            persistent={"field\x00": "value\x00"},
            answered=[message_id],
            done=[admission.seq],
            answer="reply \x00\x01",
            deliveries=drafts,
            title="title \x00",
        )
        assert await store.commit_and_release(lease, batch)
        kept = [(e.role, e.content, e.message_id) for e in await store.transcript(key)]
        assert kept == [(e.role, e.content, e.message_id) for e in entries]
        assert await store.answer(message_id) == "reply \x00\x01"
        assert await store.is_answered(message_id)
        assert not await store.is_answered("m")
        assert await store.load_persistent(key) == {"field\x00": "value\x00"}
        assert await store.load_fields(key, ["field\x00"]) == {"field\x00": "value\x00"}
        [conversation] = await store.conversations(key)
        assert (conversation.key, conversation.title) == (key, "title \x00")
        assert await store.pending(key) == []
        [claimed] = await store.claim_deliveries(["lane\x00"], "p1", 5, 10)
        assert (claimed.id, claimed.lane, claimed.target) == ("d\x00", "lane\x00", "target\x00")
        again = await store.acquire(key, "p\x002", 5, token="t\x00")
        [renewed] = await store.renew_many([again], 5)
        assert renewed is not None
        assert (renewed.key, renewed.token) == (key, "t\x00")
        assert await store.lease_holder(key) == "p\x002"

    async def test_a_failed_message_keeps_nul(self, store: Store, clock: StoreClock) -> None:
        seq = await store.enqueue(NUL_KEY, "m\x00", "p\x001", b"\x00")
        assert await store.pending_keys() == [NUL_KEY]
        await store.park(NUL_KEY, [seq], "failed: \x00")
        [failed] = await store.failed()
        record = failed.record
        assert (record.key, record.message_id, record.owner) == (NUL_KEY, "m\x00", "p\x001")
        assert failed.reason == "failed: \x00"
        retried = await store.retry_failed("m\x00", "p\x001")
        assert retried is not None
        assert (retried.key, retried.seq, retried.message_id) == (NUL_KEY, seq, "m\x00")
        await store.heartbeat("p\x001", 0.01)
        await clock.advance(0.05)
        [adopted] = await store.adopt_orphans("p2", 10)
        assert (adopted.key, adopted.message_id, adopted.owner) == (NUL_KEY, "m\x00", "p2")

    @pytest.mark.parametrize("text", CLOSE_CALLS)
    async def test_texts_an_escape_could_confuse_stay_apart(self, store: Store, text: str) -> None:
        key = SessionKey(f"k{text}")
        others = [SessionKey(f"k{t}") for t in CLOSE_CALLS if t != text]
        await store.enqueue(key, f"m{text}", "p1", b"")
        for other in others:
            await store.enqueue(other, f"m{other}", "p1", b"")
        assert [r.message_id for r in await store.pending(key)] == [f"m{text}"]
        await store.commit(
            key, None, WriteBatch(transcript=[TranscriptEntry("user", text, 0)], answered=[text])
        )
        assert [e.content for e in await store.transcript(key)] == [text]
        assert await store.answer(text) == ""
        assert not any([await store.is_answered(t) for t in CLOSE_CALLS if t != text])
        assert sorted(await store.pending_keys()) == sorted([key, *others])


LONE = "a\ud800b"
"""A lone surrogate: no UTF-8 carries it, so no store can keep it (the gateway makes each
U+FFFD; a store given one refuses it)."""

Call = Callable[[Store], Awaitable[object]]

PHOTO = Attachment(AttachmentKind.IMAGE, "f1", "image/jpeg", 10, name=LONE)

WRITES: dict[str, Call] = {
    "transcript content": lambda s: s.commit(
        KEY, None, WriteBatch(transcript=[TranscriptEntry("user", LONE, 0)], answered=["m1"])
    ),
    "transcript message id": lambda s: s.commit(
        KEY, None, WriteBatch(transcript=[TranscriptEntry("user", "hi", 0, message_id=LONE)])
    ),
    "attachment name": lambda s: s.commit(
        KEY, None, WriteBatch(transcript=[TranscriptEntry("user", "hi", 0, attachments=(PHOTO,))])
    ),
    "answer": lambda s: s.commit(KEY, None, WriteBatch(answered=["m1"], answer=LONE)),
    "answered id": lambda s: s.commit(KEY, None, WriteBatch(answered=["m1", LONE])),
    "title": lambda s: s.commit(KEY, None, WriteBatch(answered=["m1"], title=LONE)),
    "field name": lambda s: s.commit(KEY, None, WriteBatch(answered=["m1"], persistent={LONE: 1})),
    "delivery target": lambda s: s.commit(
        KEY, None, WriteBatch(answered=["m1"], deliveries=[DeliveryDraft("d1", "l", LONE, b"")])
    ),
    "new conversation's title": lambda s: s.new_conversation(KEY, LONE),
    "session key": lambda s: s.enqueue(SessionKey(LONE), "m1", "p1", b""),
    "message id": lambda s: s.enqueue(KEY, LONE, "p1", b""),
    "fused message id": lambda s: s.enqueue_and_acquire(KEY, LONE, "p1", b"", 5),
    "lease holder": lambda s: s.acquire(KEY, LONE, 5),
    "lease token": lambda s: s.acquire_and_read(KEY, "p1", 5, token=LONE),
    "failure reason": lambda s: s.park(KEY, [1], LONE),
    "heartbeat": lambda s: s.heartbeat(LONE, 5),
    "recorded delivery": lambda s: s.record_deliveries([DeliveryDraft(LONE, "l", "t", b"")]),
}
"""Calls that would keep a text holding a lone surrogate, by what holds it."""

READS: dict[str, Call] = {
    "generation": lambda s: s.generation(SessionKey(LONE)),
    "pending": lambda s: s.pending(SessionKey(LONE)),
    "persistent fields": lambda s: s.load_persistent(SessionKey(LONE)),
    "answer": lambda s: s.answer(LONE),
    "conversation's transcript": lambda s: s.transcript(KEY, LONE),
    "alive": lambda s: s.alive([LONE]),
}
"""Calls that only read, naming such a text."""


class TestLoneSurrogates:
    @pytest.mark.parametrize("call", WRITES.values(), ids=WRITES.keys())
    async def test_a_text_no_utf8_carries_is_refused_and_nothing_is_written(
        self, store: Store, call: Call
    ) -> None:
        seq = await store.enqueue(KEY, "m0", "p1", b"")
        assert seq == 1  # the failure reason's call parks it
        with pytest.raises(StoreError) as refused:
            await call(store)
        assert not refused.value.maybe_applied  # nothing reached a server
        assert [r.message_id for r in await store.pending(KEY)] == ["m0"]
        assert await store.failed() == []
        assert await store.generation(KEY) == 0
        assert await store.transcript(KEY) == []
        assert [c.title for c in await store.conversations(KEY)] == [""]
        assert not await store.is_answered("m1")
        assert await store.load_persistent(KEY) == {}
        assert await store.deliveries(PENDING) == []
        assert await store.alive(["p1"]) == {"p1": False}

    @pytest.mark.parametrize("call", READS.values(), ids=READS.keys())
    async def test_a_read_naming_one_is_refused_alike(self, store: Store, call: Call) -> None:
        with pytest.raises(StoreError) as refused:
            await call(store)
        assert not refused.value.maybe_applied
