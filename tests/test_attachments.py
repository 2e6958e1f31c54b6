"""Attachments in the core types: stored only when there are some, cleaned like text,
named safely, described on one line, and counted against the queue's bytes."""

from __future__ import annotations

import pytest

from chatlane.agents.demo import DemoAgent
from chatlane.attachments import (
    MAX_MIME_TYPE,
    MAX_NAME,
    clean_mime_type,
    clean_name,
    describe,
    human_size,
    kind_of,
    oversized,
    summary,
    too_large_notice,
)
from chatlane.identity import SessionSource
from chatlane.runtime.capacity import message_bytes
from chatlane.stores.codec import decode_message, encode_message
from chatlane.testing import GatewayHarness
from chatlane.types import Attachment, AttachmentKind, InboundMessage

SOURCE = SessionSource("telegram", chat_id="42", user_id="42")
PHOTO = Attachment(AttachmentKind.IMAGE, "AgACAgI", "image/jpeg", 12_345, "photo.jpg")


def test_a_message_without_attachments_stores_no_more_than_before() -> None:
    encoded = encode_message(InboundMessage(SOURCE, "hi", id="m1", received_at=1.0))
    assert b"attachments" not in encoded
    assert b"internal" not in encoded  # every field left at its default is left out
    assert decode_message(encoded).attachments == ()


def test_a_message_with_attachments_round_trips() -> None:
    message = InboundMessage(SOURCE, "", id="m1", attachments=(PHOTO,))
    assert decode_message(encode_message(message)) == message


def test_an_attachment_leaves_out_what_is_unknown() -> None:
    bare = Attachment(AttachmentKind.VOICE, "v1")
    encoded = encode_message(InboundMessage(SOURCE, "", id="m1", attachments=(bare,)))
    assert b'"attachments":[{"kind":"voice","ref":"v1"}]' in encoded


def test_cleaned_replaces_lone_surrogates_in_attachments() -> None:
    odd = Attachment(AttachmentKind.DOCUMENT, "f\ud800", "text/\udc00plain", 1, "a\ud83d.txt")
    message = InboundMessage(SOURCE, "x", attachments=(odd, PHOTO)).cleaned()
    first = message.attachments[0]
    assert (first.ref, first.mime_type, first.name) == (
        "f\ufffd",
        "text/\ufffdplain",
        "a\ufffd.txt",
    )
    assert message.attachments[1] is PHOTO
    encode_message(message)  # now UTF-8 can carry it


def test_cleaned_keeps_the_same_message_when_nothing_is_odd() -> None:
    message = InboundMessage(SOURCE, "fine", attachments=(PHOTO,))
    assert message.cleaned() is message


@pytest.mark.parametrize(
    ("raw", "kept"),
    [
        ("../../etc/passwd", "../../etc/passwd"),
        ("C:\\temp\\a.txt", "C:\\temp\\a.txt"),
        ("фото 🙂👨‍👩‍👧.jpg", "фото 🙂👨‍👩‍👧.jpg"),
        ("two\nlines\x00and\u2028more\t.txt", "two lines and more .txt"),
        ("bad \ud800 half", "bad \ufffd half"),
        ("   padded   ", "padded"),
    ],
)
def test_a_name_keeps_separators_and_unicode_on_one_line(raw: str, kept: str) -> None:
    assert clean_name(raw) == kept


def test_a_long_name_is_cut_keeping_its_extension() -> None:
    cut = clean_name("n" * 1000 + ".pdf")
    assert len(cut) == MAX_NAME
    assert cut.endswith("….pdf")
    no_extension = clean_name("x" * 1000)
    assert len(no_extension) == MAX_NAME
    assert no_extension.endswith("…")
    long_extension = clean_name("a." + "e" * 1000)
    assert len(long_extension) == MAX_NAME


def test_a_mime_type_is_one_short_lower_case_line() -> None:
    assert clean_mime_type("Image/JPEG") == "image/jpeg"
    assert clean_mime_type("text/plain\r\nX-Evil: 1") == "text/plain x-evil: 1"
    assert len(clean_mime_type("a/" + "b" * 500)) == MAX_MIME_TYPE


@pytest.mark.parametrize(
    ("size", "shown"),
    [
        (0, "0 bytes"),
        (1, "1 byte"),
        (1023, "1023 bytes"),
        (1024, "1 KB"),
        (12_345, "12 KB"),
        (1_572_864, "1.5 MB"),
        (20 * 1024 * 1024, "20 MB"),
        (3 * 1024**5, "3072 TB"),
    ],
)
def test_sizes_read_in_the_largest_whole_unit(size: int, shown: str) -> None:
    assert human_size(size) == shown


def test_describe_names_what_is_known() -> None:
    assert describe(PHOTO) == "photo.jpg image/jpeg 12 KB"
    assert describe(Attachment(AttachmentKind.VOICE, "v1", "audio/ogg")) == "voice audio/ogg"
    assert summary(()) == ""
    assert summary((PHOTO,)) == "1 attachment: photo.jpg image/jpeg 12 KB"
    two = summary((PHOTO, Attachment(AttachmentKind.VIDEO, "v")))
    assert two == "2 attachments: photo.jpg image/jpeg 12 KB; video"


def test_a_url_reference_is_told_from_a_file_id() -> None:
    assert Attachment(AttachmentKind.IMAGE, "https://example.org/a.png").is_url
    assert not PHOTO.is_url
    assert not Attachment(AttachmentKind.IMAGE, "ftp://example.org/a.png").is_url


def test_attachments_count_against_the_queued_bytes() -> None:
    plain = InboundMessage(SOURCE, "hi")
    with_photo = InboundMessage(SOURCE, "hi", attachments=(PHOTO,))
    assert message_bytes(with_photo) > message_bytes(plain) + len(PHOTO.ref)


async def test_queue_and_steer_commands_keep_the_message_attachments() -> None:
    async with GatewayHarness(DemoAgent()) as h:
        await h.send("/queue look", chat_id="c", attachments=(PHOTO,))
        await h.send("/now look again", chat_id="d", attachments=(PHOTO,))
        await h.settle()
        described = "(1 attachment: photo.jpg image/jpeg 12 KB)"
        assert f"echo: look {described}" in await h.replies(chat_id="c", count=2)
        assert await h.replies(chat_id="d", count=1) == [f"echo: look again {described}"]


@pytest.mark.parametrize(
    ("mime_type", "kind"),
    [
        ("image/png", AttachmentKind.IMAGE),
        ("Audio/MPEG", AttachmentKind.AUDIO),
        ("video/webm", AttachmentKind.VIDEO),
        ("application/pdf", AttachmentKind.DOCUMENT),
        ("text/plain; charset=utf-8", AttachmentKind.DOCUMENT),
        ("image", AttachmentKind.DOCUMENT),
        ("", AttachmentKind.DOCUMENT),
    ],
)
def test_a_kind_is_read_from_a_mime_type_alone(mime_type: str, kind: AttachmentKind) -> None:
    assert kind_of(mime_type) is kind


def test_the_first_file_over_the_cap_is_named_and_an_unknown_size_never_is() -> None:
    unknown = Attachment(AttachmentKind.VOICE, "v")
    large = Attachment(AttachmentKind.IMAGE, "p", size=2048)
    assert oversized((unknown, PHOTO), 1024) is PHOTO
    assert oversized((unknown,), 1) is None
    assert too_large_notice(large, 1024) == (
        "Sorry — This photo is 2 KB; I can take files of up to 1 KB. "
        "It was not read: please send a smaller one."
    )
