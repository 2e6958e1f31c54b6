"""Adopting dead processes' records without losing any to a failed call.

:meth:`Adoptions.orphans` adopts session by session, for the stores without
one call that adopts many sessions at once (memory and Redis). PostgreSQL
reads the orphaned records, then adopts exactly those in one statement, and
uses :meth:`Adoptions.remember` and :meth:`Adoptions.read_back` alike. (SQLite
adopts in one transaction and its answers are never lost.)

What stays true:

* The queues are read against the owners' heartbeats, and each session's
  records are adopted by calls of their own (:meth:`~chatlane.stores.protocols.
  PendingQueue.adopt`, from the owner they were read with, so of two adopters
  one gets each record).
* A call that failed fails its session alone: what the others adopted is
  returned, never left this process's and unknown to it. The whole adoption
  raises only when it adopted nothing and something failed.
* A failed call that may have applied all the same (its answer lost) is
  remembered with the seqs it asked for. The next adoption first reads those
  sessions' queues and returns the remembered records that became this
  process's: only this process makes a record its own. One it cannot read is
  kept for the adoption after.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import msgspec

from chatlane.errors import StoreError
from chatlane.stores.records import PendingRecord
from chatlane.types import SessionKey

if TYPE_CHECKING:
    from chatlane.stores.base import Store


class Adoptions:
    """One store's adoptions by session, and the ones whose answer was lost."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._unsure: dict[SessionKey, set[int]] = {}
        """Seqs asked for by adoptions that may have applied, by session."""

    @property
    def unsure(self) -> bool:
        """Whether an adoption whose answer was lost waits to be read back."""
        return bool(self._unsure)

    async def orphans(self, holder: str, limit: int) -> list[PendingRecord]:
        """Adopt the records of up to ``limit`` sessions whose owners have no live heartbeat
        (and return those a lost answer made ``holder``'s before).

        :raises StoreError: nothing was adopted: the queues could not be read, or every
            adoption failed.
        """
        found = await self.read_back(holder)
        try:
            return [*found, *await self._scan(holder, limit)]
        except StoreError:
            if not found:
                raise
            return found  # what is read back is never dropped; the scan is made next time

    async def _scan(self, holder: str, limit: int) -> list[PendingRecord]:
        store = self._store
        keys = await store.pending_keys()
        queues = await asyncio.gather(*(store.pending(key) for key in keys))
        owners = sorted({r.owner for records in queues for r in records if r.owner != holder})
        alive = await store.alive(owners) if owners else {}
        orphaned = [
            [r for r in records if r.owner != holder and not alive.get(r.owner, False)]
            for records in queues
        ]
        chosen = [records for records in orphaned if records][:limit]
        taken = await asyncio.gather(*(self._session(records, holder) for records in chosen))
        adopted = [record for records, _ in taken for record in records]
        failures = [error for _, error in taken if error is not None]
        if failures and not adopted:
            raise failures[0]
        return adopted

    async def _session(
        self, records: list[PendingRecord], holder: str
    ) -> tuple[list[PendingRecord], StoreError | None]:
        """Adopt one session's ``records``: what was adopted, and the failure, if one."""
        adopted: list[PendingRecord] = []
        for owner in sorted({r.owner for r in records}):
            mine = [r for r in records if r.owner == owner]
            key, seqs = mine[0].key, [r.seq for r in mine]
            try:
                got = set(await self._store.adopt(key, seqs, owner, holder))
            except StoreError as error:
                self.remember(((key, seq) for seq in seqs), error)
                return _in_order(adopted), error
            adopted += [_owned_by(r, holder) for r in mine if r.seq in got]
        return _in_order(adopted), None

    def remember(self, records: Iterable[tuple[SessionKey, int]], error: StoreError) -> None:
        """An adoption of ``records`` (session and seq) failed with ``error``: if it may
        have applied all the same, read them back at the next adoption."""
        if self._store.may_have_applied(error):
            for key, seq in records:
                self._unsure.setdefault(key, set()).add(seq)

    async def read_back(self, holder: str) -> list[PendingRecord]:
        """The remembered records that became ``holder``'s; a session whose queue cannot
        be read stays remembered."""
        found: list[PendingRecord] = []
        for key, seqs in list(self._unsure.items()):
            try:
                records = await self._store.pending(key)
            except StoreError:
                continue
            del self._unsure[key]
            found += [r for r in records if r.seq in seqs and r.owner == holder]
        return found


def _owned_by(record: PendingRecord, holder: str) -> PendingRecord:
    return msgspec.structs.replace(record, owner=holder)


def _in_order(records: Sequence[PendingRecord]) -> list[PendingRecord]:
    return sorted(records, key=lambda r: r.seq)
