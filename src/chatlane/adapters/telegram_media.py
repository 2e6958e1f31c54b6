"""The files of Telegram messages, as chatlane attachments: references, never downloads.

What stays true:

* A message with a photo, document, voice note, audio file, video, video note
  or animation has exactly one attachment (an album arrives as one message per
  file); every other message has none (:func:`attachment_of`).
* A photo is its largest size; its MIME type is ``image/jpeg`` (Telegram
  re-encodes photos so). The reference is Telegram's ``file_id``: an agent gets
  the file with ``getFile`` and the bot token, which chatlane never hands out.
* Names and MIME types are cleaned (:mod:`chatlane.attachments`); a size
  Telegram does not give is 0, and is never refused for its size.
* A file larger than the cap is refused as a whole message, with a notice
  naming it and the cap (:func:`~chatlane.attachments.too_large_notice`):
  never silently dropped.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from telegram import Message
from telegram.ext import filters

from chatlane.attachments import clean_mime_type, clean_name
from chatlane.types import Attachment, AttachmentKind

__all__ = ["MEDIA", "attachment_of"]

MEDIA = (
    filters.PHOTO
    | filters.Document.ALL
    | filters.VOICE
    | filters.AUDIO
    | filters.VIDEO
    | filters.VIDEO_NOTE
    | filters.ANIMATION
)
"""The messages whose file becomes an attachment."""

PHOTO_MIME_TYPE = "image/jpeg"


def attachment_of(message: Message) -> Attachment | None:
    """The file ``message`` carries, as an attachment; None for a message without one."""
    for read in _READERS:
        found = read(message)
        if found is not None:
            return found
    return None


def _photo(message: Message) -> Attachment | None:
    if not message.photo:
        return None
    largest = max(message.photo, key=lambda size: (size.width * size.height, size.file_size or 0))
    return Attachment(AttachmentKind.IMAGE, largest.file_id, PHOTO_MIME_TYPE, _size(largest))


def _animation(message: Message) -> Attachment | None:
    """An animation (a GIF, sent as an MPEG-4 video); Telegram adds it as a document too."""
    found = message.animation
    if found is None:
        return None
    return _file(AttachmentKind.VIDEO, found.file_id, found.mime_type, found, found.file_name)


def _video(message: Message) -> Attachment | None:
    found = message.video
    if found is None:
        return None
    return _file(AttachmentKind.VIDEO, found.file_id, found.mime_type, found, found.file_name)


def _video_note(message: Message) -> Attachment | None:
    found = message.video_note
    if found is None:
        return None
    return _file(AttachmentKind.VIDEO, found.file_id, "video/mp4", found, None)


def _voice(message: Message) -> Attachment | None:
    found = message.voice
    if found is None:
        return None
    return _file(AttachmentKind.VOICE, found.file_id, found.mime_type, found, None)


def _audio(message: Message) -> Attachment | None:
    found = message.audio
    if found is None:
        return None
    return _file(AttachmentKind.AUDIO, found.file_id, found.mime_type, found, found.file_name)


def _document(message: Message) -> Attachment | None:
    found = message.document
    if found is None:
        return None
    return _file(AttachmentKind.DOCUMENT, found.file_id, found.mime_type, found, found.file_name)


_READERS: tuple[Callable[[Message], Attachment | None], ...] = (
    _photo,
    _animation,  # before the document Telegram sends with it
    _video,
    _video_note,
    _voice,
    _audio,
    _document,
)


class _Sized(Protocol):
    @property
    def file_size(self) -> int | None: ...


def _size(found: _Sized) -> int:
    size = found.file_size
    return size if size is not None and size > 0 else 0


def _file(
    kind: AttachmentKind, file_id: str, mime_type: str | None, found: _Sized, name: str | None
) -> Attachment:
    return Attachment(
        kind, file_id, clean_mime_type(mime_type or ""), _size(found), clean_name(name or "")
    )
