"""The scheduler ``chatlane serve`` runs, built from the configuration."""

from __future__ import annotations

import zoneinfo

from chatlane.config import CHAT_PLATFORMS, SERVED_ALWAYS, Config, ResetPolicyConfig
from chatlane.errors import ConfigError
from chatlane.identity import ChatType
from chatlane.scheduling.autoreset import AutoResetPolicy, AutoResetSettings
from chatlane.scheduling.cron import LOCAL, ORIGIN, Job, explicit_target
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


def _configured_job(config: Config, index: int) -> Job:
    """Job ``index`` of ``[[cron]]``; its target, if it names a chat, on a platform served here.

    A reply to a chat platform this gateway does not run would wait in the
    delivery ledger for its adapter forever.

    :raises ConfigError: naming ``cron.<index>``, for a bad job or such a target.
    """
    entry = config.cron[index]
    try:
        job = Job(entry.schedule, entry.prompt, entry.target, id=entry.id)
    except ConfigError as error:
        raise ConfigError(f"configuration key 'cron.{index}': {error}") from None
    if job.target in (ORIGIN, LOCAL):
        return job
    platform = explicit_target(job.target).platform
    if platform in config.served_platforms():
        return job
    if platform in CHAT_PLATFORMS:
        problem = (
            f"sends to {platform}, which is not enabled, so its replies would wait for it "
            f"forever: set [{platform}] enabled = true, or give the job another target"
        )
    else:
        served = ", ".join((*SERVED_ALWAYS, *CHAT_PLATFORMS))
        problem = f"sends to {platform!r}, which is not a platform chatlane serves ({served})"
    raise ConfigError(f"configuration key 'cron.{index}': job {job.id!r} {problem}")


def build_scheduler(config: Config) -> Scheduler:
    """The scheduler for ``config``'s auto-reset policies, cron jobs and ``/cron`` limits.

    A job created from a chat runs only while its gateway allows its creator
    (:func:`chatlane.hub.gateway_settings` makes that ``config.allows``).

    :raises ConfigError: for an unknown time zone, a bad policy, a bad job or one whose
        target is on a platform not served here (named).
    """
    try:
        tz = zoneinfo.ZoneInfo(config.scheduler.timezone)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError):
        raise ConfigError(
            f"configuration key 'scheduler.timezone' = "
            f"{config.scheduler.timezone!r}: expected a time zone such as "
            "'UTC' or 'Europe/Berlin'"
        ) from None
    jobs = [_configured_job(config, index) for index in range(len(config.cron))]
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
