"""The records a store keeps and returns: leases, queued and failed messages, transcripts.

Frozen msgspec structs (a :class:`WriteBatch` excepted, which callers fill
in): what a backend hands out is a value, never a view of its storage.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from chatlane.errors import SessionBusy
from chatlane.types import Attachment, SessionKey

__all__ = [
    "DEAD",
    "DELIVERED",
    "PENDING",
    "Admission",
    "AnsweredMark",
    "Conversation",
    "Delivery",
    "DeliveryDraft",
    "DeliveryStats",
    "FailedRecord",
    "Lease",
    "PendingRecord",
    "Settlement",
    "SettlementKind",
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


class TranscriptEntry(msgspec.Struct, frozen=True, omit_defaults=True):
    """One message of a conversation.

    ``attachments`` are the files a user's message came with (references, as
    the message carried them); entries written before attachments were kept
    read back with none.
    """

    role: str
    content: str
    generation: int
    conversation_id: str = ""
    message_id: str = ""
    created_at: float = 0.0
    attachments: tuple[Attachment, ...] = ()


class AnsweredMark(msgspec.Struct, frozen=True):
    """What a store keeps of an answered message (:meth:`~chatlane.stores.protocols.
    SessionData.mark`): what it was answered with, in which session, and whether its turn
    failed.

    Marks written before the store kept the session and the failure read back with
    ``key`` and ``failure`` empty: taken as the asking session's, and as answered.
    """

    answer: str
    """The reply, or the notice its sender got (the batch's :attr:`WriteBatch.answer`)."""
    key: SessionKey = SessionKey("")
    """The session whose commit set the mark; "" for a mark written before it was kept."""
    failure: str = ""
    """Why its turn failed ("" if it was answered): its failed outcome's reason."""

    def belongs_to(self, key: SessionKey) -> bool:
        """Whether the mark is ``key``'s own (a mark that names no session is taken as so)."""
        return not self.key or self.key == key


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
        notice), kept with their marks and read back by :meth:`Store.mark`.
    :ivar failure: why the turn failed, when ``answer`` is its failure notice ("" for
        an answer): kept with the marks, so every process ends those messages failed.
    :ivar deliveries: outbound messages recorded for delivery in the same write
        (the delivery ledger): written only if the batch applies, each at most
        once per id.
    :ivar title: a title for the session's current conversation (the one
        ``transcript`` goes to), set only if that conversation has none yet:
        of two batches titling one conversation, the first applied wins. ""
        sets nothing.
    :ivar rename: set ``title`` even if the conversation has one (a title the
        agent chose, which replaces the one drawn from the first message).
    """

    transcript: list[TranscriptEntry] = msgspec.field(default_factory=list)
    persistent: dict[str, Any] = msgspec.field(default_factory=dict)
    answered: list[str] = msgspec.field(default_factory=list)
    done: list[int] = msgspec.field(default_factory=list)
    answer: str = ""
    deliveries: list[DeliveryDraft] = msgspec.field(default_factory=list)
    title: str = ""
    rename: bool = False
    failure: str = ""

    def is_empty(self) -> bool:
        """Whether the batch would change nothing."""
        return not (
            self.transcript
            or self.persistent
            or self.answered
            or self.done
            or self.deliveries
            or self.title
        )


# -- the delivery ledger -------------------------------------------------------------

PENDING = "pending"
"""A delivery not yet accepted by its platform (claimed or not)."""
DELIVERED = "delivered"
"""A delivery its platform accepted; kept for the retention, then pruned."""
DEAD = "dead"
"""A delivery given up on, with its reason, until an operator retries it."""


class DeliveryDraft(msgspec.Struct, frozen=True):
    """An outbound message to record in the delivery ledger.

    ``lane`` says who may send it: a worker claims deliveries by lane (a
    platform, or one chat of a platform whose chats are served by the
    process holding their connection). ``target`` orders them: the
    deliveries of one target are sent one at a time, in the order the store
    recorded them. A target belongs to exactly one lane.
    """

    id: str
    """Stable across every attempt: handed to platforms that can deduplicate by it."""
    lane: str
    target: str
    payload: bytes
    """The encoded outbound message (opaque to the store)."""


class Delivery(msgspec.Struct, frozen=True):
    """A recorded delivery, as the store keeps it."""

    id: str
    seq: int
    """Store-wide order of recording: grows with each delivery recorded."""
    lane: str
    target: str
    payload: bytes
    created_at: float
    state: str
    """:data:`PENDING`, :data:`DELIVERED` or :data:`DEAD`."""
    attempts: int = 0
    """Failed attempts that counted (a platform that was down spends none)."""
    next_at: float = 0.0
    """Not claimed again before this time (a retry's backoff, a platform's ``retry_after``)."""
    claim: str = ""
    """The token of its claim not settled yet ("" when none): a live one while
    ``claim_expires`` lies ahead; an expired one means its sender may have died mid-send."""
    claim_expires: float = 0.0
    holder: str = ""
    """The process that claimed it last."""
    uncertain: bool = False
    """An earlier attempt may have reached the platform: a re-send may duplicate it.

    Once set it stays, through a dead letter and its redelivery
    (:meth:`~chatlane.stores.protocols.Deliveries.retry_dead`)."""
    reason: str = ""
    """The last failure (a dead delivery's: why it was given up)."""
    settled_at: float = 0.0
    """When it was delivered or given up on (0.0 while pending)."""


class SettlementKind(enum.StrEnum):
    """What became of a claimed delivery's attempt."""

    DELIVERED = "delivered"
    """The platform accepted it: done."""
    RETRY = "retry"
    """It failed for a reason of its own: an attempt spent, claimable again after ``delay``."""
    RELEASE = "release"
    """Not attempted, or the platform was down: no attempt spent, claimable after ``delay``."""
    DEAD = "dead"
    """It can never be delivered (``reason`` says why): given up on."""


class Settlement(msgspec.Struct, frozen=True):
    """The end of one claim on a delivery: applied only by the claim's own token."""

    id: str
    claim: str
    kind: SettlementKind
    delay: float = 0.0
    reason: str = ""
    maybe_sent: bool = False
    """The attempt may have reached the platform (a timeout, part of a long message before a
    refusal): a later send is labelled, a dead letter's redelivery too."""


class DeliveryStats(msgspec.Struct, frozen=True):
    """The ledger at a glance, for metrics and ``chatlane inspect``."""

    pending: int
    oldest_pending_at: float
    """When the oldest pending delivery was recorded; 0.0 when none is pending."""
    dead: int
