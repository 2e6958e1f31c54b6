"""What becomes of a turn's stored messages once the turn is over.

What stays true, whatever way the turn ended:

* Its lease is released (once, by generation), unless the commit that
  answered it released it already. A store that cannot be reached is
  retried with backoff until it answers or the engine closes; meanwhile the
  session's slot stays claimed, so no later message overtakes the turn's own.
  Any other store error is logged, never raised — the session's slot must
  still be freed.
* An answered turn's messages already left the durable queue in its commit.
* Messages of a turn that was stopped, interrupted, evicted, failed or
  rejected leave the queue: their senders were told.
* A turn that gave way (an earlier message must run first) goes back into the
  local queue in store order.
* After a lost lease, only what is still queued in the store under this
  process's name runs again — a message another process adopted is its to
  run, one a ``/stop`` elsewhere dropped is not run at all — and after
  :data:`MAX_RERUNS` lost leases the message is set aside as failed
  (:meth:`~chatlane.stores.base.Store.park`: kept in the store, visible to
  the operator, who can run it again) and its sender is told why.
* At shutdown nothing is dropped: the messages stay queued for the next process.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from chatlane.errors import ChatlaneError, StoreError
from chatlane.logs import turn_fields
from chatlane.metrics import Metrics
from chatlane.runtime import pending
from chatlane.runtime.backoff import retry_store, retryable
from chatlane.runtime.elsewhere import drop_still_ours
from chatlane.runtime.ending import Fate, TurnEnd, fate
from chatlane.runtime.leases import LeaseKeeper
from chatlane.runtime.outcomes import Outcome, OutcomeLedger
from chatlane.runtime.outlet import Outlet
from chatlane.runtime.slots import Slots
from chatlane.runtime.turn import Turn
from chatlane.stores.base import Store
from chatlane.types import InboundMessage, OutboundKind

log = logging.getLogger("chatlane.runtime")

Step = Callable[[Turn, bool], Awaitable[None]]
"""One step of settling a turn: the turn, and whether the engine is closing."""

MAX_RERUNS = 3
"""Turns that may run one message and lose their lease before the sender gets a notice."""


class TurnAftermath:
    """Settles finished turns against the store (see the module docstring).

    :param slots: the engine's slots: whether the engine is closing.
    """

    def __init__(
        self,
        store: Store,
        leases: LeaseKeeper,
        outlet: Outlet,
        metrics: Metrics,
        outcomes: OutcomeLedger,
        slots: Slots,
    ) -> None:
        self._store = store
        self._leases = leases
        self._outlet = outlet
        self._metrics = metrics
        self._outcomes = outcomes
        self._slots = slots

    def has_work(self, turn: Turn) -> bool:
        """Whether :meth:`settle` has anything to do for ``turn``.

        Not for a turn that answered and whose commit released its lease: its
        messages left the queue in that commit and no lease is left to give back.
        """
        answered = turn.answered and turn.ended_by is None
        return not answered or self._leases.holds(turn.session_state, turn.generation)

    async def settle(self, turn: Turn) -> None:
        """Release ``turn``'s lease and decide what becomes of its stored messages.

        Each step is retried on its own through an outage, so a step that
        already changed this process's queue never runs twice.
        """
        if not self.has_work(turn):
            return
        steps = (self._drop_untaken_steers, self._settle_messages, self._release)
        for step in steps:
            try:
                await step(turn, self._slots.closed)
            except StoreError as error:
                await self._outlast(step, turn, error)
            except ChatlaneError as error:
                log.error("could not settle the turn: %s", error, extra=_fields(turn))

    async def _outlast(self, step: Step, turn: Turn, error: StoreError) -> None:
        """Retry ``step`` through an outage until the store answers or the engine closes."""
        fields, slots = _fields(turn), self._slots
        if not retryable(error) or slots.closed:
            log.error("could not settle the turn: %s", error, extra=fields)
            return
        log.warning("settling the turn failed, retrying: %s", error, extra=fields)
        try:
            await retry_store(
                lambda: step(turn, slots.closed),
                wanted=lambda: not slots.closed,
                what="settling the turn",
                fields=fields,
            )
        except ChatlaneError as failure:
            log.error("could not settle the turn: %s", failure, extra=fields)

    async def _drop_untaken_steers(self, turn: Turn, closing: bool) -> None:
        state = turn.session_state
        if turn.ended_by is TurnEnd.STOPPED:
            untaken = turn.waiting_steers()
            await self._store.drop_pending(state.key, [seq for _, seq in untaken])
            turn.untaken_steers()

    async def _settle_messages(self, turn: Turn, closing: bool) -> None:
        ending = fate(turn.ended_by, answered=turn.answered, closing=closing)
        if ending is Fate.DROP:
            self._outcomes.end(await self._drop(turn), *_told(turn.ended_by))
        elif ending is Fate.REQUEUE:
            requeue(turn)
        elif ending is Fate.RERUN:
            await self._rerun_what_is_ours(turn)

    async def _drop(self, turn: Turn) -> list[str]:
        """Drop ``turn``'s messages from the store; the ids of those dropped.

        All of them, once its agent was called. Before that the turn may have
        waited for another process's lease, and that process's running turn may
        have drawn its messages in, even answered them: only those the store
        still holds as this process's are dropped
        (:meth:`~chatlane.stores.protocols.PendingQueue.drop_own`), and the others
        are watched until the store says what became of them.
        """
        state = turn.session_state
        if turn.agent_called:
            await self._store.drop_pending(state.key, turn.seqs)
            return list(turn.message_ids)
        pairs = list(zip(turn.message_ids, turn.seqs, strict=True))
        holder = self._leases.holder
        own = await drop_still_ours(self._store, self._outcomes, holder, state.key, pairs)
        return [message_id for message_id, seq in pairs if seq in own]

    async def _release(self, turn: Turn, closing: bool) -> None:
        state = turn.session_state
        if turn.lease is not None:
            await self._leases.release(state, turn.generation)

    async def _rerun_what_is_ours(self, turn: Turn) -> None:
        """Queue again what the store still holds for this process; forget what it dropped.

        A lease lost to another process's ``/stop`` or ``/new`` took this
        session's queued messages out of the store: the local queue, and the
        steers the agent never took, let go of them too, so they never run here.
        What was queued or steered here while the store was read stays: the read
        may predate its write (on SQLite the read runs on the writer thread while
        the loop commits), and forgetting it would leave it in the store as this
        process's, run by no one.
        """
        state = turn.session_state
        known = pending.known(state).union(seq for _, seq in turn.waiting_steers())
        records = await self._store.pending(state.key)
        ours = pending.or_kept(state, {r.seq for r in records if r.owner == self._leases.holder})
        stored = pending.or_kept(state, {r.seq for r in records})
        gone = pending.keep_only(state, stored, known) + turn.keep_steers(stored, known)
        if gone:
            log.info("%d queued message(s) left the store", len(gone), extra=turn_fields(state.key))
        pairs = list(zip((*turn.messages, *turn.steered), turn.seqs, strict=True))
        self._outcomes.watch([*(m.id for m in gone), *(m.id for m, s in pairs if s not in ours)])
        kept = [(m, s) for m, s in pairs if s in ours]
        if kept and turn.reruns + 1 >= MAX_RERUNS:
            await self._give_up(turn, kept)
            return
        for message, seq in kept:
            pending.insert_in_order(state, [message], [seq], turn.reruns + 1)

    async def _give_up(self, turn: Turn, kept: list[tuple[InboundMessage, int]]) -> None:
        state = turn.session_state
        reason = f"its turn lost its lease {MAX_RERUNS} times"
        await self._store.park(state.key, [seq for _, seq in kept], reason)
        self._metrics.failed(len(kept))
        log.error("message(s) set aside as failed: %s", reason, extra=turn_fields(state.key))
        text = (
            f"Sorry — this message could not be completed: {reason} (the gateway may be "
            "overloaded or paused). It is kept as failed; an operator can run it again."
        )
        ids = tuple(m.id for m, _ in kept)
        self._outcomes.end(ids, Outcome.FAILED, text, reason)
        await self._outlet.send(OutboundKind.NOTICE, state.key, turn.source, text, ids, None)


_TOLD_AS = {
    TurnEnd.STOPPED: Outcome.STOPPED,
    TurnEnd.INTERRUPTED: Outcome.INTERRUPTED,
    TurnEnd.REJECTED: Outcome.REFUSED,
}
"""How a turn whose senders were told why it ended ends its messages (others: failed)."""


def _told(end: TurnEnd | None) -> tuple[Outcome, str, str]:
    """The outcome, text and reason of a turn whose messages leave because it ended early."""
    outcome = Outcome.FAILED if end is None else _TOLD_AS.get(end, Outcome.FAILED)
    return outcome, "", "" if end is None else end.value


def requeue(turn: Turn) -> None:
    """Put a turn's messages back into the local queue, in store order."""
    state = turn.session_state
    count = len(turn.messages)
    pending.insert_in_order(state, list(turn.messages), list(turn.seqs[:count]))
    for message, seq in zip(turn.steered, turn.seqs[count:], strict=True):
        pending.insert_in_order(state, [message], [seq])


def _fields(turn: Turn) -> dict[str, object]:
    return turn_fields(turn.session_key, turn.generation)
