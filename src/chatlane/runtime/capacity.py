"""Process-wide limits: what every session of one engine may hold together.

Per-session caps (``queue_cap``) bound one session; sessions are named by
their senders, so those caps alone bound nothing in sum. :class:`Capacity`
bounds the sum. What stays true:

* A message is admitted, or refused with :class:`~chatlane.errors.GatewayFull`
  *before* it is stored, when it would take this process past
  ``queued_bytes`` (bytes of the messages it holds unanswered: running,
  steered into a running turn, taken by its agent or not, or queued) or
  would make one session more live than ``live_sessions`` (sessions with a
  turn running, waiting for its lease or collecting here).
* The byte count never under-counts: a message is counted from its admission
  until a recount of what the engine still holds no longer finds it. A
  recount happens when the count reaches the limit, or when the messages
  counted reach twice what the last recount found (at least
  :data:`RECOUNT_FLOOR`): what is remembered stays within a small multiple
  of what the engine holds, however many sessions came and went, and a
  message pays for a constant share of recounting on average.
* Sessions being admitted concurrently are counted while they are stored,
  so messages arriving at once cannot all slip in under the live limit; a
  session counts once however many of its messages arrive together.
* Messages already accepted (adopted after a restart, retried, re-queued
  after a lost lease) are never refused: only new arrivals are admitted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from chatlane.errors import GatewayFull, MessageTooLarge
from chatlane.runtime.limits import Bytes, Count, check_bounds
from chatlane.types import Attachment, InboundMessage, SessionKey

if TYPE_CHECKING:
    from chatlane.runtime.slots import Slots

MESSAGE_OVERHEAD = 256
"""Bytes counted per message on top of its text: ids, source and bookkeeping."""
ATTACHMENT_OVERHEAD = 64
"""Bytes counted per attachment on top of its reference, name and MIME type."""
RECOUNT_FLOOR = 1024
"""Messages counted before a recount, however few the engine held at the last one."""


@dataclass(frozen=True, slots=True)
class CapacitySettings:
    """Process-wide limits of one engine.

    :param queued_bytes: bytes of unanswered messages (UTF-8 text plus
        :data:`MESSAGE_OVERHEAD` each, and each attachment's reference) this
        process may hold at once.
    :param live_sessions: sessions that may have a turn running, waiting or
        collecting in this process at once; a message for one more is refused.
    """

    queued_bytes: Bytes = 64 * 1024 * 1024
    live_sessions: Count = 10_000

    def __post_init__(self) -> None:
        check_bounds(self)


def message_bytes(message: InboundMessage) -> int:
    """What ``message`` counts against ``queued_bytes``."""
    text = message.text
    size = len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
    if message.attachments:  # references only: the files themselves are never held
        size += sum(_reference_bytes(a) for a in message.attachments)
    return size + MESSAGE_OVERHEAD


def _reference_bytes(attachment: Attachment) -> int:
    texts = f"{attachment.ref}{attachment.name}{attachment.mime_type}"
    return len(texts.encode("utf-8", "surrogatepass")) + ATTACHMENT_OVERHEAD


class Capacity:
    """Admits new messages against :class:`CapacitySettings` (see the module docstring).

    :param slots: the engine's slots: the messages it holds unanswered right
        now (for recounts) and how many sessions are live.
    """

    def __init__(self, settings: CapacitySettings, slots: Slots) -> None:
        self.settings = settings
        self._held = slots.held
        self._live = slots.live_count
        self._sizes: dict[str, int] = {}
        self._total = 0
        self._arriving: dict[SessionKey, int] = {}
        """Sessions not live here with messages being admitted, and how many of them."""
        self._storing: dict[str, InboundMessage] = {}
        """Admitted messages not yet held by the engine (being stored): recounts keep them."""
        self._recount_at = RECOUNT_FLOOR

    @property
    def counted_bytes(self) -> int:
        """Bytes counted now (at least what is held: stale entries go at the next recount)."""
        return self._total

    def reserve(self, message: InboundMessage, *, arriving: SessionKey | None) -> None:
        """Count ``message`` in while it is stored and accepted; :meth:`settled` ends that.

        :param arriving: the message's session when it is not live here: one more live
            session, counted once however many of its messages arrive at once.
        :raises GatewayFull: if a limit would be passed; nothing was counted.
        """
        settings = self.settings
        arrives = arriving is not None and arriving not in self._arriving
        if arrives and self._live() + len(self._arriving) >= settings.live_sessions:
            self._refuse_live()
        size = message_bytes(message)
        if self._total + size > settings.queued_bytes or len(self._sizes) >= self._recount_at:
            self._recount_for(size)
        message_id, sizes = message.id, self._sizes  # counted once, however often reserved
        self._total += size - sizes.get(message_id, 0)
        sizes[message_id] = size
        if arriving is not None:
            self._arriving[arriving] = self._arriving.get(arriving, 0) + 1
        self._storing[message_id] = message

    def settled(self, message: InboundMessage, *, arriving: SessionKey | None) -> None:
        """``message`` is stored and accepted (or refused): the engine holds it from now on."""
        if arriving is not None:
            left = self._arriving[arriving] - 1
            if left:
                self._arriving[arriving] = left
            else:
                del self._arriving[arriving]
        self._storing.pop(message.id, None)

    def _refuse_live(self) -> None:
        limit = self.settings.live_sessions
        live = self._live() + len(self._arriving)
        raise GatewayFull("live_sessions", f"{live} sessions are live (limit {limit})")

    def _recount_for(self, size: int) -> None:
        """Recount; :raises GatewayFull: if ``size`` more bytes would still pass the limit
        (:class:`~chatlane.errors.MessageTooLarge` if they alone pass it)."""
        limit = self.settings.queued_bytes
        if size > limit:
            raise MessageTooLarge(size, limit)
        self._recount()
        if self._total + size > limit:
            raise GatewayFull(
                "queued_bytes", f"{self._total} bytes wait to be answered (limit {limit})"
            )

    def _recount(self) -> None:
        held = [*self._held(), *self._storing.values()]
        self._sizes = {m.id: message_bytes(m) for m in held}
        self._total = sum(self._sizes.values())
        self._recount_at = max(RECOUNT_FLOOR, 2 * len(self._sizes))
