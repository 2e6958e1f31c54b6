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
    photo = _photo(message)
    if photo is not None:
        return photo
    for field, kind, fixed_mime_type in _FILES:
        found = getattr(message, field)
        if found is not None:
            mime_type = fixed_mime_type or getattr(found, "mime_type", None)
            return _file(kind, found.file_id, mime_type, found, getattr(found, "file_name", None))
    return None


def _photo(message: Message) -> Attachment | None:
    if not message.photo:
        return None
    largest = max(message.photo, key=lambda size: (size.width * size.height, size.file_size or 0))
    return Attachment(AttachmentKind.IMAGE, largest.file_id, PHOTO_MIME_TYPE, _size(largest))


_FILES: tuple[tuple[str, AttachmentKind, str | None], ...] = (
    ("animation", AttachmentKind.VIDEO, None),  # a GIF: before the document Telegram adds
    ("video", AttachmentKind.VIDEO, None),
    ("video_note", AttachmentKind.VIDEO, "video/mp4"),
    ("voice", AttachmentKind.VOICE, None),
    ("audio", AttachmentKind.AUDIO, None),
    ("document", AttachmentKind.DOCUMENT, None),
)
"""The fields of a message that hold one file, in the order they are looked at, each with
its kind and the MIME type Telegram leaves out (a video note is always MP4); a field's
``file_name`` and ``mime_type`` are read where its type has them."""


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
