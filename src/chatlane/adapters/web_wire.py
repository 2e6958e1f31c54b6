"""The web chat's wire format: JSON frames over the WebSocket at ``/ws``.

Client → server, one object per text frame::

    {"type": "message", "text": "…"[, "ref": "…"]}   # text: at most MAX_TEXT bytes of UTF-8

Server → client::

    {"type": "commands", "items": [{"name", "usage", "summary"}, …]}
    {"type": "history", "conversation": id, "messages": [{"role", "text", "id"}, …]}
    {"type": "conversations", "items": [{"id", "title", "preview", "started_at", "current"}, …]}
    {"type": "title", "conversation": id, "title"}   # the current conversation was (re)titled
    {"type": "chunk" | "reply" | "ack" | "notice" | "approval",
     "text", "id", "in_reply_to", "generation"[, "approval_id"][, "command": true]
     [, "asks": {"command", "reason"}]}     # asks: what an approval asks about, verbatim
    {"type": "user", "text", "id"}            # from another tab; on connect, not answered yet
    {"type": "accepted", "ref", "id"}         # the sender's own message got this id
    {"type": "state", "id", "state"[, "short_id"][, "elapsed"]}   # what the gateway did with it
    {"type": "outcome", "id", "outcome"}      # how it ended (one per message)
    {"type": "error", "text"}                 # a refused frame or a failed dispatch

What stays true: :func:`parse_frame` accepts exactly the client frame above
and names what is wrong with anything else (invalid or deeply nested JSON, a
wrong shape, a binary frame, an empty or oversized text, a lone surrogate, a
``ref`` that is not a short token), so
a bad frame costs the client an error event and never the server a traceback.
Events carry only JSON types and are encoded ASCII-safe.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from starlette.types import Message

from chatlane.approvals import ApprovalRequest
from chatlane.commands import CommandSpec
from chatlane.errors import ChatlaneError
from chatlane.gateway import DispatchResult
from chatlane.runtime.busy import BusyOutcome
from chatlane.runtime.outcomes import MessageOutcome
from chatlane.stores.base import Conversation, TranscriptEntry
from chatlane.types import Outbound

MAX_TEXT = 16 * 1024
"""Most bytes (UTF-8) one message's text may have."""
MAX_FRAME = 64 * 1024
"""Most characters one client frame may have."""
MAX_FRAME_BYTES = 1024 * 1024
"""Most bytes the server reads of one WebSocket frame; a larger one closes the socket (1009)."""
MAX_REF = 64
"""Most characters of the ``ref`` a client may give its message."""
PREVIEW_CHARS = 80
HISTORY_ROLES = frozenset({"user", "assistant", "notice"})

Event = dict[str, Any]
_REF = re.compile(rf"[A-Za-z0-9_-]{{1,{MAX_REF}}}")


class MessageState(enum.StrEnum):
    """What the gateway did with a message when it arrived (the ``state`` event)."""

    RUNNING = "running"
    """A turn runs for it (or will, as soon as the session's lease is taken)."""
    QUEUED = "queued"
    """It waits for a turn of its own; ``/unqueue #<short_id>`` takes it out."""
    MERGED = "merged"
    """It joined messages waiting for the next turn (``collect``)."""
    STEERED = "steered"
    """It was handed to the running turn."""
    INTERRUPTING = "interrupting"
    """The running turn is being interrupted so that this message runs next."""
    REDIRECTING = "redirecting"
    """The running turn stops at its next safe point, keeping what it did, so that
    this message runs next (``redirect``)."""
    REFUSED = "refused"
    """It will not run: the session is busy and rejects, the queue is full, or the
    sender is not allowed."""
    COMMAND = "command"
    """It was a command, answered at once."""


_BUSY_STATES = {
    BusyOutcome.QUEUED: MessageState.QUEUED,
    BusyOutcome.MERGED: MessageState.MERGED,
    BusyOutcome.STEERED: MessageState.STEERED,
    BusyOutcome.INTERRUPTING: MessageState.INTERRUPTING,
    BusyOutcome.REDIRECTING: MessageState.REDIRECTING,
    BusyOutcome.COLLAPSED: MessageState.MERGED,  # the full queue became one turn with it
    BusyOutcome.REJECTED: MessageState.REFUSED,
    BusyOutcome.QUEUE_FULL: MessageState.REFUSED,
}


def state_of(result: DispatchResult) -> MessageState:
    """The state a dispatched message is in, from what the gateway said of it."""
    if result.refused:
        return MessageState.REFUSED
    if result.command is not None and result.outcome is None:
        return MessageState.COMMAND
    if result.outcome is not None:
        return _BUSY_STATES[result.outcome]
    return MessageState.RUNNING


@dataclass(frozen=True, slots=True)
class MessageFrame:
    """A client's message: its text, and the ``ref`` the client named it by (``""``: none)."""

    text: str
    ref: str = ""


class InvalidWebMessage(ChatlaneError, ValueError):
    """A client frame is not a message the web chat accepts; the client gets an error event."""


def encode(event: Event) -> str:
    """One event as a text frame (ASCII-safe, so odd Unicode cannot break the write)."""
    return json.dumps(event)


def parse_frame(frame: Message) -> MessageFrame:
    """The text and ref of a client's ``{"type": "message", "text": …}`` frame.

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
    ref = data.get("ref", "")
    if not isinstance(ref, str) or (ref and _REF.fullmatch(ref) is None):
        raise InvalidWebMessage(f'"ref" is at most {MAX_REF} of A-Z a-z 0-9 _ -.')
    return MessageFrame(checked_text(text), ref)


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


def outbound_event(outbound: Outbound, asks: ApprovalRequest | None = None) -> Event:
    """``chunk`` ``reply`` ``ack`` ``notice`` or ``approval``; ``id`` groups a turn's events.

    An ``approval`` also names its request (``approval_id``), which its buttons answer,
    and, given the request it asks about (``asks``), its command and reason verbatim, so
    the page shows the very command it approves, whatever characters it holds.
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
    if asks is not None:
        event["asks"] = {"command": asks.command, "reason": asks.reason}
    return event


def accepted_event(ref: str, message_id: str) -> Event:
    """To the sender: the message it named ``ref`` is known as ``message_id`` from now on."""
    return {"type": "accepted", "ref": ref, "id": message_id}


def state_event(
    message_id: str, state: MessageState, *, short_id: int = 0, elapsed: float | None = None
) -> Event:
    """What became of a message on arrival; ``short_id`` for a waiting one, ``elapsed``
    (seconds) for one whose turn was already running when the socket connected."""
    event: Event = {"type": "state", "id": message_id, "state": state.value}
    if short_id:
        event["short_id"] = short_id
    if elapsed is not None:
        event["elapsed"] = round(elapsed, 1)
    return event


def outcome_event(outcome: MessageOutcome) -> Event:
    """How a message ended: answered, refused, dropped, interrupted, stopped, failed, shut down."""
    return {"type": "outcome", "id": outcome.message_id, "outcome": outcome.outcome.value}


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


def title_event(conversation: Conversation) -> Event:
    """The current conversation's new title, for its entry in the list and the heading."""
    return {"type": "title", "conversation": conversation.id, "title": conversation.title}


def commands_event(specs: Iterable[CommandSpec]) -> Event:
    """The slash commands, for the page's help list."""
    items = [{"name": s.name, "usage": s.usage, "summary": s.summary} for s in specs]
    return {"type": "commands", "items": items}


def error_event(text: str) -> Event:
    """A refused frame or a failed dispatch, shown to the sender only."""
    return {"type": "error", "text": text}
