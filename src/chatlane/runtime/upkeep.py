"""An engine's background work: renewals and heartbeats, fence checks, adoption, eviction.

Each kind of upkeep runs in a task of its own, started with the engine's
first message and cancelled when it closes, so none waits behind another.
What stays true:

* Every ``renew_every`` (``ttl / 10``) the process's heartbeat and every lease
  its running turns hold are renewed, concurrently, each in one store call
  however many sessions run. A lease the store refuses to renew is lost: its
  turn is superseded (as interrupted when another process fenced it to
  interrupt it). When the store cannot be reached the turns keep running
  until their leases are about to expire on this host's clock: a turn whose
  lease has less than :func:`expiry_margin` left is superseded, and cancelled
  just before the lease expires here if it has not ended by then, whether or not a
  renewal is still waiting for the store (a host cut off from it never
  answers), so it has stopped before the store lets another process take the
  session. A lease released while its renewal was
  under way (the turn committed and ended) is not a loss, and is not logged
  as one. A turn is given up for its lease once: superseded, logged and
  counted in ``chatlane_lease_failures_total`` once, however many passes
  find it still holding the lease while it winds down.
* Every ``fence_check`` seconds each running turn's generation is compared
  with the store's (one batched read, :meth:`~chatlane.stores.base.Store.generations`):
  a turn another process fenced (``/stop`` or ``/new`` sent there, or an
  interrupt) is reported at once, not at the next renewal. A failed check is
  logged and changes nothing. The same check reads the
  ``redirect_generation`` field of each running turn whose session's own
  policy is ``redirect`` (one read per such turn; none for other sessions)
  and redirects the turn another process asked to redirect, and reads the
  queue of each running turn whose session's own policy is ``steer`` or
  ``collect`` (one read per such turn), drawing in what other processes
  accepted for it since it started (:func:`~chatlane.runtime.elsewhere.draw_in`).
* Every ``fence_check`` seconds (or ``renew_every``), the messages this process
  accepted that left for another process are looked up in the store (one
  batch), and those whose fate is known get their outcome
  (:mod:`chatlane.runtime.watch`).
* Every ``adopt_every`` (``ttl / 5``) one bounded batch of dead processes'
  messages is adopted (one store call, ``adopt_batch`` sessions); a full
  batch is followed at once by the next.
* A turn that made no progress for ``turn_timeout`` is evicted: superseded and
  cancelled at once, its lease released, its messages failed and its sender
  told, and the session's next turn started, once: the evicted turn's own end
  may start it first, while the eviction still waits on the store, and then
  the eviction starts nothing (the watchdog runs only when ``turn_timeout > 0``).

The upkeep reaches the turns through the engine's :class:`~chatlane.runtime.slots.Slots`;
its one call back into the engine is ``adopt``, which runs an adopted message
as the engine runs any other.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Protocol

from chatlane.errors import ChatlaneError
from chatlane.logs import turn_fields
from chatlane.metrics import Metrics
from chatlane.runtime import pending
from chatlane.runtime.elsewhere import draw_in, redirected_elsewhere, was_interrupted_elsewhere
from chatlane.runtime.ending import TurnEnd
from chatlane.runtime.leases import LeaseKeeper, locally_expired
from chatlane.runtime.outcomes import Outcome, OutcomeLedger
from chatlane.runtime.outlet import Outlet
from chatlane.runtime.persisted import settle_once
from chatlane.runtime.recovery import adopt_orphans, sessions_in
from chatlane.runtime.settings import LeaseSettings
from chatlane.runtime.slots import Slots
from chatlane.runtime.turn import Turn
from chatlane.runtime.watch import settle_watched
from chatlane.state import SessionState
from chatlane.stores.base import Lease
from chatlane.types import InboundMessage, OutboundKind, SessionKey

log = logging.getLogger("chatlane.runtime")

Adopt = Callable[[SessionKey, InboundMessage, int], Awaitable[None]]
"""Runs a message adopted from a dead process (the engine's ``adopt``)."""

TakeAnswers = Callable[[list[SessionState]], Awaitable[None]]
"""Resolves the approvals of sessions waiting here that other processes answered
(the engine's :meth:`~chatlane.approvals.ApprovalBroker.take_answers`)."""


class Drawing(Protocol):
    """Which running turns draw in other processes' messages, and what becomes of them
    (the engine's :class:`~chatlane.runtime.arrivals.BusyDesk`)."""

    def draws_in(self, turn: Turn) -> bool: ...

    def wants_drawn(self, state: SessionState, message: InboundMessage) -> bool: ...

    def take_in(self, turn: Turn, message: InboundMessage, seq: int) -> None: ...


class Upkeep:
    """Runs the background loops of one engine (see the module docstring).

    :param slots: the engine's slots: the turns holding leases, and the way
        to supersede, end and promote.
    :param adopt: run a message adopted from a dead process.
    :param answers: resolve the approvals another process answered, at each fence check.
    """

    def __init__(
        self,
        leases: LeaseKeeper,
        slots: Slots,
        outlet: Outlet,
        outcomes: OutcomeLedger,
        metrics: Metrics,
        adopt: Adopt,
        *,
        turn_timeout: float,
        redirectable: Callable[[Turn], bool] = lambda turn: False,
        drawing: Drawing | None = None,
        answers: TakeAnswers | None = None,
    ) -> None:
        self._leases = leases
        self._slots = slots
        self._losing: set[int] = set()
        """The turns (by ``id``) whose refused renewal is being handled (:meth:`_lose`)."""
        self._outlet = outlet
        self._outcomes = outcomes
        self._metrics = metrics
        self._adopt = adopt
        self._turn_timeout = turn_timeout
        self._redirectable = redirectable
        """Whether another process may redirect a turn: only those are read for it."""
        self._drawing = drawing
        self._answers = answers
        """Resolves the approvals other processes answered (only sessions that wait on one)."""
        self._tasks: list[asyncio.Task[None]] = []
        self.started = False
        """Whether :meth:`start` started the loops (a plain attribute: read per message)."""

    @property
    def tasks(self) -> list[asyncio.Task[None]]:
        """The running loops (empty before :meth:`start`)."""
        return self._tasks

    def start(self) -> None:
        """Start the loops, once, each in a fresh context: no session is bound there.

        They serve every session, so they never keep a copy of whichever
        caller (perhaps inside a session's binding) happened to start them.
        """
        if self._tasks:
            return
        self.started = True
        settings = self._leases.settings
        loops: list[tuple[Coroutine[object, object, None], str]] = [
            (self._every(settings.renew_every, self.renew_once), "chatlane-leases"),
            (self._every(settings.renew_every / 2, self.give_up_expiring), "chatlane-expiry"),
            (self._adopting(), "chatlane-adoption"),
        ]
        if settings.fence_check > 0:
            loops.append((self._every(settings.fence_check, self.check_fences), "chatlane-fences"))
        watch_every = settings.fence_check or settings.renew_every
        loops.append((self._every(watch_every, self.settle_watched), "chatlane-outcomes"))
        if self._turn_timeout > 0:
            watch = min(self._turn_timeout / 4, 1.0)
            loops.append((self._every(watch, self.evict_stuck, first=watch), "chatlane-watchdog"))
        for loop, name in loops:
            task = asyncio.create_task(loop, name=name, context=contextvars.Context())
            self._tasks.append(task)

    async def _every(
        self, period: float, step: Callable[[], Awaitable[object]], first: float = 0.0
    ) -> None:
        """Run ``step`` every ``period`` seconds (start to start) until the engine closes."""
        await asyncio.sleep(first)
        while not self._slots.closed:
            started = time.monotonic()
            await step()
            await asyncio.sleep(max(0.0, period - (time.monotonic() - started)))

    def _leased(self) -> list[Turn]:
        """The live turns whose lease this process still holds.

        An answered turn's lease went with the commit that answered it: it is
        neither renewed nor fence-checked while its reply is delivered.
        """
        return [
            t for t in self._slots.holding() if t.generation in t.session_state.turn.lease_tokens
        ]

    async def renew_once(self) -> None:
        """Beat and renew every held lease, concurrently; the turns whose lease is gone lose it.

        A lost lease is handled beside this loop (:meth:`_lose`): asking the
        store why may wait behind a burst of other work, and the next beat
        must not.
        """
        held, boundaries = self._leased(), self._leases.boundary_leases()
        beat, renewal = await asyncio.gather(
            self._leases.heartbeat(),
            self._leases.renew_all([*_leases_of(held), *boundaries]),
            return_exceptions=True,
        )
        if isinstance(beat, BaseException):
            _raise_unless_store_error(beat)
            log.warning("heartbeat failed: %s", beat)
        if isinstance(renewal, BaseException):
            _raise_unless_store_error(renewal)
            await self._unreachable(held, renewal)
            return
        for boundary, lease in zip(boundaries, renewal[len(held) :], strict=True):
            self._leases.renewed(boundary, lease)
        for turn, lease in zip(held, renewal[: len(held)], strict=True):
            if lease is None:
                self._lose(turn, "its lease could not be renewed")
            else:
                _renewed(turn, lease)

    def _lose(self, turn: Turn, why: str) -> None:
        """Handle ``turn``'s refused renewal in the background, once at a time per turn."""
        if id(turn) in self._losing or self._lost_nothing(turn):
            return
        self._losing.add(id(turn))

        async def lose() -> None:
            try:
                await self.lease_lost(turn, why, fenced=True)
            finally:
                self._losing.discard(id(turn))

        self._slots.spawn(lose())

    @staticmethod
    def _lost_nothing(turn: Turn) -> bool:
        """Whether ``turn`` ended, answered, gave its lease back, was fenced here already, or
        was given up for its lease before (it keeps the lease until it ends, and is not
        given up again at each pass meanwhile)."""
        released = turn.generation not in turn.session_state.turn.lease_tokens
        return turn.finished or turn.answered or released or turn.is_fenced() or turn.lease_given_up

    async def give_up_expiring(self) -> int:
        """Supersede and cancel each turn whose lease is about to expire here; return how many.

        Needs no store call, so a renewal that hangs (a cut-off network) cannot
        hold it up.
        """
        margin = expiry_margin(self._leases.settings)
        expiring = [
            turn
            for turn in self._leased()
            if expires_within(turn.lease, margin) and not turn.lease_given_up
        ]
        for turn in expiring:
            left = 0.0 if turn.lease is None else turn.lease.expires_at - time.time()
            why = "its lease is about to expire unrenewed"
            grace = max(left - margin / 2, 0.0)  # cancelled a little before the lease expires
            await self.lease_lost(turn, why, fenced=False, grace=grace)
        return len(expiring)

    async def _unreachable(self, held: list[Turn], error: BaseException) -> None:
        """The store did not answer: leases hold until they expire here, then they are lost."""
        log.warning("could not renew %d lease(s): %s", len(held), error)
        for turn in held:
            if locally_expired(turn.lease):
                why = f"its lease expired while the store could not be reached ({error})"
                await self.lease_lost(turn, why, fenced=False)

    async def check_fences(self) -> None:
        """Fence each running turn whose generation another process moved past, and
        redirect each one another process asked to redirect."""
        held = self._leased()
        if not held:
            return
        try:
            moved = await self._leases.moved_on(_leases_of(held))
        except ChatlaneError as error:
            log.warning("fence check failed: %s", error)
            return
        for turn, gone in zip(held, moved, strict=True):
            if gone and turn.is_current():
                await self.lease_lost(turn, "fenced by another process", fenced=True)
        await self._redirect_asked(held)
        await self._draw_in(held)
        await self._take_answers(held)

    async def _take_answers(self, held: list[Turn]) -> None:
        """Resolve the approvals waiting here that another process recorded answers to."""
        asking = [t.session_state for t in held if t.session_state.turn.approval_requests]
        if asking and self._answers is not None:
            await self._answers(asking)

    async def _redirect_asked(self, held: list[Turn]) -> None:
        """Redirect the running turns another process asked to (``redirect_generation``)."""
        running = [
            t
            for t in held
            if t.is_current() and not t.interrupted.is_set() and self._redirectable(t)
        ]
        if not running:
            return
        try:
            asked = await redirected_elsewhere(self._leases.store, running)
        except ChatlaneError as error:
            log.warning("could not read the redirects asked elsewhere: %s", error)
            return
        for turn in asked:
            if turn.is_current() and not turn.interrupted.is_set():  # it may have moved on
                self._slots.redirect(turn)

    async def _draw_in(self, held: list[Turn]) -> None:
        """Draw other processes' messages into the running turns that steer or collect."""
        drawing = self._drawing
        if drawing is None:
            return
        drawn = [
            t
            for t in held
            if t.is_current()
            and not t.interrupted.is_set()
            and not t.settling
            and drawing.draws_in(t)
        ]
        await asyncio.gather(*(self._draw_into(turn, drawing) for turn in drawn))

    async def _draw_into(self, turn: Turn, drawing: Drawing) -> None:
        state = turn.session_state
        if self._leases.is_drawing(state.key):
            return  # a fence check made by hand meanwhile: one draw at a time
        known = {*turn.seqs, *(seq for _, seq in turn.waiting_steers())}
        known.update(seq for seq, _ in pending.queued(state))
        wanted = functools.partial(drawing.wants_drawn, state)
        leases = self._leases
        with leases.drawing(state.key):
            try:
                drawn = await draw_in(leases.store, leases.holder, turn, known, wanted)
            except ChatlaneError as error:
                log.warning("could not draw in messages: %s", error, extra=turn_fields(state.key))
                return
            for message, seq in drawn:
                fields = turn_fields(state.key)
                log.info("drew in message %s (seq %d)", message.id, seq, extra=fields)
                drawing.take_in(turn, message, seq)

    async def lease_lost(
        self, turn: Turn, why: str, *, fenced: bool, grace: float | None = None
    ) -> None:
        """``turn``'s lease is gone (``why`` is for the log): supersede it.

        ``grace``: at most this long to wind down before it is cancelled.

        When the store said so (``fenced``), another process may have fenced
        it to interrupt it, and the store is asked; then the turn ends as
        interrupted. A turn that ended, or was fenced here, while the renewal
        was under way lost nothing; so did one given up for its lease before.
        """
        if self._lost_nothing(turn):
            return  # before asking the store: no read for a turn that ended meanwhile
        store = self._leases.store
        try:
            interrupted = fenced and await was_interrupted_elsewhere(store, turn)
        except ChatlaneError:
            interrupted = False
        if self._lost_nothing(turn):
            return
        turn.give_up_lease()
        if interrupted:
            detail = "by a message to another process"
            self._slots.supersede(turn, TurnEnd.INTERRUPTED, detail, fenced_in_store=True)
            return
        log.warning("lease lost: %s", why, extra=turn_fields(turn.session_key, turn.generation))
        self._metrics.lease_failure()
        self._slots.supersede(turn, TurnEnd.LEASE_LOST, why, grace=grace)

    async def settle_watched(self) -> int:
        """End what the store says became of messages that left for another process."""
        try:
            return await settle_watched(self._leases.store, self._outcomes)
        except ChatlaneError as error:
            log.warning("could not read what became of messages elsewhere: %s", error)
            return 0

    async def _adopting(self) -> None:
        settings = self._leases.settings
        while not self._slots.closed:
            count = await self.adopt_once()
            await asyncio.sleep(0.0 if count >= settings.adopt_batch else settings.adopt_every)

    async def adopt_once(self) -> int:
        """Adopt one batch of orphaned messages; return how many sessions it held."""
        leases = self._leases
        try:
            records = await adopt_orphans(
                leases.store, leases.holder, self._adopt, leases.settings.adopt_batch
            )
        except ChatlaneError as error:
            log.warning("adoption failed: %s", error)
            return 0
        return sessions_in(records)

    async def evict_stuck(self) -> int:
        """Evict every turn that made no progress for ``turn_timeout``; return how many."""
        deadline = time.monotonic() - self._turn_timeout
        stuck = [turn for turn in self._slots.holding() if turn.last_progress < deadline]
        for turn in stuck:
            await self._evict(turn)
        return len(stuck)

    async def _evict(self, turn: Turn) -> None:
        """Stop ``turn``, free its slot, release its lease, tell its sender, and promote.

        The turn's task, cancelled here, starts the session's next turn itself
        when it ends (:meth:`Slots.finish`), perhaps during the awaits here; the
        promotion at the end then finds the slot taken and starts nothing.
        """
        state, slots = turn.session_state, self._slots
        if not state.turn.holds(turn):
            return
        slots.supersede(turn, TurnEnd.EVICTED)
        if turn.agent_called:  # a --once is used up only by a turn whose agent was called
            settle_once(turn)
        if turn.task is not None:
            turn.task.cancel()
        slots.end(turn)
        slots.free(state)  # held at once if a boundary runs: nothing starts in the old conversation
        await self._leases.release(state, turn.generation)
        timeout = self._turn_timeout
        text = f"The running turn made no progress for {timeout:g}s and was stopped."
        self._outcomes.end(turn.message_ids, Outcome.FAILED, text, reason=TurnEnd.EVICTED)
        await self._outlet.about(turn, OutboundKind.NOTICE, text)
        slots.promote(state)  # nothing if the turn's own end started the next one


def expiry_margin(settings: LeaseSettings) -> float:
    """How long before its lease expires here an unrenewed turn is given up.

    A renewal, twice the expiry check's period: a healthy process renews
    long before; a cut-off one stops with time to spare before the store's
    expiry lets another process in.
    """
    return max(settings.renew_every, 0.05)


def expires_within(lease: Lease | None, seconds: float) -> bool:
    """Whether this host's clock says ``lease`` expires within ``seconds``."""
    return lease is not None and lease.expires_at - time.time() <= seconds


def _renewed(turn: Turn, lease: Lease) -> None:
    """``turn``'s lease was renewed as ``lease``, unless it was released meanwhile."""
    tokens = turn.session_state.turn.lease_tokens
    if turn.generation in tokens:
        tokens[turn.generation] = lease
        turn.renewed(lease)


def _leases_of(turns: Iterable[Turn]) -> list[Lease]:
    return [turn.lease for turn in turns if turn.lease is not None]


def _raise_unless_store_error(error: BaseException) -> None:
    if not isinstance(error, ChatlaneError):
        raise error
