"""The store contract: what every backend (memory, SQLite, Redis, PostgreSQL) keeps, and how.

A store holds, per session key: the **generation** (the fencing token — it
only grows, and survives restarts), a **lease** (who runs the session's turn
right now), **persistent fields**, **conversations** with their
**transcripts**, a **durable pending queue** of accepted messages, and the set
of inbound messages already **answered**. :class:`Store` is the union of the
small protocols of :mod:`chatlane.stores.protocols` (leases, session data,
conversations, the pending queue, liveness) and of a turn's fused calls
(:class:`~chatlane.stores.protocols.Turns`); the records it keeps are in
:mod:`chatlane.stores.records`, the ids it makes in :mod:`chatlane.stores.ids`,
the names of the persistent fields chatlane uses in :mod:`chatlane.stores.fields`.

What every implementation guarantees — the contract suite in
``tests/stores/contract/`` (one module per protocol) checks each point
against each backend:

* :meth:`Store.acquire` is one atomic check-and-set: it fails with
  :class:`~chatlane.errors.SessionBusy` while another live lease exists (or
  with its subclass :class:`~chatlane.errors.EarlierMessageFirst` while a
  message queued earlier must run first), and on success bumps the generation by one.
* Every write made for a turn goes through :meth:`Store.commit` with that
  turn's generation and is refused as a whole, atomically, with
  :class:`~chatlane.errors.StaleGeneration` once the generation moved on. An
  inbound message is recorded as answered at most once
  (:class:`~chatlane.errors.AlreadyAnswered`) for :attr:`Store.answered_retention`
  seconds; an older mark is forgotten (each heartbeat prunes some), so the
  record of answered messages does not grow without bound.
* While its mark is kept, :meth:`Store.mark` tells what a message was
  answered with (the reply or the notice, written in the same commit as the
  mark), in which session, and why its turn failed if it did
  (:class:`~chatlane.stores.records.AnsweredMark`), whichever process committed it.
  A mark written before the store kept the session and the failure reads back
  with both empty.
* Message ids are unique across every session of a store: a message queued
  under an id another session's queued message holds is refused with
  :class:`~chatlane.errors.MessageIdInUse`, nothing written.
* :meth:`Store.renew` and :meth:`Store.release` succeed only with the lease's
  own token: a lease that expired, was taken over or was fenced off raises
  :class:`~chatlane.errors.LeaseLost`; releasing a lease twice raises
  :class:`~chatlane.errors.LeaseError`.
* Pending messages are returned in the order the store accepted them
  (``seq`` grows per key) and stay until removed by a commit or a drop, or
  set aside as failed (:meth:`Store.park`), where they stay until retried.
* A turn costs two calls (:class:`~chatlane.stores.protocols.Turns`):
  :meth:`Store.enqueue_and_acquire` queues a message and takes its session's
  lease (or says why not, never losing the message) with the session's
  persistent fields, and :meth:`Store.commit_and_release` commits the reply
  and releases the lease — each one transaction in every backend, a refused
  commit releasing nothing.
* :meth:`Store.renew_many` renews every lease a process holds in one call,
  and :meth:`Store.adopt_orphans` adopts a bounded batch of dead processes'
  messages in one call: upkeep costs do not grow with one round trip per session.
* Each heartbeat also prunes what no one needs any more: answered marks past
  their retention, heartbeats and leases expired for :data:`PRUNE_AFTER`.
* A text kept as text (a key, an id, a transcript entry, an answer, a title…)
  comes back exactly as given, NUL included; one holding a lone surrogate,
  which no UTF-8 carries, is refused by every call with
  :class:`~chatlane.errors.StoreError`, nothing written
  (:func:`~chatlane.stores.codec.unstorable`).
* Persistent values are JSON, encoded alike by every backend
  (:mod:`chatlane.stores.codec`): a value that is not is refused with
  :class:`~chatlane.errors.StoreError`, and no backend hands out or keeps the
  caller's objects.
* Times (lease expiry, heartbeats, retention) are wall-clock seconds, read
  from the store's clock: :data:`now` unless another :data:`Clock` is
  injected (the memory and SQLite stores take one; Redis reads its server's
  ``TIME``, PostgreSQL its server's ``clock_timestamp()``).
"""

from __future__ import annotations

import abc
import functools
import time
from collections.abc import Callable

from chatlane.errors import LeaseError, LeaseLost, StoreDamaged, StoreError
from chatlane.stores.adoption import Adoptions
from chatlane.stores.protocols import (
    Conversations,
    Deliveries,
    Leases,
    Liveness,
    PendingQueue,
    SessionData,
    Turns,
)
from chatlane.stores.records import (
    DEAD,
    DELIVERED,
    PENDING,
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
    SettlementKind,
    Taken,
    TranscriptEntry,
    WriteBatch,
)

__all__ = [
    "ANSWERED_RETENTION",
    "DEAD",
    "DELIVERED",
    "DELIVERED_RETENTION",
    "PENDING",
    "PRUNE_AFTER",
    "Admission",
    "AnsweredMark",
    "Clock",
    "Conversation",
    "Conversations",
    "Deliveries",
    "Delivery",
    "DeliveryDraft",
    "DeliveryStats",
    "FailedRecord",
    "Lease",
    "Leases",
    "Liveness",
    "PendingQueue",
    "PendingRecord",
    "SessionData",
    "Settlement",
    "SettlementKind",
    "Store",
    "Taken",
    "TranscriptEntry",
    "Turns",
    "WriteBatch",
    "now",
]


Clock = Callable[[], float]
"""Where a store reads the time: wall-clock seconds (tests pass a clock they advance)."""


def already_released(lease: Lease) -> LeaseError:
    """The error for releasing ``lease`` a second time (every backend raises this one)."""
    message = f"lease on {lease.key!r} was already released"
    return LeaseError(message, key=lease.key, generation=lease.generation)


def taken_over(lease: Lease) -> LeaseLost:
    """The error for releasing ``lease`` after another holder took the session."""
    message = f"lease on {lease.key!r} was taken over since generation {lease.generation}"
    return LeaseLost(message, key=lease.key, generation=lease.generation)


now: Clock = time.time
"""Wall-clock seconds: lease expiry must mean the same thing in every process.

``time.time`` itself, so a store reading it on every call pays no Python frame.
"""


PRUNE_AFTER = 60.0
"""Seconds an expired heartbeat or lease is kept before a heartbeat prunes it."""

ANSWERED_RETENTION = 7 * 24 * 3600.0
"""Seconds a message stays marked answered: far longer than any re-delivery or re-run."""

DELIVERED_RETENTION = 3600.0
"""Seconds a delivered delivery stays in the ledger (for ``chatlane inspect``) until pruned."""


class Store(Turns, Leases, SessionData, Conversations, PendingQueue, Liveness, Deliveries):
    """A backend for sessions, leases and durable queues: every protocol of the contract.

    See the module docstring, and :mod:`chatlane.stores.protocols` for each slice.
    """

    url: str = ""
    answered_retention: float = ANSWERED_RETENTION
    """Seconds an answered mark holds (see :data:`ANSWERED_RETENTION`)."""
    answers_may_be_lost: bool = False
    """Whether a call can fail here after it applied (its answer lost on the way back, as
    over a connection to a server that broke): then the runtime takes back what a failed
    admission may have stored (:mod:`chatlane.runtime.withdrawals`). ``False`` where a
    failed call changed nothing."""

    def may_have_applied(self, error: BaseException) -> bool:
        """Whether a call that failed with ``error`` may have changed this store all the
        same: only a :class:`~chatlane.errors.StoreError` that says it may have
        (``maybe_applied``), on a store whose answers may be lost."""
        return self.answers_may_be_lost and isinstance(error, StoreError) and error.maybe_applied

    delivered_retention: float = DELIVERED_RETENTION
    """Seconds a delivered delivery is kept (see :data:`DELIVERED_RETENTION`); dead ones
    are kept for :attr:`answered_retention`."""

    async def adopt_orphans(self, holder: str, limit: int) -> list[PendingRecord]:
        """See :meth:`PendingQueue.adopt_orphans`: the queues, read against :meth:`alive`,
        each session adopted on its own (:mod:`chatlane.stores.adoption`)."""
        return await self._adoptions.orphans(holder, limit)

    @functools.cached_property
    def _adoptions(self) -> Adoptions:
        return Adoptions(self)

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
