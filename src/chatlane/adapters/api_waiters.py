"""HTTP requests waiting for the answer to their message, and how they always get one.

An API request is answered by the turn that runs its message. Most answers
arrive as outbounds (a ``REPLY``, or a ``NOTICE`` when the agent failed or the
turn was evicted), but some turns end without answering here: an interrupted
turn and a stopped turn are fenced, ``/stop``, ``/new`` or ``/reset`` drop
queued messages silently for the connection that sent them, and a turn that
lost its lease leaves its message to the process that adopted it. What stays
true:

* A waiter is answered exactly once: by its ``REPLY``; by a ``NOTICE`` that
  refuses its message (busy ``reject`` found out late, in another process's
  session: the request gets the same 409 as a local refusal); with a notice of
  its own when :class:`WaiterTracker` sees its turn fenced (interrupted,
  stopped); once its message is no longer running or queued here, by what the
  store says became of it (:mod:`chatlane.adapters.api_fates`) — the answer
  committed for it, wherever it was committed; the ``NOTICE`` it got; or, if
  the store holds it neither answered nor queued, the "dropped" notice —;
  with a 503 as soon as the engine is closing (its message stays queued for
  the next start), before the server stops waiting for open requests; or with
  a timeout after ``ceiling`` seconds without progress in its session.
* A message still queued in the store for another process waits there, and
  a store that cannot be read is not a drop: such a waiter keeps waiting,
  under the ceiling. Nothing is called "dropped" that the store still holds.
* Acknowledgements, approval prompts and mid-turn notices are never the
  answer; they travel alongside it (SSE comments when streaming).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import time
from collections import deque
from dataclasses import dataclass, field

from chatlane.adapters.api_fates import Fate, Found, fate_in_store
from chatlane.runtime.ending import TurnEnd
from chatlane.runtime.engine import TurnEngine
from chatlane.runtime.turn import Turn
from chatlane.types import Outbound, OutboundKind

INTERRUPTED_TEXT = "Interrupted by a newer message; this turn's answer was discarded."
STOPPED_TEXT = "Stopped (by /stop, /new or /reset) before it answered."
NOT_RUN_TEXT = "This message was dropped (by /stop, /new or /reset) before it was answered."
_FENCED_TEXTS = {TurnEnd.INTERRUPTED: INTERRUPTED_TEXT, TurnEnd.STOPPED: STOPPED_TEXT}


class EventKind(enum.Enum):
    """What a waiting request receives."""

    CHUNK = "chunk"
    """Part of the answer, as the agent streams it."""
    COMMENT = "comment"
    """Information that is not the answer (acks, approval prompts, mid-turn notices)."""
    FINAL = "final"
    """The answer (a reply or a notice); nothing follows."""
    KEPT = "kept"
    """The answer the store kept for the message (perhaps committed by another process,
    after this one streamed a run of its own that was fenced); nothing follows."""
    REFUSED = "refused"
    """The message was refused without running; ``text`` is the busy outcome; nothing follows."""
    TIMEOUT = "timeout"
    """No progress for the ceiling; nothing follows."""
    SHUTDOWN = "shutdown"
    """The gateway is stopping; nothing follows."""
    GONE = "gone"
    """The client disconnected; nobody reads what would follow."""


_LAST = frozenset(
    {
        *(EventKind.FINAL, EventKind.KEPT, EventKind.REFUSED),
        *(EventKind.TIMEOUT, EventKind.SHUTDOWN, EventKind.GONE),
    }
)


@dataclass(frozen=True, slots=True)
class WaiterEvent:
    kind: EventKind
    text: str = ""


class Place(enum.Enum):
    """Where a waiter's message is in the engine."""

    RUNNING = "running"
    WAITING = "waiting"
    NOWHERE = "nowhere"


@dataclass(eq=False, slots=True)
class Waiter:
    """One HTTP request waiting for the answer to its message ``message_id``.

    ``accepted`` becomes true once the gateway took the message to run it;
    before that the tracker leaves the waiter alone. ``ask_store`` is set while
    its message is neither running nor queued here and the store should be
    asked what became of it.
    """

    message_id: str
    events: deque[WaiterEvent] = field(default_factory=deque)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    session_key: str = ""
    accepted: bool = False
    steered_into: Turn | None = None
    notice: str | None = None
    nowhere_since: float | None = None
    ask_store: bool = False
    last_progress: float = field(default_factory=time.monotonic)
    finished: bool = False

    def push(self, event: WaiterEvent) -> None:
        """Queue ``event``; nothing is queued after the last one."""
        if self.finished:
            return
        self.finished = event.kind in _LAST
        self.last_progress = time.monotonic()
        self.events.append(event)
        self.ready.set()

    async def next_event(self, tick: float) -> WaiterEvent | None:
        """The next event, or ``None`` if none came within ``tick`` seconds."""
        if not self.events:
            self.ready.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(tick):
                    await self.ready.wait()
        return self.events.popleft() if self.events else None

    def take(self, outbound: Outbound) -> None:
        """Turn one outbound for this waiter's message into an event."""
        if outbound.kind is OutboundKind.CHUNK:
            self.push(WaiterEvent(EventKind.CHUNK, outbound.text))
        elif outbound.kind is OutboundKind.REPLY:
            self.push(WaiterEvent(EventKind.FINAL, outbound.text))
        elif outbound.refusal:
            self.push(WaiterEvent(EventKind.REFUSED, outbound.refusal))
        else:
            if outbound.kind is OutboundKind.NOTICE:
                self.notice = outbound.text
            self.push(WaiterEvent(EventKind.COMMENT, outbound.text))


class WaiterTracker:
    """Finds each waiter's message in the engine and answers the ones no turn will answer.

    :param ceiling: seconds without progress (no event for the waiter, and no
        progress of its session's running turn) after which it times out.
    :param settle_grace: seconds a message may be neither running nor queued
        here before the store is asked what became of it (an eviction notice
        may still be on its way).
    """

    def __init__(self, engine: TurnEngine, *, ceiling: float, settle_grace: float) -> None:
        self.engine = engine
        self.ceiling = ceiling
        self.settle_grace = settle_grace

    async def follow(self, waiter: Waiter) -> None:
        """:meth:`check` ``waiter``; if its message left this engine, ask the store (one read)."""
        self.check(waiter)
        if waiter.finished or not waiter.ask_store:
            return
        found = await fate_in_store(
            self.engine.store, self.engine.holder, waiter.session_key, waiter.message_id
        )
        waiter.ask_store = False
        self._settle(waiter, found)

    def check(self, waiter: Waiter) -> None:
        """Answer ``waiter`` now if its message can no longer be answered by a turn here.

        A message neither running nor queued here is marked for the store to
        be asked (:meth:`follow`): at once when a notice came for it, else after
        ``settle_grace``.
        """
        if waiter.finished or not waiter.accepted:
            return
        if self.engine.closed:
            waiter.push(WaiterEvent(EventKind.SHUTDOWN))  # its message stays queued
            return
        turn = self.engine.running_turn(waiter.session_key)
        place = self.place(waiter, turn)
        if place is Place.RUNNING and turn is not None:
            reason = fenced_reason(turn)
            if reason is not None:
                waiter.push(WaiterEvent(EventKind.FINAL, reason))
                return
        now = time.monotonic()
        if place is Place.NOWHERE:
            self._gone(waiter, now)
        else:
            waiter.nowhere_since, waiter.ask_store = None, False
        self._expire(waiter, turn, now)

    def place(self, waiter: Waiter, turn: Turn | None) -> Place:
        """Whether the message runs now, waits for a turn, or is in neither."""
        message_id = waiter.message_id
        if turn is not None:
            if message_id in turn.message_ids:
                return Place.RUNNING
            if waiter.steered_into is turn:
                return Place.WAITING
        if self.engine.is_waiting(waiter.session_key, message_id):
            return Place.WAITING
        return Place.NOWHERE

    def _gone(self, waiter: Waiter, now: float) -> None:
        if self.engine.was_interrupted(waiter.message_id):
            waiter.push(WaiterEvent(EventKind.FINAL, INTERRUPTED_TEXT))  # even from elsewhere
            return
        if waiter.nowhere_since is None:
            waiter.nowhere_since = now
        settled = now - waiter.nowhere_since >= self.settle_grace
        waiter.ask_store = waiter.notice is not None or settled

    def _settle(self, waiter: Waiter, found: Found) -> None:
        """Answer ``waiter`` by what the store said, unless its message came back here."""
        if found.fate is Fate.ANSWERED:
            waiter.push(WaiterEvent(EventKind.KEPT, found.answer))
            return
        turn = self.engine.running_turn(waiter.session_key)
        if found.fate is Fate.ELSEWHERE or self.place(waiter, turn) is not Place.NOWHERE:
            return  # it runs, or waits, elsewhere or here again
        if waiter.notice is not None:
            waiter.push(WaiterEvent(EventKind.FINAL, waiter.notice))
        elif found.fate is Fate.GONE:
            waiter.push(WaiterEvent(EventKind.FINAL, NOT_RUN_TEXT))

    def _expire(self, waiter: Waiter, turn: Turn | None, now: float) -> None:
        active = max(waiter.last_progress, turn.last_progress if turn is not None else 0.0)
        if now - active > self.ceiling:
            waiter.push(WaiterEvent(EventKind.TIMEOUT))


def fenced_reason(turn: Turn) -> str | None:
    """The notice for a turn that will never answer (interrupted or stopped), else ``None``.

    An evicted turn is answered by the engine's own notice; a turn that lost
    its lease is queued again, so neither has a reason here.
    """
    if not turn.interrupted.is_set():
        return None
    return None if turn.ended_by is None else _FENCED_TEXTS.get(turn.ended_by)


__all__ = ["EventKind", "Waiter", "WaiterEvent", "WaiterTracker", "fenced_reason"]
