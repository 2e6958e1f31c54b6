"""The delivery ledger of the in-memory store (:class:`~chatlane.stores.protocols.Deliveries`).

Kept apart from :mod:`chatlane.stores.memory` so that each stays small; the
store owns one :class:`MemoryLedger` and hands it its clock. Every method runs
without an ``await``, so each is atomic with respect to the event loop.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Sequence

from msgspec.structs import replace

from chatlane.stores.ids import new_token
from chatlane.stores.records import (
    DEAD,
    DELIVERED,
    PENDING,
    Delivery,
    DeliveryDraft,
    DeliveryStats,
    Settlement,
    SettlementKind,
)

__all__ = ["MemoryLedger"]


class MemoryLedger:
    """Deliveries by id, and each target's pending ones in recording order."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._records: dict[str, Delivery] = {}
        """Delivery id → its record; insertion order is recording order."""
        self._queues: dict[str, list[tuple[int, str]]] = {}
        """Target → its pending deliveries as ``(seq, id)``, oldest first."""
        self._lanes: dict[str, set[str]] = {}
        """Lane → its targets with pending deliveries."""
        self._seq = itertools.count(1)

    def record(self, drafts: Sequence[DeliveryDraft]) -> None:
        """Record each draft not recorded before, pending and due now."""
        moment = self._clock()
        for draft in drafts:
            if draft.id in self._records:
                continue
            delivery = Delivery(
                draft.id,
                next(self._seq),
                draft.lane,
                draft.target,
                draft.payload,
                moment,
                PENDING,
            )
            self._records[draft.id] = delivery
            self._enqueue(delivery)

    def claim(self, lanes: Sequence[str], holder: str, ttl: float, limit: int) -> list[Delivery]:
        """See :meth:`~chatlane.stores.protocols.Deliveries.claim_deliveries`."""
        moment = self._clock()
        heads = [
            head
            for lane in dict.fromkeys(lanes)  # a lane named twice is claimed once
            for target in self._lanes.get(lane, ())
            if _claimable(head := self._records[self._queues[target][0][1]], moment)
        ]
        heads.sort(key=lambda delivery: delivery.seq)
        claimed = []
        for head in heads[: max(limit, 0)]:
            delivery = replace(
                head,
                claim=new_token(),
                claim_expires=moment + ttl,
                holder=holder,
                uncertain=head.uncertain or bool(head.claim),
            )
            self._records[head.id] = delivery
            claimed.append(delivery)
        return claimed

    def settle(self, settlements: Sequence[Settlement]) -> list[bool]:
        """See :meth:`~chatlane.stores.protocols.Deliveries.settle_deliveries`."""
        moment = self._clock()
        applied = []
        for settlement in settlements:
            delivery = self._records.get(settlement.id)
            ok = delivery is not None and delivery.claim == settlement.claim != ""
            if delivery is not None and ok:
                self._records[delivery.id] = after = _settled(delivery, settlement, moment)
                if after.state != PENDING:
                    self._dequeue(after)
            applied.append(ok)
        return applied

    def listed(self, state: str, limit: int) -> list[Delivery]:
        """Deliveries in ``state``, oldest recorded first."""
        found = (d for d in self._records.values() if d.state == state)
        return sorted(found, key=lambda d: d.seq)[: max(limit, 0)]

    def get(self, delivery_id: str) -> Delivery | None:
        """One delivery by id."""
        return self._records.get(delivery_id)

    def stats(self) -> DeliveryStats:
        """How many are pending (and since when) and dead."""
        pending = [d for d in self._records.values() if d.state == PENDING]
        dead = sum(1 for d in self._records.values() if d.state == DEAD)
        oldest = min((d.created_at for d in pending), default=0.0)
        return DeliveryStats(len(pending), oldest, dead)

    def retry_dead(self, delivery_id: str) -> bool:
        """Make a dead delivery pending again, due now, with no attempts counted."""
        delivery = self._records.get(delivery_id)
        if delivery is None or delivery.state != DEAD:
            return False
        revived = replace(delivery, state=PENDING, attempts=0, next_at=0.0, settled_at=0.0)
        self._records[delivery_id] = revived
        self._enqueue(revived)
        return True

    def prune(self, delivered_before: float, dead_before: float) -> None:
        """Forget delivered ones settled before the first cutoff, dead ones before the second."""
        for delivery in list(self._records.values()):
            cutoff = {DELIVERED: delivered_before, DEAD: dead_before}.get(delivery.state)
            if cutoff is not None and delivery.settled_at <= cutoff:
                del self._records[delivery.id]

    def _enqueue(self, delivery: Delivery) -> None:
        bisect.insort(self._queues.setdefault(delivery.target, []), (delivery.seq, delivery.id))
        self._lanes.setdefault(delivery.lane, set()).add(delivery.target)

    def _dequeue(self, delivery: Delivery) -> None:
        queue = self._queues[delivery.target]
        queue.remove((delivery.seq, delivery.id))
        if not queue:
            del self._queues[delivery.target]
            targets = self._lanes[delivery.lane]
            targets.discard(delivery.target)
            if not targets:
                del self._lanes[delivery.lane]


def _claimable(head: Delivery, moment: float) -> bool:
    """Whether a target's oldest pending delivery is due and under no live claim."""
    return head.next_at <= moment and not (head.claim and head.claim_expires > moment)


def _settled(delivery: Delivery, settlement: Settlement, moment: float) -> Delivery:
    """``delivery`` after ``settlement``, applied at ``moment`` (its claim checked before)."""
    kind = settlement.kind
    if kind is SettlementKind.DELIVERED:
        return replace(delivery, state=DELIVERED, claim="", settled_at=moment)
    if kind is SettlementKind.DEAD:  # maybe sent stays, so a redelivery is labelled
        return replace(
            delivery,
            state=DEAD,
            claim="",
            reason=settlement.reason,
            settled_at=moment,
            uncertain=delivery.uncertain or settlement.maybe_sent,
        )
    spent = 1 if kind is SettlementKind.RETRY else 0
    return replace(
        delivery,
        attempts=delivery.attempts + spent,
        next_at=moment + settlement.delay,
        claim="",
        reason=settlement.reason or delivery.reason,
        uncertain=delivery.uncertain or settlement.maybe_sent,
    )
