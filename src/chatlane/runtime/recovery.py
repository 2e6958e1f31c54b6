"""Adopting the messages of processes that died, so no accepted message is lost.

A process's pending records carry its holder id, and a live process renews a
heartbeat. :func:`adopt_orphans` asks the store, in one call, for the records
of up to ``limit`` sessions whose owner's heartbeat has expired (a crash,
``kill -9``, a pause longer than the TTL, or a clean stop that signed off);
the store makes this process their owner — atomically per record, so two
adopters never both take one — and each is handed to ``run`` in store order.
A message re-run this way cannot be answered twice: replies are recorded
against message ids before delivery. A record that cannot be read is set
aside as failed (:meth:`~chatlane.stores.base.Store.park`), never dropped.
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

OnAdopted = Callable[[SessionKey, InboundMessage], None]
"""Hears each message an engine adopted (from a process that stopped, or retried by an
operator) once it runs or waits there: no dispatch here told its sender's adapter of it."""


async def adopt_orphans(store: Store, holder: str, run: Run, limit: int) -> list[PendingRecord]:
    """Adopt one batch of dead processes' records (``limit`` sessions) and ``run`` them.

    :returns: the records adopted; records of fewer than ``limit`` sessions
        means nothing more was waiting.
    :raises ChatlaneError: the store could not be asked (nothing was adopted).
    """
    records = await store.adopt_orphans(holder, limit)
    for record in records:
        await _rerun(store, record, run)
    return records


def sessions_in(records: list[PendingRecord]) -> int:
    """How many sessions ``records`` belong to."""
    return len({record.key for record in records})


async def adopt_all(store: Store, holder: str, run: Run, limit: int) -> int:
    """Adopt batch after batch until one is not full; return how many messages were adopted."""
    total = 0
    while True:
        records = await adopt_orphans(store, holder, run, limit)
        total += len(records)
        if sessions_in(records) < limit:
            return total


async def _rerun(store: Store, record: PendingRecord, run: Run) -> None:
    key = record.key
    try:
        message = decode_message(record.payload)
    except StoreError as error:
        log.error("unreadable pending record %s: %s", record.seq, error, extra=turn_fields(key))
        await store.park(key, [record.seq], f"unreadable record: {error}")
        return
    log.info(
        "adopted message %s (seq %d) from a process that stopped",
        message.id,
        record.seq,
        extra=turn_fields(key),
    )
    await run(key, message, record.seq)
