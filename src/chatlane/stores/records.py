"""The records a store keeps and returns: leases, queued and failed messages, transcripts.

Frozen msgspec structs (a :class:`WriteBatch` excepted, which callers fill
in): what a backend hands out is a value, never a view of its storage.
"""

from __future__ import annotations

from typing import Any

import msgspec

from chatlane.errors import SessionBusy
from chatlane.types import SessionKey

__all__ = [
    "Admission",
    "Conversation",
    "FailedRecord",
    "Lease",
    "PendingRecord",
    "Taken",
    "TranscriptEntry",
    "WriteBatch",
]


class Lease(msgspec.Struct, frozen=True):
    """The right to run ``key``'s turn until ``expires_at`` (wall clock, seconds).

    ``token`` identifies this holding (never reused); ``generation`` is the
    fencing token every write made under the lease must carry.
    """

    key: SessionKey
    holder: str
    token: str
    generation: int
    expires_at: float


class Taken(msgspec.Struct, frozen=True):
    """A lease just taken, and the session's persistent fields as that transaction read them."""

    lease: Lease
    persistent: dict[str, Any] | None
    """Every persistent field of the session (a fresh copy, as ``load_persistent`` returns);
    ``None`` only from a store whose fused operation is not one transaction, when the read
    failed after the lease was taken."""


class Admission(msgspec.Struct, frozen=True):
    """A message made durable, and the lease its session could or could not be given with it.

    Exactly one of ``lease`` and ``refusal`` is set, unless the lease could
    not be asked for at all (a store whose fused operation is not one
    transaction, during an outage): then both are ``None``, and the caller
    waits for the lease as it would for a refused one. The message is queued
    under ``seq`` either way.
    """

    seq: int
    lease: Lease | None
    refusal: SessionBusy | None
    """Why the lease was not given: what ``acquire`` would have raised."""
    persistent: dict[str, Any] | None
    """The session's persistent fields, read in the same transaction; ``None`` if not asked."""


class PendingRecord(msgspec.Struct, frozen=True):
    """An accepted message waiting for its turn; ``seq`` orders a key's records."""

    key: SessionKey
    seq: int
    message_id: str
    owner: str
    """The process (holder id) that accepted the message and waits for its reply."""
    payload: bytes
    """The encoded :class:`~chatlane.types.InboundMessage` (see :mod:`chatlane.stores.codec`)."""
    accepted_at: float


class FailedRecord(msgspec.Struct, frozen=True):
    """An accepted message that could not be completed, kept until an operator retries it.

    It never runs and is never adopted while it is here; :meth:`Store.retry_failed`
    puts it back into its session's queue under its original ``seq``.
    """

    record: PendingRecord
    reason: str
    failed_at: float


class TranscriptEntry(msgspec.Struct, frozen=True):
    """One message of a conversation."""

    role: str
    content: str
    generation: int
    conversation_id: str = ""
    message_id: str = ""
    created_at: float = 0.0


class Conversation(msgspec.Struct, frozen=True):
    """One conversation of a session; ``ended_at`` is 0.0 while it is current."""

    id: str
    key: SessionKey
    started_at: float
    ended_at: float = 0.0
    title: str = ""


class WriteBatch(msgspec.Struct):
    """Writes that are applied together, or not at all.

    :ivar transcript: entries appended to the session's current conversation
        (their ``conversation_id`` and ``created_at`` are filled in by the store
        when empty).
    :ivar persistent: persistent fields to set (JSON-compatible values).
    :ivar answered: inbound message ids this batch answers; if any was answered
        before, the whole batch is refused with ``AlreadyAnswered``.
    :ivar done: ``seq`` numbers of pending records to remove.
    :ivar answer: the text that answers each of ``answered`` (the reply, or a
        notice), kept with their marks and read back by :meth:`Store.answer`.
    """

    transcript: list[TranscriptEntry] = msgspec.field(default_factory=list)
    persistent: dict[str, Any] = msgspec.field(default_factory=dict)
    answered: list[str] = msgspec.field(default_factory=list)
    done: list[int] = msgspec.field(default_factory=list)
    answer: str = ""

    def is_empty(self) -> bool:
        """Whether the batch would change nothing."""
        return not (self.transcript or self.persistent or self.answered or self.done)
