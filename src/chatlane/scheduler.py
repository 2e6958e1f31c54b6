"""Where :class:`Scheduler` used to live; it is now :mod:`chatlane.scheduling.loop`.

Kept so that ``from chatlane.scheduler import …`` goes on working.
"""

from __future__ import annotations

from chatlane.scheduling.loop import (
    CRON_COMMAND,
    CRON_USAGE,
    LOCAL,
    ORIGIN,
    SILENT,
    AutoResetPolicy,
    AutoResetSettings,
    Job,
    JobAction,
    JobRun,
    Scheduler,
    SchedulerSettings,
    cron_command,
    split_add,
)
from chatlane.scheduling.silent import CRON_ID, DONE_ID

__all__ = [
    "CRON_COMMAND",
    "CRON_ID",
    "CRON_USAGE",
    "DONE_ID",
    "LOCAL",
    "ORIGIN",
    "SILENT",
    "AutoResetPolicy",
    "AutoResetSettings",
    "Job",
    "JobAction",
    "JobRun",
    "Scheduler",
    "SchedulerSettings",
    "cron_command",
    "split_add",
]
