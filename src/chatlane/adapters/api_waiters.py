"""HTTP requests waiting for the outcome of their message.

An API request is answered by its message's one outcome, which the engine
emits (:mod:`chatlane.runtime.outcomes`) wherever the message ended: here, or
in another process that adopted it (the engine learns that from the store).
The adapter never looks inside the engine to guess. What stays true:

* A waiter gets exactly one last event: its message's outcome (the answer;
  a failure, interruption, stop or drop notice; a refusal, as 409 or 429) —
  for a command, which no turn runs, its reply or the notice refusing it —
  a 503 once the engine is closing (its message stays queued for the next
  start), a 504 after ``ceiling`` seconds without progress, or the client
  leaving. Nothing is queued after it.
* Chunks, acknowledgements, approval prompts and mid-turn notices travel
  beside it (SSE comments when streaming); none of them is the answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import time
from collections import deque
from dataclasses import dataclass, field

from chatlane.identity import NO_SESSION, SessionKey
from chatlane.runtime.outcomes import MessageOutcome, Outcome
from chatlane.types import Outbound, OutboundKind

INTERRUPTED_TEXT = "Interrupted by a newer message; this turn's answer was discarded."
STOPPED_TEXT = "Stopped (by /stop, /new or /reset) before it answered."
NOT_RUN_TEXT = "This message was dropped (by /stop, /new or /reset) before it was answered."
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
    GONE = "gone"
    """The client disconnected; nobody reads what would follow."""


_LAST = frozenset(
    {EventKind.FINAL, EventKind.REFUSED, EventKind.TIMEOUT, EventKind.SHUTDOWN, EventKind.GONE}
)


@dataclass(frozen=True, slots=True)
class WaiterEvent:
    kind: EventKind
    text: str = ""
    answer: bool = False
    """A ``FINAL`` that is the committed answer (a stream shows how it differs from its chunks)."""


@dataclass(eq=False, slots=True)
class Waiter:
    """One HTTP request waiting for the outcome of its message ``message_id``."""

    message_id: str
    events: deque[WaiterEvent] = field(default_factory=deque)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    session_key: SessionKey = NO_SESSION
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
        """Turn one outbound for this waiter's message into an event.

        A turn's answer arrives as its message's outcome (:meth:`end`) before
        its ``REPLY`` is delivered; a command, which no turn runs, is finished
        by its ``REPLY`` or by the notice refusing its message.
        """
        if outbound.kind is OutboundKind.CHUNK:
            self.push(WaiterEvent(EventKind.CHUNK, outbound.text))
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
    return WaiterEvent(EventKind.FINAL, _NOTICES[kind])


__all__ = ["EventKind", "Waiter", "WaiterEvent", "event_for"]
