"""Ending messages that left for another process, from what the store says became of them.

A message this process accepted can end elsewhere: another process adopted
it after this one lost its lease (and answered it, or set it aside), or a
``/stop`` sent there dropped it. The ledger watches such messages
(:meth:`~chatlane.runtime.outcomes.OutcomeLedger.watch`); :func:`settle_watched`
asks the store about all of them at once. The queue is read before the
answers: a commit removes a message from the queue and marks it answered in
one write, so a message that is neither queued nor answered after that
order of reads was really dropped (or set aside as failed).

A message the store marked answered ends as its mark says
(:func:`~chatlane.runtime.outcomes.marked_outcome`): answered, failed when its
turn failed there, or refused when the mark is another session's (its id was
used by another conversation) — never with another session's answer. A
failed record counts only if it is the watched message's session's.
"""

from __future__ import annotations

import asyncio

from chatlane.runtime.outcomes import Outcome, OutcomeLedger, marked_outcome
from chatlane.stores.base import Store
from chatlane.types import SessionKey

FAILED_SCAN = 1000
"""How many failed records are read to find a watched message among them."""


async def settle_watched(store: Store, ledger: OutcomeLedger) -> int:
    """End every watched message whose fate the store knows; return how many ended.

    :raises ChatlaneError: the store could not be read (nothing is ended).
    """
    watched = ledger.watched()
    if not watched:
        return 0
    keys = sorted(set(watched.values()))
    queues = await asyncio.gather(*(store.pending(key) for key in keys))
    queued = {record.message_id for records in queues for record in records}
    decided = [message_id for message_id in watched if message_id not in queued]
    if not decided:
        return 0
    marks = await asyncio.gather(*(store.mark(message_id) for message_id in decided))
    unanswered = {m: watched[m] for m, mark in zip(decided, marks, strict=True) if mark is None}
    failed = await _failed_reasons(store, unanswered)
    for message_id, mark in zip(decided, marks, strict=True):
        if mark is not None:
            ledger.end([message_id], *marked_outcome(mark, watched[message_id]))
        elif message_id in failed:
            ledger.end([message_id], Outcome.FAILED, reason=failed[message_id])
        else:
            ledger.end([message_id], Outcome.DROPPED)
    return len(decided)


async def _failed_reasons(store: Store, wanted: dict[str, SessionKey]) -> dict[str, str]:
    """Why each of ``wanted`` (message id → its session) was set aside as failed, for those
    that were, in their own session."""
    if not wanted:
        return {}
    found = await store.failed(FAILED_SCAN)
    return {
        f.record.message_id: f.reason
        for f in found
        if wanted.get(f.record.message_id) == f.record.key
    }
