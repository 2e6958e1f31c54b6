"""What a turn engine is configured with, and what ``/stop`` reports.

Plain frozen records: the engine reads them, nothing else changes them, and
their numbers are checked when they are made (:mod:`chatlane.runtime.limits`).
They are also what the configuration's ``[runtime]`` table decodes into
(:mod:`chatlane.config`): one type, one set of defaults and bounds.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING

from chatlane.errors import ChatlaneError, ConfigError, shown_to_users
from chatlane.runtime.busy import BusySettings, Overflow
from chatlane.runtime.capacity import CapacitySettings
from chatlane.runtime.limits import (
    MAX_SECONDS,
    Count,
    CountOrZero,
    LeaseSeconds,
    PositiveSeconds,
    Seconds,
    check_bounds,
)
from chatlane.types import InboundMessage, SessionKey

if TYPE_CHECKING:
    from chatlane.runtime.leases import BoundaryHold


@dataclass(frozen=True, slots=True)
class LeaseSettings:
    """How turns hold leases.

    :param ttl: seconds a lease (and a process's heartbeat) lives without
        renewal; both are renewed every :attr:`renew_every` (``ttl / 10``), so
        a process whose event loop turns is never taken for dead, and a
        killed one's sessions are taken over within ``ttl``. At least
        :data:`~chatlane.runtime.limits.MIN_LEASE_TTL` (0.1 s), and 1 s when read
        from the configuration (:data:`~chatlane.runtime.limits.CONFIGURED_LEASE_TTL`).
    :param max_active_sessions: sessions that may run at once across every
        process sharing the store (0 = unlimited).
    :param poll: first wait (seconds) before retrying a busy session; doubles
        up to ``max_poll``.
    :param fence_check: seconds between two checks that each running turn's
        generation still holds in the store (one batched read), so a
        turn another process fenced — ``/stop`` or ``/new`` sent there — is
        interrupted at once instead of at its next renewal; 0 leaves it to the
        renewal (every ``ttl / 3``).
    """

    ttl: LeaseSeconds = 10.0
    max_active_sessions: CountOrZero = 0
    poll: PositiveSeconds = 0.005
    max_poll: PositiveSeconds = 0.25
    fence_check: Seconds = 0.5
    adopt_batch: Count = 256
    """Sessions whose orphaned messages one adoption cycle takes at most."""

    @property
    def renew_every(self) -> float:
        """Seconds between two renewals of every held lease and the heartbeat."""
        return self.ttl / 10

    @property
    def adopt_every(self) -> float:
        """Seconds between two adoption cycles (a full batch is followed at once by the next)."""
        return self.ttl / 5

    def __post_init__(self) -> None:
        check_bounds(self)


@dataclass(frozen=True, slots=True)
class RuntimeSettings:
    """Tunables of the turn engine; every duration is in seconds.

    :param queue_cap: messages that may wait per session.
    :param overflow: what one more message does to a full queue
        (:class:`~chatlane.runtime.busy.Overflow`): refused (the default), or
        the oldest waiting message makes room for it.
    :param collect_debounce: quiet time before a ``collect`` follow-up starts.
    :param coalesce: per platform, the quiet time an idle session waits for
        more of a sender's messages before its turn starts (messages that
        arrive within it become one turn); none by default.
    :param coalesce_max_wait: the longest a coalescing turn waits after its
        first message, however steadily messages keep coming.
    :param interrupt_grace: how long an interrupted agent may wind down before
        its task is cancelled.
    :param interrupt_depth: consecutive interrupts of one session after which
        ``rollback`` degrades to ``queue``.
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
    :param side_answers: ``/btw`` questions answered at once in this process
        (:mod:`chatlane.runtime.aside`); one more is refused.
    """

    busy: BusySettings = field(default_factory=BusySettings)
    queue_cap: Count = 32
    overflow: Overflow = Overflow.REFUSE_NEW
    collect_debounce: Seconds = 0.5
    coalesce: Mapping[str, Seconds] = field(default_factory=dict)
    coalesce_max_wait: Seconds = 5.0
    interrupt_grace: Seconds = 5.0
    interrupt_depth: Count = 3
    ack_debounce: Seconds = 30.0
    turn_timeout: Seconds = 600.0
    leases: LeaseSettings = field(default_factory=LeaseSettings)
    approval_timeout: Seconds = 300.0
    reread_stored: Seconds = 1.0
    capacity: CapacitySettings = field(default_factory=CapacitySettings)
    side_answers: Count = 4

    def __post_init__(self) -> None:
        check_bounds(self)
        object.__setattr__(self, "overflow", Overflow.parse(self.overflow))
        object.__setattr__(self, "coalesce", _windows(self.coalesce))


def _windows(coalesce: Mapping[str, float]) -> Mapping[str, float]:
    """``coalesce`` frozen, every window a number of seconds from 0 to ``MAX_SECONDS``."""
    for platform, seconds in coalesce.items():
        if isinstance(seconds, bool) or not isinstance(seconds, int | float):
            raise ConfigError(f"coalesce.{platform}: expected seconds, got {seconds!r}")
        if not 0 <= seconds <= MAX_SECONDS:
            raise ConfigError(
                f"coalesce.{platform} = {seconds}: expected a finite number >= 0 "
                f"and <= {MAX_SECONDS}"
            )
    return MappingProxyType(dict(coalesce))


@dataclass(frozen=True, slots=True)
class StopResult:
    """What ``/stop`` did: whether a turn was running and which messages it dropped."""

    stopped_turn: bool
    dropped: tuple[InboundMessage, ...]
    dropped_elsewhere: int = 0
    """Messages other processes had accepted (running there, or queued), dropped from the store."""


@dataclass(slots=True)
class Boundary:
    """A conversation boundary under way for ``key`` (see :mod:`chatlane.lifecycle`)."""

    key: SessionKey
    waiting: frozenset[int]
    """The seqs of the messages waiting here when it began: the ones it drops."""
    hold: BoundaryHold | None = None
    """The session's lease, held for it in the store: no process starts a turn meanwhile."""


class StopIncomplete(ChatlaneError):
    """``/stop`` stopped what ran here, but the store could not drop the queued messages.

    They wait again in their places (the store still holds them; they run
    as if no ``/stop`` had come); ``kept`` counts them. Its text is the
    cause's as users may see it (:func:`~chatlane.errors.shown_to_users`).
    """

    def __init__(self, stopped_turn: bool, kept: int, cause: ChatlaneError) -> None:
        super().__init__(shown_to_users(cause))
        self.stopped_turn = stopped_turn
        self.kept = kept


__all__ = ["LeaseSettings", "RuntimeSettings", "StopIncomplete", "StopResult"]
