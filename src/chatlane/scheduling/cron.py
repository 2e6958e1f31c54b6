"""Scheduled jobs: when they run, what they are, and how their ticks are claimed.

A :data:`Schedule` turns "the last moment considered" into "the next tick"
(epoch seconds). What stays true:

* ``next_after(t)`` is strictly greater than ``t`` and depends only on ``t``,
  the schedule, its anchor and the time zone — so every process that shares a
  store computes the same ticks, and a tick's epoch names it everywhere.
* A cron expression that can never match (``0 0 30 2 *``) is refused when it
  is parsed, never discovered by a scheduler that waits forever.
* Cron fields are ``minute hour day-of-month month day-of-week`` with ``*``,
  lists, ranges, steps (``*/15``, ``1-30/5``, ``5/15``), month and day names
  (``jan``…``dec``, ``sun``…``sat``; 0 and 7 are Sunday) and the ``@hourly``
  ``@daily`` ``@midnight`` ``@weekly`` ``@monthly`` ``@yearly`` ``@annually``
  shorthands. As in Vixie cron, when both day fields are restricted a day
  matching either one matches.
* A :class:`Job` is valid once built: its schedule parses, its target is
  ``origin`` (with an origin), ``local`` or ``platform:chat_id[:thread_id]``.
* :meth:`JobBook.claim` says :attr:`Claim.CLAIMED` for one tick of one job to
  exactly one caller, across every process sharing the store — even when a
  claimer stalls past its lease (its fenced write is then refused).
"""

from __future__ import annotations

import calendar
import datetime as dt
import enum
import functools
import hashlib
import logging
import re
import socket
from dataclasses import dataclass
from typing import Final, TypeAlias

import msgspec

from chatlane.errors import (
    ChatlaneError,
    ConfigError,
    LeaseError,
    SessionBusy,
    StaleGeneration,
    StoreError,
)
from chatlane.identity import ChatType, SessionSource, unescape_component
from chatlane.stores.base import Lease, Store
from chatlane.stores.fields import JOB_PREFIX, LAST_TICK, LAST_TICK_CLOCK, job_field
from chatlane.types import SessionKey, Target

log = logging.getLogger("chatlane.scheduler")

__all__ = [
    "LOCAL",
    "MAX_INTERVAL",
    "ORIGIN",
    "Claim",
    "CronExpression",
    "Interval",
    "Job",
    "JobBook",
    "JobRun",
    "Schedule",
    "explicit_target",
    "parse_schedule",
    "run_source",
]

MONTHS: Final = {name.lower(): i for i, name in enumerate(calendar.month_abbr) if name}
WEEKDAYS: Final = {"sun": 0, "mon": 1, "tue": 2, "wed": 3, "thu": 4, "fri": 5, "sat": 6}
MACROS: Final = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}
UNITS: Final = {"s": 1, "sec": 1, "second": 1, "m": 60, "min": 60, "minute": 60}
UNITS.update({"h": 3600, "hr": 3600, "hour": 3600})
_EVERY: Final = re.compile(r"every\s+([0-9]+)\s*([a-z]+)", re.IGNORECASE)
_HORIZON: Final = dt.timedelta(days=146_097 + 1)
"""How far ahead a match is looked for: one whole Gregorian cycle (400 years), after which
the calendar, weekdays included, repeats — so what is not found in it never matches."""
_LONGEST: Final = (0, 31, 29, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31)
"""The most days each month (index 1-12) ever has."""
MAX_INTERVAL: Final = 366 * 86_400
"""The longest interval (366 days): beyond it, ticks leave what the clock can name."""


@dataclass(frozen=True, slots=True)
class _Field:
    name: str
    low: int
    high: int
    names: dict[str, int]


_FIELDS: Final = (
    _Field("minute", 0, 59, {}),
    _Field("hour", 0, 23, {}),
    _Field("day of month", 1, 31, {}),
    _Field("month", 1, 12, MONTHS),
    _Field("day of week", 0, 7, WEEKDAYS),
)


def _number(text: str) -> int | None:
    """``text`` as a whole number written in ASCII digits, or None if it is not one."""
    if not (text.isascii() and text.isdecimal()):  # Arabic-Indic digits are decimal too
        return None
    try:
        return int(text)
    except ValueError:  # more digits than int() converts
        return None


def _value(text: str, spec: _Field) -> int:
    number = spec.names.get(text.lower())
    if number is None:
        number = _number(text)
    if number is None:
        raise ConfigError(f"cron {spec.name}: {text!r} is not a number or name")
    if not spec.low <= number <= spec.high:
        raise ConfigError(f"cron {spec.name}: {number} is outside {spec.low}-{spec.high}")
    return number


def _part(text: str, spec: _Field) -> set[int]:
    span, slash, step_text = text.partition("/")
    step = _number(step_text) or 0
    if slash and step < 1:
        raise ConfigError(f"cron {spec.name}: step {step_text!r} must be a positive number")
    if span == "*":
        low, high = spec.low, spec.high
    elif "-" in span:
        low, high = (_value(end, spec) for end in span.split("-", 1))
        if low > high:
            raise ConfigError(f"cron {spec.name}: range {span!r} runs backwards")
    else:
        low = _value(span, spec)
        high = spec.high if slash else low
    return set(range(low, high + 1, step or 1))


def _field(text: str, spec: _Field) -> tuple[int, ...]:
    values: set[int] = set()
    for part in text.split(","):
        values |= _part(part, spec)
    if spec.name == "day of week" and 7 in values:
        values = (values - {7}) | {0}
    return tuple(sorted(values))


@dataclass(frozen=True, slots=True)
class CronExpression:
    """A parsed five-field cron expression; build it with :meth:`parse`."""

    text: str
    minutes: tuple[int, ...]
    hours: tuple[int, ...]
    days: tuple[int, ...]
    months: tuple[int, ...]
    weekdays: tuple[int, ...]
    any_day: bool
    any_weekday: bool

    @classmethod
    def parse(cls, text: str) -> CronExpression:
        """Read ``text``; raise :class:`ConfigError` naming the field that is wrong."""
        words = MACROS.get(text.strip().lower(), text).split()
        if len(words) != 5:
            raise ConfigError(
                f"a cron expression has 5 fields (minute hour day month weekday), not "
                f"{len(words)}: {text!r}"
            )
        minutes, hours, days, months, weekdays = (
            _field(word, spec) for word, spec in zip(words, _FIELDS, strict=True)
        )
        any_day, any_weekday = words[2].startswith("*"), words[4].startswith("*")
        canonical = " ".join(text.split())
        expression = cls(canonical, minutes, hours, days, months, weekdays, any_day, any_weekday)
        if not expression._has_a_date() or expression.next_after(0.0) is None:
            raise ConfigError(f"cron expression {text!r} never matches a real date")
        return expression

    def _has_a_date(self) -> bool:
        """Whether a day can match at all: false when every (month, day) pair it needs is absent."""
        if not (self.any_day or self.any_weekday):
            return True  # either day field may match, and some weekday always does
        return any(day <= _LONGEST[month] for month in self.months for day in self.days)

    def matches_day(self, day: dt.date) -> bool:
        """Whether ``day`` is one the expression runs on (month, then the two day fields)."""
        if day.month not in self.months:
            return False
        by_date = day.day in self.days
        by_weekday = (day.weekday() + 1) % 7 in self.weekdays
        if self.any_day or self.any_weekday:
            return by_date and by_weekday
        return by_date or by_weekday

    def next_after(
        self, moment: float, *, anchor: float = 0.0, tz: dt.tzinfo = dt.UTC
    ) -> float | None:
        """The first matching minute strictly after ``moment`` in ``tz``, or None if none ever is.

        None too past the years :mod:`datetime` names (9999): never an error.

        ``anchor`` is ignored (cron ticks sit on the wall clock). A wall-clock
        time skipped by a daylight-saving change runs at the instant it maps
        to; a repeated one runs once.
        """
        try:
            return self._search(moment, tz)
        except (OverflowError, ValueError):  # a moment beyond the years datetime can name
            return None

    def _search(self, moment: float, tz: dt.tzinfo) -> float | None:
        day = dt.datetime.fromtimestamp(moment, tz).date()
        end = day + _HORIZON
        while day < end:
            if day.month not in self.months:
                day = (day.replace(day=1) + dt.timedelta(days=31)).replace(day=1)
                continue
            if self.matches_day(day):
                found = min((t for t in self._times(day, tz) if t > moment), default=None)
                if found is not None:
                    return found
            day += dt.timedelta(days=1)
        return None

    def _times(self, day: dt.date, tz: dt.tzinfo) -> list[float]:
        return [
            dt.datetime(day.year, day.month, day.day, hour, minute, tzinfo=tz).timestamp()
            for hour in self.hours
            for minute in self.minutes
        ]


@dataclass(frozen=True, slots=True)
class Interval:
    """Every ``seconds``, counted from the job's anchor (its creation time)."""

    text: str
    seconds: int

    @classmethod
    def parse(cls, text: str) -> Interval:
        """Read ``every <n>s|m|h`` (``sec``/``min``/``hour`` and plurals work too).

        :raises ConfigError: if ``text`` is not one, or is under a second or over
            :data:`MAX_INTERVAL` (366 days).
        """
        match = _EVERY.fullmatch(text.strip())
        unit = _unit(match.group(2)) if match else None
        count = _number(match.group(1)) if match else None
        if match is None or unit is None or count is None:
            raise ConfigError(
                f"an interval reads like `every 30s`, `every 5m` or `every 2h`: {text!r}"
            )
        if count * unit < 1:
            raise ConfigError(f"an interval must be at least one second: {text!r}")
        if count * unit > MAX_INTERVAL:
            raise ConfigError(f"an interval may be at most 366 days (8784h): {text!r}")
        return cls(f"every {match.group(1)}{match.group(2).lower()[0]}", count * unit)

    def next_after(
        self, moment: float, *, anchor: float = 0.0, tz: dt.tzinfo = dt.UTC
    ) -> float | None:
        """The first ``anchor + k * seconds`` (k ≥ 1) after ``moment``; ``tz`` is ignored."""
        if moment < anchor:
            return anchor + self.seconds
        return anchor + ((moment - anchor) // self.seconds + 1) * self.seconds


def _unit(word: str) -> int | None:
    word = word.lower()
    if word not in UNITS and len(word) > 2 and word.endswith("s"):
        word = word[:-1]
    return UNITS.get(word)


Schedule: TypeAlias = CronExpression | Interval


def parse_schedule(text: str) -> Schedule:
    """An interval for ``every …``, else a cron expression (or ``@daily``-style shorthand).

    A text is parsed once (a schedule is immutable, and checking that a cron
    expression ever matches can take milliseconds): reloading thousands of jobs
    that share a few schedules, as every sync does, costs a few parses, not thousands.

    :raises ConfigError: if ``text`` is neither, with what was expected.
    """
    return _parsed(text)


@functools.lru_cache(maxsize=1024)
def _parsed(text: str) -> Schedule:
    if text.strip().lower().startswith("every"):
        return Interval.parse(text)
    return CronExpression.parse(text)


# -- jobs ----------------------------------------------------------------------------

ORIGIN, LOCAL = "origin", "local"
"""Targets: the chat a job was created in; no chat at all (the store keeps the result)."""


def explicit_target(text: str) -> Target:
    """Read ``platform:chat_id[:thread_id]`` (``:`` inside an id is written ``%3A``, and
    ``%`` as ``%25``).

    :raises ConfigError: if ``text`` does not have that shape.
    """
    parts = [unescape_component(part) for part in text.split(":")]
    if len(parts) not in (2, 3) or not all(parts):
        raise ConfigError(
            f"a job target is origin, local or platform:chat_id[:thread_id], not {text!r}"
        )
    return Target(parts[0], parts[1], parts[2] if len(parts) == 3 else None)


@dataclass(frozen=True, slots=True)
class Job:
    """A prompt sent on a schedule to a target.

    :param schedule: a cron expression or ``every <n>s|m|h``.
    :param target: ``origin``, ``local`` or ``platform:chat_id[:thread_id]``.
    :param origin: the chat the job was created from (required for ``origin``).
    :param id: stable across processes; derived from the content when empty.
    :param created_at: the anchor of an interval's ticks (epoch seconds).
    :raises ConfigError: for an empty prompt, a bad schedule or a bad target.
    """

    schedule: str
    prompt: str
    target: str = LOCAL
    origin: SessionSource | None = None
    id: str = ""
    created_at: float = 0.0

    def __post_init__(self) -> None:
        if not self.prompt.strip():
            raise ConfigError("a job needs a prompt")
        parse_schedule(self.schedule)
        if self.target == ORIGIN and self.origin is None:
            raise ConfigError("a job whose target is origin needs the chat it came from")
        if self.target not in (ORIGIN, LOCAL):
            explicit_target(self.target)
        if not self.id:
            content = "\0".join((self.schedule, self.prompt, self.target)).encode()
            object.__setattr__(self, "id", "cfg-" + hashlib.sha256(content).hexdigest()[:8])


def run_source(job: Job) -> SessionSource:
    """The source a job's prompt is sent from: its origin, or one made from its target.

    An explicit target without a thread is written as a DM of that chat, one
    with a thread as that thread; a ``local`` job gets the chat ``local:<id>``.
    """
    if job.target == ORIGIN and job.origin is not None:
        return job.origin
    if job.target == LOCAL:
        return SessionSource(LOCAL, chat_id=job.id)
    target = explicit_target(job.target)
    chat_type = ChatType.THREAD if target.thread_id else ChatType.DM
    return SessionSource(
        target.platform, chat_id=target.chat_id, chat_type=chat_type, thread_id=target.thread_id
    )


@dataclass(frozen=True, slots=True)
class JobRun:
    """One tick of one job, and where its prompt goes."""

    job: Job
    tick: float
    session_key: SessionKey
    source: SessionSource
    message_id: str


CLOCK_SKEW = 300.0
"""Seconds by which a tick this host claimed may be ahead of its clock before it counts as
claimed by the clock before it was put right (:meth:`JobBook.claim`)."""


class Claim(enum.Enum):
    """What :meth:`JobBook.claim` found."""

    CLAIMED = "claimed"
    """This caller runs the tick."""
    TAKEN = "taken"
    """Someone already claimed it."""
    BUSY = "busy"
    """Another process is claiming it right now; ask again on the next pass."""
    GONE = "gone"
    """The job was removed."""


class JobBook:
    """Jobs and their claimed ticks in the store, through the plain Store protocol.

    Jobs are the persistent fields ``job:<id>`` of the key ``<namespace>:scheduler``
    (one field per job, so processes adding jobs at once never overwrite each
    other). The last claimed tick of a job is the field ``last_tick`` of
    ``<namespace>:scheduler:job:<id>``, written under that key's lease with
    the lease's generation. Both are store keys that no source can be given
    (:func:`~chatlane.identity.parse_session_key` refuses them), so neither is
    ever a session's.
    """

    def __init__(
        self, store: Store, namespace: str, holder: str, ttl: float, clock: str = ""
    ) -> None:
        """:param clock: the name of the clock claims are made by: this host's, by default."""
        self.store = store
        self.key = SessionKey(f"{namespace}:scheduler")
        self.holder = holder
        self.ttl = ttl
        self.clock = clock or socket.gethostname()

    async def load(self) -> dict[str, Job]:
        """Every stored job by id; a record that no longer reads as a job is logged and skipped."""
        jobs = {}
        for name, value in (await self.store.load_persistent(self.key)).items():
            if not name.startswith(JOB_PREFIX) or value is None:
                continue
            try:
                job = msgspec.convert(value, Job)
            except msgspec.ValidationError as error:
                log.warning("skipping stored job %s: %s", name, error)
                continue
            jobs[job.id] = job
        return jobs

    async def create(self, job: Job) -> bool:
        """Store ``job`` unless a job has its id already; whether it was stored.

        Under the lease its ticks are claimed under: of processes creating one id at
        once, one stores it, and the others find the lease held or the id taken. A
        save whose answer was lost is asked after, still under the lease: the job it
        finds is this one.

        :raises ChatlaneError: the store could not be asked, or did not store it.
        """
        try:
            lease = await self.store.acquire(self._claim_key(job.id), self.holder, self.ttl)
        except SessionBusy:
            return False
        try:
            if await self._exists(job.id):
                return False
            try:
                await self.save(job)
            except StoreError as error:
                if not error.maybe_applied or not await self._exists(job.id):
                    raise
            return True
        finally:
            await self._release(lease)

    async def save(self, job: Job) -> None:
        """Store ``job`` (replacing one with its id)."""
        await self.store.set_persistent(
            self.key, None, **{job_field(job.id): msgspec.to_builtins(job)}
        )

    async def delete(self, job_id: str) -> None:
        """Remove a stored job and its claim record."""
        await self.store.set_persistent(self.key, None, **{job_field(job_id): None})
        await self.store.set_persistent(self._claim_key(job_id), None, **{LAST_TICK: None})

    def _claim_key(self, job_id: str) -> SessionKey:
        return SessionKey(f"{self.key}:job:{job_id}")

    async def claim(
        self, job_id: str, tick: float, *, stored: bool = True, now: float | None = None
    ) -> Claim:
        """Claim ``tick`` of ``job_id`` (see :class:`Claim`); ``stored=False``: a configured job.

        A stored job is checked to still exist by reading its own field alone, so a
        claim costs the same however many jobs are stored, and N ticks due together
        read N fields, not N times every job.

        ``now``: the claimer's clock. A tick this host claimed later than it by more
        than :data:`CLOCK_SKEW` was claimed by this clock while it ran ahead, put right
        since (a tick is claimed only once due): it no longer holds back the ticks
        before it, which would otherwise wait until the wrong time came round again.
        Another host's claim always stands: its clock may still be ahead.
        """
        if stored and not await self._exists(job_id):
            return Claim.GONE
        try:
            lease = await self.store.acquire(self._claim_key(job_id), self.holder, self.ttl)
        except SessionBusy:
            return Claim.BUSY
        try:
            return await self._record(lease, tick, now)
        finally:
            await self._release(lease)

    async def _exists(self, job_id: str) -> bool:
        name = job_field(job_id)
        return (await self.store.load_fields(self.key, [name])).get(name) is not None

    async def _record(self, lease: Lease, tick: float, now: float | None) -> Claim:
        stored = await self.store.load_persistent(lease.key)
        last, clock = stored.get(LAST_TICK), stored.get(LAST_TICK_CLOCK)
        if isinstance(last, int | float) and last >= tick and not self._put_right(last, clock, now):
            return Claim.TAKEN
        written = {LAST_TICK: tick, LAST_TICK_CLOCK: self.clock}
        try:
            await self.store.set_persistent(lease.key, lease.generation, **written)
        except StaleGeneration:
            return Claim.BUSY
        return Claim.CLAIMED

    def _put_right(self, last: float, clock: object, now: float | None) -> bool:
        """Whether ``last``, a tick this host's clock (``clock``) claimed, is ahead of that
        clock by more than :data:`CLOCK_SKEW`: the clock ran ahead and was put right since
        (a tick is claimed only once due). Another host's claim ahead of this clock is
        that host's clock, perhaps still ahead: it stands, so no tick runs twice."""
        if now is None or clock != self.clock or last <= now + CLOCK_SKEW:
            return False
        log.warning(
            "a job's last claimed tick (%.0f) is ahead of this host's clock (%.0f): the clock "
            "ran ahead and was put right; claimed over it",
            last,
            now,
        )
        return True

    async def _release(self, lease: Lease) -> None:
        try:
            await self.store.release(lease)
        except LeaseError as error:
            log.info("claim lease on %s was already gone: %s", lease.key, error)
        except ChatlaneError as error:  # the claim stands; the lease runs out by its TTL
            log.warning("could not release the claim lease on %s: %s", lease.key, error)
