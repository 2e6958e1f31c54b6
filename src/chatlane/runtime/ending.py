"""Why a turn ended early, and what becomes of its stored messages: pure rules, no I/O.

What stays true:

* A turn's end reason is recorded once: the first cause wins
  (:meth:`~chatlane.runtime.turn.Turn.end`), so a stop that races a lost
  lease is a stop, whatever comes after.
* :func:`fate` alone decides what happens to an unanswered turn's messages,
  by one table (``tests/runtime/test_ending.py`` checks every row).
"""

from __future__ import annotations

import enum


class TurnEnd(enum.StrEnum):
    """Why a turn ended before it answered (or why its answer does not count)."""

    STOPPED = "stopped"
    """``/stop`` (or ``/new``, ``/reset``) ended it; its senders were told."""
    INTERRUPTED = "interrupted"
    """A newer message interrupted it (busy policy ``rollback``)."""
    EVICTED = "evicted"
    """It made no progress for ``turn_timeout``; its senders got a notice."""
    LEASE_LOST = "lease lost"
    """Its lease expired or was taken over: what is still its own runs again."""
    SHUTDOWN = "shutdown"
    """The engine closed: its messages stay queued for the next process."""
    REORDERED = "reordered"
    """It gave way to an earlier message queued here before it took its lease."""
    FAILED = "failed"
    """The agent failed; its senders got a notice."""
    REJECTED = "rejected"
    """Busy in another process under the ``reject`` policy; its sender was told."""
    DROPPED = "dropped"
    """Another process's ``/stop`` or ``/new`` took its messages from the store as it waited."""


class Fate(enum.Enum):
    """What becomes of an ended turn's stored messages."""

    KEEP = "keep"
    """Nothing to do: answered (the commit dequeued them), or left queued in the store."""
    DROP = "drop"
    """Their senders were told: they leave the durable queue."""
    REQUEUE = "requeue"
    """Back into this process's queue, in store order."""
    RERUN = "rerun"
    """What the store still holds for this process runs again; the rest is forgotten."""


TOLD = frozenset(
    {TurnEnd.STOPPED, TurnEnd.INTERRUPTED, TurnEnd.EVICTED, TurnEnd.FAILED, TurnEnd.REJECTED}
)
"""Ends whose senders were told what happened: their messages are done."""

LET_GO = frozenset({TurnEnd.STOPPED, TurnEnd.INTERRUPTED, TurnEnd.FAILED})
"""Ends by which a turn that ran here under its lease lets its session go: stopped by a
command or an interrupt, or its agent failed; not a lease refused or lost, by which
another process may hold the session. Such a turn only winds down in its slot."""


def fate(end: TurnEnd | None, *, answered: bool, closing: bool) -> Fate:
    """What becomes of a turn's stored messages, given why it ended.

    :param end: the recorded end reason (``None``: it ended without one).
    :param answered: its answer was committed.
    :param closing: the engine is shutting down.
    """
    if answered:
        return Fate.KEEP
    if end in TOLD:
        return Fate.DROP
    if closing:
        return Fate.KEEP
    if end is TurnEnd.REORDERED:
        return Fate.REQUEUE
    if end is TurnEnd.LEASE_LOST:
        return Fate.RERUN
    return Fate.KEEP
