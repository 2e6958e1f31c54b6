"""What goes through the delivery ledger, and how an outbound message is recorded there.

What stays true:

* A ``REPLY``, ``NOTICE`` or ``APPROVAL`` to a platform with a ledgered
  sender is never handed to the adapter directly: it is recorded in the
  store (with the commit that made it, for a turn's reply) and sent by the
  delivery worker. Streamed ``CHUNK``\\ s and ``ACK``\\ s stay best-effort.
* A delivery's lane is its platform, its target the chat and thread it goes
  to: deliveries to one chat and thread are sent one at a time, in the order
  they were recorded.
* A delivery's id is made once, when it is drafted, and kept through every
  attempt: platforms that deduplicate get it as their idempotency key.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Iterable

import msgspec

from chatlane.stores.base import Delivery, DeliveryDraft, Store
from chatlane.stores.ids import time_prefix
from chatlane.types import Outbound, OutboundKind, Target

__all__ = [
    "LEDGERED_KINDS",
    "RESENT_LABEL",
    "DeliveryLedger",
    "draft_of",
    "label_resent",
    "new_delivery_id",
    "outbound_of",
    "target_key",
]

LEDGERED_KINDS = frozenset({OutboundKind.REPLY, OutboundKind.NOTICE, OutboundKind.APPROVAL})
"""The kinds that must reach their chat; chunks and acknowledgements are best-effort."""

RESENT_LABEL = "↻ Sent again — this may repeat an earlier message.\n\n"
"""Put before a delivery that may have reached its chat already, where the
platform cannot deduplicate: a duplicate the reader can tell for one."""


def label_resent(parts: list[str], first_posted: int = 0) -> list[str]:
    """``parts`` with :data:`RESENT_LABEL` in front of part ``first_posted``: the first that
    is posted, not an edit of a draft already shown (an edit repeats nothing).

    A platform that takes parts one by one must cut them where it cut them the first time
    (split at its limit less the label's length, labelled or not): a part that went out
    before and is deduplicated is then the same part, and none overlaps the next.
    """
    if first_posted >= len(parts):
        return parts
    return [
        RESENT_LABEL + part if index == first_posted else part for index, part in enumerate(parts)
    ]


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(Outbound).decode


def new_delivery_id() -> str:
    """A delivery id: URL-safe, unguessable (96 random bits), and in creation order.

    It starts with the millisecond it was made (12 hex digits), so the
    ledger's index of ids (delivered ones are kept an hour) grows at its end,
    where its pages are in memory, instead of at a random page of it.
    """
    return f"d_{time_prefix()}{secrets.token_hex(12)}"


def target_key(target: Target) -> str:
    """The ledger's name for ``target``: one per platform, chat and thread, never shared."""
    return json.dumps([target.platform, target.chat_id, target.thread_id], ensure_ascii=False)


def draft_of(outbound: Outbound) -> DeliveryDraft:
    """``outbound`` as a new delivery, in its platform's lane."""
    target = outbound.target
    return DeliveryDraft(new_delivery_id(), target.platform, target_key(target), _encode(outbound))


def outbound_of(delivery: Delivery) -> Outbound:
    """The outbound message ``delivery`` carries.

    :raises msgspec.DecodeError: the payload is not one (a damaged record).
    """
    return _decode(delivery.payload)


class DeliveryLedger:
    """Records outbound messages of ledgered platforms for the delivery worker.

    :param platforms: the platforms whose sender is the worker's.
    :param recorded: called after each recording, so the worker looks at once.
    """

    def __init__(
        self, store: Store, platforms: Iterable[str], recorded: Callable[[], None]
    ) -> None:
        self.store = store
        self.platforms = frozenset(platforms)
        self.recorded = recorded

    def handles(self, outbound: Outbound) -> bool:
        """Whether ``outbound`` goes through the ledger rather than straight to its adapter."""
        return outbound.kind in LEDGERED_KINDS and outbound.target.platform in self.platforms

    async def record(self, outbound: Outbound) -> None:
        """Record ``outbound`` on its own (not with a commit), then wake the worker.

        :raises StoreError: it could not be recorded.
        """
        await self.store.record_deliveries([draft_of(outbound)])
        self.recorded()
