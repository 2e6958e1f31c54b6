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
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine

from chatlane.context import bound_context
from chatlane.identity import SessionSource
from chatlane.logs import turn_fields
from chatlane.runtime.outcomes import Outcome, OutcomeLedger
from chatlane.runtime.slots import Slots
from chatlane.runtime.turn import Turn
from chatlane.types import Deliver, Outbound, OutboundFilter, OutboundKind, SessionKey, Target

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

    def add_filter(self, keep: OutboundFilter) -> None:
        """Deliver only what ``keep`` returns True for (after the filters added before it)."""
        self._filters.append(keep)

    async def deliver(self, outbound: Outbound) -> None:
        """Hand ``outbound`` to the adapter unless a filter holds it back; errors propagate."""
        if not self._filters or all(keep(outbound) for keep in self._filters):
            await self._deliver(outbound)

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
    ) -> None:
        """Deliver one outbound message; an adapter's failure is logged, never raised.

        ``refusal`` marks a notice refusing ``in_reply_to``, ``approval_id`` the
        request an ``APPROVAL`` asks about (see :class:`~chatlane.types.Outbound`).
        """
        if generation is None:
            generation = self._generation_of(key)
        target = Target.of(source)
        outbound = Outbound(kind, key, target, text, generation, in_reply_to, refusal, approval_id)
        if refusal:
            self._outcomes.end(in_reply_to, Outcome.REFUSED, text, reason=refusal)
        try:
            if not self._filters or all(keep(outbound) for keep in self._filters):
                await self._deliver(outbound)
        except Exception:
            log.exception("delivery failed (%s)", kind, extra=turn_fields(key, generation))

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
