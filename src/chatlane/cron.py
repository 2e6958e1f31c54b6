"""Where cron schedules and jobs used to live; they are now :mod:`chatlane.scheduling.cron`.

Kept so that ``from chatlane.cron import …`` goes on working.
"""

from __future__ import annotations

from chatlane.scheduling.cron import (
    LOCAL,
    MACROS,
    MAX_INTERVAL,
    MONTHS,
    ORIGIN,
    UNITS,
    WEEKDAYS,
    Claim,
    CronExpression,
    Interval,
    Job,
    JobBook,
    JobRun,
    Schedule,
    explicit_target,
    parse_schedule,
    run_source,
)

__all__ = [
    "LOCAL",
    "MACROS",
    "MAX_INTERVAL",
    "MONTHS",
    "ORIGIN",
    "UNITS",
    "WEEKDAYS",
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
