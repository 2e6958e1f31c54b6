"""The store protocol: what every backend (memory, SQLite, Redis) keeps, and by which rules.

A store holds, per session key: the **generation** (the fencing token — it
only grows, and survives restarts), a **lease** (who runs the session's turn
right now), **persistent fields**, **conversations** with their
**transcripts**, a **durable pending queue** of accepted messages, and the set
of inbound messages already **answered**.

What every implementation guarantees — the contract suite in
``tests/stores/test_contract.py`` checks each point against each backend:

* :meth:`Store.acquire` is one atomic check-and-set: it fails with
  :class:`~chatlane.errors.SessionBusy` while another live lease exists (or a
  message queued earlier must run first), and on success bumps the generation.
* Every write made for a turn goes through :meth:`Store.commit` with that
  turn's generation and is refused as a whole, atomically, with
  :class:`~chatlane.errors.StaleGeneration` once the generation moved on. An
  inbound message is recorded as answered at most once
  (:class:`~chatlane.errors.AlreadyAnswered`) for :attr:`Store.answered_retention`
  seconds; an older mark is forgotten (each heartbeat prunes some), so the
  record of answered messages does not grow without bound.
* While its mark is kept, :meth:`Store.answer` tells what a message was
  answered with (the reply or the notice, written in the same commit as the
  mark), whichever process committed it.
* :meth:`Store.renew` and :meth:`Store.release` succeed only with the lease's
  own token: a lease that expired, was taken over or was fenced off raises
  :class:`~chatlane.errors.LeaseLost`; releasing a lease twice raises
  :class:`~chatlane.errors.LeaseError`.
* Pending messages are returned in the order the store accepted them
  (``seq`` grows per key) and stay until removed by a commit or a drop, or
  set aside as failed (:meth:`Store.park`), where they stay until retried.
* :meth:`Store.renew_many` renews every lease a process holds in one call,
  and :meth:`Store.adopt_orphans` adopts a bounded batch of dead processes'
  messages in one call: upkeep costs do not grow with one round trip per session.
* Each heartbeat also prunes what no one needs any more: answered marks past
  their retention, heartbeats and leases expired for :data:`PRUNE_AFTER`.
"""

from __future__ import annotations

import abc
import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgspec

from chatlane.errors import LeaseLost, StoreDamaged
from chatlane.types import SessionKey

__all__ = [
    "ANSWERED_RETENTION",
    "PRUNE_AFTER",
    "Clock",
    "Conversation",
    "FailedRecord",
    "Lease",
    "PendingRecord",
    "Store",
    "TranscriptEntry",
    "WriteBatch",
    "now",
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


Clock = Callable[[], float]
"""Where a store reads the time: wall-clock seconds (tests pass a clock they advance)."""


def now() -> float:
    """Wall-clock seconds: lease expiry must mean the same thing in every process."""
    return time.time()


PRUNE_AFTER = 60.0
"""Seconds an expired heartbeat or lease is kept before a heartbeat prunes it."""

ANSWERED_RETENTION = 7 * 24 * 3600.0
"""Seconds a message stays marked answered: far longer than any re-delivery or re-run."""


class Store(abc.ABC):
    """A backend for sessions, leases and durable queues. See the module docstring."""

    url: str = ""
    answered_retention: float = ANSWERED_RETENTION
    """Seconds an answered mark holds (see :data:`ANSWERED_RETENTION`)."""

    # -- generations and leases ----------------------------------------------

    @abc.abstractmethod
    async def acquire(
        self,
        key: SessionKey,
        holder: str,
        ttl: float,
        *,
        head_seq: int | None = None,
        max_active: int = 0,
    ) -> Lease:
        """Take ``key``'s lease for ``ttl`` seconds and bump its generation.

        :param head_seq: if given, succeed only when no pending record of
            ``key`` owned by another holder has a smaller ``seq`` (so messages
            run in store order across processes; a process orders its own).
        :param max_active: if positive, succeed only while fewer than this many
            other sessions hold a live lease.
        :raises SessionBusy: another live lease exists, or an earlier message must run first.
        :raises ActiveSessionLimit: ``max_active`` sessions already run.
        """

    @abc.abstractmethod
    async def renew(self, lease: Lease, ttl: float) -> Lease:
        """Extend ``lease`` by ``ttl`` seconds from now.

        :raises LeaseLost: it expired, was taken over, or its generation was bumped.
        """

    async def renew_many(self, leases: Sequence[Lease], ttl: float) -> list[Lease | None]:
        """Renew each of ``leases`` by ``ttl`` seconds from now: one call for a process's leases.

        :returns: in order, the renewed lease, or ``None`` where it was lost
            (expired, taken over, or its generation was bumped).
        :raises StoreError: the store could not be asked; nothing is known of the leases.
        """
        results = await asyncio.gather(
            *(self.renew(lease, ttl) for lease in leases), return_exceptions=True
        )
        renewed: list[Lease | None] = []
        for result in results:
            if isinstance(result, LeaseLost):
                renewed.append(None)
            elif isinstance(result, BaseException):
                raise result
            else:
                renewed.append(result)
        return renewed

    @abc.abstractmethod
    async def release(self, lease: Lease) -> None:
        """Give ``lease`` up.

        :raises LeaseError: it was already released.
        :raises LeaseLost: another holder has (or had) the session since.
        """

    @abc.abstractmethod
    async def bump_generation(self, key: SessionKey) -> int:
        """Advance ``key``'s generation (stop, interrupt, eviction) and return it.

        The current lease stays with its holder, but every write it makes from
        now on is refused, and its renewal fails.
        """

    @abc.abstractmethod
    async def generation(self, key: SessionKey) -> int:
        """``key``'s current generation (0 if it never ran)."""

    async def generations(self, keys: Sequence[SessionKey]) -> list[int]:
        """The current generation of each of ``keys``, in order (one read where the backend can)."""
        return list(await asyncio.gather(*(self.generation(key) for key in keys)))

    @abc.abstractmethod
    async def active_sessions(self) -> int:
        """How many sessions hold a live lease, across every process."""

    # -- fenced writes and reads -----------------------------------------------

    @abc.abstractmethod
    async def commit(self, key: SessionKey, generation: int | None, batch: WriteBatch) -> None:
        """Apply ``batch`` atomically, if ``generation`` is still current.

        ``generation=None`` writes unfenced (for commands run outside a turn).

        :raises StaleGeneration: the generation moved on; nothing was written.
        :raises AlreadyAnswered: a message in ``batch.answered`` was answered
            before; nothing was written.
        """

    @abc.abstractmethod
    async def load_persistent(self, key: SessionKey) -> dict[str, Any]:
        """Every persistent field stored for ``key``."""

    @abc.abstractmethod
    async def transcript(
        self, key: SessionKey, conversation_id: str | None = None, limit: int = 100
    ) -> list[TranscriptEntry]:
        """The last ``limit`` entries of a conversation (default: the current one), oldest first."""

    @abc.abstractmethod
    async def is_answered(self, message_id: str) -> bool:
        """Whether an inbound message was recorded as answered (within the retention)."""

    @abc.abstractmethod
    async def answer(self, message_id: str) -> str | None:
        """The text committed as the answer to an inbound message, while its mark is kept.

        ``None`` if it is not recorded as answered (within the retention); the
        batch's :attr:`WriteBatch.answer` otherwise (empty if it carried none).
        """

    # -- conversations -----------------------------------------------------------

    @abc.abstractmethod
    async def conversation(self, key: SessionKey) -> Conversation:
        """``key``'s current conversation, started on first use."""

    @abc.abstractmethod
    async def new_conversation(self, key: SessionKey, title: str = "") -> Conversation:
        """End ``key``'s current conversation and start a new one."""

    @abc.abstractmethod
    async def resume_conversation(self, key: SessionKey, conversation_id: str) -> Conversation:
        """End the current conversation and make an earlier one current again.

        :raises KeyError: no such conversation for ``key``.
        """

    @abc.abstractmethod
    async def conversations(self, key: SessionKey, limit: int = 20) -> list[Conversation]:
        """``key``'s conversations, newest first."""

    # -- the durable pending queue -------------------------------------------------

    @abc.abstractmethod
    async def enqueue(self, key: SessionKey, message_id: str, owner: str, payload: bytes) -> int:
        """Persist an accepted message and return its ``seq`` (idempotent per message id)."""

    @abc.abstractmethod
    async def pending(self, key: SessionKey) -> list[PendingRecord]:
        """``key``'s pending records, in the order they were accepted."""

    @abc.abstractmethod
    async def pending_keys(self) -> list[SessionKey]:
        """Every key with at least one pending record."""

    @abc.abstractmethod
    async def drop_pending(self, key: SessionKey, seqs: Sequence[int]) -> None:
        """Remove pending records (answered with a notice instead of a run)."""

    @abc.abstractmethod
    async def adopt(
        self, key: SessionKey, seqs: Sequence[int], old_owner: str, new_owner: str
    ) -> list[int]:
        """Make ``new_owner`` the owner of those records still owned by ``old_owner``.

        Used to take over the messages of a process that died. Atomic per
        record, so of two processes adopting at once each record goes to one.

        :returns: the seqs that were adopted, in order.
        """

    async def adopt_orphans(self, holder: str, limit: int) -> list[PendingRecord]:
        """Adopt the records of up to ``limit`` sessions whose owners have no live heartbeat.

        Each record becomes ``holder``'s atomically (of two adopters each gets
        it once). Failed records are never adopted.

        :returns: the adopted records (with ``holder`` as owner), by session, in ``seq`` order.
        """
        keys = await self.pending_keys()
        queues = await asyncio.gather(*(self.pending(key) for key in keys))
        owners = sorted({r.owner for records in queues for r in records if r.owner != holder})
        alive = await self.alive(owners) if owners else {}
        orphaned = [
            [r for r in records if r.owner != holder and not alive.get(r.owner, False)]
            for records in queues
        ]
        chosen = [records for records in orphaned if records][:limit]
        taken = await asyncio.gather(*(self._adopt_all(records, holder) for records in chosen))
        return [record for records in taken for record in records]

    async def _adopt_all(self, records: list[PendingRecord], holder: str) -> list[PendingRecord]:
        adopted: list[PendingRecord] = []
        for owner in sorted({r.owner for r in records}):
            mine = [r for r in records if r.owner == owner]
            seqs = set(await self.adopt(mine[0].key, [r.seq for r in mine], owner, holder))
            adopted += [msgspec.structs.replace(r, owner=holder) for r in mine if r.seq in seqs]
        return sorted(adopted, key=lambda r: r.seq)

    # -- messages that could not be completed -------------------------------------------

    @abc.abstractmethod
    async def park(self, key: SessionKey, seqs: Sequence[int], reason: str) -> None:
        """Set pending records aside as failed, with ``reason``: kept, never run or adopted."""

    @abc.abstractmethod
    async def failed(self, limit: int = 100) -> list[FailedRecord]:
        """Failed records, oldest failure first."""

    @abc.abstractmethod
    async def retry_failed(self, message_id: str, owner: str) -> PendingRecord | None:
        """Put a failed message back into its session's queue, owned by ``owner``.

        :returns: its pending record (same ``seq`` as before), or ``None`` if
            no failed message has that id.
        """

    # -- process liveness ------------------------------------------------------------

    @abc.abstractmethod
    async def heartbeat(self, holder: str, ttl: float) -> None:
        """Record that process ``holder`` is alive for the next ``ttl`` seconds.

        Also forgets answered marks older than :attr:`answered_retention`.
        """

    @abc.abstractmethod
    async def alive(self, holders: Sequence[str]) -> Mapping[str, bool]:
        """Which of ``holders`` sent a heartbeat that has not expired."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Flush pending writes and release connections. Idempotent."""

    @property
    def damaged(self) -> StoreDamaged | None:
        """Why the store's data can no longer be trusted, once it found that; else None.

        It never goes back to None: a damaged store refuses every later call.
        Backends whose data cannot be damaged from here keep the default.
        """
        return None

    # -- derived operations, written once ------------------------------------------

    async def append_transcript(
        self, key: SessionKey, generation: int | None, *entries: TranscriptEntry
    ) -> None:
        """Append entries to the current conversation (fenced by ``generation``)."""
        await self.commit(key, generation, WriteBatch(transcript=list(entries)))

    async def set_persistent(self, key: SessionKey, generation: int | None, **fields: Any) -> None:
        """Set persistent fields (fenced by ``generation`` unless it is None)."""
        await self.commit(key, generation, WriteBatch(persistent=dict(fields)))

    async def record_reply(
        self, key: SessionKey, generation: int, message_ids: Sequence[str], text: str
    ) -> None:
        """Record the assistant's reply to ``message_ids``: at most once per message."""
        entry = TranscriptEntry("assistant", text, generation)
        batch = WriteBatch(transcript=[entry], answered=list(message_ids), answer=text)
        await self.commit(key, generation, batch)
