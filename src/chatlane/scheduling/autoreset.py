"""Auto-reset: conversations that end on their own, after idle time or at a daily hour.

The :class:`~chatlane.scheduling.loop.Scheduler` feeds an :class:`ActivityTracker`
from the gateway (every message a person sends, every reply they get) and asks
an :class:`AutoResetter` on each pass which sessions are due. What stays true:

* :func:`resolve` is pure: the chat type's policy beats the platform's, which
  beats the default — the same order as the busy policies.
* A session is never reset while a turn runs for it in any process sharing
  the store, nor while a message waits for it there. A due idle reset simply
  waits (the turn's reply is activity, so the idle time starts again); a due
  daily reset is remembered and done as soon as the session is idle.
* Looking never disturbs the session: whether another process runs it is a
  read of the store (:meth:`~chatlane.stores.protocols.Leases.lease_holder`),
  never a lease taken and given back. Such a lease would guard nothing the
  read does not (the reset keeps no lease while it ends the conversation),
  but a person's message arriving while it was held would find the session
  busy elsewhere and get the busy policy's answer (refused, "queued",
  "interrupting") for a turn that does not exist. A message that arrives
  here before the session is stopped is activity, and the last check, after
  every await, calls the reset off; one arriving after it starts the new
  conversation.
* What a person said through another process counts as activity too: the
  store's transcript is checked before a reset, and a newer message than the
  tracker knows postpones it (the tracker then counts from that message).
* Every reset goes through :func:`chatlane.lifecycle.end_conversation` with
  the gateway's ``before_reset`` hook. If a message arrives or a turn starts
  while the hook runs, that reset is called off (nothing changed) and the
  session is looked at again on a later pass.
* Tracking is bounded: at most ``cap`` sessions, least recently active
  dropped first, and a session is forgotten once it was reset. Only sessions
  seen since this process started are tracked.
"""

from __future__ import annotations

import datetime as dt
import logging
import math
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, NoReturn

from chatlane.errors import ChatlaneError, ConfigError
from chatlane.identity import ChatType, SessionSource
from chatlane.lifecycle import BeforeReset, EndReason, end_conversation
from chatlane.runtime import pending
from chatlane.state import SlotPhase
from chatlane.stores.base import Conversation
from chatlane.types import OutboundKind, SessionKey

if TYPE_CHECKING:
    from chatlane.runtime.engine import TurnEngine

__all__ = [
    "Activity",
    "ActivityTracker",
    "AutoResetPolicy",
    "AutoResetSettings",
    "AutoResetter",
    "DueReset",
    "daily_boundary",
    "due_reason",
    "notice_text",
    "resolve",
]

log = logging.getLogger("chatlane.scheduler")

RECENT = 50
"""How many of the newest transcript entries are searched for a person's last message."""


@dataclass(frozen=True, slots=True)
class AutoResetPolicy:
    """When a session's conversation ends by itself; the default policy never resets.

    :param idle_after: seconds without activity after which it ends (None: never).
    :param daily_at_hour: hour (0-23, in the scheduler's time zone) at which every
        conversation active since the previous such hour ends (None: never).
    :param notify: tell the chat when its conversation was reset.
    :raises ConfigError: for a non-positive ``idle_after`` or an hour outside 0-23.
    """

    idle_after: float | None = None
    daily_at_hour: int | None = None
    notify: bool = True

    def __post_init__(self) -> None:
        idle = self.idle_after
        if idle is not None and not (idle > 0 and math.isfinite(idle)):
            raise ConfigError(f"auto-reset idle_after must be positive and finite, not {idle!r}")
        if self.daily_at_hour is not None and not 0 <= self.daily_at_hour <= 23:
            raise ConfigError(f"auto-reset daily_at_hour must be 0-23, not {self.daily_at_hour!r}")

    @property
    def enabled(self) -> bool:
        """Whether this policy ever resets anything."""
        return self.idle_after is not None or self.daily_at_hour is not None


@dataclass(frozen=True, slots=True)
class AutoResetSettings:
    """The auto-reset policy for the whole gateway, per platform and per chat type."""

    default: AutoResetPolicy = field(default_factory=AutoResetPolicy)
    per_platform: Mapping[str, AutoResetPolicy] = field(default_factory=dict)
    per_chat_type: Mapping[ChatType, AutoResetPolicy] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "per_platform", MappingProxyType(dict(self.per_platform)))
        object.__setattr__(self, "per_chat_type", MappingProxyType(dict(self.per_chat_type)))


def resolve(settings: AutoResetSettings, source: SessionSource) -> AutoResetPolicy:
    """The policy for ``source``: its chat type's, else its platform's, else the default."""
    by_chat_type = settings.per_chat_type.get(source.chat_type)
    if by_chat_type is not None:
        return by_chat_type
    return settings.per_platform.get(source.platform, settings.default)


@dataclass(slots=True)
class Activity:
    """What the tracker knows of one session: where it talks, and when it last did."""

    source: SessionSource
    last_at: float
    daily_due: bool = False
    """A daily reset found the session busy; it is reset as soon as it is idle."""


class ActivityTracker:
    """The last activity of at most ``cap`` sessions, least recently active evicted first."""

    def __init__(self, cap: int = 10_000) -> None:
        if cap < 1:
            raise ConfigError(f"the activity tracker's cap must be positive, not {cap}")
        self.cap = cap
        self._entries: OrderedDict[SessionKey, Activity] = OrderedDict()

    def touch(self, key: SessionKey, source: SessionSource, at: float) -> None:
        """Record that ``key`` was active at ``at``, from ``source`` (its latest chat/thread)."""
        entry = self._entries.get(key)
        if entry is None:
            self._entries[key] = Activity(source, at)
        else:
            entry.source, entry.last_at = source, max(entry.last_at, at)
            self._entries.move_to_end(key)
        while len(self._entries) > self.cap:
            evicted, _ = self._entries.popitem(last=False)
            log.debug("auto-reset no longer tracks %s (cap %d)", evicted, self.cap)

    def refresh(self, key: SessionKey, at: float) -> None:
        """Count activity of a tracked session (a reply it got); untracked keys are ignored."""
        entry = self._entries.get(key)
        if entry is not None:
            self.touch(key, entry.source, at)

    def forget(self, key: SessionKey) -> None:
        """Stop tracking ``key`` (after its reset)."""
        self._entries.pop(key, None)

    def get(self, key: SessionKey) -> Activity | None:
        """What is known of ``key``, if it is tracked."""
        return self._entries.get(key)

    def snapshot(self) -> list[tuple[SessionKey, Activity]]:
        """Every tracked session, least recently active first."""
        return list(self._entries.items())

    def __len__(self) -> int:
        return len(self._entries)


def daily_boundary(moment: float, hour: int, tz: dt.tzinfo) -> float:
    """The latest ``hour``:00 in ``tz`` at or before ``moment`` (epoch seconds)."""
    local = dt.datetime.fromtimestamp(moment, tz)
    day = local.date() if local.hour >= hour else local.date() - dt.timedelta(days=1)
    return dt.datetime(day.year, day.month, day.day, hour, tzinfo=tz).timestamp()


def due_reason(
    policy: AutoResetPolicy, activity: Activity, moment: float, tz: dt.tzinfo
) -> EndReason | None:
    """Why ``activity``'s session should be reset at ``moment``, or None if it should not."""
    if activity.daily_due:
        return EndReason.DAILY
    if policy.idle_after is not None and moment - activity.last_at >= policy.idle_after:
        return EndReason.IDLE
    hour = policy.daily_at_hour
    if hour is not None and activity.last_at < daily_boundary(moment, hour, tz):
        return EndReason.DAILY
    return None


@dataclass(frozen=True, slots=True)
class DueReset:
    """One reset to carry out now."""

    key: SessionKey
    reason: EndReason
    policy: AutoResetPolicy
    source: SessionSource
    last_at: float


class _CalledOff(ChatlaneError):
    """The session came back to life while the before_reset hook ran."""


class _AlreadyNew(ChatlaneError):
    """The current conversation began after the activity the reset was planned on."""


class AutoResetter:
    """Finds the sessions due for a reset and resets them through the lifecycle funnel.

    :param internal_ids: prefixes of the ids of messages no person sent (jobs,
        completions): in the transcript, they are not activity.
    """

    def __init__(
        self,
        settings: AutoResetSettings,
        tracker: ActivityTracker,
        tz: dt.tzinfo,
        internal_ids: tuple[str, ...] = (),
    ):
        self.settings = settings
        self.tracker = tracker
        self.tz = tz
        self.internal_ids = internal_ids

    def due(self, engine: TurnEngine, moment: float) -> list[DueReset]:
        """The resets to start at ``moment``; a daily one due for a busy session is remembered."""
        found = []
        for key, activity in self.tracker.snapshot():
            policy = resolve(self.settings, activity.source)
            reason = due_reason(policy, activity, moment, self.tz)
            if reason is None:
                continue
            if _busy(engine, key):
                activity.daily_due = activity.daily_due or reason is EndReason.DAILY
                continue
            found.append(DueReset(key, reason, policy, activity.source, activity.last_at))
        return found

    async def reset(
        self, engine: TurnEngine, due: DueReset, before_reset: BeforeReset | None
    ) -> bool:
        """End ``due``'s conversation, tell its chat if the policy says so; False if called off.

        A failing ``before_reset`` hook is logged and the session is left as
        it was (and no longer tracked, so the hook is not retried every pass).
        """
        if not await self._quiet(engine, due):  # asked before the hook is bothered
            return False
        hook = self._guarded(engine, due, before_reset)
        try:
            await end_conversation(engine, due.key, due.reason, before_reset=hook)
        except _CalledOff:
            log.info("auto-reset of %s called off: the session is active again", due.key)
            return False
        except _AlreadyNew:
            log.info("auto-reset of %s not needed: a newer conversation began", due.key)
            self.tracker.forget(due.key)
            return False
        except Exception:
            log.exception("before_reset (or the store) failed; %s was not reset", due.key)
            self.tracker.forget(due.key)
            return False
        self.tracker.forget(due.key)
        if due.policy.notify:
            text = notice_text(due.reason, due.policy)
            await engine.send(OutboundKind.NOTICE, due.key, due.source, text)
        return True

    def _guarded(
        self, engine: TurnEngine, due: DueReset, before_reset: BeforeReset | None
    ) -> BeforeReset:
        async def hook(key: SessionKey, reason: EndReason, conversation: Conversation) -> None:
            if conversation.started_at > due.last_at:
                raise _AlreadyNew(key)  # another process's reset, or a /new, came first
            if before_reset is not None:
                await before_reset(key, reason, conversation)
            await self._check_store(engine, due)
            # last, with no await until the funnel stops the session: a message
            # that arrived during the awaits above calls the reset off
            entry = self.tracker.get(key)
            if entry is None or entry.last_at != due.last_at or _busy(engine, key):
                self._call_off(due)

        return hook

    async def _quiet(self, engine: TurnEngine, due: DueReset) -> bool:
        """Whether no process runs or is about to run the session, and no one talked there."""
        try:
            await self._check_store(engine, due)
        except _CalledOff:
            log.info("auto-reset of %s postponed: the session is active elsewhere", due.key)
            return False
        return True

    async def _check_store(self, engine: TurnEngine, due: DueReset) -> None:
        """Call the reset off if another process runs the session, or a person talked there.

        :raises _CalledOff: a message waits for the session or a turn holds its
            lease (in any process), or the transcript has a person's message
            newer than the tracker's last activity (which then moves to it).
        """
        store = engine.store
        if await store.pending(due.key) or await self._leased(engine, due.key):
            self._call_off(due)
        spoke_at = await self._last_spoken(engine, due.key)
        if spoke_at > due.last_at:
            self.tracker.refresh(due.key, spoke_at)
            self._call_off(due)

    @staticmethod
    async def _leased(engine: TurnEngine, key: SessionKey) -> bool:
        """Whether a turn holds ``key``'s lease, in any process (the reset's own hold of
        the lease, :meth:`~chatlane.runtime.engine.TurnEngine.hold_boundary`, is none)."""
        holder = await engine.store.lease_holder(key)
        return holder is not None and not (holder == engine.holder and engine.holds_boundary(key))

    async def _last_spoken(self, engine: TurnEngine, key: SessionKey) -> float:
        """When a person's newest message in the current conversation was stored (0: none seen)."""
        for entry in reversed(await engine.store.transcript(key, limit=RECENT)):
            if entry.role == "user" and not entry.message_id.startswith(self.internal_ids):
                return entry.created_at
        return 0.0

    def _call_off(self, due: DueReset) -> NoReturn:
        """Give up this reset; a daily one stays due, to be done once the session is idle."""
        entry = self.tracker.get(due.key)
        if entry is not None and due.reason is EndReason.DAILY:
            entry.daily_due = True
        raise _CalledOff(due.key)


def _busy(engine: TurnEngine, key: SessionKey) -> bool:
    """A turn holds ``key``'s slot here, or a message waits for one (the reset's own
    hold of the slot is not activity; what arrived during it waits)."""
    state = engine.registry.peek(key)
    if state is None:
        return False
    held_for_reset = state.turn.phase is SlotPhase.ENDING
    return (state.turn.is_running and not held_for_reset) or pending.pending_count(state) > 0


def notice_text(reason: EndReason, policy: AutoResetPolicy) -> str:
    """What the chat is told after an auto-reset."""
    if reason is EndReason.IDLE and policy.idle_after is not None:
        head = f"This conversation was idle for {_duration(policy.idle_after)}, so it was closed."
    else:
        head = "The daily reset closed this conversation."
    return f"{head} Your next message starts a new one."


def _duration(seconds: float) -> str:
    for unit, size in (("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.3g}{unit}"
    return f"{seconds:.3g}s"
