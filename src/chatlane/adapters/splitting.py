"""Long texts split into messages a platform takes: at a line or word, code blocks kept whole.

Shared by the chat adapters that send Markdown-like text (Slack's mrkdwn,
Discord's Markdown); Telegram, which splits plain text its own way, shares the
character checks and the blank-text rule. What stays true:

* Joined, the parts are the text, but for the fences added where a part ends
  inside a code block: that part gets a closing fence, and the next one an
  opening fence, so every part reads as it would in the whole.
* A part is at most ``limit`` long, as ``measure`` counts (characters, or
  UTF-16 code units for a platform that counts those).
* A cut never splits a character sequence (an emoji with joiners or skin
  tones, a flag, a letter with its marks, a Hangul syllable of conjoining
  jamo), nor anything the caller's ``unbroken`` check protects (Slack's
  escapes and links).
* A text with nothing visible in it (:func:`blank`), which no chat platform
  posts, is sent as :data:`EMPTY_REPLY` (:func:`never_blank`), so every outbound
  message shows its chat something; a part with nothing visible is not sent.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Callable

__all__ = ["EMPTY_REPLY", "FENCE", "blank", "joined", "never_blank", "split_text", "utf16_len"]

FENCE = "```"
EMPTY_REPLY = "(empty reply)"
"""What a chat gets for a text with nothing visible in it (a reply of only spaces): the
user still sees that the turn ended."""
_INVISIBLE = frozenset({"Cc", "Cf"})
"""Unicode categories drawn as nothing: control and format characters (U+200B …)."""
_JOINERS = frozenset("\u200d\ufe0e\ufe0f\u20e3")
_MARKS = frozenset({"Mn", "Mc", "Me"})
"""Unicode categories of marks, which belong to the character before them (spacing ones,
such as Devanagari's vowel signs, too)."""
_LEADING_JAMO = ((0x1100, 0x115F), (0xA960, 0xA97F))
_FOLLOWING_JAMO = ((0x1160, 0x11FF), (0xD7B0, 0xD7FF))
"""Hangul jamo: a syllable is leading consonants, then vowels and trailing consonants."""
_SYLLABLES = (0xAC00, 0xD7A3)

Measure = Callable[[str], int]
Unbroken = Callable[[str, int], bool]
"""Whether cutting a text before an index leaves what the caller protects whole."""


def utf16_len(text: str) -> int:
    """The length of ``text`` in UTF-16 code units (a character outside the BMP counts two)."""
    return len(text.encode("utf-16-le", "surrogatepass")) // 2


def blank(text: str) -> bool:
    """Whether nothing in ``text`` is visible: it holds only whitespace, control and format
    characters (a zero-width space …), or nothing at all."""
    return all(char.isspace() or unicodedata.category(char) in _INVISIBLE for char in text)


def never_blank(text: str) -> str:
    """``text``, or :data:`EMPTY_REPLY` if nothing in it is visible (:func:`blank`)."""
    return EMPTY_REPLY if blank(text) else text


def split_text(
    text: str, limit: int, *, measure: Measure = len, unbroken: Unbroken | None = None
) -> list[str]:
    """``text`` in parts of at most ``limit`` (as ``measure`` counts), in order.

    A part ends after the last newline (else space) in the second half of its
    window where nothing is cut (see the module docstring); failing that, at
    the last such point at all. A part ending inside a code block gets a
    closing fence, and the next one an opening fence.
    """
    room = limit - len(FENCE) - 1  # a part may need a closing fence after it
    parts: list[str] = []
    while measure(text) > limit:
        cut = _cut_point(text, _fit(text, room, measure), unbroken)
        part, text = text[:cut], text[cut:]
        if part.count(FENCE) % 2 == 1:
            part += FENCE if part.endswith("\n") else "\n" + FENCE
            text = f"{FENCE}\n{text}"
        parts.append(part)
    parts.append(text)
    return parts


def _fit(text: str, room: int, measure: Measure) -> int:
    """How many characters of ``text`` fit in ``room``, as ``measure`` counts (it adds up
    character by character, as characters and UTF-16 code units do)."""
    if measure is len:
        return min(room, len(text))
    units = 0
    for index, char in enumerate(text):
        units += measure(char)
        if units > room:
            return max(index, 1)
    return len(text)


def _cut_point(text: str, end: int, unbroken: Unbroken | None) -> int:
    """Where the part that starts ``text`` and holds at most ``end`` characters should end."""

    def whole(cut: int) -> bool:
        if unbroken is not None and not unbroken(text, cut):
            return False
        return cut >= len(text) or not joined(text[cut - 1], text[cut])

    for separator in ("\n", " "):
        at = text.rfind(separator, end // 2, end)
        while at >= 0 and not whole(at + 1):
            at = text.rfind(separator, end // 2, at)
        if at >= 0:
            return at + 1
    cut = end
    while cut > 1 and not whole(cut):
        cut -= 1
    return cut if cut > 1 else end


def joined(before: str, after: str) -> bool:
    """Whether a cut between ``before`` and ``after`` would split one visible character."""
    if before == "\u200d" or after in _JOINERS or unicodedata.category(after) in _MARKS:
        return True
    code = ord(after)
    if 0x1F1E6 <= ord(before) <= 0x1F1FF and 0x1F1E6 <= code <= 0x1F1FF:
        return True  # a flag is two regional indicators (a cut may still fall between two flags)
    if _jamo_joined(ord(before), code):
        return True
    return 0x1F3FB <= code <= 0x1F3FF or 0xE0020 <= code <= 0xE007F or 0xFE00 <= code <= 0xFE0F


def _jamo_joined(before: int, after: int) -> bool:
    """Whether ``after`` continues a Hangul syllable of conjoining jamo: a vowel or trailing
    consonant, or anything of a syllable after a leading consonant."""
    if _within(after, _FOLLOWING_JAMO):
        return True
    starts = _within(after, _LEADING_JAMO) or _SYLLABLES[0] <= after <= _SYLLABLES[1]
    return starts and _within(before, _LEADING_JAMO)


def _within(code: int, ranges: tuple[tuple[int, int], ...]) -> bool:
    return any(low <= code <= high for low, high in ranges)
