"""The in-memory store: the reference implementation, for tests and single-process use.

Every operation runs without an ``await`` between its check and its write, so
each one is atomic with respect to the event loop — the same guarantees the
SQLite and Redis stores give across processes, here within one.

It has wake-ups (:class:`~chatlane.stores.protocols.Wakeups`): engines that
share one memory store wait for a session's lease on a watch, woken when the
lease is released or the session's pending records are removed or handed on.

Persistent values are kept as JSON text, as the other stores keep them
(:mod:`chatlane.stores.codec`): a value they would refuse is refused here
too, and what a caller passes in or gets back is never the stored object.
So is every other text they would refuse: a call given a text holding a lone
surrogate, which no UTF-8 carries, fails with the same
:class:`~chatlane.errors.StoreError` (:func:`~chatlane.stores.codec.storable`),
nothing written, though this store could have kept it.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
from msgspec.structs import replace

from chatlane.errors import (
    ActiveSessionLimit,
    AlreadyAnswered,
    EarlierMessageFirst,
    LeaseLost,
    MessageIdInUse,
    SessionBusy,
    StaleGeneration,
)
from chatlane.stores.base import (
    PRUNE_AFTER,
    Admission,
    AnsweredMark,
    Clock,
    Conversation,
    Delivery,
    DeliveryDraft,
    DeliveryStats,
    FailedRecord,
    Lease,
    PendingRecord,
    Settlement,
    Store,
    Taken,
    TranscriptEntry,
    WriteBatch,
    already_released,
    now,
    taken_over,
)
from chatlane.stores.codec import batch_texts, decode_value, encode_value, storable
from chatlane.stores.ids import new_conversation_id, new_token
from chatlane.stores.memory_ledger import MemoryLedger
from chatlane.stores.wakeups import WakeupHub, Watch
from chatlane.types import SessionKey


class _Mark(msgspec.Struct, frozen=True, gc=False):
    """An answered mark: when the message was answered, and what the store tells of it.

    A struct of a float and a record of strings, never tracked by the garbage
    collector: one is kept per answered message, and tracked objects kept
    that often would make the collector run (and walk them) more often.
    """

    at: float
    told: AnsweredMark


class _Kept(msgspec.Struct, frozen=True, gc=False):
    """A transcript entry as the caller made it, and when its commit applied.

    Stamped with its conversation and that time only when read
    (:func:`_stamped`): most entries are never read back here. Never
    tracked by the garbage collector, as :class:`_Mark`; it holds only a
    frozen entry of strings and numbers, so it is in no reference cycle.
    """

    entry: TranscriptEntry
    at: float


@dataclass(slots=True)
class _Session:
    generation: int = 0
    lease: Lease | None = None
    persistent: dict[str, str] = field(default_factory=dict)
    """Field name → its value as JSON text: stored apart from the caller's objects."""
    conversations: list[Conversation] = field(default_factory=list)
    current: str = ""
    """The id of the current one of ``conversations``; "" until the first starts."""
    pending: dict[int, PendingRecord] = field(default_factory=dict)


class MemoryStore(Store):
    """A :class:`~chatlane.stores.base.Store` in this process's memory."""

    def __init__(self, url: str = "memory://", *, clock: Clock = now) -> None:
        """:param clock: where the store reads the time (wall-clock seconds by default)."""
        self.url = url
        self._clock = clock
        self._sessions: defaultdict[SessionKey, _Session] = defaultdict(_Session)
        self._transcripts: defaultdict[str, list[_Kept]] = defaultdict(list)
        """Conversation id → its entries, oldest first (see :class:`_Kept`)."""
        self._answered: dict[str, _Mark] = {}
        """Message id → its answered mark; insertion order is time order."""
        self._message_seq: dict[str, int] = {}
        self._seq = itertools.count(1)
        self._heartbeats: dict[str, float] = {}
        self._failed: dict[str, FailedRecord] = {}
        """Message id → its failed record; insertion order is failure order."""
        self._leased: set[SessionKey] = set()
        """Every session holding a lease: a released one leaves at once, an expired one
        when a heartbeat prunes it. Counting live leases looks at these only."""
        self._queued: set[SessionKey] = set()
        """Every session with pending messages, and those that had some until
        :meth:`pending_keys` drops them."""
        self._wakeups = WakeupHub()
        self._ledger = MemoryLedger(clock)

    def watch_wakeups(self, key: SessionKey) -> Watch:
        """See :meth:`~chatlane.stores.protocols.Wakeups.watch_wakeups`."""
        return self._wakeups.watch(key)

    # -- generations and leases ----------------------------------------------

    def _live_lease(self, session: _Session) -> Lease | None:
        lease = session.lease
        return lease if lease is not None and lease.expires_at > self._clock() else None

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
        _storable(key, holder, token)
        return self._acquire(key, holder, ttl, head_seq, max_active, self._clock(), token)

    def _acquire(
        self,
        key: SessionKey,
        holder: str,
        ttl: float,
        head_seq: int | None,
        max_active: int,
        moment: float,
        token: str,
    ) -> Lease:
        """Take ``key``'s lease at ``moment`` (the store's clock, read once by the caller)."""
        session = self._sessions[key]
        held = session.lease
        if held is not None and held.expires_at > moment:  # live: as _live_lease reads it
            if token and held.token == token:
                return held  # an earlier try of this acquisition took it
            raise SessionBusy(f"session {key!r} is running elsewhere", key=key)
        pending = session.pending
        if (
            head_seq is not None
            and (len(pending) > 1 or head_seq not in pending)  # else the head is all there is
            and _earlier_foreign(session, head_seq, holder)
        ):
            raise EarlierMessageFirst(f"an earlier message of {key!r} runs first", key=key)
        if max_active and (active := self._active()) >= max_active:
            raise ActiveSessionLimit(
                f"at the active session limit ({active}/{max_active})", key=key
            )
        session.generation += 1
        session.lease = Lease(key, holder, token or new_token(), session.generation, moment + ttl)
        self._leased.add(key)
        return session.lease

    async def renew(self, lease: Lease, ttl: float) -> Lease:
        session = self._sessions[lease.key]
        held = self._live_lease(session)
        if held is None or held.token != lease.token or session.generation != lease.generation:
            raise LeaseLost(
                f"lease on {lease.key!r} (generation {lease.generation}) was lost",
                key=lease.key,
                generation=lease.generation,
            )
        session.lease = Lease(
            lease.key, lease.holder, lease.token, lease.generation, self._clock() + ttl
        )
        return session.lease

    async def release(self, lease: Lease) -> None:
        self._release(lease)

    def _release(self, lease: Lease) -> None:
        session = self._sessions[lease.key]
        held = session.lease
        if held is not None and held.token == lease.token:
            session.lease = None
            self._leased.discard(lease.key)
            self._wakeups.wake(lease.key)
            return
        if held is None and session.generation == lease.generation:
            raise already_released(lease)
        raise taken_over(lease)

    async def bump_generation(self, key: SessionKey) -> int:
        _storable(key)
        session = self._sessions[key]
        session.generation += 1
        return session.generation

    async def generation(self, key: SessionKey) -> int:
        _storable(key)
        session = self._sessions.get(key)
        return 0 if session is None else session.generation

    async def lease_holder(self, key: SessionKey) -> str | None:
        _storable(key)
        session = self._sessions.get(key)
        lease = None if session is None else self._live_lease(session)
        return None if lease is None else lease.holder

    async def active_sessions(self) -> int:
        return self._active()

    def _active(self) -> int:
        sessions = self._sessions
        return sum(1 for key in self._leased if self._live_lease(sessions[key]) is not None)

    # -- fenced writes and reads -----------------------------------------------

    async def commit(self, key: SessionKey, generation: int | None, batch: WriteBatch) -> None:
        self._commit(key, generation, batch)

    def _commit(self, key: SessionKey, generation: int | None, batch: WriteBatch) -> _Session:
        """Apply ``batch`` whole, or raise with nothing applied; the session it applied to."""
        storable(NAME, batch_texts(key, batch))
        persistent = batch.persistent
        fields = {n: encode_value(key, n, v) for n, v in persistent.items()} if persistent else None
        session = self._sessions[key]
        if generation is not None and generation != session.generation:
            raise StaleGeneration(key, generation, session.generation, "commit")
        moment = self._clock()
        marks = self._answered
        for message_id in batch.answered:
            if message_id in marks:  # answered, or answered long ago and forgotten
                self._refuse_answered(key, batch.answered, moment - self.answered_retention)
        conversation_id = session.current or self._start(key, session, "").id
        transcript = self._transcripts[conversation_id]
        for entry in batch.transcript:  # an entry's own id and time are kept
            transcript.append(_Kept(entry, moment))
        if batch.title:
            self._title(session, conversation_id, batch.title, batch.rename)
        if fields:
            session.persistent.update(fields)
        if batch.deliveries:
            self._ledger.record(batch.deliveries)
        mark = _Mark(moment, AnsweredMark(batch.answer, key, batch.failure))
        for message_id in batch.answered:
            marks.pop(message_id, None)  # a forgotten mark moves to the end
            marks[message_id] = mark
        if batch.done:
            self._remove_all_pending(session, batch.done)
            self._wakeups.wake(key)
        return session

    def _refuse_answered(self, key: SessionKey, message_ids: Sequence[str], cutoff: float) -> None:
        """:raises AlreadyAnswered: if any of ``message_ids`` was answered after ``cutoff``."""
        marks = self._answered
        repeated = [m for m in message_ids if (mark := marks.get(m)) and mark.at > cutoff]
        if repeated:
            raise AlreadyAnswered(repeated, key=key)

    async def load_persistent(self, key: SessionKey) -> dict[str, Any]:
        _storable(key)
        return self._load_persistent(key)

    async def load_fields(self, key: SessionKey, names: Sequence[str]) -> dict[str, Any]:
        _storable(key, *names)
        session = self._sessions.get(key)
        stored = {} if session is None else session.persistent
        return {n: decode_value(key, n, stored[n]) for n in names if n in stored}

    def _load_persistent(self, key: SessionKey) -> dict[str, Any]:
        session = self._sessions.get(key)
        if session is None or not session.persistent:
            return {}
        return {name: decode_value(key, name, value) for name, value in session.persistent.items()}

    async def transcript(
        self, key: SessionKey, conversation_id: str | None = None, limit: int = 100
    ) -> list[TranscriptEntry]:
        _storable(key, conversation_id or "")
        if conversation_id is None:
            conversation_id = (await self.conversation(key)).id
        return self._read_transcript(conversation_id, limit) if limit > 0 else []

    def _read_transcript(self, conversation_id: str, limit: int) -> list[TranscriptEntry]:
        """The last ``limit`` entries of ``conversation_id``, stamped, oldest first."""
        kept = self._transcripts[conversation_id][-limit:]
        return [_stamped(k.entry, conversation_id, k.at) for k in kept]

    async def is_answered(self, message_id: str) -> bool:
        _storable(message_id)
        return self._marked(message_id, self._clock() - self.answered_retention) is not None

    async def mark(self, message_id: str) -> AnsweredMark | None:
        _storable(message_id)
        mark = self._marked(message_id, self._clock() - self.answered_retention)
        return None if mark is None else mark.told

    def _marked(self, message_id: str, cutoff: float) -> _Mark | None:
        """``message_id``'s answered mark, if it was set after ``cutoff``."""
        mark = self._answered.get(message_id)
        return mark if mark is not None and mark.at > cutoff else None

    # -- a turn's fused calls: no await inside, so each is atomic ---------------------

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
        _storable(key, message_id, owner, token)
        moment = self._clock()  # one reading for the record and the lease
        seq = self._enqueue(key, message_id, owner, payload, moment)
        lease: Lease | None = None
        refusal: SessionBusy | None = None
        try:
            lease = self._acquire(key, owner, ttl, seq, max_active, moment, token)
        except SessionBusy as error:
            refusal = error
        persistent = self._load_persistent(key) if with_persistent else None
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
        _storable(key, holder, token)
        lease = self._acquire(key, holder, ttl, head_seq, max_active, self._clock(), token)
        return Taken(lease, self._load_persistent(key))

    async def commit_and_release(self, lease: Lease, batch: WriteBatch) -> bool:
        session = self._commit(lease.key, lease.generation, batch)
        held = session.lease
        if held is None or held.token != lease.token:
            return False  # released before: a successor would have moved the generation
        session.lease = None  # as _release does for the lease it holds
        self._leased.discard(lease.key)
        return True

    # -- conversations -----------------------------------------------------------

    def _current(self, key: SessionKey, session: _Session) -> Conversation:
        for conversation in session.conversations:
            if conversation.id == session.current:
                return conversation
        return self._start(key, session, "")

    def _start(self, key: SessionKey, session: _Session, title: str) -> Conversation:
        conversation = Conversation(new_conversation_id(), key, self._clock(), title=title)
        session.conversations.append(conversation)
        session.current = conversation.id
        return conversation

    def _title(self, session: _Session, conversation_id: str, title: str, rename: bool) -> None:
        """Give ``conversation_id`` ``title``: if it has none, or ``rename`` says so."""
        session.conversations = [
            replace(c, title=title) if c.id == conversation_id and (rename or not c.title) else c
            for c in session.conversations
        ]

    def _end_current(self, session: _Session) -> None:
        moment = self._clock()
        session.conversations = [
            _ended(c, moment) if c.id == session.current else c for c in session.conversations
        ]

    async def conversation(self, key: SessionKey) -> Conversation:
        _storable(key)
        return self._current(key, self._sessions[key])

    async def new_conversation(self, key: SessionKey, title: str = "") -> Conversation:
        _storable(key, title)
        session = self._sessions[key]
        self._end_current(session)
        return self._start(key, session, title)

    async def resume_conversation(self, key: SessionKey, conversation_id: str) -> Conversation:
        _storable(key, conversation_id)
        session = self._sessions[key]
        found = [c for c in session.conversations if c.id == conversation_id]
        if not found:
            raise KeyError(conversation_id)
        self._end_current(session)
        resumed = replace(found[0], ended_at=0.0)
        session.conversations = [
            resumed if c.id == conversation_id else c for c in session.conversations
        ]
        session.current = conversation_id
        return resumed

    async def conversations(self, key: SessionKey, limit: int = 20) -> list[Conversation]:
        _storable(key)
        session = self._sessions[key]
        self._current(key, session)
        return sorted(session.conversations, key=lambda c: c.started_at, reverse=True)[:limit]

    # -- the durable pending queue -------------------------------------------------

    async def enqueue(
        self, key: SessionKey, message_id: str, owner: str, payload: bytes, *, seq: int = 0
    ) -> int:
        _storable(key, message_id, owner)
        return self._enqueue(key, message_id, owner, payload, self._clock(), seq)

    def _enqueue(
        self,
        key: SessionKey,
        message_id: str,
        owner: str,
        payload: bytes,
        moment: float,
        seq: int = 0,
    ) -> int:
        """Queue the message, accepted at ``moment`` (under ``seq``, given one); a message
        queued before keeps its seq.

        :raises MessageIdInUse: another session's queued message has that id.
        """
        known = self._message_seq.get(message_id)
        if known is not None:
            if known not in self._sessions[key].pending:
                raise MessageIdInUse(message_id, key=key)
            return known
        seq = seq or next(self._seq)
        record = PendingRecord(key, seq, message_id, owner, payload, moment)
        self._sessions[key].pending[seq] = record
        self._message_seq[message_id] = seq
        self._queued.add(key)
        return seq

    async def pending(self, key: SessionKey) -> list[PendingRecord]:
        _storable(key)
        session = self._sessions.get(key)
        return [] if session is None else [session.pending[s] for s in sorted(session.pending)]

    async def pending_keys(self) -> list[SessionKey]:
        sessions = self._sessions
        self._queued = {key for key in self._queued if sessions[key].pending}
        return sorted(self._queued)

    async def drop_pending(self, key: SessionKey, seqs: Sequence[int]) -> None:
        _storable(key)
        self._remove_all_pending(self._sessions[key], seqs)
        self._wakeups.wake(key)

    async def drop_own(self, key: SessionKey, seqs: Sequence[int], owner: str) -> list[int]:
        _storable(key, owner)
        session = self._sessions[key]
        pending = session.pending
        own = [seq for seq in sorted(seqs) if seq in pending and pending[seq].owner == owner]
        if own:
            self._remove_all_pending(session, own)
            self._wakeups.wake(key)
        return own

    async def adopt(
        self,
        key: SessionKey,
        seqs: Sequence[int],
        old_owner: str,
        new_owner: str,
        *,
        generation: int | None = None,
    ) -> list[int]:
        _storable(key, old_owner, new_owner)
        session = self._sessions[key]
        if generation is not None and session.generation != generation:
            return []
        pending = session.pending
        adopted = [s for s in sorted(seqs) if s in pending and pending[s].owner == old_owner]
        for seq in adopted:
            pending[seq] = replace(pending[seq], owner=new_owner)
        if adopted:
            self._wakeups.wake(key)
        return adopted

    async def park(self, key: SessionKey, seqs: Sequence[int], reason: str) -> None:
        _storable(key, reason)
        session = self._sessions[key]
        moment = self._clock()
        for seq in sorted(seqs):
            record = session.pending.get(seq)
            if record is not None:
                self._remove_pending(session, seq)
                self._failed[record.message_id] = FailedRecord(record, reason, moment)
        self._wakeups.wake(key)

    async def failed(self, limit: int = 100) -> list[FailedRecord]:
        return list(self._failed.values())[: max(limit, 0)]

    async def retry_failed(self, message_id: str, owner: str) -> PendingRecord | None:
        _storable(message_id, owner)
        failed = self._failed.get(message_id)
        if failed is None:
            return None
        self._queued_elsewhere(failed.record)
        del self._failed[message_id]
        self._unqueue(message_id)  # queued again since it failed: this record takes its place
        record = replace(failed.record, owner=owner)
        self._sessions[record.key].pending[record.seq] = record
        self._message_seq[message_id] = record.seq
        self._queued.add(record.key)
        return record

    def _queued_elsewhere(self, record: PendingRecord) -> None:
        """:raises MessageIdInUse: another session than ``record``'s queued its id since."""
        seq = self._message_seq.get(record.message_id)
        if seq is not None and seq not in self._sessions[record.key].pending:
            raise MessageIdInUse(record.message_id, key=record.key)

    def _unqueue(self, message_id: str) -> None:
        """Remove the pending record holding ``message_id``, under whichever key it is queued."""
        seq = self._message_seq.get(message_id)
        if seq is None:
            return
        for key in self._queued:
            session = self._sessions[key]
            record = session.pending.get(seq)
            if record is not None and record.message_id == message_id:
                self._remove_pending(session, seq)
                self._wakeups.wake(key)
                return

    def _remove_pending(self, session: _Session, seq: int) -> None:
        self._remove_all_pending(session, (seq,))

    def _remove_all_pending(self, session: _Session, seqs: Iterable[int]) -> None:
        """Remove ``seqs`` from ``session``'s queue (those it holds); their ids may queue again."""
        pending, message_seq = session.pending, self._message_seq
        for seq in seqs:
            record = pending.pop(seq, None)
            if record is not None:
                message_seq.pop(record.message_id, None)
        if not pending:
            pending.clear()  # an emptied dict keeps its table until cleared

    # -- the delivery ledger ---------------------------------------------------------

    async def record_deliveries(self, drafts: Sequence[DeliveryDraft]) -> None:
        _storable(*(text for d in drafts for text in (d.id, d.lane, d.target)))
        self._ledger.record(drafts)

    async def claim_deliveries(
        self, lanes: Sequence[str], holder: str, ttl: float, limit: int
    ) -> list[Delivery]:
        _storable(holder, *lanes)
        return self._ledger.claim(lanes, holder, ttl, limit)

    async def settle_deliveries(self, settlements: Sequence[Settlement]) -> list[bool]:
        _storable(*(text for s in settlements for text in (s.id, s.claim, s.reason)))
        return self._ledger.settle(settlements)

    async def deliveries(self, state: str, limit: int = 100) -> list[Delivery]:
        _storable(state)
        return self._ledger.listed(state, limit)

    async def delivery(self, delivery_id: str) -> Delivery | None:
        _storable(delivery_id)
        return self._ledger.get(delivery_id)

    async def delivery_stats(self) -> DeliveryStats:
        return self._ledger.stats()

    async def retry_dead(self, delivery_id: str) -> bool:
        _storable(delivery_id)
        return self._ledger.retry_dead(delivery_id)

    # -- process liveness ------------------------------------------------------------

    async def heartbeat(self, holder: str, ttl: float) -> None:
        _storable(holder)
        moment = self._clock()
        self._heartbeats[holder] = moment + ttl
        cutoff = moment - self.answered_retention
        while self._answered and next(iter(self._answered.values())).at <= cutoff:
            del self._answered[next(iter(self._answered))]
        self._prune(moment - PRUNE_AFTER)
        self._ledger.prune(moment - self.delivered_retention, cutoff)

    def _prune(self, cutoff: float) -> None:
        """Forget heartbeats and leases that expired before ``cutoff``.

        Only sessions that held a lease since the last prune are looked at, so a
        heartbeat costs what changed since the last one, not the number of sessions.
        """
        for holder in [h for h, expiry in self._heartbeats.items() if expiry <= cutoff]:
            del self._heartbeats[holder]
        kept: set[SessionKey] = set()
        for key in self._leased:
            session = self._sessions[key]
            if session.lease is not None and session.lease.expires_at <= cutoff:
                session.lease = None
            if session.lease is not None:
                kept.add(key)
        self._leased = kept

    async def alive(self, holders: Sequence[str]) -> Mapping[str, bool]:
        _storable(*holders)
        moment = self._clock()
        return {h: self._heartbeats.get(h, 0.0) > moment for h in holders}

    async def close(self) -> None:
        return None


NAME = "memory store"
"""How the memory store names itself in its errors."""


def _storable(*texts: str) -> None:
    """Refuse ``texts`` as the stores that encode them do, if one holds a lone surrogate
    (:func:`~chatlane.stores.codec.storable`)."""
    storable(NAME, texts)


def _earlier_foreign(session: _Session, head_seq: int, holder: str) -> bool:
    """Whether another holder's message was accepted before ``head_seq``."""
    return any(seq < head_seq and r.owner != holder for seq, r in session.pending.items())


def _stamped(entry: TranscriptEntry, conversation_id: str, at: float) -> TranscriptEntry:
    """``entry`` as read back: in ``conversation_id``, made at ``at``, unless it says otherwise."""
    if entry.conversation_id and entry.created_at:
        return entry
    return replace(
        entry,
        conversation_id=entry.conversation_id or conversation_id,
        created_at=entry.created_at or at,
    )


def _ended(conversation: Conversation, moment: float) -> Conversation:
    return replace(conversation, ended_at=moment)
