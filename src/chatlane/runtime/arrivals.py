"""What becomes of a message that finds its session busy, here or in another process.

:class:`BusyDesk` applies the session's busy policy (:mod:`chatlane.runtime.busy`)
and tells the sender. What stays true:

* Here, a message for a running session is queued, merged, steered into the
  run, used to interrupt it (rolled back, or redirected: stopped at a safe
  point with its work kept), or refused with a notice; a refused message
  leaves the store's queue at once, so it is never run later. If the store
  cannot drop it, it is not refused: it waits in the queue (past the cap if
  need be) and its sender is told so, since a message the store keeps runs
  some day, and never unannounced. A turn that let its session go
  (``/stop``, ``/new``, an interrupt, its agent's failure) and only winds
  down in its slot refuses nothing: under ``reject`` the message queues and
  runs once that turn is gone.
* A turn that waits for a lease another process holds gets the policy once,
  on its first refused acquire (:mod:`chatlane.runtime.elsewhere`): ``reject``
  refuses it, ``rollback`` interrupts the other process's turn through the
  store and ``redirect`` redirects it, anything else lets it wait for the lease.
* A message that arrives while a conversation boundary runs (``/new``,
  ``/reset``, ``/resume``, an auto-reset) is queued whatever the policy, and
  past the cap (what fills the queue is dropped with the ending
  conversation; the process-wide limits still apply): it steers, interrupts,
  merges and collapses into nothing of the ending conversation, and runs in
  the new one.
* The queue is full when ``queue_cap`` messages wait: queued, or steered into
  the running turn and not taken by its agent yet (a steer is decided only
  below the cap, so steering never takes a session past it). A message that
  finds the queue full is refused, unless the overflow is ``drop-oldest`` or
  ``summarize`` (below): under ``drop-oldest`` the oldest waiting message,
  queued or steered, leaves (here and in the store, its sender told) and the
  new one waits in its place.
* A message taken out of the queue (overflow, ``/unqueue``), or back from the
  running turn's steers (overflow, ``/unqueue``), leaves it here before the
  store is asked, so it never starts meanwhile nor reaches the agent; if the
  store cannot drop it, it waits again in its place (among the steers, while
  that turn runs). Under ``steer`` (for an agent that takes steers) it leaves
  the store only while the store holds it as this process's: one that another
  process's running turn drew in, and whose agent may have it, stays there.
* Under ``summarize`` a message that finds the queue full is not refused:
  it and every waiting message (the untaken steers too) become one turn (its
  agent reads a note that they were collapsed), and each of their senders is
  told, once per chat.
* The sender of a message that waits hears so at most once per
  ``ack_debounce`` per session; refusals ("rejected", "queue full") always
  answer, and internal events never get an ack.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from chatlane.errors import ActiveSessionLimit, ChatlaneError, ConfigError, TakenElsewhere
from chatlane.identity import SessionSource
from chatlane.logs import turn_fields
from chatlane.metrics import Metrics
from chatlane.runtime import pending
from chatlane.runtime.busy import (
    ALWAYS_ANSWERED,
    BUSY_ELSEWHERE,
    COLLECTED_ELSEWHERE,
    NOW,
    STEERED_ELSEWHERE,
    BusyContext,
    BusyOutcome,
    BusyPolicy,
    Overflow,
    ack_text,
    collapsed_note,
    collapsed_text,
    decide,
    interrupt_flavour,
    resolve_policy,
)
from chatlane.runtime.elsewhere import (
    drop_still_ours,
    interrupt_elsewhere,
    outcome_elsewhere,
    redirect_elsewhere,
)
from chatlane.runtime.ending import LET_GO, TurnEnd
from chatlane.runtime.kept import KeptMessages
from chatlane.runtime.leases import AcquireWait
from chatlane.runtime.outcomes import Outcome, OutcomeLedger
from chatlane.runtime.outlet import Outlet
from chatlane.runtime.settings import RuntimeSettings
from chatlane.runtime.slots import Slots
from chatlane.runtime.turn import Turn, running_turn_of, waiting_here
from chatlane.state import SessionState, SlotPhase
from chatlane.stores.base import Store
from chatlane.types import Agent, InboundMessage, OutboundKind, accepts_steering

log = logging.getLogger("chatlane.runtime")

_DRAWN = frozenset({BusyPolicy.STEER, BusyPolicy.COLLECT})
"""The policies under which a running turn draws in other processes' messages."""

_DRAWN_KEPT = 10_000
"""How many drawn-in message ids a desk remembers (see ``BusyDesk._drawn``)."""

_PLACED = frozenset({BusyOutcome.QUEUED, BusyOutcome.MERGED, BusyOutcome.STEERED})
"""The outcomes of :meth:`BusyDesk._apply` that put the message somewhere here."""


DROPPED_OLDEST = "Dropped from a full queue to make room for a newer message"
"""The notice the sender of a message dropped by the ``drop-oldest`` overflow gets."""


class BusyDesk:
    """Applies busy policies for one engine (see the module docstring).

    :param slots: the engine's slots: a turn interrupted is superseded there,
        and what the desk sends in the background runs there.
    :param holder: this process's holder id: what it takes out of a queue leaves the
        store only while the store holds it as this process's.
    """

    def __init__(
        self,
        settings: RuntimeSettings,
        agent: Agent,
        store: Store,
        holder: str,
        metrics: Metrics,
        outlet: Outlet,
        outcomes: OutcomeLedger,
        slots: Slots,
        kept: KeptMessages,
    ) -> None:
        """:param kept: puts back what a failed drop may have taken from the store."""
        self._settings = settings
        self._agent = agent
        self._store = store
        self._holder = holder
        self._metrics = metrics
        self._outlet = outlet
        self._outcomes = outcomes
        self._slots = slots
        self._kept = kept
        self._drawn: dict[str, None] = {}
        """Ids of the latest messages drawn in from other processes (at most :data:`_DRAWN_KEPT`):
        their senders heard from there, so a wait here tells them nothing more."""

    def policy_for(self, state: SessionState, message: InboundMessage) -> BusyPolicy:
        """The busy policy in force for ``message``: its own if it names one, else its session's."""
        session = resolve_policy(self._settings.busy, message.source, state.persistent.busy_policy)
        if message.busy_policy == NOW:
            return interrupt_flavour(session)
        if message.busy_policy:
            try:
                return BusyPolicy.parse(message.busy_policy)
            except ConfigError as error:
                log.warning("ignoring the message's busy policy: %s", error)
        return session

    def redirectable(self, turn: Turn) -> bool:
        """Whether another process may redirect ``turn``: its session's own policy (not a
        message's) is ``redirect``. Only such turns are watched for it, so the fence
        check reads nothing more for every other session."""
        state = turn.session_state
        policy = resolve_policy(self._settings.busy, turn.source, state.persistent.busy_policy)
        return policy is BusyPolicy.REDIRECT

    def draws_in(self, turn: Turn) -> bool:
        """Whether ``turn`` draws in what other processes accept for its session: its
        session's own policy steers or collects. Only such turns' queues are read at
        fence checks, as only redirecting ones are read for a redirect."""
        state = turn.session_state
        policy = resolve_policy(self._settings.busy, turn.source, state.persistent.busy_policy)
        return policy in _DRAWN

    def wants_drawn(self, state: SessionState, message: InboundMessage) -> bool:
        """Whether another process's ``message`` would be steered or collected here."""
        return self.policy_for(state, message) in _DRAWN

    def drew_in_any(self, turn: Turn) -> bool:
        """Whether one of ``turn``'s messages was drawn in from another process: that process
        may drop it from the store later (``/unqueue``, ``/stop``, ``/new``), so the turn
        looks at the store's queue once it holds the lease, before its agent runs."""
        drawn = self._drawn
        return bool(drawn) and any(message.id in drawn for message in turn.messages)

    def take_in(self, turn: Turn, message: InboundMessage, seq: int) -> None:
        """``message``, drawn in from another process while ``turn`` ran, as if it arrived here.

        Its sender heard from the process that accepted it, so nothing is said.
        While the agent runs it is steered or collected by its policy; once the
        agent is done (or never took steering) it waits in store order, past the
        cap if need be: a message another process accepted is never refused here.
        """
        state = turn.session_state
        self._drawn[message.id] = None
        if len(self._drawn) > _DRAWN_KEPT:
            del self._drawn[next(iter(self._drawn))]
        if state.turn.holds(turn) and not turn.settling:
            policy = self.policy_for(state, message)
            outcome = self._apply(state, message, seq, policy)
            self._metrics.busy(outcome.value, policy.value)
            if outcome in _PLACED:
                return
        pending.insert_in_order(state, [message], [seq])
        self._slots.promote(state)  # runs now if the turn it was drawn for has freed the slot

    # -- the session runs here ---------------------------------------------------

    async def arrive(self, state: SessionState, message: InboundMessage, seq: int) -> BusyOutcome:
        """Apply the busy policy to ``message`` (stored under ``seq``) and tell its sender."""
        policy = self.policy_for(state, message)
        outcome = self._apply(state, message, seq, policy)
        room = self._room(state) if outcome is BusyOutcome.QUEUE_FULL else None
        if room is not None:  # the oldest left the queue here: the new message takes its place
            outcome = self._apply(state, message, seq, policy)
            self._metrics.busy("dropped_oldest", policy.value)
            await self._let_go(state, room, DROPPED_OLDEST)
        if outcome is BusyOutcome.QUEUE_FULL and self._settings.overflow is Overflow.SUMMARIZE:
            outcome = BusyOutcome.COLLAPSED
            await self._collapse(state, message, seq)
        if outcome in ALWAYS_ANSWERED:
            outcome = await self._refuse(state, message, seq, outcome)
        self._metrics.busy(outcome.value, policy.value)
        if outcome is not BusyOutcome.COLLAPSED:  # its senders were told, every one
            await self._acknowledge(state, message, outcome)
        return outcome

    async def _refuse(
        self, state: SessionState, message: InboundMessage, seq: int, refusal: BusyOutcome
    ) -> BusyOutcome:
        """Drop a refused ``message`` from the store: ``refusal``; or, if the store cannot,
        queue it (past the cap if need be): :attr:`BusyOutcome.QUEUED`."""
        try:
            await self._store.drop_pending(state.key, [seq])
        except ChatlaneError as error:
            log.warning(
                "could not drop a %s message; it waits instead: %s",
                refusal.value,
                error,
                extra=turn_fields(state.key),
            )
            await self._kept.keep(state, [(message, seq)], error)
            pending.insert_in_order(state, [message], [seq])
            self._slots.promote(state)  # if the turn it found ended meanwhile
            return BusyOutcome.QUEUED
        return refusal

    async def _collapse(self, state: SessionState, message: InboundMessage, seq: int) -> None:
        """Make the waiting messages (the running turn's untaken steers too) and ``message``
        one turn; tell each of their senders."""
        turn = running_turn_of(state)
        steers = () if turn is None else turn.untaken_steers()
        count = pending.pending_count(state) + len(steers) + 1
        others = pending.collapse(state, message, seq, collapsed_note(count), steers)
        told: dict[tuple[object, ...], tuple[SessionSource, list[str]]] = {}
        for each in (*others, message):
            if not each.internal:
                source = each.source
                where = (source.chat_id, source.thread_id, source.user_id)
                told.setdefault(where, (source, []))[1].append(each.id)
        text = collapsed_text(count)
        for source, ids in told.values():
            await self._outlet.send(OutboundKind.ACK, state.key, source, text, tuple(ids))

    # -- coalescing: an idle session waits for more of a sender's messages --------------

    def coalesces(self, message: InboundMessage) -> bool:
        """Whether ``message``'s platform coalesces messages to an idle session."""
        return not message.internal and self._settings.coalesce.get(message.source.platform, 0) > 0

    def coalesce(self, state: SessionState, message: InboundMessage, seq: int) -> BusyOutcome:
        """Hold ``message`` (already stored) for its session's next turn, with what follows it.

        The turn starts once its sender was quiet for the platform's window,
        or ``coalesce_max_wait`` after its first message; a message of another
        sender waits as its own turn. Nothing is acknowledged: no turn runs.
        """
        settings = self._settings
        window = settings.coalesce.get(message.source.platform, 0)
        pending.collect(state, message, seq, window, settings.coalesce_max_wait)
        self._slots.promote(state)  # a free slot is held until the window runs out
        return BusyOutcome.MERGED

    def _apply(
        self, state: SessionState, message: InboundMessage, seq: int, policy: BusyPolicy
    ) -> BusyOutcome:
        turn = running_turn_of(state)
        if self._slots.ends_conversation(state.key):  # it waits for the new conversation,
            pending.enqueue(state, message, seq)  # whatever the policy, and past the cap:
            return BusyOutcome.QUEUED  # what fills the queue is dropped with the old one
        coalescing = turn is None and state.turn.phase is SlotPhase.COLLECTING
        if coalescing and self.coalesces(message) and not self._full(state):
            return self.coalesce(state, message, seq)
        outcome = decide(policy, self._context(state, message, turn))
        if outcome is BusyOutcome.QUEUED:
            pending.enqueue(state, message, seq)
        elif outcome is BusyOutcome.MERGED:
            pending.collect(state, message, seq, self._settings.collect_debounce)
        elif outcome is BusyOutcome.INTERRUPTING and turn is not None:
            pending.enqueue(state, message, seq)
            state.conversation.interrupt_streak += 1
            self._slots.supersede(turn, TurnEnd.INTERRUPTED)
        elif outcome is BusyOutcome.REDIRECTING and turn is not None:
            pending.enqueue(state, message, seq)
            state.conversation.interrupt_streak += 1
            self._slots.redirect(turn)
        elif outcome is BusyOutcome.STEERED and turn is not None:
            turn.steer(message, seq)
        return outcome

    def _room(self, state: SessionState) -> Taken | None:
        """Under ``drop-oldest``, take the oldest waiting message out here: the queue's
        first, or the running turn's oldest untaken steer if it was stored before."""
        if self._settings.overflow is not Overflow.DROP_OLDEST:
            return None
        waiting = pending.queued(state)
        turn = running_turn_of(state)
        steered = None if turn is None else _oldest_steer(turn)
        if turn is not None and steered is not None and (not waiting or steered < waiting[0][0]):
            return _unsteered(turn, steered)
        return _taken(state, waiting[0][0]) if waiting else None

    async def take_out(self, state: SessionState, seq: int, notice: str) -> InboundMessage | None:
        """Take the message waiting under ``seq`` out of the queue, or back from the running
        turn's steers its agent has not taken (it never gets it), here and in the store.

        It ends as dropped; its sender gets ``notice`` with the start of its text.

        :returns: the message, or ``None`` if none waits here under ``seq``.
        :raises TakenElsewhere: it had left this process: another process's running turn
            drew it in (:mod:`~chatlane.runtime.elsewhere`), and its agent may take it any
            moment. It no longer waits here; what becomes of it is watched.
        :raises ChatlaneError: the store could not drop it: it waits again, in its place
            (steered again with :meth:`~chatlane.runtime.turn.Turn.steer_again` while its
            turn runs).
        """
        taken = _taken(state, seq)
        if taken is None:
            turn = running_turn_of(state)
            taken = None if turn is None else _unsteered(turn, seq)
        if taken is None:
            return None
        await self._let_go(state, taken, notice, reraise=True)
        return taken.message

    async def _let_go(
        self, state: SessionState, taken: Taken, notice: str, *, reraise: bool = False
    ) -> None:
        """Drop a message taken out of the queue from the store too, and tell its sender.

        One that another process's running turn drew in and may have steered into
        its agent (:meth:`_drop`) is not dropped: it is watched until the store
        says what became of it, and :class:`~chatlane.errors.TakenElsewhere` is
        logged or, with ``reraise``, raised.
        If the store cannot drop it, it waits again in its place (even past the
        cap: a message the store keeps is never lost), and the error is logged
        or, with ``reraise``, raised.
        """
        message, seq = taken.message, taken.seq
        try:
            dropped = await self._drop(state, message, seq)
        except ChatlaneError as error:
            await self._kept.keep(state, [(message, seq)], error)
            self._put_back(state, taken)
            if reraise:
                raise
            log.warning("could not drop a message: %s", error, extra=turn_fields(state.key))
            return
        if not dropped:
            if reraise:
                raise TakenElsewhere(message.id)
            log.info("not dropped: steered elsewhere", extra=turn_fields(state.key))
            return
        if not pending.pending_entries(state):
            self._slots.stop_collecting(state)
        text = f"{notice}: {pending.preview(message)}"
        await self._outlet.send(OutboundKind.NOTICE, state.key, message.source, text, (message.id,))
        self._outcomes.end([message.id], Outcome.DROPPED, text)

    async def _drop(self, state: SessionState, message: InboundMessage, seq: int) -> bool:
        """Drop ``message`` (stored under ``seq``) from the store; whether it was dropped.

        A message its policy steers, for an agent that takes steers, may have been
        drawn into another process's running turn and steered into its agent,
        which takes it any moment: it is dropped only while the store holds it as
        this process's (or a dead one's,
        :func:`~chatlane.runtime.elsewhere.drop_still_ours`), and watched
        otherwise — unless it waits here from memory alone (:mod:`~.kept`: the
        store holds no record of it, so no other process has it). Any other
        message another process drew in waits there for a turn of its own, which
        reads the store's queue before its agent runs (:meth:`drew_in_any`): it
        is dropped wherever it is.

        :raises ChatlaneError: the store could not drop it.
        """
        steers = self.policy_for(state, message) is BusyPolicy.STEER
        if steers and accepts_steering(self._agent):
            if await self._kept_alone(state, seq):
                return True
            pair = [(message.id, seq)]
            store, holder = self._store, self._holder
            return bool(await drop_still_ours(store, self._outcomes, holder, state.key, pair))
        await self._store.drop_pending(state.key, [seq])
        return True

    async def _kept_alone(self, state: SessionState, seq: int) -> bool:
        """Whether the message stored under ``seq`` waits here from memory alone: kept
        after a drop that may have applied (:mod:`~.kept`), and not in the store's queue.

        :raises ChatlaneError: the store could not be read.
        """
        if seq not in state.conversation.kept_seqs:
            return False
        return all(record.seq != seq for record in await self._store.pending(state.key))

    def _put_back(self, state: SessionState, taken: Taken) -> None:
        """``taken`` waits again in its place: among its turn's steers while that turn is
        not finished (what it never takes is queued when it is), else in the queue, in
        store order (started at once if the turn it waited for ended meanwhile)."""
        turn = taken.steered_into
        if turn is not None and not turn.finished:
            turn.steer_again(taken.message, taken.seq)
            return
        pending.insert_in_order(state, [taken.message], [taken.seq], taken.reruns)
        self._slots.promote(state)

    def _full(self, state: SessionState) -> bool:
        return pending.pending_count(state) >= self._settings.queue_cap

    def _context(
        self, state: SessionState, message: InboundMessage, turn: Turn | None
    ) -> BusyContext:
        settings = self._settings
        steerable = turn is not None and not turn.interrupted.is_set()
        return BusyContext(
            queued=pending.pending_count(state),
            queue_cap=settings.queue_cap,
            steers_waiting=0 if turn is None else turn.steers_waiting(),
            internal=message.internal,
            agent_accepts_steering=steerable and accepts_steering(self._agent),
            from_turn_author=turn is None or message.source.user_id == turn.author,
            interrupt_streak=state.conversation.interrupt_streak,
            interrupt_depth=settings.interrupt_depth,
            already_interrupted=_not_interruptible(turn),
            winding_down=_winding_down(turn),
        )

    async def _acknowledge(
        self, state: SessionState, message: InboundMessage, outcome: BusyOutcome
    ) -> None:
        if outcome not in ALWAYS_ANSWERED and not self._ack_due(state, message):
            return
        full = outcome is BusyOutcome.QUEUE_FULL  # it says what the cap counted
        text = ack_text(outcome, waiting_here(state) if full else pending.pending_count(state))
        refused = outcome in ALWAYS_ANSWERED
        kind = OutboundKind.NOTICE if refused else OutboundKind.ACK
        refusal = outcome.value if refused else ""
        await self._outlet.send(
            kind, state.key, message.source, text, (message.id,), refusal=refusal
        )

    def _ack_due(self, state: SessionState, message: InboundMessage) -> bool:
        """Ack a person's message that waits on a running turn, at most once per debounce."""
        if message.internal or running_turn_of(state) is None:
            return False
        now = time.monotonic()
        last = state.turn.busy_ack_ts
        if last and now - last < self._settings.ack_debounce:
            return False
        state.turn.busy_ack_ts = now
        return True

    # -- the session runs in another process ----------------------------------------

    def on_wait(self, turn: Turn, error: ChatlaneError, wait: AcquireWait) -> None:
        """``turn`` was refused its lease with ``error``; act once per kind of wait, and
        apply the busy policy once: a turn that interrupted the one running elsewhere
        must not interrupt what runs after it there."""
        state = turn.session_state
        if not wait.first(error):
            return
        if isinstance(error, ActiveSessionLimit):
            self._tell(turn, OutboundKind.ACK, f"{error}, queued")
            return
        if wait.elsewhere:
            return  # busy, then an earlier message first (or the reverse): one wait, one policy
        wait.elsewhere = True
        log.info(
            "running elsewhere; %d message(s) wait",
            len(turn.messages),
            extra=turn_fields(state.key),
        )
        self._elsewhere(turn, turn.messages[0])

    def _elsewhere(self, turn: Turn, message: InboundMessage) -> None:
        """The busy policy, for a turn whose session another process runs.

        A fresh message is refused under ``reject`` (it leaves the store's
        queue), interrupts the other process's turn under ``rollback``,
        redirects it under ``redirect``, and otherwise waits for the lease;
        the sender gets the notice or the (debounced) ack.
        """
        state = turn.session_state
        if message.internal or message.id in self._drawn:
            return
        policy = self.policy_for(state, message)
        settings = self._settings
        outcome = outcome_elsewhere(
            policy,
            state,
            turn,
            message,
            queue_cap=settings.queue_cap,
            depth=settings.interrupt_depth,
        )
        if outcome is BusyOutcome.REDIRECTING and not self.redirectable(turn):
            outcome = BusyOutcome.QUEUED  # only a redirect session's turns are watched for one
        if outcome in _REACHING:
            state.conversation.interrupt_streak += 1
            self._metrics.busy(outcome.value, policy.value)
            self._slots.spawn(self._reach_elsewhere(turn, message, outcome))
        elif outcome is BusyOutcome.REJECTED:
            turn.end(TurnEnd.REJECTED)
            turn.interrupted.set()  # no longer wanted: the lease wait ends
            self._metrics.busy(BusyOutcome.REJECTED.value, policy.value)
            text = ack_text(BusyOutcome.REJECTED, 0)
            self._tell(turn, OutboundKind.NOTICE, text, refusal=BusyOutcome.REJECTED)
        elif self._ack_due(state, message):
            self._tell(turn, OutboundKind.ACK, self._waits_elsewhere(turn, policy))

    def _waits_elsewhere(self, turn: Turn, policy: BusyPolicy) -> str:
        """The ack for a message that waits while another process runs its session: what
        that process will do with it (draw it in under ``steer`` or ``collect``), else queued."""
        if not turn.refusable or not self.draws_in(turn):
            return BUSY_ELSEWHERE
        if policy is BusyPolicy.STEER and accepts_steering(self._agent):
            return STEERED_ELSEWHERE
        return COLLECTED_ELSEWHERE if policy is BusyPolicy.COLLECT else BUSY_ELSEWHERE

    def _tell(self, turn: Turn, kind: OutboundKind, text: str, refusal: str = "") -> None:
        """Send ``text`` about ``turn``'s messages to their sender, in the background."""
        source, ids = turn.messages[0].source, turn.message_ids
        self._slots.spawn(
            self._outlet.send(kind, turn.session_key, source, text, ids, refusal=refusal)
        )

    async def _reach_elsewhere(
        self, turn: Turn, message: InboundMessage, outcome: BusyOutcome
    ) -> None:
        """Interrupt or redirect (``outcome``) the turn another process runs, through the store."""
        state = turn.session_state
        try:
            reached = await _REACHING[outcome](self._store, state.key)
        except ChatlaneError as error:
            log.warning(
                "could not reach the turn elsewhere (%s): %s",
                outcome,
                error,
                extra=turn_fields(state.key),
            )
            return  # the message still waits for its turn
        log.info("%s the turn elsewhere", outcome, extra=turn_fields(state.key, reached))
        if self._ack_due(state, message):
            self._tell(turn, OutboundKind.ACK, ack_text(outcome, 0))


_REACHING = {
    BusyOutcome.INTERRUPTING: interrupt_elsewhere,
    BusyOutcome.REDIRECTING: redirect_elsewhere,
}
"""How a turn another process runs is reached, by the outcome that reaches it."""


@dataclass(frozen=True, slots=True)
class Taken:
    """A message taken out of a session's queue here (or back from its running turn's
    steers), not yet out of the store's."""

    message: InboundMessage
    seq: int
    reruns: int
    steered_into: Turn | None = None
    """The running turn it was steered into and taken back from; ``None``: it was queued."""


def _taken(state: SessionState, seq: int) -> Taken | None:
    found = pending.take(state, seq)
    return None if found is None else Taken(found[0], seq, found[1])


def _oldest_steer(turn: Turn) -> int | None:
    """The smallest seq of the steers ``turn``'s agent has not taken, if any."""
    return min((seq for _, seq in turn.waiting_steers()), default=None)


def _unsteered(turn: Turn, seq: int) -> Taken | None:
    message = turn.unsteer(seq)
    return None if message is None else Taken(message, seq, 0, turn)


def _winding_down(turn: Turn | None) -> bool:
    """``turn`` ran here under its lease and let the session go (:data:`LET_GO`)."""
    return turn is not None and turn.lease is not None and turn.ended_by in LET_GO


def _not_interruptible(turn: Turn | None) -> bool:
    """No agent to interrupt yet (or any more): the message queues instead."""
    return turn is None or turn.lease is None or turn.interrupted.is_set()
