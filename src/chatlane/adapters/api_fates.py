"""What the store says became of a message this process no longer runs or queues.

A message can leave this process's engine without an answer reaching the
request that waits for it here: its turn lost its lease (the process was
paused past the TTL, or overloaded) and another process adopted the message
and answered it, or still runs it. The store knows, whichever process did it.
What stays true:

* The store is read, never written, and a failed read is :attr:`Fate.UNKNOWN`
  — never taken for "dropped".
* The queue is read before the answer. A commit answers a message and takes
  it out of the queue in one atomic write, so a message missing from the
  queue was either answered (and the answer read after sees it) or dropped:
  a commit landing between the two reads cannot pass for a drop.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from chatlane.errors import ChatlaneError
from chatlane.stores.base import Store
from chatlane.types import SessionKey


class Fate(enum.Enum):
    """Where the store has a message."""

    ANSWERED = "answered"
    """A commit answered it; the answer's text comes with it."""
    ELSEWHERE = "elsewhere"
    """Still queued, owned by another process: it runs (or waits) there."""
    HERE = "here"
    """Still queued under this process's name, though its engine no longer holds it."""
    GONE = "gone"
    """Neither answered nor queued: dropped (``/stop``, ``/new``, ``/reset``, a refusal)."""
    UNKNOWN = "unknown"
    """The store could not be read."""


@dataclass(frozen=True, slots=True)
class Found:
    """What the store said of one message; ``answer`` is set when it was answered."""

    fate: Fate
    answer: str = ""


async def fate_in_store(store: Store, holder: str, key: SessionKey, message_id: str) -> Found:
    """Ask ``store`` what became of ``message_id`` of session ``key`` (``holder`` is this process).

    Two reads: ``key``'s queue, then (if the message left it) its answer.
    """
    try:
        records = await store.pending(key)
        owners = [r.owner for r in records if r.message_id == message_id]
        if owners:
            return Found(Fate.HERE if owners[0] == holder else Fate.ELSEWHERE)
        answer = await store.answer(message_id)
    except ChatlaneError:
        return Found(Fate.UNKNOWN)
    return Found(Fate.GONE) if answer is None else Found(Fate.ANSWERED, answer)


__all__ = ["Fate", "Found", "fate_in_store"]
