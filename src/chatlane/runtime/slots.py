"""The turn slots of one process's sessions: who holds them, what comes next, and when.

:class:`Slots` is the one owner of this process's turn slots and of
everything time-based about them: the live turns, the sessions waiting out a
``collect`` debounce, timers, background tasks, promotion of a session's next
pending turn, and superseding a turn. The engine's helpers are handed it
instead of callables into the engine. What stays true:

* A turn is live from :meth:`Slots.claim` until :meth:`Slots.end`; live turns
  and collecting sessions are what :meth:`Slots.is_idle`,
  :meth:`Slots.live_count` and :meth:`Slots.held` count, and an ended turn
  wakes :meth:`Slots.wait_idle`.
* When a turn is finished its session's slot is freed only if the turn still
  holds it; then the session's next pending turn starts at once, through the
  one ``start`` given at construction, or the slot is held empty until a
  ``collect`` debounce runs out. Steers the agent never took go back into
  the queue first, in store order. Nothing is promoted once
  :meth:`Slots.close` was called.
* A session has at most one turn claimed or running here: :meth:`Slots.promote`
  starts a turn only into a free slot (idle), and is a no-op while a turn holds
  it or a ``collect`` debounce runs; whoever frees the slot promotes. So
  several ends racing to promote one session (an evicted turn's own end and
  its eviction) start its next turn once.
* While a conversation boundary runs (:meth:`begin_boundary` until
  :meth:`end_boundary`) no turn starts for its session: a freed slot is held
  empty (:attr:`~chatlane.state.SlotPhase.ENDING`), so what arrives meanwhile
  waits, and starts in the new conversation once the boundary is done.
* A ``/model --once`` is settled when a turn whose agent was called ends,
  however it ends; a turn that never called its agent (refused its lease,
  drawn into another process's turn, answered by a replay) leaves it to the next.
* A superseded turn is stale from that moment: the session's generation is
  bumped here, and in the store unless the store already moved on; its
  approval requests are denied at once; its task is cancelled after
  ``interrupt_grace`` unless its agent ended by then (the settling of its
  messages that follows is never cancelled).
* A redirected turn (:meth:`Slots.redirect`) stays current, so it can commit
  what it did; its approval requests are denied at once (a wait for one is a
  safe point). If it is still running after ``interrupt_grace`` it is
  superseded as interrupted, exactly as ``rollback`` would have done.
* Timers set before :meth:`Slots.close` are cancelled by it; a background
  task's failure is logged, never left unretrieved.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine

from chatlane.approvals import deny_stale, end_turn_requests
from chatlane.errors import StoreError
from chatlane.logs import turn_fields
from chatlane.metrics import Metrics
from chatlane.runtime import pending
from chatlane.runtime.backoff import retryable
from chatlane.runtime.ending import TurnEnd
from chatlane.runtime.persisted import settle_once
from chatlane.runtime.settings import RuntimeSettings
from chatlane.runtime.turn import Turn, running_turn_of
from chatlane.state import SessionRegistry, SessionState, SlotPhase
from chatlane.stores.base import Store
from chatlane.types import InboundMessage, SessionKey

log = logging.getLogger("chatlane.runtime")

StartTurn = Callable[[SessionState, tuple[InboundMessage, ...], tuple[int, ...], int], Turn]
"""Starts a turn for a session's messages (seqs, reruns); it calls :meth:`Slots.claim`."""


class Slots:
    """Owns one process's turn slots, timers and promotion (see the module docstring).

    :param start: the engine's way to start (and drive) a turn; the only call
        back into the engine, made to promote a session's next pending turn.
    """

    def __init__(
        self,
        registry: SessionRegistry,
        store: Store,
        settings: RuntimeSettings,
        metrics: Metrics,
        start: StartTurn,
    ) -> None:
        self._registry = registry
        self._store = store
        self._settings = settings
        self._metrics = metrics
        self._start = start
        self._turns: set[Turn] = set()
        self._collecting: set[SessionKey] = set()
        self._ending: dict[SessionKey, int] = {}
        """The sessions whose conversation boundaries run, and how many run for each."""
        self._held: set[SessionKey] = set()
        """The sessions whose slot a boundary holds empty (:attr:`SlotPhase.ENDING`)."""
        self._tasks: set[asyncio.Task[object]] = set()
        self._timers: set[asyncio.TimerHandle] = set()
        self._live_ended = asyncio.Event()
        self.closed = False
        """Whether :meth:`close` was called (only it sets this): from then on nothing is promoted.

        A plain attribute, not a property: it is read several times per message.
        """

    # -- a turn's life in its slot ------------------------------------------------

    def claim(self, turn: Turn) -> None:
        """``turn`` takes its session's slot (idle or collecting): it is live from now on."""
        turn.session_state.turn.claim(turn, time.time())
        self._turns.add(turn)

    def finish(self, turn: Turn) -> None:
        """``turn``'s task is done: end it, free its slot if it still holds it, promote."""
        state, ended_by = turn.session_state, turn.ended_by
        ran = self.end(turn)
        self._live_ended.set()
        if ran:
            outcome = "answered" if turn.answered else (ended_by or "fenced")
            self._metrics.turn_finished(outcome, time.monotonic() - turn.started_at)
        if turn.agent_called and turn.once_restore is not None:
            settle_once(turn)  # not a turn refused, drawn in elsewhere or replayed: it ran no agent
        for message, seq in turn.untaken_steers():
            pending.insert_in_order(state, [message], [seq])  # before what came after it
        slot = state.turn
        if slot.current is not turn:  # as slot.holds(turn): a turn is never None
            self.promote(state)  # an evicted turn's untaken steers still run
            return
        if not turn.interrupted.is_set():
            state.conversation.interrupt_streak = 0
        slot.clear()
        self.promote(state)

    def end(self, turn: Turn) -> bool:
        """The engine is done with ``turn``: it is no longer live and can ask nothing any more.

        :returns: whether the turn ran under a lease.
        """
        self._turns.discard(turn)
        turn.mark_finished()
        if turn.lease is None:
            return False
        end_turn_requests(turn.session_state, turn.generation)
        return True

    def promote(self, state: SessionState) -> None:
        """Start the session's next pending turn, or wait out a collect debounce.

        Only into a free slot: while a turn holds it (claimed or running) or a
        debounce runs, nothing changes, and the next turn starts when it is freed.
        """
        if state.turn.is_running or self.closed:
            return
        if state.key in self._ending:
            self._hold(state)
            return
        queue = pending.pending_entries(state)
        if not queue:
            return
        delay = queue[0].delay()
        if delay > 0:
            state.turn.collect(time.time())
            self._collecting.add(state.key)
            self._call_later(delay, self._promote_after_debounce, state)
            return
        entry = pending.take_next(state)
        turn = self._start(state, tuple(entry.messages), tuple(entry.seqs), entry.reruns)
        if entry.note:  # its task has not run yet
            turn.annotate(entry.note)

    def _promote_after_debounce(self, state: SessionState) -> None:
        self._done_collecting(state.key)
        if state.turn.phase is SlotPhase.COLLECTING:
            state.turn.clear()
            self.promote(state)

    def stop_collecting(self, state: SessionState) -> None:
        """Free ``state``'s slot if it is held empty for a debounce (its queue was dropped)."""
        if state.turn.phase is SlotPhase.COLLECTING:
            self.free(state)
            self._done_collecting(state.key)

    def free(self, state: SessionState) -> None:
        """Empty ``state``'s slot (its turn is gone); held empty while a boundary runs."""
        state.turn.clear()
        if state.key in self._ending:
            self._hold(state)

    # -- conversation boundaries ----------------------------------------------------

    def begin_boundary(self, state: SessionState) -> None:
        """A conversation boundary begins for ``state``'s session: from now until
        :meth:`end_boundary` no turn starts for it, and a free slot is held empty."""
        key = state.key
        self._ending[key] = self._ending.get(key, 0) + 1
        if not state.turn.is_running:
            self._hold(state)

    def _hold(self, state: SessionState) -> None:
        state.turn.hold_for_boundary(time.time())
        self._held.add(state.key)

    def end_boundary(self, state: SessionState) -> None:
        """The boundary :meth:`begin_boundary` began is done (or failed): once the last one
        for the session is, its slot is freed and what waits starts."""
        key = state.key
        left = self._ending.pop(key, 1) - 1
        if left > 0:
            self._ending[key] = left
            return
        self._held.discard(key)
        if state.turn.phase is SlotPhase.ENDING:
            state.turn.clear()
        self._live_ended.set()
        self.promote(state)

    def ends_conversation(self, key: SessionKey) -> bool:
        """Whether a conversation boundary runs for ``key``: what arrives waits for it."""
        return key in self._ending

    def _done_collecting(self, key: SessionKey) -> None:
        """``key`` no longer waits out a debounce: it may have been the last live session."""
        self._collecting.discard(key)
        self._live_ended.set()

    def supersede(
        self,
        turn: Turn,
        ended_by: TurnEnd,
        detail: str = "",
        *,
        fenced_in_store: bool = False,
        grace: float | None = None,
    ) -> None:
        """Make ``turn`` stale, ask it to stop, and cancel it after the grace period.

        ``grace`` shortens ``interrupt_grace`` (a lease about to expire leaves no more).

        The store's generation is bumped too, unless it already moved on
        (``fenced_in_store``, or a lost lease).
        """
        state = turn.session_state
        turn.end(ended_by)
        if turn.is_current():
            state.persistent.bump_generation()
            if ended_by != TurnEnd.LEASE_LOST and not fenced_in_store:
                self.spawn(self._store.bump_generation(state.key))
        turn.interrupted.set()
        deny_stale(state, self.generation_is)
        if turn.lease is not None:
            end_turn_requests(state, turn.generation)  # even if its generation still holds
        log.info(
            "turn superseded (%s%s)",
            ended_by,
            detail and f": {detail}",
            extra=turn_fields(turn.session_key, turn.generation),
        )
        task = turn.task
        if task is not None and not task.done():
            wait = self._settings.interrupt_grace
            self._call_later(wait if grace is None else min(grace, wait), _cancel, turn)

    def redirect(self, turn: Turn) -> None:
        """Have ``turn`` stop at its next safe point and keep its work (policy ``redirect``)."""
        turn.redirect()
        end_turn_requests(turn.session_state, turn.generation)
        log.info("turn redirected", extra=turn_fields(turn.session_key, turn.generation))
        task = turn.task
        if task is not None and not task.done():
            self._call_later(self._settings.interrupt_grace, self._redirect_overdue, turn)

    def _redirect_overdue(self, turn: Turn) -> None:
        """``turn`` found no safe point within the grace period: it is rolled back."""
        if not (turn.finished or turn.settling or turn.answered or turn.ended_by is not None):
            reason = "redirected, no safe point in time"
            self.supersede(turn, TurnEnd.INTERRUPTED, reason, grace=0.0)

    def close(self) -> list[Turn]:
        """Promote nothing from now on, cancel timers, supersede every live turn; return them."""
        self.closed = True
        for handle in self._timers:
            handle.cancel()
        self._timers.clear()
        turns = list(self._turns)
        for turn in turns:
            self.supersede(turn, TurnEnd.SHUTDOWN)
        return turns

    # -- timers and background tasks -------------------------------------------------

    def _call_later(self, delay: float, callback: Callable[..., object], *args: object) -> None:
        loop = asyncio.get_running_loop()

        def fire() -> None:
            self._timers.discard(handle)
            callback(*args)

        handle = loop.call_later(delay, fire)
        self._timers.add(handle)

    def spawn(self, coro: Coroutine[object, object, object]) -> None:
        """Run ``coro`` in the background; its failure is logged, never left unretrieved."""
        task: asyncio.Task[object] = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._spawned_done)

    def _spawned_done(self, task: asyncio.Task[object]) -> None:
        self._tasks.discard(task)
        if task.cancelled() or (error := task.exception()) is None:
            return
        if isinstance(error, StoreError) and retryable(error):  # an outage: no traceback
            log.warning("background step failed: %s", error)
        else:
            log.error("background step failed: %r", error, exc_info=error)

    def spawned(self) -> list[asyncio.Task[object]]:
        """The background tasks not done yet (:meth:`spawn`)."""
        return list(self._tasks)

    # -- what the slots hold ------------------------------------------------------------

    def running_turn(self, key: SessionKey) -> Turn | None:
        """The turn that holds ``key``'s slot, if any (``None`` while idle)."""
        state = self._registry.peek(key)
        return None if state is None else running_turn_of(state)

    def generation_of(self, key: SessionKey) -> int:
        """``key``'s current generation here (0 for a session this process does not know)."""
        state = self._registry.peek(key)
        return 0 if state is None else state.persistent.run_generation

    def generation_is(self, key: SessionKey, generation: int) -> bool:
        """Whether ``generation`` is ``key``'s current one here."""
        state = self._registry.peek(key)
        return state is not None and state.persistent.run_generation == generation

    def holding(self) -> list[Turn]:
        """Live turns whose lease is of the session's current generation (even if expired here)."""
        return [t for t in self._turns if t.lease is not None and not (t.finished or t.is_fenced())]

    def unanswered(self, key: SessionKey) -> list[InboundMessage]:
        """``key``'s messages held here that no commit answered yet: running first (the
        steers its agent took too), then the steers it has not taken, then queued."""
        state = self._registry.peek(key)
        if state is None:
            return []
        turn = running_turn_of(state)
        queued = [m for entry in pending.pending_entries(state) for m in entry.messages]
        if turn is None:
            return queued
        running = [] if turn.answered else [*turn.messages, *turn.steered]
        return [*running, *(message for message, _ in turn.waiting_steers()), *queued]

    def held(self) -> list[InboundMessage]:
        """Every message this process holds unanswered, across every live session (steered
        ones included, taken by their agent or not)."""
        return [message for key in self.live_keys() for message in self.unanswered(key)]

    def live_keys(self) -> set[SessionKey]:
        """Sessions with a turn running or waiting, collecting, or held by a boundary here."""
        return {turn.session_key for turn in self._turns} | self._collecting | self._held

    def live_count(self) -> int:
        """Sessions with a turn running or waiting, collecting, or held by a boundary here."""
        return len(self._turns) + len(self._collecting) + len(self._held)

    def running_count(self) -> int:
        """Turns running (or waiting for their lease) in this process."""
        return len(self._turns)

    def is_idle(self) -> bool:
        """No turn is live, no session waits out a collect debounce or a boundary."""
        return not self._turns and not self._collecting and not self._ending

    async def wait_idle(self) -> None:
        """Return once :meth:`is_idle` holds (wrap in a timeout to bound the wait)."""
        while not self.is_idle():
            self._live_ended.clear()
            await self._live_ended.wait()


def _cancel(turn: Turn) -> None:
    """Cancel ``turn``'s agent, unless it is done: its settling must run to its end."""
    task = turn.task
    if task is not None and not task.done() and not turn.settling:
        task.cancel()


__all__ = ["Slots", "StartTurn"]
