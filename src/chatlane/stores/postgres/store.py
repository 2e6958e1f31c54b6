"""The PostgreSQL store: sessions, leases and the durable queue in the operators' own database.

Every call is one transaction on a connection of the store's pools (asyncpg:
see :mod:`~chatlane.stores.postgres.pools`), or a single statement where it
only reads. The operations themselves — the
SQL, and the checks around it — live in :mod:`~chatlane.stores.postgres.leases`,
:mod:`~chatlane.stores.postgres.data`, :mod:`~chatlane.stores.postgres.queue`
and :mod:`~chatlane.stores.postgres.liveness`, the delivery ledger in
:mod:`~chatlane.stores.postgres.ledger`; a turn's fused calls are one
transaction each, and a commit's deliveries are recorded in its transaction.

What stays true beyond the :class:`~chatlane.stores.base.Store` contract:

* A transaction that writes a session's rows first takes that session's
  advisory lock (``pg_advisory_xact_lock`` on a hash of its key), then reads
  the server's clock. So every check-and-set of one session (acquire, release,
  bump, fenced commit, enqueue, adopt) runs after the last one committed, in
  ``READ COMMITTED``, and no transaction of another session waits for it.
* Times are the server's: lease expiry, heartbeats and retention are judged
  against ``clock_timestamp()`` read inside the transaction (``now()`` in a
  single read), never this host's clock; a lease's ``expires_at`` is that
  moment plus its TTL. Hosts' clocks must agree with the server's to well
  within a TTL (NTP), as the runtime compares ``expires_at`` with its own.
* It has wake-ups (:class:`~chatlane.stores.protocols.Wakeups`): a
  transaction that frees a session someone waits for (its lease released, its
  pending records removed) notifies the store's channel, and one connection
  outside the pools listens (:mod:`~chatlane.stores.postgres.wakeups`).
  Without it (down, or not yet back) waiters poll.
* Every text is kept exactly, NUL included, which PostgreSQL's ``text`` cannot
  hold: each call talks through :class:`~chatlane.stores.postgres.text.Escaped`,
  which escapes it on the way to the server and back
  (:mod:`~chatlane.stores.postgres.text`).
* Any failure of the driver or the server becomes
  :class:`~chatlane.errors.StoreError` naming the store (its password masked) —
  except :meth:`PostgresStore.renew`, which raises
  :class:`~chatlane.errors.LeaseLost`: a lease that could not be renewed must
  be treated as gone. A transaction that failed before its commit wrote
  nothing (``StoreError.maybe_applied`` is false); one whose connection broke
  as it committed may have applied all the same.
* Every call is bounded (:mod:`~chatlane.stores.postgres.pools`): one whose
  connection does not answer within its limit (``command_timeout``;
  ``renew_timeout`` for heartbeats and renewals) fails with ``StoreError``
  saying so, and its connection is closed, never handed out again; the next
  calls open fresh ones. It may have applied by the same rule: a transaction
  cut before its ``COMMIT`` did not; a routine's statement, once sent, may have.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

import asyncpg

from chatlane.errors import LeaseLost, SessionBusy, StoreError
from chatlane.stores.base import (
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
    Store,
    Taken,
    TranscriptEntry,
    WriteBatch,
)
from chatlane.stores.codec import detached_batch, encoding_refused
from chatlane.stores.postgres import data
from chatlane.stores.postgres import leases as ls
from chatlane.stores.postgres import ledger as dl
from chatlane.stores.postgres import liveness as lv
from chatlane.stores.postgres import queue as pq
from chatlane.stores.postgres.db import Db, DriverError, Row
from chatlane.stores.postgres.pools import Call, PoolName, Pools, open_pools
from chatlane.stores.postgres.schema import migrate
from chatlane.stores.postgres.text import Escaped
from chatlane.stores.postgres.url import Location, parse_url, redact
from chatlane.stores.postgres.wakeups import Listener, token
from chatlane.stores.wakeups import Watch
from chatlane.types import SessionKey

__all__ = ["PostgresStore"]

T = TypeVar("T")
Operation = Callable[[Db, float], Awaitable[T]]
"""A function of a connection inside a transaction, and the server's clock read in it."""

_NOW = "SELECT extract(epoch FROM clock_timestamp())::float8"
_LOCKED_NOW = f"{_NOW} FROM pg_advisory_xact_lock(hashtextextended($1, 0))"
"""The session's lock, then the clock: the moment is read once the lock is held."""


class PostgresStore(Store):
    """A :class:`~chatlane.stores.base.Store` in a PostgreSQL (13+) schema; open it with
    :meth:`open`."""

    answers_may_be_lost = True  # a connection can break after the server committed

    def __init__(self, url: str, location: Location, pools: Pools) -> None:
        self.url = url
        self.location = location
        self._name = f"postgres store {redact(url)}"
        self._pools = pools
        self._closed = False
        self.listener = Listener(location, self._name)
        """The connection that listens for wake-ups, and the watches it wakes."""

    @classmethod
    async def open(cls, url: str) -> PostgresStore:
        """Connect to ``url``, create the store's schema if missing and bring it up to date.

        :raises StoreError: the URL is malformed, the server cannot be reached or
            refuses the credentials, or the schema is newer than this chatlane knows.
        """
        location = parse_url(url)
        store = cls(url, location, await open_pools(location, f"postgres store {redact(url)}"))
        try:
            await store._migrate()
            await store.listener.start()
        except BaseException:
            await store.close()
            raise
        return store

    async def _migrate(self) -> None:
        try:
            async with self._pools.quick.acquire(timeout=self.location.connect_timeout) as db:
                await migrate(db, self.location.schema)
        except DriverError as error:
            schema = self.location.schema
            raise StoreError(
                f"{self._name}: cannot set up schema {schema!r}: {_reason(error)}"
            ) from None

    def watch_wakeups(self, key: SessionKey) -> Watch:
        """See :meth:`~chatlane.stores.protocols.Wakeups.watch_wakeups`: woken by ``NOTIFY``."""
        return self.listener.watch(key)

    def _notice(self, key: SessionKey) -> tuple[str, str]:
        """The channel and ``key``'s token on it: what a transaction that frees ``key`` notifies."""
        return self.listener.channel, token(key)

    # -- talking to the server -------------------------------------------------

    async def _write(
        self,
        key: SessionKey | None,
        op: Operation[T],
        *,
        upkeep: bool = False,
        then: float | None = None,
    ) -> T:
        """Run ``op`` in one transaction, under ``key``'s lock unless ``key`` is None.

        :param upkeep: a heartbeat or a renewal, which takes no session's lock: on the pool
            kept for them (see :mod:`~chatlane.stores.postgres.pools`), within ``renew_timeout``.
        :param then: seconds the rest of the call may take once the server has answered its
            first statement (the connection is alive), instead of what is left of its limit.
        """
        call = self._call_on("liveness" if upkeep else "turns")
        committing = False
        try:
            async with call as connection:
                db = Escaped(connection)
                try:
                    async with db.transaction():
                        clock = db.fetchval(_NOW) if key is None else db.fetchval(_LOCKED_NOW, key)
                        moment = await clock
                        if then is not None:
                            call.extend(then)
                        done = await op(db, moment)
                        committing = True  # leaving the block sends COMMIT: it may apply
                        return done
                except asyncpg.InternalClientError:
                    db.terminate()  # as _closing_if_lost: never handed out again
                    raise
        except DriverError as error:
            raise self._failure(error, committing, call) from error

    async def _call(self, op: Callable[[Db], Awaitable[T]]) -> T:
        """Run ``op``, one statement calling a routine of the schema, in its own transaction
        (:mod:`~chatlane.stores.postgres.routines`: it takes the session's lock itself).

        A failure once the statement may have reached the server may have applied, unless
        the server refused it (an ``ERROR`` rolls its transaction back) or the driver did
        before sending it.
        """
        call = self._call_on("turns")
        sent = False
        try:
            async with call as db:
                sent = True
                return await _closing_if_lost(Escaped(db), op)
        except DriverError as error:
            raise self._failure(error, sent and not _rolled_back(error), call) from error

    async def _read(self, op: Callable[[Db], Awaitable[T]]) -> T:
        """Run ``op``, a single statement that only reads, outside any transaction (quick pool)."""
        call = self._call_on("quick")
        try:
            async with call as db:
                return await _closing_if_lost(Escaped(db), op)
        except DriverError as error:
            raise self._failure(error, False, call) from error

    async def _fetch(self, query: str, *args: Any) -> list[Row]:
        """The rows of one read (for tests and tools that look into the store's tables)."""
        return await self._read(lambda db: db.fetch(query, *args))

    def _call_on(self, name: PoolName) -> Call:
        """A bounded call on a connection of pool ``name`` (see
        :mod:`~chatlane.stores.postgres.pools`)."""
        if self._closed:
            raise StoreError(f"{self._name} is closed")
        return self._pools.call(name)

    def _failure(self, error: BaseException, committing: bool, call: Call) -> StoreError:
        """``error`` as a :class:`StoreError`; ``committing``: it came as the transaction
        was being committed, which may have applied (otherwise the server rolled it back).
        A call whose connection was closed for not answering in time says so."""
        if isinstance(error, UnicodeEncodeError):  # never sent: the refusal every store makes
            return encoding_refused(self._name, error)
        if call.expired:
            text = (
                f"{self._name}: no answer within {call.limit:g} s ({call.option}); "
                "its connection was closed"
            )
        else:
            text = f"{self._name}: {type(error).__name__}: {_reason(error)}"
        return StoreError(text, maybe_applied=committing)

    # -- generations and leases ----------------------------------------------

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
        turn, schema = (head_seq, max_active, token), self.location.schema
        lease = await self._call(lambda db: ls.acquire(db, key, holder, ttl, turn, schema))
        if isinstance(lease, SessionBusy):
            raise lease  # once the refusal's statement committed: it marks who waits
        return lease

    async def renew(self, lease: Lease, ttl: float) -> Lease:
        """See :meth:`Store.renew`; failing to reach the server also raises ``LeaseLost``."""
        try:
            [renewed] = await self.renew_many([lease], ttl)
        except StoreError as error:
            raise LeaseLost(
                f"lease on {lease.key!r} could not be renewed: {error}",
                key=lease.key,
                generation=lease.generation,
            ) from error
        if renewed is None:
            raise LeaseLost(
                f"lease on {lease.key!r} (generation {lease.generation}) was lost",
                key=lease.key,
                generation=lease.generation,
            )
        return renewed

    async def renew_many(self, leases: Sequence[Lease], ttl: float) -> list[Lease | None]:
        """See :meth:`Store.renew_many`: one ``UPDATE`` for all of them."""
        held = list(leases)
        if not held:
            return []
        return await self._write(None, lambda db, m: ls.renew_many(db, m, held, ttl), upkeep=True)

    async def release(self, lease: Lease) -> None:
        notice = self._notice(lease.key)
        await self._write(lease.key, lambda db, _: ls.release(db, lease, notice))

    async def bump_generation(self, key: SessionKey) -> int:
        return await self._write(key, lambda db, _: ls.bump(db, key))

    async def generation(self, key: SessionKey) -> int:
        return await self._read(lambda db: ls.generation(db, key))

    async def generations(self, keys: Sequence[SessionKey]) -> list[int]:
        wanted = list(keys)
        if not wanted:
            return []
        return await self._read(lambda db: ls.generations(db, wanted))

    async def lease_holder(self, key: SessionKey) -> str | None:
        return await self._read(lambda db: ls.holder(db, key))

    async def active_sessions(self) -> int:
        return await self._read(ls.active)

    # -- fenced writes and reads -----------------------------------------------

    async def commit(self, key: SessionKey, generation: int | None, batch: WriteBatch) -> None:
        (fields, frozen), retention = detached_batch(key, batch), self._retained
        notice, lock = self._notice(key), self._target_lock
        await self._call(
            lambda db: data.commit(db, key, generation, frozen, fields, retention, notice, lock)
        )

    async def load_persistent(self, key: SessionKey) -> dict[str, Any]:
        return await self._read(lambda db: data.load_persistent(db, key))

    async def load_fields(self, key: SessionKey, names: Sequence[str]) -> dict[str, Any]:
        wanted = list(dict.fromkeys(names))
        return await self._read(lambda db: data.load_fields(db, key, wanted)) if wanted else {}

    async def transcript(
        self, key: SessionKey, conversation_id: str | None = None, limit: int = 100
    ) -> list[TranscriptEntry]:
        if conversation_id is not None:
            named = conversation_id
            return await self._read(lambda db: data.transcript(db, named, limit))

        async def op(db: Db, moment: float) -> list[TranscriptEntry]:
            conversation = await data.current(db, moment, key)
            return await data.transcript(db, conversation.id, limit)

        return await self._write(key, op)

    async def is_answered(self, message_id: str) -> bool:
        return await self.mark(message_id) is not None

    async def mark(self, message_id: str) -> AnsweredMark | None:
        retention = self._retained
        return await self._read(lambda db: data.mark(db, message_id, retention))

    @property
    def _retained(self) -> float:
        """Seconds an answered mark holds, as the queries take it."""
        return float(self.answered_retention)

    # -- a turn's fused calls: one transaction each ----------------------------------

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
        turn, schema, message = (
            (None, max_active, token),
            self.location.schema,
            (message_id, payload),
        )
        seq, lease, persistent = await self._call(
            lambda db: ls.admit(db, key, owner, ttl, turn, schema, with_persistent, message)
        )
        assert seq is not None
        if isinstance(lease, SessionBusy):
            return Admission(seq, None, lease, persistent)
        return Admission(seq, lease, None, persistent)

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
        turn, schema = (head_seq, max_active, token), self.location.schema
        _, lease, persistent = await self._call(
            lambda db: ls.admit(db, key, holder, ttl, turn, schema, True)
        )
        if isinstance(lease, SessionBusy):
            raise lease  # once the refusal's statement committed: it marks who waits
        return Taken(lease, persistent)

    async def commit_and_release(self, lease: Lease, batch: WriteBatch) -> bool:
        key, generation = lease.key, lease.generation
        (fields, frozen), retention = detached_batch(key, batch), self._retained
        notice, lock, freeing = self._notice(key), self._target_lock, lease.token
        return await self._call(
            lambda db: data.commit(
                db, key, generation, frozen, fields, retention, notice, lock, freeing
            )
        )

    # -- conversations -----------------------------------------------------------

    async def conversation(self, key: SessionKey) -> Conversation:
        return await self._write(key, lambda db, m: data.current(db, m, key))

    async def new_conversation(self, key: SessionKey, title: str = "") -> Conversation:
        return await self._write(key, lambda db, m: data.new_conversation(db, m, key, title))

    async def resume_conversation(self, key: SessionKey, conversation_id: str) -> Conversation:
        return await self._write(key, lambda db, m: data.resume(db, m, key, conversation_id))

    async def conversations(self, key: SessionKey, limit: int = 20) -> list[Conversation]:
        return await self._write(key, lambda db, m: data.conversations(db, m, key, limit))

    # -- the durable pending queue -------------------------------------------------

    async def enqueue(
        self, key: SessionKey, message_id: str, owner: str, payload: bytes, *, seq: int = 0
    ) -> int:
        return await self._write(
            key, lambda db, m: pq.enqueue(db, m, key, message_id, owner, payload, seq)
        )

    async def pending(self, key: SessionKey) -> list[PendingRecord]:
        return await self._read(lambda db: pq.pending(db, key))

    async def pending_keys(self) -> list[SessionKey]:
        return await self._read(pq.pending_keys)

    async def drop_pending(self, key: SessionKey, seqs: Sequence[int]) -> None:
        dropped = list(seqs)
        if dropped:
            notice = self._notice(key)
            await self._write(key, lambda db, _: pq.drop(db, key, dropped, notice))

    async def drop_own(self, key: SessionKey, seqs: Sequence[int], owner: str) -> list[int]:
        asked = list(seqs)
        if not asked:
            return []
        notice = self._notice(key)
        return await self._write(key, lambda db, _: pq.drop_own(db, key, asked, owner, notice))

    async def adopt(
        self,
        key: SessionKey,
        seqs: Sequence[int],
        old_owner: str,
        new_owner: str,
        *,
        generation: int | None = None,
    ) -> list[int]:
        asked = list(seqs)
        if not asked:
            return []
        adopted = await self._write(
            key, lambda db, _: pq.adopt(db, key, asked, old_owner, new_owner, generation)
        )
        if adopted:
            self.listener.wake({key})  # its waiters here: nobody else waits for their new owner
        return adopted

    async def adopt_orphans(self, holder: str, limit: int) -> list[PendingRecord]:
        """One read of the orphaned records, then one ``UPDATE`` of exactly those: an
        adoption whose answer was lost is read back at the next (:mod:`~.adoption`)."""
        adopted = await self._adoptions.read_back(holder)
        try:
            adopted += await self._adopt_found(holder, limit)
        except StoreError:
            if not adopted:  # what is read back is never dropped
                raise
        self.listener.wake({record.key for record in adopted})
        return adopted

    async def _adopt_found(self, holder: str, limit: int) -> list[PendingRecord]:
        found = await self._write(None, lambda db, m: pq.orphans(db, m, holder, limit))
        if not found:
            return []
        try:
            return await self._write(None, lambda db, m: pq.adopt_orphans(db, m, holder, found))
        except StoreError as error:
            self._adoptions.remember(((key, seq) for key, seq, _ in found), error)
            raise

    async def park(self, key: SessionKey, seqs: Sequence[int], reason: str) -> None:
        parked = list(seqs)
        if parked:
            notice = self._notice(key)
            await self._write(key, lambda db, m: pq.park(db, m, key, parked, reason, notice))

    async def failed(self, limit: int = 100) -> list[FailedRecord]:
        return await self._read(lambda db: pq.failed(db, limit))

    async def retry_failed(self, message_id: str, owner: str) -> PendingRecord | None:
        return await self._write(None, lambda db, _: pq.retry_failed(db, message_id, owner))

    # -- the delivery ledger ---------------------------------------------------------

    @property
    def _target_lock(self) -> str:
        """The prefix of the advisory locks recording takes on targets (see the ledger)."""
        return dl.target_lock(self.location.schema)

    async def record_deliveries(self, drafts: Sequence[DeliveryDraft]) -> None:
        recorded, lock = list(drafts), self._target_lock
        if recorded:
            await self._call(lambda db: dl.record(db, recorded, lock))

    async def claim_deliveries(
        self, lanes: Sequence[str], holder: str, ttl: float, limit: int
    ) -> list[Delivery]:
        asked = list(lanes)
        if not asked or limit <= 0:
            return []
        return await self._write(None, lambda db, m: dl.claim(db, m, asked, holder, ttl, limit))

    async def settle_deliveries(self, settlements: Sequence[Settlement]) -> list[bool]:
        asked = list(settlements)
        if not asked:
            return []
        return await self._write(None, lambda db, m: dl.settle(db, m, asked))

    async def deliveries(self, state: str, limit: int = 100) -> list[Delivery]:
        return await self._read(lambda db: dl.listed(db, state, limit))

    async def delivery(self, delivery_id: str) -> Delivery | None:
        return await self._read(lambda db: dl.get(db, delivery_id))

    async def delivery_stats(self) -> DeliveryStats:
        return await self._read(dl.stats)

    async def retry_dead(self, delivery_id: str) -> bool:
        return await self._write(None, lambda db, _: dl.retry_dead(db, delivery_id))

    # -- process liveness ------------------------------------------------------------

    async def heartbeat(self, holder: str, ttl: float) -> None:
        """See :meth:`Store.heartbeat`; also prunes settled deliveries past their retention."""
        retention, kept = self._retained, float(self.delivered_retention)

        async def op(db: Db, moment: float) -> None:
            await lv.heartbeat(db, moment, holder, ttl, retention)
            await dl.prune(db, moment - kept, moment - retention)

        # its pruning may meet a backlog (after a long stop): once the server has answered,
        # the call has command_timeout, and a slow prune never fails every heartbeat
        await self._write(None, op, upkeep=True, then=self.location.command_timeout)

    async def alive(self, holders: Sequence[str]) -> Mapping[str, bool]:
        asked = list(holders)
        return await self._read(lambda db: lv.alive(db, asked)) if asked else {}

    async def close(self) -> None:
        """Close every connection (the pools', the listener's). Idempotent; later calls raise
        ``StoreError``."""
        if not self._closed:
            self._closed = True
            await self.listener.close()
            await self._pools.close()


async def _closing_if_lost(db: Db, op: Callable[[Db], Awaitable[T]]) -> T:
    """``op(db)``; a connection the driver lost track of (``InternalClientError``: "cannot
    switch to state …; another operation is in progress", after the server dropped
    connections) is closed before the pool takes it back, never handed out again."""
    try:
        return await op(db)
    except asyncpg.InternalClientError:
        db.terminate()
        raise


def _rolled_back(error: BaseException) -> bool:
    """Whether ``error`` says a statement did not apply: the server refused it with an
    ``ERROR`` (its transaction rolled back), or the driver refused its arguments before
    sending it (a text it cannot encode, a value it cannot convert). A broken connection,
    a ``FATAL`` or a timeout says nothing: the statement may have committed."""
    if isinstance(error, UnicodeEncodeError):
        return True
    if isinstance(error, asyncpg.DataError) and error.severity is None:
        return True  # made by the driver, not the server: never sent
    return isinstance(error, asyncpg.PostgresError) and error.severity_en == "ERROR"


def _reason(error: BaseException) -> str:
    """What went wrong, in the driver's or the system's words (never the URL's password)."""
    return str(error) or type(error).__name__
