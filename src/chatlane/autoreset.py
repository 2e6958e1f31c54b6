"""Where auto-reset used to live; it is now :mod:`chatlane.scheduling.autoreset`.

Kept so that ``from chatlane.autoreset import …`` goes on working.
"""

from __future__ import annotations

from chatlane.scheduling.autoreset import (
    RECENT,
    Activity,
    ActivityTracker,
    AutoResetPolicy,
    AutoResetSettings,
    AutoResetter,
    DueReset,
    daily_boundary,
    due_reason,
    notice_text,
    resolve,
)

__all__ = [
    "RECENT",
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
