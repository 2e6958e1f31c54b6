"""The scheduler ``chatlane serve`` runs, built from the configuration."""

from __future__ import annotations

import zoneinfo

from chatlane.config import Config, ResetPolicyConfig
from chatlane.errors import ConfigError
from chatlane.identity import ChatType
from chatlane.scheduling.autoreset import AutoResetPolicy, AutoResetSettings
from chatlane.scheduling.cron import Job
from chatlane.scheduling.loop import Scheduler, SchedulerSettings


def _policy(config: ResetPolicyConfig, where: str) -> AutoResetPolicy:
    try:
        return AutoResetPolicy(config.idle_after, config.daily_at_hour, config.notify)
    except ConfigError as error:
        raise ConfigError(f"configuration key '{where}': {error}") from None


def auto_reset_settings(config: Config) -> AutoResetSettings:
    """Idle and daily resets: global, per platform, per chat type.

    :raises ConfigError: naming the key of a bad policy.
    """
    reset = config.auto_reset
    return AutoResetSettings(
        default=_policy(reset, "auto_reset"),
        per_platform={
            p: _policy(c, f"auto_reset.per_platform.{p}") for p, c in reset.per_platform.items()
        },
        per_chat_type={
            ChatType(t): _policy(c, f"auto_reset.per_chat_type.{t}")
            for t, c in reset.per_chat_type.items()
        },
    )


def build_scheduler(config: Config) -> Scheduler:
    """The scheduler for ``config``'s auto-reset policies, cron jobs and ``/cron`` limits.

    A job created from a chat runs only while its gateway allows its creator
    (:func:`chatlane.hub.gateway_settings` makes that ``config.allows``).

    :raises ConfigError: for an unknown time zone, a bad policy or a bad job (named).
    """
    try:
        tz = zoneinfo.ZoneInfo(config.scheduler.timezone)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError):
        raise ConfigError(
            f"configuration key 'scheduler.timezone' = "
            f"{config.scheduler.timezone!r}: expected a time zone such as "
            "'UTC' or 'Europe/Berlin'"
        ) from None
    jobs = []
    for index, job in enumerate(config.cron):
        try:
            jobs.append(Job(job.schedule, job.prompt, job.target, id=job.id))
        except ConfigError as error:
            raise ConfigError(f"configuration key 'cron.{index}': {error}") from None
    limits = config.scheduler
    settings = SchedulerSettings(
        auto_reset=auto_reset_settings(config),
        tz=tz,
        chat_job_cap=limits.chat_job_cap,
        user_job_cap=limits.user_job_cap,
        total_job_cap=limits.total_job_cap,
        min_interval=limits.min_interval,
    )
    return Scheduler(settings, jobs=jobs)
