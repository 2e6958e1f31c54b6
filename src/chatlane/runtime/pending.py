"""The pending queue: messages waiting for a session's next turn.

The queue lives in the session's conversation scope (``queued_events``), one
:class:`PendingEntry` per future turn. An entry made by the ``collect`` policy
keeps absorbing its author's messages until it starts, and does not start
before its ``ready_at`` (the debounce deadline). The messages of one entry
always have one author.

The queue is kept in store order (by ``seq``) however messages reach it: a
message can be taken in here after one the store accepted later (its own
store call answered first), and the next turn must still be the earliest
one. A turn waiting for its lease gives way to an earlier message queued
behind it, so a queue out of order could start the same later turn again
and again.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

from chatlane.state import SessionState
from chatlane.types import InboundMessage, clipped


@dataclass(slots=True)
class PendingEntry:
    """The messages of one future turn."""

    messages: list[InboundMessage] = field(default_factory=list)
    seqs: list[int] = field(default_factory=list)
    """The store's ``seq`` of each message, in the same order."""
    collecting: bool = False
    ready_at: float = 0.0
    """``time.monotonic()`` reading before which a collecting entry does not start."""
    reruns: int = 0
    """How many earlier turns ran these messages and lost their lease before answering."""
    latest: float = math.inf
    """``time.monotonic()`` reading a collecting entry never waits past, however often pushed."""
    note: str = ""
    """What the agent reads before the messages' text (a collapsed queue says so)."""

    def delay(self) -> float:
        """Seconds until this entry may start (0 when it may start now)."""
        if not self.collecting:
            return 0.0
        return max(0.0, self.ready_at - time.monotonic())


def pending_entries(state: SessionState) -> list[PendingEntry]:
    """The session's queue, oldest first (the live list, not a copy)."""
    queue: list[PendingEntry] = state.conversation.queued_events
    return queue


def pending_count(state: SessionState) -> int:
    """How many messages wait for a turn of this session."""
    return sum(len(entry.messages) for entry in pending_entries(state))


def enqueue(state: SessionState, message: InboundMessage, seq: int) -> None:
    """Queue ``message`` as its own future turn, in its place in store order."""
    queue = pending_entries(state)
    if queue and queue[-1].seqs and max(queue[-1].seqs) > seq:
        insert_in_order(state, [message], [seq])  # the store accepted it before the last one
    else:
        queue.append(PendingEntry([message], [seq]))


def insert_in_order(
    state: SessionState, messages: list[InboundMessage], seqs: list[int], reruns: int = 0
) -> None:
    """Queue ``messages`` as one turn before every entry accepted after them.

    Used for adopted, drawn-in and re-run messages, so a session's messages
    keep the order the store accepted them in. When they fall inside a
    waiting entry's span (it holds messages accepted both before and after
    them: a collected turn that drew in another process's messages), they
    join that entry in their place, if it has one author and they have the
    same; as a turn of their own after it, a later message in it would run
    before them. A message already waiting here (adopted again, after a
    process taken for dead took it back) is not queued twice.
    """
    queue = pending_entries(state)
    waiting = {seq for entry in queue for seq in entry.seqs}
    if waiting.intersection(seqs):
        fresh = [(m, s) for m, s in zip(messages, seqs, strict=True) if s not in waiting]
        if not fresh:
            return
        messages, seqs = [m for m, _ in fresh], [s for _, s in fresh]
    first = min(seqs)
    spanning = next((e for e in queue if e.seqs and min(e.seqs) < first < max(e.seqs)), None)
    if spanning is not None and _joins(spanning, messages):
        pairs = sorted(
            [
                *zip(spanning.messages, spanning.seqs, strict=True),
                *zip(messages, seqs, strict=True),
            ],
            key=lambda pair: pair[1],
        )
        spanning.messages = [message for message, _ in pairs]
        spanning.seqs = [seq for _, seq in pairs]
        spanning.reruns = max(spanning.reruns, reruns)
        return
    index = next((i for i, e in enumerate(queue) if e.seqs and min(e.seqs) > first), len(queue))
    queue.insert(index, PendingEntry(messages, seqs, reruns=reruns))


def take_next(state: SessionState) -> PendingEntry:
    """Take the next turn's entry out of the (non-empty) queue, in store order.

    Should a message wait in a later entry with a seq below some of the first
    entry's (the first drew in, collected or re-ran messages around it), the
    first entry runs only its messages before that seq; the others wait again
    in their place (:func:`insert_in_order`). So the messages waiting here
    always run in the order the store accepted them. A collapsed queue's
    entry (it has a note) runs whole.
    """
    queue = pending_entries(state)
    entry = queue.pop(0)
    later = [seq for other in queue for seq in other.seqs]
    if not later or entry.note:
        return entry
    cut = min(later)
    pairs = list(zip(entry.messages, entry.seqs, strict=True))
    now = [(message, seq) for message, seq in pairs if seq < cut]
    if not now or len(now) == len(pairs):
        return entry
    rest = [(message, seq) for message, seq in pairs if seq > cut]
    entry.messages, entry.seqs = [m for m, _ in now], [s for _, s in now]
    insert_in_order(state, [m for m, _ in rest], [s for _, s in rest], entry.reruns)
    return entry


def _joins(entry: PendingEntry, messages: list[InboundMessage]) -> bool:
    """Whether ``messages`` may run in ``entry``'s turn: one author for all, and no note
    (a collapsed queue's note counts its messages)."""
    if entry.note or not entry.messages:
        return False
    author = entry.messages[0].source.user_id
    together = [*entry.messages, *messages]
    return all(m.source.user_id == author and not m.internal for m in together)


def holds(state: SessionState, message_id: str) -> bool:
    """Whether ``message_id`` waits in the session's queue."""
    return any(m.id == message_id for entry in pending_entries(state) for m in entry.messages)


def queued(state: SessionState) -> list[tuple[int, InboundMessage]]:
    """Every waiting message with its store ``seq``, in the order they will run."""
    entries = pending_entries(state)
    return [pair for e in entries for pair in zip(e.seqs, e.messages, strict=True)]


def take(state: SessionState, seq: int) -> tuple[InboundMessage, int] | None:
    """Take the message stored under ``seq`` out of the queue; it and its entry's reruns.

    An entry left empty leaves the queue; ``None`` if no message waits under ``seq``.
    """
    queue = pending_entries(state)
    for entry in queue:
        if seq in entry.seqs:
            index = entry.seqs.index(seq)
            message = entry.messages.pop(index)
            del entry.seqs[index]
            if not entry.messages:
                queue.remove(entry)
            return message, entry.reruns
    return None


PREVIEW_CHARS = 40


def preview(message: InboundMessage) -> str:
    """The start of ``message``'s text on one line, quoted, to name it in a notice or a list."""
    text = " ".join(message.text.split())
    return f"“{clipped(text, PREVIEW_CHARS)}”"


def smallest_seq(state: SessionState) -> int | None:
    """The smallest store seq waiting in the session's queue, if any."""
    queue = pending_entries(state)
    if not queue:
        return None
    return min((seq for entry in queue for seq in entry.seqs), default=None)


def collect(
    state: SessionState,
    message: InboundMessage,
    seq: int,
    debounce: float,
    max_wait: float = math.inf,
) -> None:
    """Merge ``message`` into the last collecting entry of its author (or start one).

    Only the last entry can take it, and only if the same user wrote that
    entry's messages: a message of another author waits as its own turn, so
    every turn has one author — the one who answers its approvals. The
    entry's deadline is pushed back by ``debounce``, but never past
    ``max_wait`` after the entry started.
    """
    queue = pending_entries(state)
    if queue and queue[-1].seqs and max(queue[-1].seqs) > seq:
        insert_in_order(state, [message], [seq])  # earlier than what collects: its own turn
        return
    now = time.monotonic()
    if not queue or not _takes(queue[-1], message):
        queue.append(PendingEntry(collecting=True, latest=now + max_wait))
    entry = queue[-1]
    entry.messages.append(message)
    entry.seqs.append(seq)
    entry.ready_at = min(now + debounce, entry.latest)


def _takes(entry: PendingEntry, message: InboundMessage) -> bool:
    """Whether a collecting ``entry`` may absorb ``message``: same author, never another."""
    if not entry.collecting or not entry.messages:
        return False
    return entry.messages[0].source.user_id == message.source.user_id


def keep_only(state: SessionState, stored: set[int], known: set[int]) -> list[InboundMessage]:
    """Forget queued messages that were ``known`` before a read of the store and that
    the read did not find (not in ``stored``); return them, oldest first.

    The store is the truth: a message another process dropped (``/stop``,
    ``/new``) or answered must not run here. A message queued here while the
    read ran stays: the read may predate its write.
    """
    queue = pending_entries(state)
    gone: list[InboundMessage] = []
    for entry in list(queue):
        pairs = list(zip(entry.messages, entry.seqs, strict=True))
        kept = [(m, seq) for m, seq in pairs if seq in stored or seq not in known]
        gone += [message for message, seq in pairs if seq in known and seq not in stored]
        entry.messages = [message for message, _ in kept]
        entry.seqs = [seq for _, seq in kept]
        if not entry.messages:
            queue.remove(entry)
    return gone


def kept_after_drop(state: SessionState, seqs: list[int], *, unsure: bool) -> None:
    """``seqs`` wait here again because their drop from the store failed; if ``unsure``,
    the store may no longer hold them (:mod:`~chatlane.runtime.kept`).

    Such messages were told they still wait, so they run even if the store no
    longer holds them: :func:`or_kept` counts them as stored.
    """
    if unsure:
        conversation = state.conversation
        conversation.kept_seqs = conversation.kept_seqs.union(seqs)


def or_kept(state: SessionState, stored: set[int]) -> set[int]:
    """``stored`` (seqs a read of the store found) with the messages kept after a drop
    that may have been made (:func:`kept_after_drop`)."""
    kept = state.conversation.kept_seqs
    return stored | kept if kept else stored


def known(state: SessionState) -> set[int]:
    """The seqs of every message waiting here: taken before a read of the store, what
    :func:`keep_only` may forget after it."""
    return {seq for entry in pending_entries(state) for seq in entry.seqs}


def collapse(
    state: SessionState,
    message: InboundMessage,
    seq: int,
    note: str,
    steers: Sequence[tuple[InboundMessage, int]] = (),
) -> list[InboundMessage]:
    """Make every waiting message, ``steers`` (messages and seqs taken back from the running
    turn, which its agent never took) and ``message`` one turn, in store order, read with
    ``note``.

    The turn may have several authors: then it can ask no approvals. Returns
    the messages that waited (not ``message``).
    """
    queue = pending_entries(state)
    reruns = max((entry.reruns for entry in queue), default=0)
    waiting, seqs = drain(state)
    pairs = sorted(
        [*zip(waiting, seqs, strict=True), *steers, (message, seq)], key=lambda pair: pair[1]
    )
    queue.append(
        PendingEntry([m for m, _ in pairs], [s for _, s in pairs], reruns=reruns, note=note)
    )
    return [m for m, _ in pairs if m is not message]


def restore(state: SessionState, entries: list[PendingEntry]) -> None:
    """Put ``entries`` taken by :func:`drain` back at the head of the queue, before
    what was queued since; one whose messages wait here again already is skipped."""
    waiting = known(state)
    pending_entries(state)[:0] = [e for e in entries if not waiting.intersection(e.seqs)]


def drain(
    state: SessionState, only: AbstractSet[int] | None = None
) -> tuple[list[InboundMessage], list[int]]:
    """Remove every pending message and return them with their seqs, oldest first.

    With ``only``, just the turns holding one of those seqs; the rest stay queued.
    """
    queue = pending_entries(state)
    taken = queue if only is None else [e for e in queue if not only.isdisjoint(e.seqs)]
    messages = [message for entry in taken for message in entry.messages]
    seqs = [seq for entry in taken for seq in entry.seqs]
    if only is None:
        queue.clear()
    else:
        queue[:] = [entry for entry in queue if only.isdisjoint(entry.seqs)]
    return messages, seqs
