"""Where the configured scheduler used to be built; now :mod:`chatlane.scheduling.settings`.

Kept so that ``from chatlane.scheduling_config import …`` goes on working.
"""

from __future__ import annotations

from chatlane.scheduling.settings import auto_reset_settings, build_scheduler

__all__ = ["auto_reset_settings", "build_scheduler"]
