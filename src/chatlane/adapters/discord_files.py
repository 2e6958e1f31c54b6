"""The files of Discord messages, as chatlane attachments: references, never downloads.

What stays true:

* A message's attachments give one chatlane attachment each, in their order
  (:func:`files_of`); the reference is the file's CDN URL, which an agent
  fetches without a token. Discord signs these URLs and they expire (after
  about a day), so an agent fetches a file while its turn runs.
* A voice message (the message's ``voice`` flag, or an attachment with a
  duration and a waveform) is ``voice``; any other file's kind is read from
  its content type (:func:`~chatlane.attachments.kind_of`).
* Names and content types are cleaned (:mod:`chatlane.attachments`); a size
  Discord does not give is 0, and is never refused for its size.
"""

from __future__ import annotations

import discord

from chatlane.attachments import clean_mime_type, clean_name, kind_of
from chatlane.types import Attachment, AttachmentKind

__all__ = ["files_of"]


def files_of(message: discord.Message) -> tuple[Attachment, ...]:
    """The files ``message`` carries, as attachments."""
    voice = message.flags.voice
    return tuple(_attachment(found, voice=voice) for found in message.attachments)


def _attachment(found: discord.Attachment, *, voice: bool) -> Attachment:
    mime_type = clean_mime_type(found.content_type or "")
    is_voice = voice or found.is_voice_message()
    kind = AttachmentKind.VOICE if is_voice else kind_of(mime_type)
    size = found.size if found.size > 0 else 0
    return Attachment(kind, found.url, mime_type, size, clean_name(found.filename))
