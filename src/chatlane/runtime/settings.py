"""What a turn engine is configured with, and what ``/stop`` reports.

Plain frozen records: the engine reads them, nothing else changes them, and
their numbers are checked when they are made (:mod:`chatlane.runtime.limits`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from chatlane.runtime.busy import BusySettings
from chatlane.runtime.capacity import CapacitySettings
from chatlane.runtime.leases import LeaseSettings
from chatlane.runtime.limits import require_numbers
from chatlane.types import InboundMessage


@dataclass(frozen=True, slots=True)
class RuntimeSettings:
    """Tunables of the turn engine; every duration is in seconds.

    :param queue_cap: messages that may wait per session; one more gets a notice.
    :param collect_debounce: quiet time before a ``collect`` follow-up starts.
    :param interrupt_grace: how long an interrupted agent may wind down before
        its task is cancelled.
    :param interrupt_depth: consecutive interrupts of one session after which
        ``interrupt`` degrades to ``queue``.
    :param ack_debounce: minimum time between two acks to one session
        (notices that a message will not run are never debounced).
    :param turn_timeout: a turn with no progress for this long is evicted
        (0 disables eviction).
    :param leases: lease TTL, the cross-process active-session cap, polling.
    :param approval_timeout: seconds a tool waits for ``/approve`` before it
        counts as denied.
    :param reread_stored: seconds a session's stored choices (``/model``,
        ``/reasoning``, ``/fast``, ``/busy``, the approval allowlist, the
        current conversation) are trusted before a turn reads them again, so
        what another process changed applies here too (0: at every turn).
    :param capacity: process-wide limits on the bytes of unanswered messages and
        on live sessions (:mod:`chatlane.runtime.capacity`).
    """

    busy: BusySettings = field(default_factory=BusySettings)
    queue_cap: int = 32
    collect_debounce: float = 0.5
    interrupt_grace: float = 5.0
    interrupt_depth: int = 3
    ack_debounce: float = 30.0
    turn_timeout: float = 600.0
    leases: LeaseSettings = field(default_factory=LeaseSettings)
    approval_timeout: float = 300.0
    reread_stored: float = 1.0
    capacity: CapacitySettings = field(default_factory=CapacitySettings)

    def __post_init__(self) -> None:
        require_numbers(
            self,
            positive=("queue_cap", "interrupt_depth"),
            non_negative=(
                "collect_debounce",
                "interrupt_grace",
                "ack_debounce",
                "turn_timeout",
                "approval_timeout",
                "reread_stored",
            ),
            whole=("queue_cap", "interrupt_depth"),
        )


@dataclass(frozen=True, slots=True)
class StopResult:
    """What ``/stop`` did: whether a turn was running and which messages it dropped."""

    stopped_turn: bool
    dropped: tuple[InboundMessage, ...]
    dropped_elsewhere: int = 0
    """Messages other processes had accepted (running there, or queued), dropped from the store."""


__all__ = ["RuntimeSettings", "StopResult"]
