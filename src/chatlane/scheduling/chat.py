"""``/cron``: jobs created from a chat, and the limits that keep them bounded.

Session names are chosen by their senders (API callers and web browsers name
as many as they like), so a per-chat cap alone bounds nothing. What stays true:

* A chat sees and removes only the jobs created from it.
* A job created from a chat is refused unless it keeps every cap: at most
  ``chat_job_cap`` per chat, ``user_job_cap`` per principal (the platform and
  user id: the person, or the API client, not the session name) and
  ``total_job_cap`` for all chats together; and its runs are at least
  ``min_interval`` seconds apart. Adds are counted one after another (per
  process), so adds sent at once cannot all slip under a cap.
* Jobs the operator made (configuration, :meth:`Scheduler.add_job`) count
  against none of these caps, and the operator lists and removes every job
  (``chatlane cron``, ``/admin/cron``).
"""

from __future__ import annotations

import datetime as dt
import itertools
import re
from typing import TYPE_CHECKING

from chatlane.commands import CommandBusy, CommandCall, CommandSpec, UsageError, quoted
from chatlane.errors import ConfigError
from chatlane.identity import SessionSource, build_session_key
from chatlane.redaction import CREDENTIALS_REFUSED, looks_like_credential
from chatlane.scheduling.cron import ORIGIN, CronExpression, Job, Schedule, parse_schedule
from chatlane.types import SessionKey, visible

if TYPE_CHECKING:
    from chatlane.scheduling.loop import Scheduler

__all__ = [
    "CRON_COMMAND",
    "CRON_USAGE",
    "cron_command",
    "min_gap",
    "principal_of",
    "split_add",
]

CRON_USAGE = (
    '/cron add "<minute hour day month weekday>" <prompt> | /cron add every <n>s|m|h <prompt>'
    " | /cron list | /cron remove <id>"
)


def cron_command(scheduler: Scheduler | None) -> CommandSpec:
    """The ``/cron`` command for ``scheduler`` (``None``: it says scheduling is off)."""

    async def handler(call: CommandCall) -> str:
        if scheduler is None:
            return "Scheduled jobs are not enabled on this gateway."
        return await _cron(scheduler, call)

    return CommandSpec(
        "cron",
        "schedule a prompt for this chat, list or remove jobs",
        CRON_USAGE,
        CommandBusy.DISPATCH,
        handler,
    )


CRON_COMMAND = cron_command(None)
"""The placeholder in :func:`~chatlane.commands.default_router`; a scheduler replaces it."""


def principal_of(source: SessionSource) -> str:
    """Who a chat's jobs are counted against: the platform and the user (else the chat)."""
    who = source.user_id if source.user_id is not None else source.chat_id
    return f"{source.platform}:{who or ''}"


def min_gap(schedule: Schedule) -> float:
    """The shortest time (seconds) between two runs of ``schedule``, or an under-estimate.

    For a cron expression, the shortest gap between two of its times of day
    (the gap across midnight included, as if every day matched).
    """
    if not isinstance(schedule, CronExpression):
        return float(schedule.seconds)
    times = sorted(hour * 60 + minute for hour in schedule.hours for minute in schedule.minutes)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    gaps.append(times[0] + 1440 - times[-1])
    return 60.0 * min(gaps)


async def _cron(scheduler: Scheduler, call: CommandCall) -> str:
    verb, _, rest = call.args.strip().partition(" ")
    verb, rest = verb.lower(), rest.strip()
    if verb == "add":
        return await _add(scheduler, call, rest)
    if verb == "list" and not rest:
        await scheduler.sync()
        return _listing(scheduler, call.session_key)
    if verb in ("remove", "rm") and rest and len(rest.split()) == 1:
        return await _remove(scheduler, call.session_key, rest)
    raise UsageError("")


def split_add(args: str) -> tuple[str, str]:
    """Split ``/cron add`` arguments into the schedule and the prompt.

    :raises UsageError: if the schedule is neither quoted nor ``every …``/``@…``, or no
        prompt follows it.
    """
    text = args.strip()
    if text[:1] in ('"', "'"):
        end = text.find(text[0], 1)
        if end < 0:
            raise UsageError("the schedule's closing quote is missing.")
        schedule, prompt = text[1:end], text[end + 1 :]
    elif match := _UNQUOTED.match(text):
        schedule, prompt = match.group(1), text[match.end() :]
    else:
        raise UsageError('quote a cron expression ("*/30 * * * *") or write every <n>s|m|h.')
    if not visible(prompt):
        raise UsageError("say what the job should ask, after the schedule.")
    if len(prompt.strip()) > PROMPT_MAX:
        raise UsageError(f"a job's prompt is at most {PROMPT_MAX} characters.")
    return schedule, prompt.strip()


PROMPT_MAX = 4000
"""The longest prompt ``/cron add`` takes (a job's prompt is kept, listed and run)."""

_UNQUOTED = re.compile(r"(every\s+[0-9]+\s*[a-z]+|@[a-z]+)(?=\s|$)", re.IGNORECASE)


async def _add(scheduler: Scheduler, call: CommandCall, args: str) -> str:
    schedule, prompt = split_add(args)
    if looks_like_credential(prompt):
        raise UsageError(CREDENTIALS_REFUSED)
    too_often = _too_often(scheduler, schedule)
    if too_often:
        return too_often
    async with scheduler.adding(call.session_key):  # the counts and the add, one at a time
        await scheduler.sync()
        refusal = _over_a_cap(scheduler, call.session_key, call.message.source)
        if refusal:
            return refusal
        job = await scheduler.add_job(schedule, prompt, ORIGIN, origin=call.message.source)
    return f"Added job {job.id} ({job.schedule}); next run {_when(scheduler, job.id)}."


def _too_often(scheduler: Scheduler, schedule: str) -> str:
    """A refusal if ``schedule`` runs more often than ``min_interval`` allows, else ``""``."""
    try:
        gap = min_gap(parse_schedule(schedule))
    except ConfigError:
        return ""  # add_job names what is wrong with it
    least = scheduler.settings.min_interval
    if gap >= least:
        return ""
    return f"Jobs made from a chat may run at most every {least:g}s; this one would every {gap:g}s."


def _over_a_cap(scheduler: Scheduler, key: SessionKey, source: SessionSource) -> str:
    """Why one more job from ``key`` (sent by ``source``) is refused, or ``""`` if it is not."""
    settings, origins = scheduler.settings, chat_origins(scheduler)
    policy = scheduler.gateway.settings.key_policy
    if sum(build_session_key(o, policy) == key for o in origins) >= settings.chat_job_cap:
        cap = settings.chat_job_cap
        return f"This chat already has the most jobs it may have ({cap}); /cron remove one first."
    principal = principal_of(source)
    if sum(principal_of(o) == principal for o in origins) >= settings.user_job_cap:
        cap = settings.user_job_cap
        return f"You already have the most jobs you may have ({cap}); /cron remove one first."
    if len(origins) >= settings.total_job_cap:
        return "This gateway has as many jobs made from chats as it allows; try again later."
    return ""


def chat_origins(scheduler: Scheduler) -> list[SessionSource]:
    """The chat each known job created from a chat came from (one entry per job)."""
    return [job.origin for job in scheduler.list_jobs() if job.origin is not None]


def _chat_jobs(scheduler: Scheduler, key: SessionKey) -> list[Job]:
    policy = scheduler.gateway.settings.key_policy
    return [
        job
        for job in scheduler.list_jobs()
        if job.origin is not None and build_session_key(job.origin, policy) == key
    ]


def _listing(scheduler: Scheduler, key: SessionKey) -> str:
    jobs = _chat_jobs(scheduler, key)
    if not jobs:
        return "No jobs for this chat. Add one with /cron add."
    lines = [
        f"{j.id} {j.schedule} — next {_when(scheduler, j.id)}{_paused(scheduler, j)} — {j.prompt}"
        for j in jobs
    ]
    return "Jobs of this chat:\n" + "\n".join(lines)


def _paused(scheduler: Scheduler, job: Job) -> str:
    return " (paused: its creator is not allowed)" if scheduler.is_paused(job) else ""


async def _remove(scheduler: Scheduler, key: SessionKey, job_id: str) -> str:
    await scheduler.sync()
    if job_id not in {job.id for job in _chat_jobs(scheduler, key)}:
        raise UsageError(f"this chat has no job {quoted(job_id)}; send /cron list.")
    await scheduler.remove_job(job_id)
    return f"Removed job {job_id}."


def when_text(scheduler: Scheduler, moment: float | None) -> str:
    """``moment`` (epoch seconds) in the scheduler's time zone, or ``never``."""
    if moment is None:
        return "never"
    try:
        when = dt.datetime.fromtimestamp(moment, scheduler.settings.tz)
    except (OverflowError, OSError, ValueError):  # beyond the years datetime can name
        return f"at epoch second {moment:.0f}"
    return when.strftime("%Y-%m-%d %H:%M %Z")


def _when(scheduler: Scheduler, job_id: str) -> str:
    return when_text(scheduler, scheduler.next_run(job_id))
