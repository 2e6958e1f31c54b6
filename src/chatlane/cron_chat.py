"""Where the ``/cron`` command used to live; it is now :mod:`chatlane.scheduling.chat`.

Kept so that ``from chatlane.cron_chat import …`` goes on working.
"""

from __future__ import annotations

from chatlane.scheduling.chat import (
    CRON_COMMAND,
    CRON_USAGE,
    chat_origins,
    cron_command,
    min_gap,
    principal_of,
    split_add,
    when_text,
)

__all__ = [
    "CRON_COMMAND",
    "CRON_USAGE",
    "chat_origins",
    "cron_command",
    "min_gap",
    "principal_of",
    "split_add",
    "when_text",
]
