"""Wake-ups: telling a process that waits for a session's lease that it may be free now.

A store that offers them (:class:`~chatlane.stores.protocols.Wakeups`) keeps
a :class:`WakeupHub`: a waiter takes a :class:`Watch` on a session before it
asks for the lease, and waits on it instead of sleeping blindly between two
tries. What stays true:

* A wake-up is a hint, never needed for correctness: the waiter waits at
  most its poll delay and asks again whether one came or not, so a wake-up
  that is lost (a listener that was down, a notification sent before the
  watch) only delays a turn, never loses a message.
* A watch remembers a wake-up that came while nobody was waiting on it (the
  waiter was asking the store), so one that arrives between a refusal and the
  wait that follows it is not missed: that wait returns at once.
* Waking a session nobody watches costs a dictionary look-up.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import TracebackType

__all__ = ["WakeupHub", "Watch"]


def _always() -> bool:
    return True


class Watch:
    """One waiter's watch on one session (a :class:`~chatlane.stores.protocols.Watch`).

    Close it (or use it as a context manager) when the wait is over.
    """

    __slots__ = ("_event", "_hub", "_listening", "token")

    def __init__(self, hub: WakeupHub, token: str, listening: Callable[[], bool]) -> None:
        self._hub = hub
        self._listening = listening
        self._event = asyncio.Event()
        self.token = token
        """What the hub files this watch under (the session key, or a hash of it)."""

    @property
    def listening(self) -> bool:
        """Whether wake-ups can reach this watch now (``False``: the waiter only polls)."""
        return self._listening()

    @property
    def woken(self) -> bool:
        """Whether a wake-up came that no :meth:`wait` has returned yet."""
        return self._event.is_set()

    async def wait(self, seconds: float) -> bool:
        """Wait for a wake-up, at most ``seconds``; whether one came.

        A wake-up that came since the last wait (or since the watch was taken)
        returns at once; each wake-up is returned once.
        """
        event = self._event
        if not event.is_set():
            try:
                async with asyncio.timeout(seconds):
                    await event.wait()
            except TimeoutError:
                return False
        event.clear()
        return True

    def wake(self) -> None:
        """Wake this watch (its next :meth:`wait` returns at once)."""
        self._event.set()

    def close(self) -> None:
        """Stop watching (idempotent)."""
        self._hub.forget(self)

    def __enter__(self) -> Watch:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


class WakeupHub:
    """The watches of one store, filed by token; a store wakes them by token, or all at once."""

    def __init__(self, listening: Callable[[], bool] = _always) -> None:
        """:param listening: whether wake-ups reach this hub now (a listener may be down)."""
        self._listening = listening
        self._watches: dict[str, set[Watch]] = {}

    def watch(self, token: str) -> Watch:
        """A new watch on ``token``, woken by :meth:`wake` from now on."""
        watch = Watch(self, token, self._listening)
        self._watches.setdefault(token, set()).add(watch)
        return watch

    def forget(self, watch: Watch) -> None:
        """Stop waking ``watch`` (idempotent)."""
        watches = self._watches.get(watch.token)
        if watches is not None:
            watches.discard(watch)
            if not watches:
                del self._watches[watch.token]

    def watched(self, token: str) -> bool:
        """Whether anyone watches ``token``."""
        return token in self._watches

    def wake(self, token: str) -> None:
        """Wake every watch on ``token`` (nothing if no one watches it)."""
        for watch in self._watches.get(token, ()):
            watch.wake()

    def wake_all(self) -> None:
        """Wake every watch: wake-ups may have been missed (a listener came back, or closed)."""
        for watches in self._watches.values():
            for watch in watches:
                watch.wake()

    def __len__(self) -> int:
        """How many watches are open."""
        return sum(len(watches) for watches in self._watches.values())
