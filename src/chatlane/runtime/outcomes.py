"""What became of each accepted message: exactly one outcome, emitted, never polled.

Every message an engine accepts — received here, queued with ``/queue``,
adopted from a dead process, or run again by an operator — ends in exactly
one :class:`MessageOutcome`, handed to the engine's ``on_outcome`` callback
(the gateway routes it to the adapter of the message's platform). What stays
true:

* **At most one**: the ledger forgets a message once its outcome is emitted;
  a second end is ignored, so every path may say what it knows without
  counting on the others.
* **At least one**: every way a message leaves this process's hands ends it
  here — answered, refused, dropped, interrupted, stopped, failed, or still
  held when the engine closes (shut down). A message that left for another
  process (adopted there after a lost lease, or dropped by a ``/stop`` sent
  there) is *watched*: the upkeep asks the store, in one batch, what became
  of it, and ends it with what the store says (the answer committed there,
  set aside as failed, or dropped) once the store no longer queues it.
* **Never another session's**: an answered mark the store keeps for a message
  id ends a message as its mark says (:func:`marked_outcome`) only in the
  session that set it: a message whose id another session used ends refused
  (:data:`ID_IN_USE`), and one whose turn failed ends failed, in every process.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable

import msgspec

from chatlane.stores.records import AnsweredMark
from chatlane.types import InboundMessage, SessionKey

ID_IN_USE = "This message's id is already used by another conversation; it was not run."
"""The notice (and refused outcome's text) of a message whose id another session's holds."""

ID_IN_USE_REASON = "message id in use"
"""The refused outcome's reason for such a message (:class:`~chatlane.errors.MessageIdInUse`)."""


class Outcome(enum.StrEnum):
    """How an accepted message ended."""

    ANSWERED = "answered"
    """A turn committed an answer to it (``text``), here or in another process."""
    REFUSED = "refused"
    """It was refused without running (``reason``: the busy outcome, e.g. ``rejected``)."""
    DROPPED = "dropped"
    """``/stop``, ``/new`` or ``/reset`` dropped it before it ran."""
    INTERRUPTED = "interrupted"
    """A newer message interrupted its turn; that turn's answer was discarded."""
    STOPPED = "stopped"
    """``/stop`` (or ``/new``, ``/reset``) stopped its running turn."""
    SHUT_DOWN = "shut down"
    """The engine closed while it was held; it stays queued for the next process."""
    FAILED = "failed"
    """Its turn failed (``text`` is the notice its sender got; ``reason`` says why)."""


class MessageOutcome(msgspec.Struct, frozen=True):
    """The one outcome of one accepted message."""

    message_id: str
    session_key: SessionKey
    platform: str
    outcome: Outcome
    text: str = ""
    """The answer (``ANSWERED``) or the notice its sender got (``FAILED``, ``REFUSED``)."""
    reason: str = ""


OnOutcome = Callable[[MessageOutcome], None]


class OutcomeLedger:
    """The messages an engine holds open, each ended once (see the module docstring)."""

    def __init__(self, emit: OnOutcome | None) -> None:
        """``emit`` hears each outcome; ``None``: no one listens, so nothing is held open."""
        self._emit = emit
        self._open: dict[str, tuple[SessionKey, str]] = {}
        self._watched: dict[str, SessionKey] = {}
        self.listening = emit is not None
        """Whether anyone hears the outcomes; while no one does, no message is held open."""

    def open(self, key: SessionKey, message: InboundMessage) -> None:
        """``message`` was accepted (or adopted) here: it will end in one outcome."""
        if self.listening:
            self._open.setdefault(message.id, (key, message.source.platform))

    def end(
        self, message_ids: Iterable[str], outcome: Outcome, text: str = "", reason: str = ""
    ) -> None:
        """Emit ``outcome`` for each of ``message_ids`` still open (the others ended before)."""
        if not self._open:
            return
        for message_id in message_ids:
            held = self._open.pop(message_id, None)
            self._watched.pop(message_id, None)
            if held is not None and self._emit is not None:
                key, platform = held
                self._emit(MessageOutcome(message_id, key, platform, outcome, text, reason))

    def refuse(self, key: SessionKey, message: InboundMessage, text: str, reason: str) -> None:
        """End ``message`` of ``key`` refused, even if an open message of another session
        holds its id (which stays open): that one's outcome is not this one's."""
        held = self._open.get(message.id)
        if held is not None and held[0] == key:
            self.end([message.id], Outcome.REFUSED, text, reason)
        elif self._emit is not None:
            platform = message.source.platform
            self._emit(MessageOutcome(message.id, key, platform, Outcome.REFUSED, text, reason))

    def watch(self, message_ids: Iterable[str]) -> None:
        """These open messages left for another process: ask the store what becomes of them."""
        for message_id in message_ids:
            held = self._open.get(message_id)
            if held is not None:
                self._watched[message_id] = held[0]

    def watched(self) -> dict[str, SessionKey]:
        """The watched messages and their sessions (a copy)."""
        return dict(self._watched)

    def open_ids(self) -> list[str]:
        """Every message still open, oldest first."""
        return list(self._open)

    def is_open(self, message_id: str) -> bool:
        """Whether ``message_id`` has not ended yet."""
        return message_id in self._open


__all__ = [
    "ID_IN_USE",
    "ID_IN_USE_REASON",
    "MessageOutcome",
    "OnOutcome",
    "Outcome",
    "OutcomeLedger",
    "marked_outcome",
]


def marked_outcome(mark: AnsweredMark, key: SessionKey) -> tuple[Outcome, str, str]:
    """The outcome, text and reason of a message of ``key`` whose id the store marked
    answered with ``mark``: refused if another session's message set the mark, failed if
    its turn failed (with the notice its sender got), else answered."""
    if not mark.belongs_to(key):
        return Outcome.REFUSED, ID_IN_USE, ID_IN_USE_REASON
    if mark.failure:
        return Outcome.FAILED, mark.answer, mark.failure
    return Outcome.ANSWERED, mark.answer, ""
