"""The web chat's wire format: JSON frames over the WebSocket at ``/ws``.

Client → server, one object per text frame::

    {"type": "message", "text": "…"}          # at most MAX_TEXT bytes of UTF-8

Server → client::

    {"type": "commands", "items": [{"name", "usage", "summary"}, …]}
    {"type": "history", "conversation": id, "messages": [{"role", "text", "id"}, …]}
    {"type": "conversations", "items": [{"id", "title", "preview", "started_at", "current"}, …]}
    {"type": "chunk" | "reply" | "ack" | "notice" | "approval",
     "text", "id", "in_reply_to", "generation"[, "approval_id"]}
    {"type": "user", "text", "id"}            # sent from another tab of this browser
    {"type": "error", "text"}                 # a refused frame or a failed dispatch

What stays true: :func:`parse_frame` accepts exactly the client frame above
and names what is wrong with anything else (invalid or deeply nested JSON, a
wrong shape, a binary frame, an empty or oversized text, a lone surrogate), so
a bad frame costs the client an error event and never the server a traceback.
Events carry only JSON types and are encoded ASCII-safe.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

from starlette.types import Message

from chatlane.commands import CommandSpec
from chatlane.errors import ChatlaneError
from chatlane.stores.base import Conversation, TranscriptEntry
from chatlane.types import Outbound

MAX_TEXT = 16 * 1024
"""Most bytes (UTF-8) one message's text may have."""
MAX_FRAME = 64 * 1024
"""Most characters one client frame may have."""
MAX_FRAME_BYTES = 1024 * 1024
"""Most bytes the server reads of one WebSocket frame; a larger one closes the socket (1009)."""
PREVIEW_CHARS = 80
HISTORY_ROLES = frozenset({"user", "assistant", "notice"})

Event = dict[str, Any]


class InvalidWebMessage(ChatlaneError, ValueError):
    """A client frame is not a message the web chat accepts; the client gets an error event."""


def encode(event: Event) -> str:
    """One event as a text frame (ASCII-safe, so odd Unicode cannot break the write)."""
    return json.dumps(event)


def parse_frame(frame: Message) -> str:
    """The text of a client's ``{"type": "message", "text": …}`` frame.

    :raises InvalidWebMessage: naming what is wrong with the frame.
    """
    raw = frame.get("text")
    if not isinstance(raw, str):
        raise InvalidWebMessage("Send JSON in text frames, not binary ones.")
    if len(raw) > MAX_FRAME:
        raise InvalidWebMessage(f"Frame too large ({len(raw)} characters; at most {MAX_FRAME}).")
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        raise InvalidWebMessage('Not valid JSON; send {"type": "message", "text": "…"}.') from None
    if not isinstance(data, dict) or data.get("type") != "message":
        raise InvalidWebMessage('Unknown frame; send {"type": "message", "text": "…"}.')
    text = data.get("text")
    if not isinstance(text, str):
        raise InvalidWebMessage('A message needs "text", a string.')
    return checked_text(text)


def checked_text(text: str) -> str:
    """``text`` if it is non-empty, valid Unicode and at most :data:`MAX_TEXT` bytes.

    :raises InvalidWebMessage: otherwise.
    """
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError:
        raise InvalidWebMessage("The text is not valid Unicode (a lone surrogate).") from None
    if size > MAX_TEXT:
        raise InvalidWebMessage(f"Message too long ({size} bytes; at most {MAX_TEXT}).")
    if not text.strip():
        raise InvalidWebMessage("The message is empty.")
    return text


def outbound_event(outbound: Outbound) -> Event:
    """``chunk`` ``reply`` ``ack`` ``notice`` or ``approval``; ``id`` groups a turn's events.

    An ``approval`` also names its request (``approval_id``), which its buttons answer.
    """
    event: Event = {
        "type": outbound.kind.value,
        "text": outbound.text,
        "id": outbound.in_reply_to[0] if outbound.in_reply_to else "",
        "in_reply_to": list(outbound.in_reply_to),
        "generation": outbound.generation,
    }
    if outbound.approval_id:
        event["approval_id"] = outbound.approval_id
    return event


def history_event(conversation_id: str, entries: Iterable[TranscriptEntry]) -> Event:
    """The current conversation's messages (user, assistant and notice), oldest first."""
    messages = [
        {"role": e.role, "text": e.content, "id": e.message_id}
        for e in entries
        if e.role in HISTORY_ROLES
    ]
    return {"type": "history", "conversation": conversation_id, "messages": messages}


def conversation_item(
    conversation: Conversation, current: str, entries: Sequence[TranscriptEntry]
) -> Event:
    """One entry of the conversation list: its title, or its latest user message."""
    said = [e.content for e in entries if e.role == "user"]
    preview = " ".join(said[-1].split())[:PREVIEW_CHARS] if said else ""
    return {
        "id": conversation.id,
        "title": conversation.title,
        "preview": preview,
        "started_at": conversation.started_at,
        "current": conversation.id == current,
    }


def commands_event(specs: Iterable[CommandSpec]) -> Event:
    """The slash commands, for the page's help list."""
    items = [{"name": s.name, "usage": s.usage, "summary": s.summary} for s in specs]
    return {"type": "commands", "items": items}


def error_event(text: str) -> Event:
    """A refused frame or a failed dispatch, shown to the sender only."""
    return {"type": "error", "text": text}
