"""Attachments as text: the names adapters store, and the lines agents and notices show.

What stays true:

* :func:`clean_name` and :func:`clean_mime_type` make what a sender wrote safe
  to store and to show on one line: no lone surrogates, no control
  characters, whitespace collapsed, at most :data:`MAX_NAME` (or
  :data:`MAX_MIME_TYPE`) characters. Separators and any other Unicode stay:
  a name is text, never a path.
* :func:`describe` is one line per attachment: its name (or its kind when it
  has none), its MIME type and its size, each only when known.
* :func:`kind_of` reads a kind from a MIME type alone, the same for every
  platform that gives no other hint: ``image/*``, ``audio/*`` and ``video/*``
  are their kinds, anything else (an unknown type too) is a document.
* A message with a file over its platform's cap is refused as a whole, with
  one wording on every platform (:func:`too_large_notice`): never silently
  dropped. A file of unknown size (0) is never over a cap.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Sequence

from chatlane.types import Attachment, AttachmentKind, clean_text

__all__ = [
    "MAX_MIME_TYPE",
    "MAX_NAME",
    "clean_mime_type",
    "clean_name",
    "describe",
    "human_size",
    "kind_of",
    "oversized",
    "summary",
    "too_large_notice",
]

MAX_NAME = 255
"""Characters of a file name kept (a longer one is cut, its extension kept)."""
MAX_MIME_TYPE = 127
"""Characters of a MIME type kept (RFC 6838 allows 127 for each half; more is not one)."""
_MAX_SUFFIX = 16
"""The longest extension kept when a name is cut."""
_UNITS = ("bytes", "KB", "MB", "GB", "TB")


def clean_name(name: str) -> str:
    """``name`` on one line, without control characters, cut to :data:`MAX_NAME` characters."""
    flat = _one_line(name)
    if len(flat) <= MAX_NAME:
        return flat
    stem, dot, suffix = flat.rpartition(".")
    if not dot or not stem or len(suffix) > _MAX_SUFFIX:
        return flat[: MAX_NAME - 1] + "…"
    return f"{stem[: MAX_NAME - len(suffix) - 2]}….{suffix}"


def clean_mime_type(mime_type: str) -> str:
    """``mime_type`` on one line, lower case, at most :data:`MAX_MIME_TYPE` characters."""
    return _one_line(mime_type)[:MAX_MIME_TYPE].lower()


def _one_line(text: str) -> str:
    cleaned = clean_text(text)
    if not cleaned.isprintable():
        cleaned = "".join(" " if _is_control(char) else char for char in cleaned)
    return " ".join(cleaned.split())


def _is_control(char: str) -> bool:
    """Control characters (``Cc``) and line or paragraph separators; joiners stay."""
    return unicodedata.category(char) in ("Cc", "Zl", "Zp")


def human_size(size: int) -> str:
    """``size`` bytes in the largest unit (of 1024) that keeps it at least 1: ``12 KB``."""
    value, unit = float(size), 0
    while value >= 1024 and unit < len(_UNITS) - 1:
        value, unit = value / 1024, unit + 1
    if unit == 0:
        return f"{size} {'byte' if size == 1 else 'bytes'}"
    shown = f"{value:.1f}".removesuffix(".0") if value < 10 else f"{value:.0f}"
    return f"{shown} {_UNITS[unit]}"


def describe(attachment: Attachment) -> str:
    """``photo.jpg image/jpeg 12 KB``: name (or kind), MIME type and size, when known."""
    parts = [attachment.name or attachment.kind.value]
    if attachment.mime_type:
        parts.append(attachment.mime_type)
    if attachment.size > 0:
        parts.append(human_size(attachment.size))
    return " ".join(parts)


def summary(attachments: Sequence[Attachment]) -> str:
    """``1 attachment: photo.jpg image/jpeg 12 KB`` (several joined by ``; ``); "" for none."""
    if not attachments:
        return ""
    count = len(attachments)
    noun = "attachment" if count == 1 else "attachments"
    return f"{count} {noun}: " + "; ".join(describe(a) for a in attachments)


_KINDS = {
    "image": AttachmentKind.IMAGE,
    "audio": AttachmentKind.AUDIO,
    "video": AttachmentKind.VIDEO,
}
"""A MIME type's top-level type → the kind of a file that has it; any other: a document."""


def kind_of(mime_type: str) -> AttachmentKind:
    """The kind of a file whose MIME type is ``mime_type``: ``image/png`` is an image."""
    top, slash, _ = mime_type.strip().lower().partition("/")
    return _KINDS.get(top, AttachmentKind.DOCUMENT) if slash else AttachmentKind.DOCUMENT


def oversized(attachments: Sequence[Attachment], cap: int) -> Attachment | None:
    """The first of ``attachments`` larger than ``cap`` bytes, if any (an unknown size never is)."""
    return next((a for a in attachments if a.size > cap), None)


def too_large_notice(attachment: Attachment, cap: int) -> str:
    """What the sender of a file over the cap is told, on every platform."""
    named = f"“{attachment.name}”" if attachment.name else f"This {_noun(attachment.kind)}"
    return (
        f"Sorry — {named} is {human_size(attachment.size)}; I can take files of up to "
        f"{human_size(cap)}. It was not read: please send a smaller one."
    )


def _noun(kind: AttachmentKind) -> str:
    return _NOUNS.get(kind, kind.value)


_NOUNS = {
    AttachmentKind.IMAGE: "photo",
    AttachmentKind.VOICE: "voice message",
    AttachmentKind.AUDIO: "audio file",
}
