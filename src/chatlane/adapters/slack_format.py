"""Slack's text: Markdown turned into mrkdwn, and long texts split into messages.

What stays true:

* Every ``&``, ``<`` and ``>`` of the text is escaped (``&amp;``, ``&lt;``,
  ``&gt;``), code included, so nothing an agent writes becomes a mention, an
  ``@channel`` or a link Slack makes of its own; the only ``<…>`` in the result
  are the links made here from ``[label](http…)``, and a ``>`` opening a line
  stays a quote.
* Code — fenced blocks and inline spans — is kept as written (escaped, not
  reformatted); a fence's language name is dropped, since Slack would show it
  as the first line of code.
* A split never cuts an escape (``&amp;``), a link (``<url|label>``) or a
  character sequence (an emoji with joiners, a letter with its combining
  marks); a part that ends inside a code block closes it, and the next part
  opens it again.
"""

from __future__ import annotations

import re
import unicodedata

__all__ = ["MESSAGE_LIMIT", "escape", "split_message", "to_mrkdwn"]

MESSAGE_LIMIT = 3000
"""Characters of one message chatlane sends.

Slack cuts a message's text at 40,000 characters, recommends at most 4,000,
and a Block Kit section (an approval prompt's text) holds at most 3,000; one
limit for every message keeps a long reply in parts short enough to read
without Slack folding them ("Show more"), and fits the prompt's section."""

FENCE = "```"
_OPEN_FENCE = re.compile(r"^\s{0,3}(```+(?=[^`]*$)|~~~+)")
"""A line opening a code block; a backtick fence's language name holds no backtick."""
_HEADING = re.compile(r"^\s{0,3}#{1,6}\s+(.*?)(?:\s+#+)?\s*$")
_BOLD_MARKS = re.compile(r"\*\*(.+?)\*\*")
_QUOTE = re.compile(r"^\s{0,3}>\s?(.*)$")
_BULLET = re.compile(r"^(\s*)[-*+]\s+(.*)$")
_INLINE = re.compile(
    r"(?P<code>`[^`\n]+`)"
    r"|\[(?P<label>[^\]\n]+)\]\((?P<url>(?:https?|mailto):[^)\s<>|]+)\)"
    r"|\*\*(?P<bold>[^*\n]+?)\*\*"
    r"|__(?P<underbold>[^_\n]+?)__"
    r"|~~(?P<strike>[^~\n]+?)~~"
    r"|(?<![\w*])\*(?P<italic>[^*\s](?:[^*\n]*[^*\s])?)\*(?![\w*])"
)
_ESCAPES = str.maketrans({"&": "&amp;", "<": "&lt;", ">": "&gt;"})
_JOINERS = frozenset("\u200d\ufe0e\ufe0f\u20e3")
_LONGEST_ESCAPE = len("&amp;")


def escape(text: str) -> str:
    """``text`` with ``&``, ``<`` and ``>`` escaped as Slack asks."""
    return text.translate(_ESCAPES)


def to_mrkdwn(markdown: str) -> str:
    """``markdown`` as Slack's mrkdwn: ``**bold**`` → ``*bold*``, ``*it*`` → ``_it_``,
    ``~~x~~`` → ``~x~``, ``[t](u)`` → ``<u|t>``, a heading → a bold line, a bullet → ``•``;
    code kept; everything else escaped (see the module docstring)."""
    lines: list[str] = []
    fence = ""
    for line in markdown.split("\n"):
        if not fence:
            opening = _OPEN_FENCE.match(line)
            fence = opening.group(1) if opening is not None else ""
            lines.append(FENCE if fence else _line(line))
        elif _closes(line, fence):
            fence = ""
            lines.append(FENCE)
        else:
            lines.append(escape(line))
    if fence:
        lines.append(FENCE)
    return "\n".join(lines)


def _closes(line: str, fence: str) -> bool:
    """Whether ``line`` closes a code block opened by ``fence``: the same mark, as long, alone."""
    mark = line.strip()
    return mark.startswith(fence) and not mark.strip(fence[0])


def _line(line: str) -> str:
    """One line outside code, block syntax first, then the inline marks."""
    heading = _HEADING.match(line)
    if heading is not None:
        title = _BOLD_MARKS.sub(r"\1", heading.group(1))  # the whole line is bold already
        return f"*{_inline(title)}*" if title else ""
    quote = _QUOTE.match(line)
    if quote is not None:
        return f"> {_inline(quote.group(1))}"
    bullet = _BULLET.match(line)
    if bullet is not None:
        return f"{bullet.group(1)}• {_inline(bullet.group(2))}"
    return _inline(line)


def _inline(text: str) -> str:
    out: list[str] = []
    at = 0
    for match in _INLINE.finditer(text):
        out.append(escape(text[at : match.start()]))
        out.append(_mark(match))
        at = match.end()
    out.append(escape(text[at:]))
    return "".join(out)


def _mark(match: re.Match[str]) -> str:
    found = match.groupdict()
    if found["code"] is not None:
        return escape(found["code"])
    if found["url"] is not None:
        return f"<{escape(found['url'])}|{escape(found['label'])}>"
    for name, mark in (("bold", "*"), ("underbold", "*"), ("strike", "~"), ("italic", "_")):
        if found[name] is not None:
            return f"{mark}{escape(found[name])}{mark}"
    return escape(match.group(0))


def split_message(text: str, limit: int = MESSAGE_LIMIT) -> list[str]:
    """``text`` (mrkdwn) in parts of at most ``limit`` characters, in order.

    A part ends after the last newline (else space) in the second half of its
    window where nothing is cut (see the module docstring); failing that, at
    the last such point at all. A part ending inside a code block gets a
    closing fence, and the next one an opening fence.
    """
    room = limit - len(FENCE) - 1  # a part may need a closing fence after it
    parts: list[str] = []
    while len(text) > limit:
        cut = _cut_point(text, room)
        part, text = text[:cut], text[cut:]
        if part.count(FENCE) % 2 == 1:
            part += FENCE if part.endswith("\n") else "\n" + FENCE
            text = f"{FENCE}\n{text}"
        parts.append(part)
    parts.append(text)
    return parts


def _cut_point(text: str, room: int) -> int:
    """Where the part of at most ``room`` characters that starts ``text`` should end."""
    end = min(room, len(text))
    for separator in ("\n", " "):
        at = text.rfind(separator, end // 2, end)
        while at >= 0 and not _whole(text, at + 1):
            at = text.rfind(separator, end // 2, at)
        if at >= 0:
            return at + 1
    cut = end
    while cut > 1 and not _whole(text, cut):
        cut -= 1
    return cut if cut > 1 else end


def _whole(text: str, cut: int) -> bool:
    """Whether cutting ``text`` before index ``cut`` leaves every escape, link and
    visible character whole."""
    amp = text.rfind("&", max(0, cut - _LONGEST_ESCAPE + 1), cut)
    if amp >= 0 and text.find(";", amp, cut) < 0:
        return False
    if text.rfind("<", 0, cut) > text.rfind(">", 0, cut):
        return False
    return cut >= len(text) or not _joined(text[cut - 1], text[cut])


def _joined(before: str, after: str) -> bool:
    """Whether a cut between ``before`` and ``after`` would split one visible character."""
    if before == "\u200d" or after in _JOINERS or unicodedata.combining(after):
        return True
    code = ord(after)
    if 0x1F1E6 <= ord(before) <= 0x1F1FF and 0x1F1E6 <= code <= 0x1F1FF:
        return True  # a flag is two regional indicators (a cut may still fall between two flags)
    return 0x1F3FB <= code <= 0x1F3FF or 0xE0020 <= code <= 0xE007F or 0xFE00 <= code <= 0xFE0F
