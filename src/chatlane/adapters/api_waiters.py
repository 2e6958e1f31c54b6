"""HTTP requests waiting for the outcome of their message.

An API request is answered by its message's one outcome, which the engine
emits (:mod:`chatlane.runtime.outcomes`) wherever the message ended: here, or
in another process that adopted it (the engine learns that from the store).
The adapter never looks inside the engine to guess. What stays true:

* A waiter gets exactly one last event: its message's outcome (the answer;
  a failure, interruption, stop or drop notice; a refusal, as 409 or 429) —
  for a command, which no turn runs, its reply or the notice refusing it —
  a 503 once the engine is closing (its message stays queued for the next
  start), or a 504 after ``ceiling`` seconds without progress. Nothing is
  queued after it.
* Chunks, acknowledgements, approval prompts and mid-turn notices travel
  beside it (SSE comments when streaming); none of them is the answer. A
  request that does not stream is not woken by them: they only mark progress.
* A request is woken once for whatever arrived meanwhile, not once per
  event; a :class:`Ticker` also wakes every waiting request each ``tick``
  seconds, so it checks its ceiling, the gateway and its client with no timer
  of its own.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from chatlane.identity import NO_SESSION, SessionKey
from chatlane.runtime.outcomes import MessageOutcome, Outcome
from chatlane.types import Outbound, OutboundKind

INTERRUPTED_TEXT = "Interrupted by a newer message; this turn's answer was discarded."
STOPPED_TEXT = "Stopped (by /stop, /new or /reset) before it answered."
NOT_RUN_TEXT = (
    "This message was dropped before it was answered "
    "(stopped, interrupted by a newer message, or its conversation ended)."
)
FAILED_TEXT = "Sorry — this message could not be completed ({reason})."


class EventKind(enum.Enum):
    """What a waiting request receives."""

    CHUNK = "chunk"
    """Part of the answer, as the agent streams it."""
    COMMENT = "comment"
    """Information that is not the answer (acks, approval prompts, mid-turn notices)."""
    FINAL = "final"
    """The answer, or the notice saying why there is none; nothing follows."""
    REFUSED = "refused"
    """The message was refused without running; ``text`` is the busy outcome; nothing follows."""
    TIMEOUT = "timeout"
    """No progress for the ceiling; nothing follows."""
    SHUTDOWN = "shutdown"
    """The gateway is stopping; nothing follows."""


_LAST = frozenset({EventKind.FINAL, EventKind.REFUSED, EventKind.TIMEOUT, EventKind.SHUTDOWN})


@dataclass(frozen=True, slots=True)
class WaiterEvent:
    kind: EventKind
    text: str = ""
    answer: bool = False
    """A ``FINAL`` that is the committed answer (a stream shows how it differs from its chunks)."""


@dataclass(eq=False, slots=True)
class Waiter:
    """One HTTP request waiting for the outcome of its message ``message_id``.

    A waiter that does not ``stream`` keeps only its last event: chunks and
    comments mark progress but are not queued, so they never wake it.
    """

    message_id: str
    stream: bool = True
    events: list[WaiterEvent] = field(default_factory=list)
    session_key: SessionKey = NO_SESSION
    last_progress: float = field(default_factory=time.monotonic)
    finished: bool = False
    checked_at: float = field(default_factory=time.monotonic)
    """When the waiter was last ticked (or registered)."""
    ticked: bool = field(default=False, init=False)
    """A tick came since the last :meth:`wait`: time to check the ceiling and the client."""
    _wakeup: asyncio.Future[None] | None = field(default=None, init=False, repr=False)

    def push(self, event: WaiterEvent) -> None:
        """Queue ``event``; nothing is queued after the last one."""
        if self.finished:
            return
        self.finished = event.kind in _LAST
        self.last_progress = time.monotonic()
        if self.finished or self.stream:
            self.events.append(event)
            self._wake()

    def tick(self) -> None:
        """Wake the request so it checks its ceiling and its client (the adapter ticks)."""
        self.ticked = True
        self._wake()

    async def wait(self) -> tuple[list[WaiterEvent], bool]:
        """Every event queued so far, in order, and whether a tick came meanwhile.

        It returns as soon as either is there: events that arrive together are
        taken together (one wake-up, however many chunks an agent produced
        meanwhile), and a tick may come with no event.
        """
        if not self.events and not self.ticked:
            wakeup = self._wakeup = asyncio.get_running_loop().create_future()
            try:
                await wakeup
            finally:
                self._wakeup = None
        events, self.events = self.events, []
        ticked, self.ticked = self.ticked, False
        return events, ticked

    def _wake(self) -> None:
        wakeup = self._wakeup
        if wakeup is not None and not wakeup.done():
            wakeup.set_result(None)

    def take(self, outbound: Outbound) -> None:
        """Turn one outbound for this waiter's message into an event.

        A turn's answer arrives as its message's outcome (:meth:`end`) before
        its ``REPLY`` is delivered; a command, which no turn runs, is finished
        by its ``REPLY`` or by the notice refusing its message.
        """
        if outbound.kind is OutboundKind.CHUNK:
            if self.stream:
                self.push(WaiterEvent(EventKind.CHUNK, outbound.text))
            elif not self.finished:
                self.last_progress = time.monotonic()  # progress, not queued (see push)
        elif outbound.kind is OutboundKind.REPLY:
            self.push(WaiterEvent(EventKind.FINAL, outbound.text))
        elif outbound.refusal:
            self.push(WaiterEvent(EventKind.REFUSED, outbound.refusal))
        else:
            self.push(WaiterEvent(EventKind.COMMENT, outbound.text))

    def end(self, outcome: MessageOutcome) -> None:
        """Finish with the outcome of the message."""
        self.push(event_for(outcome))

    def expire(self, ceiling: float, session_progress: float) -> None:
        """Time out if neither this request nor its session progressed for ``ceiling`` seconds."""
        if time.monotonic() - max(self.last_progress, session_progress) > ceiling:
            self.push(WaiterEvent(EventKind.TIMEOUT))


class Ticker:
    """One timer for every waiting request, firing every ``period`` seconds while any waits.

    Each firing ticks the waiters that were not ticked for half a ``period`` or
    more: a request is ticked about every ``period`` seconds, first within one
    and a half, and a request answered sooner than half a ``period`` never is.
    Waiting costs no timer of its own.
    """

    def __init__(self, waiting: Callable[[], Iterable[Waiter]], period: float) -> None:
        """``waiting()``: every waiter registered now."""
        self._waiting = waiting
        self._period = period
        self._handle: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        """Make sure the timer runs on this event loop (call once a waiter is registered)."""
        loop = asyncio.get_running_loop()
        if self._handle is None or self._loop is not loop:
            self._loop = loop
            self._handle = loop.call_later(self._period, self._tick)

    def _tick(self) -> None:
        self._handle = None
        now = time.monotonic()
        waiters = list(self._waiting())
        for waiter in waiters:
            if now - waiter.checked_at >= self._period / 2:
                waiter.checked_at = now
                waiter.tick()
        if waiters:
            self.start()


_NOTICES = {
    Outcome.INTERRUPTED: INTERRUPTED_TEXT,
    Outcome.STOPPED: STOPPED_TEXT,
    Outcome.DROPPED: NOT_RUN_TEXT,
}


def event_for(outcome: MessageOutcome) -> WaiterEvent:
    """The last event a request gets for its message's ``outcome``."""
    kind = outcome.outcome
    if kind is Outcome.ANSWERED:
        return WaiterEvent(EventKind.FINAL, outcome.text, answer=True)
    if kind is Outcome.REFUSED:
        return WaiterEvent(EventKind.REFUSED, outcome.reason)
    if kind is Outcome.SHUT_DOWN:
        return WaiterEvent(EventKind.SHUTDOWN)
    if kind is Outcome.FAILED:
        return WaiterEvent(
            EventKind.FINAL, outcome.text or FAILED_TEXT.format(reason=outcome.reason)
        )
    if kind is Outcome.DROPPED and outcome.text:  # taken out of the queue: why, in its words
        return WaiterEvent(EventKind.FINAL, outcome.text)
    return WaiterEvent(EventKind.FINAL, _NOTICES[kind])


__all__ = ["EventKind", "Ticker", "Waiter", "WaiterEvent", "event_for"]
