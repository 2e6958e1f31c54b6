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

from chatlane.adapters.splitting import FENCE, split_text

__all__ = ["MESSAGE_LIMIT", "escape", "split_message", "to_mrkdwn"]

MESSAGE_LIMIT = 3000
"""Characters of one message chatlane sends.

Slack cuts a message's text at 40,000 characters, recommends at most 4,000,
and a Block Kit section (an approval prompt's text) holds at most 3,000; one
limit for every message keeps a long reply in parts short enough to read
without Slack folding them ("Show more"), and fits the prompt's section."""

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
    """``text`` (mrkdwn) in parts of at most ``limit`` characters, in order
    (:func:`~chatlane.adapters.splitting.split_text`); no cut breaks an escape or a link."""
    return split_text(text, limit, unbroken=_whole)


def _whole(text: str, cut: int) -> bool:
    """Whether cutting ``text`` before index ``cut`` leaves every escape and link whole."""
    amp = text.rfind("&", max(0, cut - _LONGEST_ESCAPE + 1), cut)
    if amp >= 0 and text.find(";", amp, cut) < 0:
        return False
    return text.rfind("<", 0, cut) <= text.rfind(">", 0, cut)
