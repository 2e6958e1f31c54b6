"""The store contract, as small protocols: one per thing a store keeps.

A backend implements all five (:class:`~chatlane.stores.base.Store` is their
union), but code that needs one slice can ask for that slice alone:

* :class:`Leases` — who runs a session now, and its generation (the fencing token);
* :class:`SessionData` — fenced writes and reads of a session's persistent
  fields, transcript and answered marks;
* :class:`Conversations` — a session's conversations, one of them current;
* :class:`PendingQueue` — accepted messages waiting for their turn, and the
  ones set aside as failed;
* :class:`Liveness` — which processes are alive;
* :class:`Turns` — a turn's own calls, fused: a message queued together with
  its session's lease, a reply committed together with the lease's release;
* :class:`Deliveries` — the delivery ledger: outbound messages recorded with
  the commit that made them, claimed by one sender at a time, settled once.

One more is optional, beside the contract: :class:`Wakeups`, a store's way of
telling a process that waits for a session's lease that the session may be
free (PostgreSQL's ``LISTEN``/``NOTIFY``, the memory store's own calls). A
store without it is polled, as before.

The contract suite has one module per protocol (``tests/stores/contract/``),
each run over every backend. Operations derived from a protocol's own
methods are written here, once; a backend overrides one only to do it in
fewer round trips, or reading less.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from chatlane.errors import LeaseError, LeaseLost, SessionBusy, StoreError
from chatlane.stores.records import (
    Admission,
    AnsweredMark,
    Conversation,
    Delivery,
    DeliveryDraft,
    DeliveryStats,
    FailedRecord,
    Lease,
    PendingRecord,
    Settlement,
    Taken,
    TranscriptEntry,
    WriteBatch,
)
from chatlane.types import SessionKey

__all__ = [
    "Conversations",
    "Deliveries",
    "Leases",
    "Liveness",
    "PendingQueue",
    "SessionData",
    "Turns",
    "Wakeups",
    "Watch",
]


class Leases(Protocol):
    """Generations and leases: at most one live lease per session, across processes."""

    @abc.abstractmethod
    async def acquire(
        self,
        key: SessionKey,
        holder: str,
        ttl: float,
        *,
        head_seq: int | None = None,
        max_active: int = 0,
        token: str = "",
    ) -> Lease:
        """Take ``key``'s lease for ``ttl`` seconds and bump its generation.

        :param head_seq: if given, succeed only when no pending record of
            ``key`` owned by another holder has a smaller ``seq`` (so messages
            run in store order across processes; a process orders its own).
        :param max_active: if positive, succeed only while fewer than this many
            other sessions hold a live lease.
        :param token: the lease's token, chosen by the caller (a fresh one if
            empty; never reuse one for another acquisition). A call that finds
            ``key``'s live lease already carrying it — an earlier try of this
            acquisition, whose answer was lost on the way back — returns that
            lease as it stands (no new generation) instead of refusing: a
            retried acquisition never waits on itself.
        :raises SessionBusy: another live lease exists.
        :raises EarlierMessageFirst: (a ``SessionBusy``) with ``head_seq``, a pending
            record of another holder has a smaller ``seq``.
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
    async def lease_holder(self, key: SessionKey) -> str | None:
        """The holder of ``key``'s live lease, or ``None`` while it has none.

        Only a read: it takes no lease, bumps no generation and wakes no one, so
        asking never makes the session look busy to a message arriving meanwhile.
        A lease that expired counts as none, even before anyone took it over.
        """

    @abc.abstractmethod
    async def active_sessions(self) -> int:
        """How many sessions hold a live lease, across every process."""


class SessionData(Protocol):
    """A session's data, written only under its current generation (fenced) or unfenced.

    Persistent values are JSON (:mod:`chatlane.stores.codec`): a value that is
    not is refused with :class:`~chatlane.errors.StoreError`, and what a caller
    passes in or reads back is never the stored object.
    """

    @abc.abstractmethod
    async def commit(self, key: SessionKey, generation: int | None, batch: WriteBatch) -> None:
        """Apply ``batch`` atomically, if ``generation`` is still current.

        ``generation=None`` writes unfenced (for commands run outside a turn).

        :raises StaleGeneration: the generation moved on; nothing was written.
        :raises AlreadyAnswered: a message in ``batch.answered`` was answered
            before; nothing was written.
        :raises StoreError: a persistent value is not JSON-compatible; nothing was written.
        """

    @abc.abstractmethod
    async def load_persistent(self, key: SessionKey) -> dict[str, Any]:
        """Every persistent field stored for ``key`` (a fresh copy)."""

    @abc.abstractmethod
    async def transcript(
        self, key: SessionKey, conversation_id: str | None = None, limit: int = 100
    ) -> list[TranscriptEntry]:
        """The last ``limit`` entries of a conversation (default: the current one), oldest first."""

    @abc.abstractmethod
    async def is_answered(self, message_id: str) -> bool:
        """Whether an inbound message was recorded as answered (within the retention)."""

    @abc.abstractmethod
    async def mark(self, message_id: str) -> AnsweredMark | None:
        """What the store keeps of an inbound message's answer, while its mark is kept.

        ``None`` if it is not recorded as answered (within the retention); else the
        batch's :attr:`WriteBatch.answer` (empty if it carried none), the session
        whose commit set the mark, and the batch's :attr:`WriteBatch.failure`.
        """

    async def answer(self, message_id: str) -> str | None:
        """The text committed as the answer to an inbound message, while its mark is kept
        (:meth:`mark`'s ``answer``); ``None`` if it is not recorded as answered."""
        mark = await self.mark(message_id)
        return None if mark is None else mark.answer

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

    async def load_fields(self, key: SessionKey, names: Sequence[str]) -> dict[str, Any]:
        """The persistent fields of ``key`` named in ``names`` that are stored (a fresh copy).

        Each shipped backend reads those fields alone, so looking at one field of a
        key that holds thousands (the scheduler's jobs) costs one field, not all.
        """
        wanted = set(names)
        return {n: v for n, v in (await self.load_persistent(key)).items() if n in wanted}


class Conversations(Protocol):
    """A session's conversations: exactly one is current, started on first use."""

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


class PendingQueue(Protocol):
    """Accepted messages, in the order the store accepted them, until done, dropped or parked."""

    @abc.abstractmethod
    async def enqueue(
        self, key: SessionKey, message_id: str, owner: str, payload: bytes, *, seq: int = 0
    ) -> int:
        """Persist an accepted message and return its ``seq`` (idempotent per message id).

        ``seq``: the one the store gave this message before, for a message whose drop
        may have applied although it failed (its answer lost): if it is no longer
        queued, it is queued again under that ``seq``, in its place among the others.
        A message still queued keeps its record either way.
        """

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
    async def drop_own(self, key: SessionKey, seqs: Sequence[int], owner: str) -> list[int]:
        """Remove those of the pending records ``seqs`` that ``owner`` still owns, at once
        (another process may adopt one meanwhile: that one stays, its to run).

        :returns: the seqs removed, in order. A call retried after its answer was lost
            returns fewer (what the first removed is gone): the caller asks the store
            what became of the others, as of any message that left it.
        """

    @abc.abstractmethod
    async def adopt(
        self,
        key: SessionKey,
        seqs: Sequence[int],
        old_owner: str,
        new_owner: str,
        *,
        generation: int | None = None,
    ) -> list[int]:
        """Make ``new_owner`` the owner of those records still owned by ``old_owner``.

        Used to take over the messages of a process that died, and to draw
        messages into a running turn. Atomic per record, so of two processes
        adopting at once each record goes to one. With ``generation`` it is
        fenced: nothing is adopted unless the session's generation is still
        that one (a turn whose lease another process took draws nothing).

        :returns: the seqs that were adopted, in order.
        """

    @abc.abstractmethod
    async def adopt_orphans(self, holder: str, limit: int) -> list[PendingRecord]:
        """Adopt the records of up to ``limit`` sessions whose owners have no live heartbeat.

        Each record becomes ``holder``'s atomically (of two adopters each gets
        it once). Failed records are never adopted. No record becomes
        ``holder``'s without being returned: by this call, or — where the call
        failed after it applied, its answer lost — by the next one
        (:mod:`chatlane.stores.adoption`).

        :returns: the adopted records (with ``holder`` as owner), by session, in ``seq`` order.
        """

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

        A record queued since under the same message id (the platform delivered the
        message again) gives way to it: the message is queued once, under its ``seq``.

        :returns: its pending record (same ``seq`` as before), or ``None`` if
            no failed message has that id.
        """


class Liveness(Protocol):
    """Process heartbeats: a process whose heartbeat expired is dead, and its messages orphans."""

    @abc.abstractmethod
    async def heartbeat(self, holder: str, ttl: float) -> None:
        """Record that process ``holder`` is alive for the next ``ttl`` seconds.

        Also prunes what no one needs any more: answered marks past their
        retention, heartbeats and leases long expired.
        """

    @abc.abstractmethod
    async def alive(self, holders: Sequence[str]) -> Mapping[str, bool]:
        """Which of ``holders`` sent a heartbeat that has not expired."""


class Deliveries(Protocol):
    """The delivery ledger: what was committed for a chat, until its platform accepted it.

    A delivery is recorded in the same write as the commit that made it
    (:attr:`WriteBatch.deliveries`), or on its own for what no turn commits
    (:meth:`record_deliveries`). What stays true:

    * **One sender at a time.** :meth:`claim_deliveries` hands a delivery to
      exactly one claim (a fresh token, for ``ttl`` seconds); only that token
      settles it (:meth:`settle_deliveries`). A claim that expires unsettled
      lets the delivery be claimed again, marked :attr:`Delivery.uncertain`,
      since its sender may have died mid-send.
    * **Order per target.** Only a target's oldest pending delivery can be
      claimed, and only while no live claim is on it: a later delivery to a
      chat is never sent before an earlier one is delivered or given up on.
    * **Nothing pending is lost**: a pending delivery stays until settled as
      delivered or dead. Delivered ones are pruned by heartbeats after
      :attr:`~chatlane.stores.base.Store.delivered_retention`; dead ones stay
      until retried (:meth:`retry_dead`) or the answered retention passes.
    """

    @abc.abstractmethod
    async def record_deliveries(self, drafts: Sequence[DeliveryDraft]) -> None:
        """Record ``drafts`` as pending, in order, unfenced (idempotent per delivery id)."""

    @abc.abstractmethod
    async def claim_deliveries(
        self, lanes: Sequence[str], holder: str, ttl: float, limit: int
    ) -> list[Delivery]:
        """Claim, for ``holder`` and ``ttl`` seconds, deliveries due in ``lanes``: one per target.

        A target's delivery is claimed when it is the target's oldest pending
        one, its :attr:`~Delivery.next_at` has passed, and no live claim is
        on it. At most ``limit`` are claimed, oldest first; each carries its
        new :attr:`~Delivery.claim` token.
        """

    @abc.abstractmethod
    async def settle_deliveries(self, settlements: Sequence[Settlement]) -> list[bool]:
        """Apply each settlement whose token is still its delivery's claim.

        :returns: in order, whether each applied (``False``: its claim was
            settled before, or the delivery was claimed again after it expired).
        """

    @abc.abstractmethod
    async def deliveries(self, state: str, limit: int = 100) -> list[Delivery]:
        """Deliveries in ``state`` (pending, delivered or dead), oldest recorded first."""

    @abc.abstractmethod
    async def delivery(self, delivery_id: str) -> Delivery | None:
        """One delivery by id, or ``None`` (never recorded, or pruned)."""

    @abc.abstractmethod
    async def delivery_stats(self) -> DeliveryStats:
        """How many are pending (and since when) and dead."""

    @abc.abstractmethod
    async def retry_dead(self, delivery_id: str) -> bool:
        """Make a dead delivery pending again, due now, with no attempts counted.

        It stays :attr:`~Delivery.uncertain` if an attempt may have reached the
        platform (its dead settlement's ``maybe_sent`` included), so the
        re-send is labelled.

        :returns: whether a dead delivery had that id.
        """


class Turns(Leases, SessionData, PendingQueue, Protocol):
    """What one turn asks of the store, in two calls: enqueue with acquire, commit with release.

    Each operation keeps the rules of the separate methods it fuses, and is
    written here from them (correct, in more round trips). Every backend
    chatlane ships overrides all three to run each as one transaction — one
    writer-thread operation in SQLite, one Lua script in Redis, one transaction
    in PostgreSQL — so a message
    to an idle session costs two store calls from its arrival to its answer.
    """

    async def enqueue_and_acquire(
        self,
        key: SessionKey,
        message_id: str,
        owner: str,
        payload: bytes,
        ttl: float,
        *,
        max_active: int = 0,
        with_persistent: bool = True,
        token: str = "",
    ) -> Admission:
        """Persist an accepted message, and take ``key``'s lease for ``owner`` with it.

        The message is queued as by :meth:`PendingQueue.enqueue` (idempotent
        per message id) whatever becomes of the lease. The lease is taken by
        the rules of :meth:`Leases.acquire` with ``head_seq`` the message's
        ``seq`` (and ``token``); what ``acquire`` would raise is returned as
        :attr:`Admission.refusal` instead.

        :param with_persistent: also read the session's persistent fields
            (:attr:`Admission.persistent`), as :meth:`SessionData.load_persistent` would.
        :raises StoreError: the store could not be asked; nothing was queued
            (in this derived form: unless the queueing itself succeeded, in
            which case the lease is left to be waited for).
        """
        seq = await self.enqueue(key, message_id, owner, payload)
        lease: Lease | None = None
        refusal: SessionBusy | None = None
        try:
            lease = await self.acquire(
                key, owner, ttl, head_seq=seq, max_active=max_active, token=token
            )
        except SessionBusy as error:
            refusal = error
        except StoreError:
            lease = None  # the message is queued: its caller waits for the lease instead
        persistent = await self._read_persistent(key) if with_persistent else None
        return Admission(seq, lease, refusal, persistent)

    async def acquire_and_read(
        self,
        key: SessionKey,
        holder: str,
        ttl: float,
        *,
        head_seq: int | None = None,
        max_active: int = 0,
        token: str = "",
    ) -> Taken:
        """:meth:`Leases.acquire`, returning the session's persistent fields read with the lease.

        :raises SessionBusy: as :meth:`Leases.acquire` (and its subclasses).
        """
        lease = await self.acquire(
            key, holder, ttl, head_seq=head_seq, max_active=max_active, token=token
        )
        return Taken(lease, await self._read_persistent(key))

    async def commit_and_release(self, lease: Lease, batch: WriteBatch) -> bool:
        """Commit ``batch`` under ``lease``'s generation and give the lease up, all at once.

        The commit is :meth:`SessionData.commit` fenced by ``lease.generation``;
        only when it applies is the lease released, as :meth:`Leases.release`
        would, so the session can be taken at once by any holder. A refused
        commit releases nothing.

        :returns: whether the lease was released: ``False`` if it had been
            released already (the commit still applied) — or, in this derived
            form, if the release could not be made; then release it yourself.
        :raises StaleGeneration: the generation moved on; nothing was written or released.
        :raises AlreadyAnswered: as :meth:`SessionData.commit`; nothing was written or released.
        :raises StoreError: as :meth:`SessionData.commit`.
        """
        await self.commit(lease.key, lease.generation, batch)
        try:
            await self.release(lease)
        except (LeaseError, StoreError):
            return False
        return True

    async def _read_persistent(self, key: SessionKey) -> dict[str, Any] | None:
        """The persistent fields, or ``None`` if they could not be read (the caller reads later)."""
        try:
            return await self.load_persistent(key)
        except StoreError:
            return None


class Watch(Protocol):
    """One waiter's watch on one session's wake-ups (see :class:`Wakeups`)."""

    @property
    def listening(self) -> bool:
        """Whether wake-ups can reach this watch now; ``False`` while the waiter only polls."""
        ...

    async def wait(self, seconds: float) -> bool:
        """Wait for a wake-up of the session, at most ``seconds``; whether one came.

        A wake-up that came since the watch was taken, or since the last wait,
        returns at once (each one once).
        """
        ...

    def wake(self) -> None:
        """Wake this watch from this process (its next :meth:`wait` returns at once)."""
        ...

    def close(self) -> None:
        """Stop watching (idempotent)."""
        ...


@runtime_checkable
class Wakeups(Protocol):
    """Optional: wake-ups for a session whose lease may have become free.

    A waiter takes a :meth:`watch_wakeups` on the session *before* it asks for the
    lease; a refusal (another live lease, or another holder's earlier
    message) is followed by a wait on it, bounded by the waiter's poll delay.
    The store wakes a watch when, in any process sharing it, a transaction
    that may let a refused acquire through has been applied: a lease released
    (``release``, ``commit_and_release``), or pending records removed or
    handed on (a commit's done records, ``drop_pending``, ``park``,
    ``adopt``). Leases that simply expire wake nobody, nor does the
    active-session limit; those waits are polled.

    Wake-ups are hints: one may be spurious (the waiter asks, and is refused
    again) or lost (the waiter asks after its poll delay anyway). No guarantee
    of the contract depends on them.
    """

    @abc.abstractmethod
    def watch_wakeups(self, key: SessionKey) -> Watch:
        """A watch on ``key``'s wake-ups, from now on; close it when the wait is over."""
