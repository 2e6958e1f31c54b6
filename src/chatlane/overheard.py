"""Messages in a shared chat that did not mention the bot, kept as context for its next turn.

With ``unmentioned = "context"`` (:class:`~chatlane.groups.GroupSettings`), an
adapter hands such a message to :meth:`~chatlane.gateway.Gateway.overhear`
instead of dropping it. What stays true:

* A line is kept in the conversation scope of the session the message would
  have gone to (:attr:`~chatlane.state.ConversationState.overheard`): a thread's
  lines stay in its session, a per-user session holds only its user's, and
  ``/new``, ``/reset``, ``/resume`` and an auto-reset clear them with the rest
  of the conversation.
* The ring is bounded: at most ``messages`` lines (the oldest dropped first),
  each at most ``chars`` characters (cut with ``…``) on one line (runs of
  white space, newlines included, read as one space, so no message can pass
  for several); a message seen twice is kept once.
* The next message that goes to the agent in that session takes every kept
  line (:func:`take`), so each is given to the agent once; the lines travel
  with that message (:attr:`~chatlane.types.InboundMessage.context`) and are
  written to the transcript before it, as one ``context`` entry
  (:func:`render`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Final

from chatlane.attachments import summary
from chatlane.types import ContextLine, InboundMessage

__all__ = [
    "CONTEXT_CHARS",
    "CONTEXT_LABEL",
    "CONTEXT_MESSAGES",
    "CONTEXT_ROLE",
    "ContextLimits",
    "keep",
    "line_of",
    "render",
    "take",
]

CONTEXT_LABEL: Final = "Earlier in this chat, not addressed to you:"
"""The first line of the block the agent reads (:func:`render`)."""
CONTEXT_ROLE: Final = "context"
"""The transcript role of that block, written before the message that took it."""


CONTEXT_MESSAGES: Final = 20
"""Lines kept per session by default (``context_messages``)."""
CONTEXT_CHARS: Final = 1000
"""Characters kept of one message by default (``context_chars``)."""


@dataclass(frozen=True, slots=True)
class ContextLimits:
    """How much is kept per session: ``messages`` lines of at most ``chars`` characters."""

    messages: int = CONTEXT_MESSAGES
    chars: int = CONTEXT_CHARS


def line_of(message: InboundMessage, chars: int) -> ContextLine:
    """The line kept for ``message``: its sender, text (files summed up), time and id."""
    text = " ".join(message.text.split())  # one line each: no text can pass for another's
    if message.attachments:
        files = f"[{summary(message.attachments)}]"
        text = f"{text} {files}" if text else files
    if len(text) > chars:
        text = text[: max(chars - 1, 0)] + "…"
    source = message.source
    return ContextLine(
        source.user_id or "",
        text,
        message.received_at,
        user_name=source.user_name,
        message_id=message.id,
    )


def keep(ring: list[ContextLine], line: ContextLine, limit: int) -> bool:
    """Add ``line`` to ``ring`` (newest last), dropping the oldest beyond ``limit``; whether
    it was added (a line whose message is already kept is not)."""
    if line.message_id and any(kept.message_id == line.message_id for kept in ring):
        return False
    ring.append(line)
    del ring[: max(len(ring) - limit, 0)]
    return True


def take(ring: list[ContextLine]) -> tuple[ContextLine, ...]:
    """Every line of ``ring``, oldest first; ``ring`` is left empty."""
    taken = tuple(ring)
    ring.clear()
    return taken


def render(lines: tuple[ContextLine, ...]) -> str:
    """The block an agent reads: :data:`CONTEXT_LABEL`, then one line per message,
    ``[HH:MM UTC] name (id): text``; "" for no lines."""
    if not lines:
        return ""
    shown = [CONTEXT_LABEL]
    for line in lines:
        when = time.strftime("%H:%M", time.gmtime(line.at))
        who = f"{line.user_name} ({line.user_id})" if line.user_name else line.user_id
        shown.append(f"[{when} UTC] {who or 'someone'}: {line.text}")
    return "\n".join(shown)
