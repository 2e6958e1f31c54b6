"""Time: the work that happens without anyone writing a message.

* :mod:`~chatlane.scheduling.loop` — the :class:`Scheduler` a gateway starts
  and stops: its passes, jobs' ticks and background completions.
* :mod:`~chatlane.scheduling.cron` — schedules, jobs, and how a tick is claimed.
* :mod:`~chatlane.scheduling.autoreset` — conversations that end after idle
  time or at a daily hour.
* :mod:`~chatlane.scheduling.chat` — the ``/cron`` command and its caps.
* :mod:`~chatlane.scheduling.settings` — the scheduler ``chatlane serve``
  builds from the configuration.

The old homes (``chatlane.scheduler``, ``chatlane.cron``, ``chatlane.autoreset``,
``chatlane.cron_chat``, ``chatlane.scheduling_config``) re-export these names.
"""

from __future__ import annotations

from chatlane.scheduling.autoreset import AutoResetPolicy, AutoResetSettings
from chatlane.scheduling.cron import LOCAL, ORIGIN, Job, JobRun
from chatlane.scheduling.loop import SILENT, JobAction, Scheduler, SchedulerSettings

__all__ = [
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
]
