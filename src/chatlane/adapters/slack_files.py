"""The files of Slack messages, as chatlane attachments: references, never downloads.

Nothing here talks to Slack or imports slack-sdk: a pure function of the event.
What stays true:

* A message event's ``files`` give one attachment each, in their order
  (:func:`files_of`); an event without them gives none. A file that was
  deleted (``mode: tombstone``) or names neither a URL nor an id is none.
* The reference is the file's ``url_private``: an agent fetches it with the
  bot token in an ``Authorization: Bearer`` header (the app needs the
  ``files:read`` scope); chatlane never hands the token out. A file Slack
  shows only by id (``file_access: check_file_info``, as in Slack Connect
  channels) is referenced by its id, for ``files.info``.
* The kind is read from the MIME type (:func:`~chatlane.attachments.kind_of`),
  except that an audio clip recorded in Slack (``subtype: slack_audio``) is a
  voice message, whatever type Slack serves it as.
* Names and MIME types are cleaned (:mod:`chatlane.attachments`); a size
  Slack does not give is 0, and is never refused for its size.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from chatlane.attachments import clean_mime_type, clean_name, kind_of
from chatlane.types import Attachment, AttachmentKind

__all__ = ["files_of"]

VOICE_CLIP = "slack_audio"
"""The ``subtype`` of an audio clip recorded in Slack."""


def files_of(event: Mapping[str, Any]) -> tuple[Attachment, ...]:
    """The files ``event`` (a ``message`` or ``app_mention``) carries, as attachments."""
    files = event.get("files")
    if not isinstance(files, list):
        return ()
    read = (_attachment(found) for found in files if isinstance(found, dict))
    return tuple(found for found in read if found is not None)


def _attachment(found: Mapping[str, Any]) -> Attachment | None:
    private = _text(found, "url_private")
    ref = private or _text(found, "id")
    if not ref or found.get("mode") == "tombstone":
        return None
    mime_type = clean_mime_type(_text(found, "mimetype"))
    kind = AttachmentKind.VOICE if found.get("subtype") == VOICE_CLIP else kind_of(mime_type)
    size = found.get("size")
    known = size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else 0
    name = clean_name(_text(found, "name") or _text(found, "title"))
    return Attachment(kind, ref, mime_type, known, name, private=bool(private))


def _text(found: Mapping[str, Any], key: str) -> str:
    value = found.get(key)
    return value if isinstance(value, str) else ""
