"""The turn engine: one running turn per session, and what happens to everything else.

What stays true:

* An accepted message is written to the store's durable queue before anything
  else happens to it; it leaves the queue only when its turn committed a reply
  or a notice answered it. A process that stops leaves its messages for the
  next one to adopt.
* A message whose id another session's queued message holds is refused when it
  is queued (the store says so on the call that queues it): its sender gets
  :data:`~chatlane.runtime.outcomes.ID_IN_USE`, it ends refused, and it never
  runs.
* A message for an idle session claims the local slot synchronously — no
  ``await`` between seeing the slot idle and claiming it — so two messages
  arriving together never both start a turn here; the store's lease makes
  that true across processes.
* Each turn runs under a lease whose generation is the turn's generation.
  Stop, interrupt, eviction and a lost lease make the turn stale; the store
  refuses a stale turn's commit and the engine delivers nothing for it.
* A message to a session idle here is queued and given the session's lease
  (with its stored choices) in one store call, and a turn that answers
  commits and releases its lease in one more: two store calls per turn
  (:mod:`chatlane.runtime.leases`). Such a turn takes the lease, and the
  choices read with it, in one step with no store call of its own, unless
  one may be needed (the generation moved on elsewhere, stale choices and
  none read); then, as a turn whose lease was refused, it takes the general
  path and waits for the lease as any other.
* A reply is recorded against the messages it answers before it is
  delivered, and a message is answered at most once — a turn re-run after a
  crash cannot deliver a second answer.
* A message for a busy session is queued, merged, steered, used to interrupt,
  or refused with a notice (:mod:`chatlane.runtime.arrivals`, by the rules of
  :mod:`chatlane.runtime.busy`); none is dropped. A session busy in another
  process gets the same, where it can cross processes
  (:mod:`chatlane.runtime.elsewhere`).
* A turn task runs in a fresh :class:`contextvars.Context` with its session
  bound, from its first step to its last.
* Leases are renewed, fences checked, stuck turns evicted and dead processes'
  messages adopted in the background (:mod:`chatlane.runtime.upkeep`); a
  turn whose lease is about to expire unrenewed is stopped there, and one
  whose lease arrives that close to expiry never runs its agent.
* The engine only orchestrates: which turns are live, promotion, timers and
  superseding belong to :class:`~chatlane.runtime.slots.Slots`, outbound
  messages to :class:`~chatlane.runtime.outlet.Outlet`; its helpers get those
  two, never callables into the engine (the slots' ``start`` and the
  upkeep's ``adopt`` aside: starting a turn is the engine's own work).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from collections.abc import Set as AbstractSet
from functools import partial
from typing import Any

import msgspec

from chatlane.approvals import ApprovalBroker, asks_of, prompt_text
from chatlane.context import bound_context
from chatlane.errors import (
    ActiveSessionLimit,
    ChatlaneError,
    MessageIdInUse,
    SessionBusy,
    StoreError,
    shown_to_users,
)
from chatlane.logs import turn_fields
from chatlane.metrics import Metrics
from chatlane.runtime import pending
from chatlane.runtime.aftermath import TurnAftermath
from chatlane.runtime.arrivals import BusyDesk
from chatlane.runtime.aside import SideAnswers
from chatlane.runtime.busy import BusyOutcome, BusyPolicy
from chatlane.runtime.capacity import Capacity
from chatlane.runtime.elsewhere import drop_still_ours, waited_in_vain
from chatlane.runtime.ending import TurnEnd
from chatlane.runtime.kept import KeptMessages
from chatlane.runtime.leases import AcquireWait, LeaseKeeper, new_holder_id
from chatlane.runtime.outcomes import (
    ID_IN_USE,
    ID_IN_USE_REASON,
    OnOutcome,
    Outcome,
    OutcomeLedger,
)
from chatlane.runtime.outlet import Outlet
from chatlane.runtime.output import TurnOutput
from chatlane.runtime.persisted import (
    at_rest,
    load_persistent,
    nothing_to_save,
    refresh_persistent,
    stored_fields,
    without_once,
)
from chatlane.runtime.recovery import OnAdopted, adopt_all
from chatlane.runtime.settings import Boundary, RuntimeSettings, StopIncomplete, StopResult
from chatlane.runtime.slots import Slots
from chatlane.runtime.turn import (
    Turn,
    TurnOverrides,
    running_turn_of,
    steered_here,
    waiting_here,
)
from chatlane.runtime.upkeep import Upkeep, expiry_margin
from chatlane.state import SessionRegistry, SessionState
from chatlane.stores.base import Admission, Lease, Store, WriteBatch
from chatlane.stores.codec import decode_message, encode_message
from chatlane.stores.ids import new_token
from chatlane.stores.memory import MemoryStore
from chatlane.types import (
    Agent,
    Deliver,
    InboundMessage,
    Outbound,
    OutboundKind,
    SessionKey,
    Target,
)

log = logging.getLogger("chatlane.runtime")


CANCELLED = "Cancelled by its sender, will not run"
"""The notice (and the dropped outcome's text) of a waiting message its sender cancelled."""


class TurnEngine:
    """Runs an agent for many sessions at once, one turn per session."""

    def __init__(
        self,
        agent: Agent,
        deliver: Deliver,
        *,
        settings: RuntimeSettings | None = None,
        registry: SessionRegistry | None = None,
        store: Store | None = None,
        holder: str | None = None,
        on_outcome: OnOutcome | None = None,
        on_adopted: OnAdopted | None = None,
    ) -> None:
        self.agent = agent
        self._on_adopted = on_adopted
        self.settings = settings or RuntimeSettings()
        self.registry = (
            registry if registry is not None else SessionRegistry(on_evict=nothing_to_save)
        )
        self.store = store if store is not None else MemoryStore()
        self.leases = LeaseKeeper(self.store, holder or new_holder_id(), self.settings.leases)
        self.metrics = Metrics()
        self.outcomes = OutcomeLedger(on_outcome)
        """Every accepted message's one outcome (:mod:`chatlane.runtime.outcomes`)."""
        self.slots = Slots(self.registry, self.store, self.settings, self.metrics, self._start)
        """Live turns, timers and promotion (:mod:`chatlane.runtime.slots`)."""
        self.outlet = Outlet(deliver, self.outcomes, self.slots)
        self.send = self.outlet.send
        """Deliver one outbound message (:meth:`Outlet.send`); never raises for the adapter."""
        self.output = TurnOutput(self.leases, self.outlet, self.outcomes)
        self.asides = SideAnswers(agent, self.outlet, self.settings)
        """``/btw`` answers beside a session's turn (:mod:`chatlane.runtime.aside`)."""
        self.output.on_fenced = self.metrics.stale
        self.approvals = ApprovalBroker(
            self.store, self.slots, self.outlet, self.settings.approval_timeout, self.holder
        )
        self.aftermath = TurnAftermath(
            self.store, self.leases, self.outlet, self.metrics, self.outcomes, self.slots
        )
        self.kept = KeptMessages(self.store, self.holder)
        """Puts back what a failed drop may have taken from the store (:mod:`~.kept`)."""
        self.busy = BusyDesk(
            self.settings,
            agent,
            self.store,
            self.holder,
            self.metrics,
            self.outlet,
            self.outcomes,
            self.slots,
            self.kept,
        )
        self.upkeep = Upkeep(
            self.leases,
            self.slots,
            self.outlet,
            self.outcomes,
            self.metrics,
            self.adopt,
            turn_timeout=self.settings.turn_timeout,
            redirectable=self.busy.redirectable,
            drawing=self.busy,
            answers=self.approvals.take_answers,
        )
        self.output.on_lost = partial(self.upkeep.lease_lost, fenced=True)
        self.capacity = Capacity(self.settings.capacity, self.slots)
        self.withdrawals = self.leases.withdrawals
        """What failed admissions may have stored, taken back (:mod:`~.withdrawals`)."""
        self.withdrawals.on_taken_back = self.metrics.took_back
        self._expiry_margin = expiry_margin(self.settings.leases)

    @property
    def closed(self) -> bool:
        """Whether :meth:`aclose` began: from then on no turn answers, messages stay queued."""
        return self.slots.closed

    @property
    def holder(self) -> str:
        """This engine's identity in the store."""
        return self.leases.holder

    # -- inbound ---------------------------------------------------------------

    async def submit(self, key: SessionKey, message: InboundMessage) -> BusyOutcome | None:
        """Persist ``message``, then run it now if its session is idle, else apply the busy policy.

        :returns: ``None`` when a turn started for the message, else the busy outcome
            (:attr:`BusyOutcome.REJECTED` for a message whose id another session's queued
            message holds: its sender is told, and it ends refused, :meth:`_id_in_use`).
        :raises GatewayFull: a process-wide limit (:mod:`chatlane.runtime.capacity`) is
            reached; nothing was stored.
        :raises StoreError: the store could not take the message: it is not taken (what a
            call that failed may have stored is taken back, :mod:`~.withdrawals`).
        """
        if message.id in self.withdrawals:  # an earlier try of it failed: this one decides
            await self.withdrawals.take_over(message.id)
        known = self.registry.peek(key)  # a message the limits refuse makes no session
        new_session = known is None or not known.is_busy  # a running turn keeps it busy
        arriving = key if new_session else None
        self.capacity.reserve(message, arriving=arriving)
        state = self.registry.get(key)
        try:
            payload = encode_message(message)
            running = not new_session and state.turn.is_running
            if running or self.slots.closed or self.busy.coalesces(message):
                state = state if state.loaded else await self._load(key)
                seq = await self._enqueue(key, message, payload)
                return await self.accept(key, message, seq)
            stale = not state.loaded or self._choices_stale(state)
            token, admission = new_token(), None
            try:
                admission = await self.leases.admit(
                    state, message.id, payload, choices=stale, token=token
                )
                if not state.loaded:
                    state = await self._load_admitted(key, admission)
            except StoreError as error:  # not taken: what the store has of it goes
                taken = admission is not None  # and then a later step failed
                self.withdrawals.failed(key, message.id, token, error=None if taken else error)
                raise
            state, seq = self._accepted(key, message, state), admission.seq
            if _holds(state, seq):
                return self._repeated(state, admission)
            if not state.turn.is_running:  # it does not coalesce: asked above
                self._start(state, (message,), (seq,), refusable=True, admission=admission)
                return None
            return await self._arrive_busy(state, message, seq, admission)
        except MessageIdInUse as error:
            return await self._id_in_use(key, message, error)
        finally:
            self.capacity.settled(message, arriving=arriving)

    async def _id_in_use(
        self, key: SessionKey, message: InboundMessage, error: MessageIdInUse
    ) -> BusyOutcome:
        """Refuse ``message``, whose id another session's queued message holds: it ends
        refused, and its sender is told; nothing of it was stored."""
        log.warning("refused: %s", error, extra=turn_fields(key))
        self.outcomes.refuse(key, message, ID_IN_USE, ID_IN_USE_REASON)
        target = Target.of(message.source)
        notice = Outbound(OutboundKind.NOTICE, key, target, ID_IN_USE, 0, (message.id,))
        await self.outlet.deliver(notice)
        return BusyOutcome.REJECTED

    async def _enqueue(self, key: SessionKey, message: InboundMessage, payload: bytes) -> int:
        """Queue ``message`` in the store (no lease); on failure, take back what it may hold."""
        try:
            return await self.store.enqueue(key, message.id, self.holder, payload)
        except StoreError as error:
            self.withdrawals.failed(key, message.id, error=error)
            raise

    async def session(self, key: SessionKey) -> SessionState:
        """``key``'s state, its persistent scope loaded from the store on first use."""
        state = self.registry.get(key)
        return state if state.loaded else await self._load(key)

    async def fresh_session(self, key: SessionKey) -> SessionState:
        """``key``'s state, its stored choices taken up as a turn would take them: read
        again once older than ``reread_stored``, so what another process changed
        (``/model``, ``/busy``, a new conversation) shows here too. While a turn runs
        here, it keeps the choices it started with, and so does a store that cannot be
        read: the choices read before are shown.
        """
        state = await self.session(key)
        moment = time.monotonic()
        if moment - state.read_at < self.settings.reread_stored or self.running_turn(key):
            return state
        try:
            fields = await self.store.load_persistent(key)
        except ChatlaneError as error:
            log.warning("kept the choices read before: %s", error, extra=turn_fields(key))
            return state
        if not at_rest(state, fields) and refresh_persistent(state, fields):
            self.approvals.end_conversation(state)
        state.read_at = moment
        return state

    async def _load(self, key: SessionKey) -> SessionState:
        fields = await self.store.load_persistent(key)
        generation = await self.store.generation(key)
        state = self.registry.get(key)
        load_persistent(state, fields, generation)
        return state

    async def _load_admitted(self, key: SessionKey, admission: Admission) -> SessionState:
        """Load a session this process had not read from what the store said with its lease.

        The lease was the generation's next one (taking a lease bumps it by
        one) and came with the stored fields: no read of its own is needed.
        Without a lease, the session is read as on any first use.
        """
        lease, fields = admission.lease, admission.persistent
        if lease is None or fields is None:
            return await self._load(key)
        state = self.registry.get(key)
        load_persistent(state, fields, lease.generation - 1)
        return state

    async def persist_conversation(self, key: SessionKey, **fields: object) -> None:
        """Set conversation overrides of ``key``, in the store, then here (a boundary clears both).

        :raises ChatlaneError: the store could not take them; nothing changed here.
        """
        state = await self.session(key)
        await self.store.set_persistent(key, None, **stored_fields(fields))
        for name, value in fields.items():
            setattr(state.conversation, name, value)

    async def persist(self, key: SessionKey, **fields: object) -> None:
        """Set persistent fields of ``key``, in the store (enums by value), then here.

        :raises ChatlaneError: the store could not take them; nothing changed here.
        """
        state = await self.session(key)
        await self.store.set_persistent(key, None, **stored_fields(fields))
        for name, value in fields.items():
            setattr(state.persistent, name, value)

    async def accept(
        self,
        key: SessionKey,
        message: InboundMessage,
        seq: int,
        admission: Admission | None = None,
        held: SessionState | None = None,
    ) -> BusyOutcome | None:
        """Run or queue a message already in the durable queue under ``seq``.

        :param admission: what the store said when it queued the message for an
            idle session: the lease it gave (or why not) and the stored choices.
        :param held: ``key``'s state as the caller read it before the store
            call; used if the registry still holds it, else read again.
        """
        state = self._accepted(key, message, held)
        if _holds(state, seq):
            return self._repeated(state, admission)
        if not state.turn.is_running:
            if self.busy.coalesces(message):
                return self.busy.coalesce(state, message, seq)
            self._start(state, (message,), (seq,), refusable=True, admission=admission)
            return None
        return await self._arrive_busy(state, message, seq, admission)

    def _accepted(
        self, key: SessionKey, message: InboundMessage, held: SessionState | None
    ) -> SessionState:
        """``message`` is in the durable queue: open its outcome; ``key``'s state as held now.

        ``held`` is the state the caller read before the store call; it is
        used if the registry still holds it, else the state is read again.
        """
        self._ensure_background()
        self.outcomes.open(key, message)
        if held is not None and self.registry.peek(key) is held:
            return held
        return self.registry.get(key)

    def _repeated(self, state: SessionState, admission: Admission | None) -> BusyOutcome:
        """A message that already waits or runs here came again (a retry under its id, which
        the store queued once): it keeps its place and its one outcome, and no busy policy
        sees it twice (a retry never interrupts its own turn, nor fills the queue)."""
        if admission is not None and admission.lease is not None:
            self.slots.spawn(self.leases.let_go(state, admission.lease))
        return BusyOutcome.QUEUED

    async def _arrive_busy(
        self, state: SessionState, message: InboundMessage, seq: int, admission: Admission | None
    ) -> BusyOutcome:
        """``message`` found its session running here: the busy policy decides."""
        if admission is not None and admission.lease is not None:
            self.slots.spawn(self.leases.let_go(state, admission.lease))  # a turn started meanwhile
        outcome = await self.busy.arrive(state, message, seq)
        self._nudge_if_behind(state, seq)
        return outcome

    def _nudge_if_behind(self, state: SessionState, seq: int) -> None:
        """A message accepted before the one whose turn waits here for the lease is queued
        behind it (two submits whose store calls came back out of order): the wait looks
        at once, and the turn gives way (:meth:`_still_wanted`)."""
        turn = running_turn_of(state)
        if turn is not None and turn.lease is None and seq < min(turn.seqs):
            self.leases.nudge(state.key)

    async def enqueue(self, key: SessionKey, message: InboundMessage) -> BusyOutcome | None:
        """Queue ``message`` as its own turn, whatever the busy policy (``/queue``).

        It is stored as asking for ``queue``, so a process running the session
        under ``steer`` or ``collect`` never draws it into a turn of its own.

        :returns: ``None`` when it started at once, :attr:`BusyOutcome.QUEUED`, or
            :attr:`BusyOutcome.QUEUE_FULL` (refused: ``queue_cap`` messages wait, queued or
            steered and not yet taken; the caller tells the sender).
        :raises MessageIdInUse: another session's queued message has its id: it ended
            refused.
        :raises ChatlaneError: the store could not read the session or queue the message;
            its outcome ended ``failed``.
            (Its outcome opens before the store call, so that a refusal for a full
            queue is one too; :meth:`submit` opens one once the store took the message.)
        """
        self._ensure_background()
        if not message.busy_policy:
            message = msgspec.structs.replace(message, busy_policy=BusyPolicy.QUEUE.value)
        self.outcomes.open(key, message)  # a refusal below is its outcome
        try:
            if message.id in self.withdrawals:
                await self.withdrawals.take_over(message.id)
            state = await self.session(key)
            if state.turn.is_running and waiting_here(state) >= self.settings.queue_cap:
                return BusyOutcome.QUEUE_FULL
            seq = await self._enqueue(key, message, encode_message(message))
        except MessageIdInUse:
            self.outcomes.refuse(key, message, ID_IN_USE, ID_IN_USE_REASON)
            raise
        except ChatlaneError as error:
            self.outcomes.end([message.id], Outcome.FAILED, reason=shown_to_users(error))
            raise
        state = self.registry.get(key)
        if not state.turn.is_running:
            self._start(state, (message,), (seq,))
            return None
        if waiting_here(state) >= self.settings.queue_cap:
            await self.store.drop_pending(key, [seq])
            return BusyOutcome.QUEUE_FULL
        pending.enqueue(state, message, seq)
        return BusyOutcome.QUEUED

    async def adopt(self, key: SessionKey, message: InboundMessage, seq: int) -> None:
        """Run a message adopted from a dead process: now if idle, else in store order;
        then tell ``on_adopted``.

        One that waits or runs here already (drawn into a turn here, then read back
        from an adoption whose answer was lost) is left where it is.
        """
        state = await self.session(key)
        if _holds(state, seq):
            return
        self.outcomes.open(key, message)
        if not state.turn.is_running:
            self._start(state, (message,), (seq,))
        else:
            pending.insert_in_order(state, [message], [seq])
            self._nudge_if_behind(state, seq)
        if self._on_adopted is not None:
            self._on_adopted(key, message)

    async def start(self) -> int:
        """Announce this process and adopt what dead ones left; return how many were adopted.

        Called by the gateway at start; the adoption loop keeps doing it in batches.
        """
        self._ensure_background()
        await self.leases.heartbeat()
        batch = self.settings.leases.adopt_batch
        return await adopt_all(self.store, self.holder, self.adopt, batch)

    async def retry_failed(self, message_id: str) -> bool:
        """Run a failed message again, here, in its place in its session's queue.

        :returns: whether a failed message with that id was found.
        :raises ChatlaneError: the store could not be reached.
        """
        record = await self.store.retry_failed(message_id, self.holder)
        if record is None:
            return False
        self._ensure_background()
        await self.adopt(record.key, decode_message(record.payload), record.seq)
        return True

    def policy_for(self, state: SessionState, message: InboundMessage) -> BusyPolicy:
        """The busy policy in force for ``message`` in ``state``'s session (``busy`` decides)."""
        return self.busy.policy_for(state, message)

    # -- running a turn --------------------------------------------------------

    def _start(
        self,
        state: SessionState,
        messages: tuple[InboundMessage, ...],
        seqs: tuple[int, ...],
        reruns: int = 0,
        *,
        refusable: bool = False,
        admission: Admission | None = None,
    ) -> Turn:
        """Claim ``state``'s slot for a turn of ``messages`` and drive it in a task of its own.

        A ``/model --once`` is for the next turn of a person: a turn of internal messages
        only (a cron job's prompt, a background completion) runs with the conversation's
        own model and leaves the one-turn choice to the turn after it.
        """
        once = state.conversation.one_turn_restore is not None
        internal = once and all(message.internal for message in messages)
        overrides = without_once(state) if internal else TurnOverrides.of(state)
        turn = Turn.of(
            state,
            messages,
            seqs,
            overrides,
            reruns=reruns,
            refusable=refusable,
            approvals=self.approvals,
            claims_once=not internal,
        )
        self.slots.claim(turn)
        context = bound_context(turn.source, state.key)
        loop = asyncio.get_running_loop()
        turn.attach(loop.create_task(self._drive(turn, admission), context=context))
        return turn

    async def _drive(self, turn: Turn, admission: Admission | None) -> None:
        state = turn.session_state
        try:
            taken = None if admission is None else self._take_given_lease(turn, admission)
            if taken is None:
                taken = await self._take_lease(turn, admission)
            if taken and not (turn.messages[0].idempotent and await self.output.replayed(turn)):
                state.turn.run(turn)
                await self.output.answer(self.agent, turn)
        except BaseException as error:
            if _must_propagate(error):
                log.info("turn cancelled", extra=turn_fields(turn.session_key, turn.generation))
                raise
            await self.output.failure(turn, error)  # the agent's own error, even a CancelledError
            turn.end(TurnEnd.FAILED)
        finally:
            turn.mark_settling()  # no cancellation from here: the messages must be settled
            try:
                if self.aftermath.has_work(turn):
                    await self.aftermath.settle(turn)
            finally:
                self.slots.finish(turn)

    def _take_given_lease(self, turn: Turn, admission: Admission) -> bool | None:
        """:meth:`_take_lease` in one step, for a lease that came with the message.

        :returns: whether the turn runs; ``None``, with nothing done, where
            it takes :meth:`_take_lease` instead: no lease came, the
            generation moved on elsewhere since this process last saw the
            session (the store's queue is read first), or the stored choices
            are stale and none came with the lease.
        """
        lease, choices = admission.lease, admission.persistent
        if lease is None:
            return None
        state = turn.session_state
        moment = time.monotonic()  # one reading: the staleness, and when the choices were read
        stale = moment - state.read_at >= self.settings.reread_stored
        if lease.generation > state.persistent.run_generation + 1 or (stale and choices is None):
            return None
        self.leases.hold(state, lease)  # released however the turn ends
        if not self._bind(turn, lease):
            return False
        if stale and choices is not None:
            self._apply_choices(turn, choices, moment)
        self._started(turn)
        return True

    async def _take_lease(self, turn: Turn, admission: Admission | None) -> bool:
        """Take the session's lease for ``turn``; False if the turn was dropped.

        The lease the store gave with the message (``admission``) is the
        turn's at once; otherwise the turn waits for it. A turn gives way
        while it waits if a message accepted before its own is queued behind
        it here: it goes back into the queue in store order, so two processes
        can never wait on each other's earlier messages. Stored choices older
        than ``reread_stored`` are taken up before the wait (a busy policy may
        decide what becomes of the message while another process runs the
        session) and again once the lease is taken — from what the store
        read with the message and with the lease, or with a read of their own
        where it could not.

        A turn of messages drawn in from another process reads the store's queue
        once it holds the lease, as one that waited for it elsewhere does: the
        process that accepted them may have dropped them since (``/unqueue``,
        which fences nothing; ``/stop`` or ``/new``, whose generation bump may
        come after this lease), and told their senders they will not run.
        """
        state = turn.session_state
        waited: _WaitedElsewhere | None = None
        if admission is not None and admission.lease is not None:
            self.leases.hold(state, admission.lease)  # released however the turn ends
            lease, choices = admission.lease, admission.persistent  # taken up once, below
        else:
            await self._take_choices(turn, None if admission is None else admission.persistent)
            waited = _WaitedElsewhere(partial(self.busy.on_wait, turn))
            taken = await self._wait_for_lease(turn, admission, waited)
            if taken is None:
                return False
            lease, choices = taken
        known = state.persistent.run_generation
        if not self._bind(turn, lease):
            return False
        elsewhere = lease.generation > known + 1 or (waited is not None and waited.seen)
        looked = elsewhere or self.busy.drew_in_any(turn)  # dropped where they were sent?
        if looked and await waited_in_vain(turn, self.store, self.holder, self.outcomes):
            return False  # another process ran, stopped, drew in or dropped the messages
        await self._take_choices(turn, choices, moved_on=elsewhere)
        self._started(turn)
        return True

    def _bind(self, turn: Turn, lease: Lease) -> bool:
        """Make ``lease`` the turn's and its generation the session's; False if it came too late.

        Too late: the turn is no longer wanted, the session's generation moved
        past the lease's, or the lease expires within the margin.
        """
        state = turn.session_state
        turn.bind_lease(lease)  # from here the lease is released however the turn ends
        known = state.persistent.run_generation
        if not self._still_wanted(turn) or lease.generation < known or self._expiring(lease):
            turn.end(TurnEnd.LEASE_LOST)
            return False
        state.persistent.advance_generation(lease.generation)
        return True

    def _started(self, turn: Turn) -> None:
        turn.touch()
        self.metrics.turn_started()

    def _expiring(self, lease: Lease) -> bool:
        """Whether ``lease`` came too late to run under: it expires here within the margin.

        Its grant may have been answered long after the store made it (a
        network cut mid-reply); the store may already have let another process in.
        """
        return lease.expires_at - time.time() <= self._expiry_margin  # as expires_within()

    async def _wait_for_lease(
        self, turn: Turn, admission: Admission | None, on_wait: _WaitedElsewhere
    ) -> tuple[Lease, dict[str, Any] | None] | None:
        """The lease waited for, and the choices read with it; ``None`` if the turn was dropped."""
        state = turn.session_state
        taken = await self.leases.acquire(
            state,
            min(turn.seqs),
            partial(self._still_wanted, turn),
            on_wait,
            refused=None if admission is None else admission.refusal,
        )
        return None if taken is None else (taken.lease, taken.persistent)

    def _choices_stale(self, state: SessionState) -> bool:
        return time.monotonic() - state.read_at >= self.settings.reread_stored

    async def _take_choices(
        self, turn: Turn, fields: Mapping[str, object] | None, *, moved_on: bool = False
    ) -> None:
        """Take up stored choices another process may have changed, if older than
        ``reread_stored``: ``fields`` if the store read them with the message or the
        lease, else a read of their own (:meth:`_apply_choices`). ``fields`` read
        with the lease are taken up whatever their age if the session's generation
        ``moved_on`` since this process last saw it (another process ran it,
        stopped it or ended its conversation meanwhile): they cost no read.
        """
        state = turn.session_state
        moment = time.monotonic()
        fresh = moved_on and fields is not None
        if not fresh and moment - state.read_at < self.settings.reread_stored:
            return
        if fields is None:
            try:
                fields = await self.store.load_persistent(state.key)
            except ChatlaneError as error:
                log.warning("kept the choices read before: %s", error, extra=turn_fields(state.key))
                return
        self._apply_choices(turn, fields, moment)

    def _apply_choices(self, turn: Turn, fields: Mapping[str, object], read_at: float) -> None:
        """Apply the stored choices ``fields`` to ``turn``'s session.

        Only what the store changed reaches the turn: its overrides were
        resolved when it started, and a ``/model --once`` sent since is for
        the next turn. ``read_at`` (``time.monotonic()``) is no later than
        the read of ``fields``: taken as their time, they are re-read no later
        than they would be.
        """
        state = turn.session_state
        if at_rest(state, fields):  # most sessions: no choice here nor in the store
            state.read_at = read_at
            return
        before = TurnOverrides.of(state)
        if refresh_persistent(state, fields):
            self.approvals.end_conversation(state)
        after = TurnOverrides.of(state)
        if after != before:
            turn.rebase_overrides(before, after)

    def _still_wanted(self, turn: Turn) -> bool:
        state = turn.session_state
        if self.slots.closed or (turn.interrupted.is_set() and not turn.redirected):
            return False  # a redirected turn runs: it stops at its first safe point
        earlier = pending.smallest_seq(state)
        if earlier is not None and earlier < min(turn.seqs):
            turn.end(TurnEnd.REORDERED)
            return False
        return True

    # -- control ---------------------------------------------------------------

    def running_turn(self, key: SessionKey) -> Turn | None:
        """The turn that holds ``key``'s slot, if any (``None`` while idle)."""
        return self.slots.running_turn(key)

    def interrupt(self, key: SessionKey, reason: str = "") -> bool:
        """Stop ``key``'s running turn (fenced from now on); its queue is kept.

        :param reason: why, for the log.
        :returns: whether a turn was running.
        """
        turn = self.slots.running_turn(key)
        if turn is None:
            return False
        self.slots.supersede(turn, TurnEnd.INTERRUPTED, reason)
        return True

    async def stop(
        self,
        key: SessionKey,
        *,
        only: AbstractSet[int] | None = None,
        foreign: AbstractSet[int] | None = None,
    ) -> StopResult:
        """``/stop``: interrupt the running turn, bump the generation, drop the queue.

        With ``only`` (a boundary's, :meth:`begin_boundary`), just the waiting
        messages stored under those seqs are dropped: what arrived since stays.
        With ``foreign`` (a boundary's that holds its session in the store,
        :meth:`hold_boundary`), of other processes' messages just those are dropped.

        The session's messages are dropped from the store's queue too, so a
        turn another process runs for it — fenced by the generation bump —
        is not run again there. For such a turn they are dropped *before* the
        bump: the process running it sees the bump within its fence check and
        re-runs what is still queued as its own, which must be nothing.
        While no turn here holds the lease, what another process drew in meanwhile
        (:meth:`_drop`) is watched, not dropped: it ends as the store says.
        """
        state = self.registry.get(key)
        entries = [e for e in pending.pending_entries(state) if only is None or _any_of(e, only)]
        queued, queued_seqs = pending.drain(state, only)
        turn = running_turn_of(state)
        if turn is not None and turn.ended_by:
            turn = None  # an earlier /stop (or interrupt) already ended it: nothing to count
        held, held_seqs = _held_by(turn)
        fenced_here = turn is not None and turn.is_current()  # its supersede bumps
        if turn is not None:
            self.slots.supersede(turn, TurnEnd.STOPPED)
        stopped = turn is not None and turn.lease is not None
        try:  # dropped before anyone elsewhere counts them
            dropped = await self._drop(state, [*held, *queued], [*held_seqs, *queued_seqs], stopped)
        except ChatlaneError as error:
            await self._queue_again(state, entries, error)
            self.outcomes.end((message.id for message in held), Outcome.DROPPED)
            raise StopIncomplete(stopped, len(queued), error) from error
        self.outcomes.end((message.id for message in dropped), Outcome.DROPPED)
        elsewhere = await self._drop_elsewhere(key, foreign)
        if not fenced_here:
            await self._bump_generation(state)
            self.slots.stop_collecting(state)
        return StopResult(stopped, tuple(dropped), elsewhere)

    async def _drop(
        self, state: SessionState, messages: list[InboundMessage], seqs: list[int], held: bool
    ) -> list[InboundMessage]:
        """Drop ``messages`` (stored under ``seqs``) from the store; those dropped.

        All of them while a turn here holds the session's lease (``held``): no other
        process can draw them in. Otherwise only those the store still holds as this
        process's (:meth:`~chatlane.stores.protocols.PendingQueue.drop_own`): another
        process's running turn may have drawn the others in, even answered them; they
        are watched until the store says what became of them, never counted as dropped.

        :raises ChatlaneError: the store could not drop them.
        """
        if not seqs:
            return messages
        if held:
            await self.store.drop_pending(state.key, seqs)
            return messages
        pairs = list(zip(messages, seqs, strict=True))
        waited = [(message.id, seq) for message, seq in pairs]
        own = await drop_still_ours(self.store, self.outcomes, self.holder, state.key, waited)
        return [message for message, seq in pairs if seq in own]

    async def _bump_generation(self, state: SessionState) -> None:
        """Fence whatever runs ``state``'s session elsewhere: the store's generation moves
        on, then this process's by one with it (unless a turn here took a later one meanwhile).

        This process's generation follows only a bump the store took: one the store
        refused, or whose answer was lost, leaves it where it was. Ahead of the store's,
        it would refuse the store's next leases as having come too late (:meth:`_bind`):
        the message each was taken for would run again, and after
        :data:`~chatlane.runtime.aftermath.MAX_RERUNS` be set aside as failed, with
        nothing wrong. Behind it, it is as after another process's bump: the next lease
        is taken as one whose generation moved on elsewhere.

        :raises ChatlaneError: the store could not bump it.
        """
        persistent = state.persistent
        bumped = persistent.run_generation + 1
        await self.store.bump_generation(state.key)
        if persistent.run_generation < bumped:
            persistent.advance_generation(bumped)

    def begin_boundary(self, key: SessionKey) -> Boundary:
        """A conversation boundary begins for ``key``: no turn starts for it here until
        :meth:`end_boundary`, and what arrives meanwhile waits, whatever its busy policy.

        :returns: the boundary, holding the seqs of the messages waiting now: the ones
            its :meth:`stop` drops (``only``).
        """
        state = self.registry.get(key)
        self.slots.begin_boundary(state)
        return Boundary(key, frozenset(pending.known(state)))

    async def hold_boundary(self, boundary: Boundary) -> None:
        """Hold ``boundary``'s session in the store too, if no process runs it: no turn
        starts for it anywhere until :meth:`end_boundary` (what other processes accept
        meanwhile waits for the lease), and the messages they had queued before are
        the ones its :meth:`stop` drops (:meth:`dropped_elsewhere`). Otherwise
        nothing changes."""
        state = self.registry.get(boundary.key)
        hold = await self.leases.hold_for_boundary(state)
        if hold is None:
            return
        boundary.hold = hold
        if hold.boundaries > 1:
            return  # joined: the first read what waited elsewhere
        self._ensure_background()  # it is renewed with the turns' leases
        try:
            queued = await self.store.pending(boundary.key)
        except ChatlaneError as error:  # the boundary's stop reads the queue again
            log.info("could not read the queue: %s", error, extra=turn_fields(boundary.key))
            return
        hold.foreign = frozenset(r.seq for r in queued if r.owner != self.holder)

    def dropped_elsewhere(self, boundary: Boundary) -> frozenset[int] | None:
        """Which of other processes' messages ``boundary``'s :meth:`stop` drops: those
        queued before its hold, while the hold still keeps the session from every other
        process; ``None`` (every one it finds) without a hold, or once another process
        fenced it (its messages may have run meanwhile, in the ending conversation)."""
        hold = boundary.hold
        return hold.foreign if hold is not None and self.leases.holding(hold) else None

    async def end_boundary(self, boundary: Boundary) -> None:
        """``boundary`` is done, or failed: its lease is given back (once the last boundary
        holding it is done), then what waits starts."""
        state = self.registry.get(boundary.key)
        try:
            if boundary.hold is not None:
                await self.leases.let_go_of_boundary(boundary.hold, self._open)
        finally:
            self.slots.end_boundary(state)

    def _open(self) -> bool:
        return not self.slots.closed

    def holds_boundary(self, key: SessionKey) -> bool:
        """Whether a boundary under way here holds ``key``'s lease (:meth:`hold_boundary`)."""
        return self.leases.holds_boundary(key)

    async def _queue_again(
        self, state: SessionState, entries: list[pending.PendingEntry], error: ChatlaneError
    ) -> None:
        """``/stop`` could not drop ``entries`` from the store (``error``): they wait here
        again, in their places before what came since, and run when the session is free
        (:mod:`~chatlane.runtime.kept`)."""
        kept = [pair for entry in entries for pair in zip(entry.messages, entry.seqs, strict=True)]
        await self.kept.keep(state, kept, error)
        pending.restore(state, entries)
        self.slots.promote(state)  # if the stopped turn ended meanwhile

    async def unqueue(self, key: SessionKey, seq: int) -> InboundMessage | None:
        """``/unqueue``: take one waiting message out of this process's queue and the store's,
        or back from the running turn's steers its agent has not taken yet.

        It ends as dropped and its sender is told. The message leaves the
        queue (or the steers) here before the store is asked, so it can never
        start, nor reach the agent, meanwhile.

        :returns: the message, or ``None`` if none waits here under ``seq``.
        :raises TakenElsewhere: another process's running turn drew it in first: it runs
            there, and no longer waits here.
        :raises ChatlaneError: the store could not drop it: it waits again, in its place.
        """
        state = self.registry.peek(key)
        if state is None:
            return None
        return await self.busy.take_out(state, seq, "Taken out of the queue, will not run")

    async def cancel_waiting(self, key: SessionKey, message_id: str) -> InboundMessage | None:
        """Take the message ``message_id`` out of this process's queue, as :meth:`unqueue` does.

        It ends as dropped and its sender is told that it was cancelled.

        :returns: the message, or ``None`` if it does not wait in the queue here
            (it runs, was steered into the running turn, or ended).
        :raises TakenElsewhere: another process's running turn drew it in first: it runs
            there, and no longer waits here.
        :raises ChatlaneError: the store could not drop it: it waits again, in its place.
        """
        state = self.registry.peek(key)
        seqs = [] if state is None else [s for s, m in pending.queued(state) if m.id == message_id]
        if state is None or not seqs:
            return None
        taken = await self.busy.take_out(state, seqs[0], CANCELLED)
        if taken is not None and taken.idempotent:  # a retry is cancelled too, not run
            await self.keep_answer(key, taken, CANCELLED)
        return taken

    async def keep_answer(self, key: SessionKey, message: InboundMessage, text: str) -> None:
        """Keep ``text`` as the answer to ``message``, which no turn answers (a command's
        reply; a cancelled message's notice), for its sender's retries under its id (an API
        request's ``Idempotency-Key``): a retry gets ``text`` instead of running the
        message. If the store cannot keep it, a retry runs the message, as before."""
        try:
            await self.store.commit(key, None, WriteBatch(answered=[message.id], answer=text))
        except ChatlaneError as error:
            log.warning("could not keep an answer for retries: %s", error, extra=turn_fields(key))

    async def _drop_elsewhere(self, key: SessionKey, only: AbstractSet[int] | None) -> int:
        """Drop the messages other processes accepted (their turns are fenced), or just
        those stored under ``only``'s seqs; count them."""
        foreign = [
            r.seq
            for r in await self.store.pending(key)
            if r.owner != self.holder and (only is None or r.seq in only)
        ]
        if foreign:
            await self.store.drop_pending(key, foreign)
        return len(foreign)

    # -- background: renewals, fence checks, eviction, adoption -------------------

    def _ensure_background(self) -> None:
        if not self.upkeep.started and not self.slots.closed:
            self.upkeep.start()

    async def evict_stuck(self) -> int:
        """Evict every turn that made no progress for ``turn_timeout``; return how many."""
        return await self.upkeep.evict_stuck()

    # -- delivery and shutdown -------------------------------------------------

    def unanswered(self, key: SessionKey) -> list[InboundMessage]:
        """``key``'s messages this process holds that no commit answered yet, oldest first.

        The running turn's messages (the steered ones it took too), then those
        steered into it that its agent has not taken, then the queued ones: what
        a transcript does not show yet (a turn writes its input when it commits).
        """
        return self.slots.unanswered(key)

    def queued(self, key: SessionKey) -> list[tuple[int, InboundMessage]]:
        """``key``'s messages waiting here for a turn, in the order they will run, each
        with its short id (the store's ``seq``: what ``/status`` lists and ``/unqueue`` takes).
        """
        state = self.registry.peek(key)
        return [] if state is None else pending.queued(state)

    def steered(self, key: SessionKey) -> list[tuple[int, InboundMessage]]:
        """``key``'s messages steered into its running turn here that its agent has not taken
        yet, each with its short id (what ``/unqueue`` takes back), in the order it would
        take them."""
        state = self.registry.peek(key)
        return [] if state is None else steered_here(state)

    def pending_approvals(self, key: SessionKey) -> list[Outbound]:
        """The prompts of ``key``'s approval requests still waiting, as first sent.

        For an adapter whose user may have lost them (a web page reloaded).
        """
        state = self.registry.peek(key)
        turn = self.running_turn(key)
        if state is None or turn is None:
            return []
        target = Target.of(turn.source)
        return [
            Outbound(
                OutboundKind.APPROVAL,
                key,
                target,
                prompt_text(r),
                r.generation,
                turn.message_ids,
                approval_id=r.id,
                asks=asks_of(r),
            )
            for r in self.approvals.pending(state)
        ]

    def last_progress(self, key: SessionKey) -> float:
        """When ``key``'s running turn last made progress (``time.monotonic()``; 0.0: none runs)."""
        turn = self.running_turn(key)
        return 0.0 if turn is None else turn.last_progress

    def queue_depth(self) -> int:
        """Messages waiting in this process, across every session: queued for a turn, or
        steered into a running one and not taken by its agent yet (:func:`waiting_here`).

        Messages wait only behind a running turn or a collect debounce, so only
        live sessions are counted, not every session the registry holds.
        """
        states = (self.registry.peek(key) for key in self.slots.live_keys())
        return sum(waiting_here(state) for state in states if state is not None)

    def running_count(self) -> int:
        """Turns running (or waiting for their lease) in this process."""
        return self.slots.running_count()

    def is_idle(self) -> bool:
        """No turn runs and no session waits out a collect debounce.

        Messages only wait behind a running turn or a debounce, so an idle
        engine has nothing pending (unless it was closed with work queued).
        """
        return self.slots.is_idle()

    async def wait_idle(self) -> None:
        """Return once :meth:`is_idle` holds and no withdrawal is owed (wrap in a timeout
        to bound the wait)."""
        await self.slots.wait_idle()
        while self.withdrawals.owed:  # what a failed admission may have stored is taken back
            await self.withdrawals.settled()
            await self.slots.wait_idle()

    async def aclose(self) -> None:
        """Stop every turn and release its lease; unanswered messages stay queued in the store.

        Running turns are fenced and asked to stop; they get ``interrupt_grace``
        to wind down before they are cancelled. Every lease still held is then
        released, so the next process can take the sessions over at once.
        """
        turns = self.slots.close()
        tasks = [turn.task for turn in turns if turn.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=self.settings.interrupt_grace)
        background = self.upkeep.tasks
        for task in [*tasks, *background]:
            task.cancel()
        await asyncio.gather(*tasks, *background, *self.slots.spawned(), return_exceptions=True)
        await self.withdrawals.aclose()
        await self.asides.close()
        for turn in turns:
            await self.leases.release(self.registry.get(turn.session_key), turn.generation)
        await self.leases.settled()  # given back by turns cancelled while giving them back too
        await self.leases.let_go_of_boundaries()
        await self.leases.sign_off()
        self.outcomes.end(self.outcomes.open_ids(), Outcome.SHUT_DOWN)


class _WaitedElsewhere:
    """A turn's ``on_wait`` that also notes whether another process held the lease: its
    messages may have left meanwhile (dropped there, or drawn into its turn)."""

    __slots__ = ("_on_wait", "seen")

    def __init__(self, on_wait: Callable[[ChatlaneError, AcquireWait], None]) -> None:
        self._on_wait = on_wait
        self.seen = False

    def __call__(self, error: ChatlaneError, wait: AcquireWait) -> None:
        if isinstance(error, SessionBusy) and not isinstance(error, ActiveSessionLimit):
            self.seen = True
        self._on_wait(error, wait)


def _must_propagate(error: BaseException) -> bool:
    """Whether ``error`` ends the turn task itself, rather than being the agent's failure.

    A ``CancelledError`` counts only while this task is being cancelled (an
    interrupt's grace ran out, an eviction, shutdown); one the agent let out
    of its own cancelled subtask is its failure, answered like any other. A
    ``SystemExit`` is the agent's too (a tool's ``sys.exit()``, argparse on
    bad arguments): let out of the task, asyncio would stop the whole gateway.
    """
    if isinstance(error, KeyboardInterrupt | GeneratorExit):
        return True
    if isinstance(error, asyncio.CancelledError):
        task = asyncio.current_task()
        return task is None or task.cancelling() > 0
    return False


def _holds(state: SessionState, seq: int) -> bool:
    """Whether the message stored under ``seq`` waits here, runs here, or was steered into
    the turn running here."""
    queue = pending.pending_entries(state)
    if queue and any(seq in entry.seqs for entry in queue):  # most sessions: nothing waits
        return True
    turn = running_turn_of(state)
    return turn is not None and (
        seq in turn.seqs or any(steered == seq for _, steered in turn.waiting_steers())
    )


def _any_of(entry: pending.PendingEntry, seqs: AbstractSet[int]) -> bool:
    return not seqs.isdisjoint(entry.seqs)


def _held_by(turn: Turn | None) -> tuple[list[InboundMessage], list[int]]:
    """What ``/stop`` drops with ``turn`` and its aftermath drops too: the messages of
    a turn still waiting for its lease (it never ran), and the steers it never took
    (their senders were told "steered")."""
    if turn is None:
        return [], []
    steers = turn.waiting_steers()
    messages = [message for message, _ in steers]
    seqs = [seq for _, seq in steers]
    if turn.lease is None:
        messages, seqs = [*messages, *turn.messages], [*seqs, *turn.seqs]
    return messages, seqs


__all__ = ["RuntimeSettings", "StopResult", "TurnEngine"]
