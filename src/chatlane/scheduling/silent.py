"""What the scheduler's own messages must not send to a chat.

The scheduler registers :func:`silent_filter` with its gateway
(:meth:`~chatlane.gateway.Gateway.add_outbound_filter`), so the gateway
holds these back before any adapter sees them. What stays true:

* A reply of exactly ``[SILENT]`` (spaces aside) to a message the scheduler
  made — a job's prompt or a background completion — is not delivered; a
  person's own message answered with ``[SILENT]`` is.
* The streamed chunks of replies to the scheduler's messages are not
  delivered: such a reply arrives whole, or (when silent) not at all.
* Nothing of a ``local`` job's session is delivered: its result is kept in
  the store's transcript only.
* Every reply to a person that is delivered is told to ``on_reply`` (the
  scheduler's activity tracker) first; the filter checks each message once.
"""

from __future__ import annotations

from collections.abc import Callable

from chatlane.types import Outbound, OutboundFilter, OutboundKind

__all__ = ["CRON_ID", "DONE_ID", "SILENT", "from_scheduler", "silent_filter"]

SILENT = "[SILENT]"
"""A reply that is exactly this (spaces aside) to a job or completion is not delivered."""
CRON_ID, DONE_ID = "chatlane-cron:", "chatlane-done:"
"""Prefixes of the ids of messages the scheduler makes."""


_SCHEDULER_IDS = (CRON_ID, DONE_ID)


def from_scheduler(outbound: Outbound) -> bool:
    """Whether ``outbound`` answers only messages the scheduler made."""
    ids = outbound.in_reply_to
    if len(ids) == 1:  # the common case: one message answered
        return ids[0].startswith(_SCHEDULER_IDS)
    return bool(ids) and all(i.startswith(_SCHEDULER_IDS) for i in ids)


def silent_filter(
    local_prefix: str, on_reply: Callable[[Outbound], None] | None = None
) -> OutboundFilter:
    """The filter that holds back what is described above.

    :param local_prefix: the start of every ``local`` job's session key.
    :param on_reply: told of each reply to a person's message as it is let through.
    """

    def keep(outbound: Outbound) -> bool:
        if outbound.session_key.startswith(local_prefix):
            return False
        if not from_scheduler(outbound):
            if on_reply is not None and outbound.kind is OutboundKind.REPLY:
                on_reply(outbound)
            return True
        if outbound.kind is OutboundKind.CHUNK:
            return False
        return not (outbound.kind is OutboundKind.REPLY and outbound.text.strip() == SILENT)

    return keep
