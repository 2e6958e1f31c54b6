"""Adopting the messages of processes that died, so no accepted message is lost.

A process's pending records carry its holder id, and a live process renews a
heartbeat. :func:`adopt_orphans` finds records whose owner's heartbeat has
expired (a crash, ``kill -9``, a pause longer than the TTL, or a clean stop
that signed off), makes this process their owner — atomically per record, so
two adopters never both take one — and hands each to ``run`` in store order.
A message re-run this way cannot be answered twice: replies are recorded
against message ids before delivery.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from chatlane.errors import StoreError
from chatlane.logs import turn_fields
from chatlane.stores.base import PendingRecord, Store
from chatlane.stores.codec import decode_message
from chatlane.types import InboundMessage, SessionKey

log = logging.getLogger("chatlane.runtime")

Run = Callable[[SessionKey, InboundMessage, int], Awaitable[object]]


async def adopt_orphans(store: Store, holder: str, run: Run) -> int:
    """Adopt every pending record whose owner is dead and ``run`` it; return how many."""
    adopted = 0
    for key in await store.pending_keys():
        records = await store.pending(key)
        for record in await _adopt(store, holder, key, records):
            adopted += await _rerun(key, record, run)
    return adopted


async def _adopt(
    store: Store, holder: str, key: SessionKey, records: list[PendingRecord]
) -> list[PendingRecord]:
    owners = sorted({r.owner for r in records if r.owner != holder})
    if not owners:
        return []
    alive = await store.alive(owners)
    taken: set[int] = set()
    for owner in (o for o in owners if not alive.get(o, False)):
        seqs = [r.seq for r in records if r.owner == owner]
        taken.update(await store.adopt(key, seqs, owner, holder))
    return [r for r in records if r.seq in taken]


async def _rerun(key: SessionKey, record: PendingRecord, run: Run) -> int:
    try:
        message = decode_message(record.payload)
    except StoreError as error:
        log.error(
            "dropping unreadable pending record %s: %s", record.seq, error, extra=turn_fields(key)
        )
        return 0
    log.info(
        "adopted message %s (seq %d) from %s",
        message.id,
        record.seq,
        record.owner,
        extra=turn_fields(key),
    )
    await run(key, message, record.seq)
    return 1
