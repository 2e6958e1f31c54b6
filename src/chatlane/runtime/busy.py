"""What happens to a message that arrives while its session runs a turn.

:class:`BusyPolicy` names the behaviours; :func:`resolve_policy` picks the one
in force for a message (session, then chat type, then platform, then the
gateway default); :func:`decide` applies it. Both are pure: the engine carries
out the :class:`BusyOutcome` they return. Every outcome either runs the message
eventually or answers its sender, so no message is ever dropped silently.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from chatlane.errors import ConfigError
from chatlane.identity import ChatType, SessionSource


class BusyPolicy(enum.StrEnum):
    """How a session treats a message that arrives while a turn runs."""

    QUEUE = "queue"
    """First in, first out: the message becomes its own turn after the current one."""
    COLLECT = "collect"
    """Merged with the other messages that arrive while busy into one follow-up turn."""
    ROLLBACK = "rollback"
    """The running turn is stopped, nothing of it is kept, and the message runs next."""
    INTERRUPT = "rollback"
    """The former name of :attr:`ROLLBACK`, still read everywhere a policy is named."""
    REDIRECT = "redirect"
    """The running turn stops at its next safe point and keeps what it did: its input
    and the reply shown so far (marked as cut short) are committed, and the message
    runs next with all of it as context. A turn that finds no safe point within
    ``interrupt_grace`` is rolled back instead."""
    STEER = "steer"
    """The text is handed to the running turn, if its agent accepts steering; what the
    agent never took runs as a follow-up turn. Until taken it waits as a queued message
    does, and counts against ``queue_cap``."""
    STEER_BACKLOG = "steer"
    """Another name of :attr:`STEER` (``steer-backlog``): a steered message the agent
    never took is kept for a follow-up turn, never lost."""
    REJECT = "reject"
    """The sender is told the session is busy; the message is not run."""

    @classmethod
    def parse(cls, value: str, *, what: str = "busy policy") -> BusyPolicy:
        """Read a policy name, raising :class:`ConfigError` that lists the choices."""
        try:
            return cls(value.strip().lower())
        except ValueError:
            choices = ", ".join(p.value for p in cls)
            raise ConfigError(
                f"{what}: {value!r} is not one of: {choices} "
                "(or interrupt, for rollback; steer-backlog, for steer)"
            ) from None

    @classmethod
    def _missing_(cls, value: object) -> BusyPolicy | None:
        """Other names: ``interrupt`` (the former name, in configs and stores) reads as
        :attr:`ROLLBACK`, ``steer-backlog`` as :attr:`STEER`."""
        return _OTHER_NAMES.get(str(value))


_OTHER_NAMES = {"interrupt": BusyPolicy.ROLLBACK, "steer-backlog": BusyPolicy.STEER}

NOW = "now"
"""The busy policy ``/now`` sends its text under: the session's interrupt flavour,
:attr:`BusyPolicy.REDIRECT` where that is the session's policy, else
:attr:`BusyPolicy.ROLLBACK`."""


def interrupt_flavour(policy: BusyPolicy) -> BusyPolicy:
    """How a message that must interrupt (``/now``) does so under the session's ``policy``."""
    return BusyPolicy.REDIRECT if policy is BusyPolicy.REDIRECT else BusyPolicy.ROLLBACK


class Overflow(enum.StrEnum):
    """What one more message does to a session where ``queue_cap`` messages wait: queued,
    or steered into the running turn and not taken by its agent yet."""

    REFUSE_NEW = "refuse-new"
    """The new message is refused with a "Queue full" notice; what waits stays as it is."""
    DROP_OLDEST = "drop-oldest"
    """The oldest waiting message (queued or steered) is dropped (its sender is told) and
    the new one waits."""
    SUMMARIZE = "summarize"
    """Every waiting message (steered ones the agent has not taken too) and the new one
    become one turn, whose agent is told they were collapsed; the sender of each
    collapsed message is told."""

    @classmethod
    def parse(cls, value: str) -> Overflow:
        """Read an overflow name, raising :class:`ConfigError` that lists the choices."""
        try:
            return cls(str(value).strip().lower())
        except ValueError:
            choices = ", ".join(o.value for o in cls)
            raise ConfigError(f"overflow: {value!r} is not one of: {choices}") from None


class BusyOutcome(enum.StrEnum):
    """What the engine does with a message for a busy session."""

    QUEUED = "queued"
    MERGED = "merged"
    INTERRUPTING = "interrupting"
    REDIRECTING = "redirecting"
    STEERED = "steered"
    REJECTED = "rejected"
    QUEUE_FULL = "queue_full"
    COLLAPSED = "collapsed"


_QUEUEING = frozenset(
    {BusyOutcome.QUEUED, BusyOutcome.MERGED, BusyOutcome.INTERRUPTING, BusyOutcome.REDIRECTING}
)

_WAITING = _QUEUEING | {BusyOutcome.STEERED}
"""The outcomes that leave the message waiting here: what ``queue_cap`` bounds."""

ALWAYS_ANSWERED = frozenset({BusyOutcome.REJECTED, BusyOutcome.QUEUE_FULL})
"""Outcomes whose notice is never debounced: the message will not run."""


def _frozen(mapping: Mapping[str, BusyPolicy]) -> Mapping[str, BusyPolicy]:
    return MappingProxyType(dict(mapping))


@dataclass(frozen=True, slots=True)
class BusySettings:
    """The busy policy for the whole gateway, per platform and per chat type."""

    default: BusyPolicy = BusyPolicy.QUEUE
    per_platform: Mapping[str, BusyPolicy] = field(default_factory=dict)
    per_chat_type: Mapping[ChatType, BusyPolicy] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "per_platform", _frozen(self.per_platform))
        object.__setattr__(self, "per_chat_type", MappingProxyType(dict(self.per_chat_type)))


def resolve_policy(
    settings: BusySettings, source: SessionSource, session_policy: BusyPolicy | None
) -> BusyPolicy:
    """The policy in force: the session's own, else chat type's, else platform's, else default."""
    if session_policy is not None:
        return session_policy
    by_chat_type = settings.per_chat_type.get(source.chat_type)
    if by_chat_type is not None:
        return by_chat_type
    return settings.per_platform.get(source.platform, settings.default)


@dataclass(frozen=True, slots=True)
class BusyContext:
    """The facts :func:`decide` needs about a busy session."""

    queued: int
    queue_cap: int
    steers_waiting: int
    """Messages steered into the running turn that its agent has not taken yet: they wait
    as queued ones do, and count against ``queue_cap`` with them."""
    internal: bool
    agent_accepts_steering: bool
    from_turn_author: bool
    """The message is by the running turn's author: only such a message is steered into
    it, so that its agent and tools never act for one person on another's request."""
    interrupt_streak: int
    interrupt_depth: int
    already_interrupted: bool
    winding_down: bool
    """The running turn let the session go (``/stop``, ``/new``, an interrupt, its agent's
    failure) and only winds down: the session is free here once it is gone."""


def decide(policy: BusyPolicy, ctx: BusyContext) -> BusyOutcome:
    """Apply ``policy`` to one message arriving at a busy session.

    Internal events always queue. Steering falls back to queueing when the
    agent does not accept it, when messages already wait (a steered message
    must never overtake them), or when the message is another person's than the
    running turn's author's (in a shared thread: it runs as its own turn); an
    interrupt falls back to queueing when the
    running turn is already being interrupted (or redirected) or the session
    has been interrupted ``interrupt_depth`` times in a row; so does a
    redirect. ``reject`` refuses nothing for a turn that is only winding down (after
    a ``/stop`` or ``/new``): the message queues, to run once that turn is gone.
    Anything that would wait past the cap (queued, merged, or steered and not yet
    taken: ``queued + steers_waiting`` messages wait already) is refused with
    :attr:`BusyOutcome.QUEUE_FULL`.
    """
    outcome = _preferred(policy, ctx)
    if outcome in _WAITING and ctx.queued + ctx.steers_waiting >= ctx.queue_cap:
        return BusyOutcome.QUEUE_FULL
    return outcome


def _preferred(policy: BusyPolicy, ctx: BusyContext) -> BusyOutcome:
    if ctx.internal:
        return BusyOutcome.QUEUED
    if policy is BusyPolicy.REJECT:
        return BusyOutcome.QUEUED if ctx.winding_down else BusyOutcome.REJECTED
    if policy is BusyPolicy.COLLECT:
        return BusyOutcome.MERGED
    if policy is BusyPolicy.STEER and _may_steer(ctx):
        return BusyOutcome.STEERED
    if policy is BusyPolicy.ROLLBACK and _may_interrupt(ctx):
        return BusyOutcome.INTERRUPTING
    if policy is BusyPolicy.REDIRECT and _may_interrupt(ctx):
        return BusyOutcome.REDIRECTING
    return BusyOutcome.QUEUED


def _may_steer(ctx: BusyContext) -> bool:
    return ctx.agent_accepts_steering and ctx.from_turn_author and ctx.queued == 0


def _may_interrupt(ctx: BusyContext) -> bool:
    return not ctx.already_interrupted and ctx.interrupt_streak < ctx.interrupt_depth


BUSY_ELSEWHERE = "Queued for the next turn (this conversation is busy)"
"""The ack for a message that waits while another process runs its session."""

STEERED_ELSEWHERE = "Sent on to the current run (this conversation is busy)"
"""The ack for a message another process's running turn will draw in and steer (or, if
its agent never takes it, run next)."""

COLLECTED_ELSEWHERE = "Added to the next turn (this conversation is busy)"
"""The ack for a message another process's running turn will draw in and collect."""


def collapsed_text(messages: int) -> str:
    """What the sender of each of ``messages`` collapsed into one turn is told."""
    return f"Queue full — {messages} waiting messages were collapsed into one turn"


def collapsed_note(messages: int) -> str:
    """What the agent of a turn collapsed from ``messages`` reads before their text."""
    return (
        f"[{messages} messages that waited in a full queue were collapsed into this one "
        "turn; answer them together]"
    )


def ack_text(outcome: BusyOutcome, queued: int) -> str:
    """The short acknowledgement the sender gets for ``outcome``."""
    texts = {
        BusyOutcome.QUEUED: f"Queued for the next turn ({queued} queued)",
        BusyOutcome.MERGED: f"Added to the next turn ({queued} collected)",
        BusyOutcome.INTERRUPTING: "Interrupting the current task",
        BusyOutcome.REDIRECTING: "Redirecting: the current reply stops here, your message is next",
        BusyOutcome.STEERED: "Steered into the current run",
        BusyOutcome.REJECTED: "Busy — your message was not run",
        BusyOutcome.QUEUE_FULL: f"Queue full ({queued} queued) — your message was not run",
        BusyOutcome.COLLAPSED: collapsed_text(queued),
    }
    return texts[outcome]
