"""Taking back what a failed admission may have stored, so that "not taken" stays true.

A store whose calls can apply and still fail (:attr:`Store.answers_may_be_lost
<chatlane.stores.base.Store.answers_may_be_lost>`: a Redis or PostgreSQL
connection that broke after the server ran the call) can leave a message its
sender was told was not taken queued in the store as this process's — to run
once this process's messages are adopted, after its end — and the lease its
admission took held until the lease's TTL. What stays true:

* A message whose queueing failed on such a store is owed a withdrawal: the
  lease taken with the admission's token, if the store holds it, is given
  back, and the message's record, if the store holds one of this process's,
  is dropped. The sender was told it was not taken; the store comes to agree.
* So is a turn that stopped waiting for its lease after a try failed so: the
  lease that try may have taken (with the wait's token) is given back.
* So, on any store, is a message the store took when a later step of its
  admission failed (reading a session this process had not seen): its sender
  is told it was not taken, as for the store call itself.
* Withdrawals outlast an outage: one worker takes them in the order owed,
  each tried again with backoff (:func:`~chatlane.runtime.backoff.retry_store`)
  until the store answers, so an outage costs one retrying caller, not one per
  message refused during it.
* A later try of the same message (a platform's redelivery, an API client's
  retry with the same idempotency key) takes over from its withdrawal: from
  then on the withdrawal leaves the message's record alone (it still gives
  back the failed try's lease), and the new try's store call — idempotent
  per message id — decides. A try that comes while the withdrawal reads or
  drops that record waits for that store call first. So a withdrawal never
  drops a record a later try relies on, and a sender who tries again is
  never refused for it.
* On a store whose failed calls change nothing (SQLite, memory), and for a
  call that surely never applied (the server could not be reached, a
  transaction failed before its commit: :attr:`StoreError.maybe_applied
  <chatlane.errors.StoreError.maybe_applied>`), nothing else is ever owed.
* When the engine closes, each withdrawal still owed is tried once more, in
  order, without backoff (the worker may have been waiting out an outage the
  store has since left). At the first that fails, it and the rest are given
  up (and logged): the record, if it exists, runs once another process adopts
  it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from chatlane.errors import LeaseError, StoreError
from chatlane.logs import turn_fields
from chatlane.runtime.backoff import retry_store
from chatlane.stores.base import Lease, Store
from chatlane.types import SessionKey

log = logging.getLogger("chatlane.runtime")


@dataclass(slots=True)
class _Owed:
    """What one failed call may have left in the store."""

    key: SessionKey
    message_id: str
    """The message whose record goes ("" for a lease alone, or once a later try took over)."""
    token: str
    """The token of the lease that goes ("" for none)."""


class Withdrawals:
    """The withdrawals one process owes its store, and the worker that makes them."""

    def __init__(self, store: Store, holder: str) -> None:
        self._store = store
        self._holder = holder
        self._owed: deque[_Owed] = deque()
        self._by_message: dict[str, _Owed] = {}
        """The owed records, by message id."""
        self._reading: _Owed | None = None
        """The withdrawal whose record the worker is reading or dropping now."""
        self._read: asyncio.Future[None] | None = None
        """Done once that store call is over."""
        self._worker: asyncio.Task[None] | None = None
        self._closed = False
        self.on_taken_back: Callable[[], None] | None = None
        """Told each time a message's record was found in the store and dropped."""

    def __contains__(self, message_id: str) -> bool:
        """Whether ``message_id``'s record is owed a withdrawal (see :meth:`take_over`)."""
        return bool(self._by_message) and message_id in self._by_message

    async def take_over(self, message_id: str) -> None:
        """A new try of ``message_id`` is about to ask the store: the withdrawal leaves its
        record alone from now on, once any store call reading or dropping it is over."""
        owed = self._by_message.get(message_id)
        while owed is not None and owed is self._reading and self._read is not None:
            await asyncio.shield(self._read)
            owed = self._by_message.get(message_id)
        if owed is not None:
            owed.message_id = ""  # its lease, if it took one, still goes back
            del self._by_message[message_id]

    def failed(
        self,
        key: SessionKey,
        message_id: str = "",
        token: str = "",
        *,
        error: StoreError | None = None,
    ) -> None:
        """Queueing ``message_id``, or taking ``key``'s lease with ``token``, or both in one
        call, failed with ``error``: take back what the store may hold of them, if the call
        may have applied all the same. Without ``error``, the store took them and a later
        step failed: take them back on any store."""
        if self._closed or (error is not None and not self._store.may_have_applied(error)):
            return
        owed = _Owed(key, message_id, token)
        self._owed.append(owed)
        if message_id:
            self._by_message[message_id] = owed
        if self._worker is None:
            self._worker = asyncio.ensure_future(self._work())

    @property
    def owed(self) -> int:
        """How many withdrawals are owed."""
        return len(self._owed)

    async def settled(self) -> None:
        """Return once nothing is owed."""
        while self._worker is not None:
            await asyncio.shield(self._worker)

    async def aclose(self) -> None:
        """Stop the worker, try what is still owed once more, and give up what then fails
        (see the module docstring)."""
        self._closed = True
        if self._worker is not None:
            self._worker.cancel()
            await asyncio.gather(self._worker, return_exceptions=True)
        try:
            while self._owed:
                await self._withdraw(self._owed[0])
                self._owed.popleft()
        except StoreError as error:
            log.warning(
                "closing with %d messages not yet taken back from the store: %s", self.owed, error
            )

    async def _work(self) -> None:
        try:
            while self._owed:
                owed = self._owed[0]
                await self._take_back(owed)
                self._owed.popleft()
                if self._by_message.get(owed.message_id) is owed:
                    del self._by_message[owed.message_id]
        finally:
            self._worker = None

    async def _take_back(self, owed: _Owed) -> None:
        """Withdraw through an outage; give up on damage or at close."""
        try:
            await retry_store(
                partial(self._withdraw, owed),
                wanted=lambda: not self._closed,
                what="taking back a message not taken",
                fields=turn_fields(owed.key),
            )
        except StoreError as error:
            log.warning("could not take back a message: %s", error, extra=turn_fields(owed.key))

    async def _withdraw(self, owed: _Owed) -> None:
        key = owed.key
        if owed.token:
            with contextlib.suppress(LeaseError):  # never taken with it, or gone since
                await self._store.release(Lease(key, self._holder, owed.token, 0, 0.0))
        if owed.message_id:
            self._reading, self._read = owed, asyncio.get_running_loop().create_future()
            try:
                await self._drop(key, owed.message_id)
            finally:
                self._reading = None
                self._read.set_result(None)

    async def _drop(self, key: SessionKey, message_id: str) -> None:
        """Drop ``message_id``'s record if the store holds one of this process's."""
        records = await self._store.pending(key)
        seqs = [r.seq for r in records if r.message_id == message_id and r.owner == self._holder]
        if seqs:
            await self._store.drop_pending(key, seqs)
            log.info(
                "took back a message its sender was told was not taken", extra=turn_fields(key)
            )
            if self.on_taken_back is not None:
                self.on_taken_back()
