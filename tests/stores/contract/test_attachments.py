"""Attachments are kept with their message, over every backend: in the durable queue (inside
the stored message) and in the transcript, across a restart too."""

from __future__ import annotations

from chatlane.identity import ChatType, SessionSource
from chatlane.stores import Store, TranscriptEntry, WriteBatch
from chatlane.stores.codec import decode_message, encode_message
from chatlane.types import Attachment, AttachmentKind, InboundMessage
from tests.stores.conftest import Reopen
from tests.stores.contract.common import KEY, entry

ODD_NAMES = (
    "../../etc/passwd",
    "C:\\Windows\\win.ini",
    "фото отпуска 🙂👨‍👩‍👧.jpg",
    "quote\"and'apostrophe;semi%20colon{braces}",
    "n" * 1000 + ".pdf",
)
"""Names with separators, Unicode, quotes and length: stored as given, never as paths."""

ATTACHMENTS = (
    Attachment(AttachmentKind.IMAGE, "AgACAgIAAxkBAAI", "image/jpeg", 123_456),
    *(
        Attachment(AttachmentKind.DOCUMENT, f"doc-{i}", "application/pdf", i, name)
        for i, name in enumerate(ODD_NAMES)
    ),
    Attachment(AttachmentKind.VOICE, "https://files.example/v.ogg?sig=1", "audio/ogg"),
)

SOURCE = SessionSource("telegram", chat_id="42", chat_type=ChatType.DM, user_id="42")


def with_files(text: str = "", message_id: str = "m1") -> InboundMessage:
    return InboundMessage(SOURCE, text, id=message_id, attachments=ATTACHMENTS)


class TestQueuedAttachments:
    async def test_a_queued_message_keeps_its_attachments(self, store: Store) -> None:
        message = with_files("see these")
        await store.enqueue(KEY, message.id, "p1", encode_message(message))
        [record] = await store.pending(KEY)
        assert decode_message(record.payload) == message

    async def test_a_message_of_attachments_alone_round_trips(self, store: Store) -> None:
        message = with_files("")
        await store.enqueue(KEY, message.id, "p1", encode_message(message))
        [record] = await store.pending(KEY)
        assert decode_message(record.payload).attachments == ATTACHMENTS

    async def test_queued_attachments_survive_a_restart(self, store: Store, reopen: Reopen) -> None:
        message = with_files("kept")
        await store.enqueue(KEY, message.id, "p1", encode_message(message))
        await store.close()
        again = await reopen()
        [record] = await again.pending(KEY)
        assert decode_message(record.payload) == message


class TestTranscriptAttachments:
    async def test_entries_keep_their_attachments_in_order(self, store: Store) -> None:
        first = TranscriptEntry("user", "look", 0, message_id="m1", attachments=ATTACHMENTS)
        second = TranscriptEntry("user", "", 0, message_id="m2", attachments=ATTACHMENTS[:1])
        batch = WriteBatch(transcript=[first, second, entry("nice", 0, "assistant")])
        await store.commit(KEY, None, batch)
        stored = await store.transcript(KEY)
        assert [e.attachments for e in stored] == [ATTACHMENTS, ATTACHMENTS[:1], ()]
        assert [e.content for e in stored] == ["look", "", "nice"]

    async def test_an_entry_without_attachments_reads_back_with_none(self, store: Store) -> None:
        await store.append_transcript(KEY, None, entry("plain", 0))
        [stored] = await store.transcript(KEY)
        assert stored.attachments == ()

    async def test_transcript_attachments_survive_a_restart(
        self, store: Store, reopen: Reopen
    ) -> None:
        kept = TranscriptEntry("user", "", 0, message_id="m1", attachments=ATTACHMENTS)
        await store.commit(KEY, None, WriteBatch(transcript=[kept]))
        await store.close()
        again = await reopen()
        [stored] = await again.transcript(KEY)
        assert stored.attachments == ATTACHMENTS
