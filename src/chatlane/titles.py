"""Conversation titles: a short, clean line drawn from a message, or chosen by the agent.

What stays true of every title chatlane stores:

* It is one line of at most :data:`TITLE_LIMIT` characters, in NFC, with
  whitespace collapsed to single spaces and trimmed; a longer one is cut at
  a word (or a character, never inside one) and ends with ``…``.
* It holds no control or invisible formatting characters (bidirectional
  overrides, zero-width spaces; the joiners emoji and some scripts need are
  kept), and no pile of combining marks on one character.
* It is never empty: text with nothing left to show gives no title
  (:func:`title_from`), or is refused (:func:`clean_title`).
"""

from __future__ import annotations

import re
import unicodedata

__all__ = ["TITLE_LIMIT", "clean_title", "title_from"]

TITLE_LIMIT = 60
"""The most characters a title keeps, its ``…`` included."""

_MARKS_KEPT = 4
"""Combining marks kept on one character: enough for any script, not for a pile-up."""

_JOINERS = frozenset("\u200c\u200d")
"""Zero-width non-joiner and joiner: needed by emoji sequences and some scripts."""

_DROPPED = frozenset({"Cc", "Cf", "Cs", "Co", "Cn"})
"""Control, format, surrogate, private-use and unassigned characters (joiners aside)."""

_MARKS = frozenset({"Mn", "Me"})

_FENCE = re.compile(r"^(```|~~~)")
_LEAD = re.compile(r"^(?:#{1,6}\s+|>\s*)+")
"""Markdown a first line may start with: a heading's hashes, a quote's ``>``."""


def title_from(text: str) -> str:
    """A title for a conversation whose first message is ``text``; "" if it has none.

    The first line with something to show, without a Markdown heading or
    quote marker (code fences are skipped), cleaned and shortened as every
    title is (see the module docstring).
    """
    for line in text.splitlines():
        if _FENCE.match(line.strip()):
            continue
        title = _clean(_LEAD.sub("", line.strip()))
        if title:
            return title
    return ""


def clean_title(title: object) -> str:
    """``title`` as a stored title: cleaned and shortened (see the module docstring).

    :raises TypeError: ``title`` is not a string.
    :raises ValueError: nothing is left to show once it is cleaned.
    """
    if not isinstance(title, str):
        raise TypeError(f"a title is a str, not {type(title).__name__}")
    cleaned = _clean(title)
    if not cleaned:
        raise ValueError("a title needs some visible text")
    return cleaned


def _clean(text: str) -> str:
    """``text`` on one line, without invisible characters, collapsed and shortened."""
    kept: list[str] = []
    marks = 0
    for char in unicodedata.normalize("NFC", text):
        category = unicodedata.category(char)
        if category in _MARKS:
            marks += 1
            if marks > _MARKS_KEPT or not kept:
                continue
        else:
            marks = 0
        if char.isspace() or category in ("Zl", "Zp"):
            kept.append(" ")
        elif category not in _DROPPED or char in _JOINERS:
            kept.append(char)
    joined = unicodedata.normalize("NFC", "".join(kept))  # what was dropped may have parted a pair
    return _shorten(" ".join(joined.split()))


def _shorten(text: str) -> str:
    """``text`` cut to :data:`TITLE_LIMIT` characters with ``…``, at a word if one is near."""
    if len(text) <= TITLE_LIMIT:
        return text
    cut = TITLE_LIMIT - 1
    while cut > 0 and unicodedata.category(text[cut]) in _MARKS | {"Mc"}:
        cut -= 1  # never part a character from its marks
    head = text[:cut]
    space = head.rfind(" ")
    if space >= TITLE_LIMIT * 2 // 3:
        head = head[:space]
    return head.rstrip(" " + "".join(_JOINERS)) + "…"
