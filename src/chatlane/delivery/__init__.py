"""The delivery ledger's runtime: recording outbound messages, and the worker that sends them.

The store keeps the ledger (:class:`~chatlane.stores.protocols.Deliveries`);
:mod:`chatlane.delivery.ledger` decides what goes through it and records it,
:mod:`chatlane.delivery.worker` claims, sends and settles. ``docs/delivery.md``
gives the guarantees per adapter.
"""

from chatlane.delivery.ledger import LEDGERED_KINDS, DeliveryLedger, draft_of, outbound_of
from chatlane.delivery.worker import Attempt, DeliverySettings, DeliveryWorker, Sender

__all__ = [
    "LEDGERED_KINDS",
    "Attempt",
    "DeliveryLedger",
    "DeliverySettings",
    "DeliveryWorker",
    "Sender",
    "draft_of",
    "outbound_of",
]
