"""The one way out of the engine: outbound messages to the adapter's ``deliver``.

Every helper of the engine (turn output, busy policies, the aftermath of a
turn, approval prompts, eviction notices) sends through one :class:`Outlet`,
so what stays true is said once:

* Every outbound message passes the gateway's outbound filters, in the order
  they were added, just before the adapter's ``deliver``.
* An adapter's failure to deliver (or a filter's) is logged, never raised into a turn.
* An outbound that carries no generation is stamped with the session's
  current one.
* A notice refusing messages (``refusal``) is also their outcome, ended in
  the ledger before it is delivered.
* :meth:`Outlet.about` sends about a turn from anywhere (a background loop
  included) with the turn's session bound, so the adapter sees that session.
* A message the delivery ledger handles (:mod:`chatlane.delivery`) is
  recorded in the store instead of handed to the adapter, after the same
  filters; a turn's reply is drafted (:meth:`Outlet.drafts`) and recorded
  with its commit. A recording the store refuses falls back to a direct,
  best-effort delivery, logged.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine

from chatlane.context import bound_context
from chatlane.delivery.ledger import DeliveryLedger, draft_of
from chatlane.errors import StoreError
from chatlane.identity import SessionSource
from chatlane.logs import turn_fields
from chatlane.runtime.outcomes import Outcome, OutcomeLedger
from chatlane.runtime.slots import Slots
from chatlane.runtime.turn import Turn
from chatlane.stores.base import DeliveryDraft
from chatlane.types import (
    Asks,
    Deliver,
    Outbound,
    OutboundFilter,
    OutboundKind,
    SessionKey,
    Target,
)

log = logging.getLogger("chatlane.runtime")


class Outlet:
    """Delivers the engine's outbound messages (see the module docstring).

    :param slots: the engine's slots, for a session's current generation.
    """

    def __init__(self, deliver: Deliver, outcomes: OutcomeLedger, slots: Slots) -> None:
        self._deliver = deliver
        self._outcomes = outcomes
        self._generation_of = slots.generation_of
        self._filters: list[OutboundFilter] = []
        self.ledger: DeliveryLedger | None = None
        """Where ledgered messages are recorded (``None``: every message goes to the adapter)."""

    def add_filter(self, keep: OutboundFilter) -> None:
        """Deliver only what ``keep`` returns True for (after the filters added before it)."""
        self._filters.append(keep)

    async def deliver(self, outbound: Outbound) -> None:
        """Hand ``outbound`` on unless a filter holds it back; errors propagate.

        On means to the ledger for a message it handles, else to the adapter.
        """
        for keep in self._filters:  # a loop, not all(): no generator per message
            if not keep(outbound):
                return
        ledger = self.ledger
        if ledger is not None and ledger.handles(outbound):
            await ledger.record(outbound)
        else:
            await self._deliver(outbound)

    def drafts(self, turn: Turn, kind: OutboundKind, text: str) -> list[DeliveryDraft]:
        """``text`` to ``turn``'s sender as a delivery to record with the turn's commit.

        Empty when the message does not go through the ledger (no ledger, not
        a ledgered platform or kind) or a filter holds it back: the caller
        then delivers it itself after the commit, through :meth:`to_turn`.
        """
        ledger = self.ledger
        if ledger is None or turn.source.platform not in ledger.platforms:
            return []  # the common case of an unledgered platform costs a set look-up
        outbound = Outbound(
            kind, turn.session_key, Target.of(turn.source), text, turn.generation, turn.message_ids
        )
        if not ledger.handles(outbound) or not all(keep(outbound) for keep in self._filters):
            return []
        return [draft_of(outbound)]

    def recorded(self) -> None:
        """Deliveries were recorded with a commit: the worker should look now."""
        if self.ledger is not None:
            self.ledger.recorded()

    async def send(
        self,
        kind: OutboundKind,
        key: SessionKey,
        source: SessionSource,
        text: str,
        in_reply_to: tuple[str, ...] = (),
        generation: int | None = None,
        *,
        refusal: str = "",
        approval_id: str = "",
        asks: Asks | None = None,
    ) -> None:
        """Deliver one outbound message; an adapter's failure is logged, never raised.

        ``refusal`` marks a notice refusing ``in_reply_to``; ``approval_id`` and
        ``asks`` the request an ``APPROVAL`` asks about (see :class:`~chatlane.types.Outbound`).
        """
        if generation is None:
            generation = self._generation_of(key)
        target = Target.of(source)
        outbound = Outbound(
            kind, key, target, text, generation, in_reply_to, refusal, approval_id, asks
        )
        if refusal:
            self._outcomes.end(in_reply_to, Outcome.REFUSED, text, reason=refusal)
        try:
            await self.deliver(outbound)
        except StoreError as error:
            log.warning("could not record a %s; delivering it directly: %s", kind, error)
            await self._deliver_directly(outbound)
        except Exception:
            log.exception("delivery failed (%s)", kind, extra=turn_fields(key, generation))

    async def _deliver_directly(self, outbound: Outbound) -> None:
        try:
            await self._deliver(outbound)
        except Exception:
            fields = turn_fields(outbound.session_key, outbound.generation)
            log.exception("delivery failed (%s)", outbound.kind, extra=fields)

    def to_turn(
        self, turn: Turn, kind: OutboundKind, text: str, refusal: str = ""
    ) -> Coroutine[object, object, None]:
        """Send ``text`` to the sender of ``turn``'s messages, in reply, at its generation."""
        return self.send(
            kind,
            turn.session_key,
            turn.source,
            text,
            turn.message_ids,
            turn.generation,
            refusal=refusal,
        )

    async def about(self, turn: Turn, kind: OutboundKind, text: str) -> None:
        """Send about ``turn`` from a background loop, with ``turn``'s session bound."""
        send = self.send(kind, turn.session_key, turn.source, text, turn.message_ids)
        await asyncio.create_task(send, context=bound_context(turn.source, turn.session_key))


__all__ = ["Outlet"]
