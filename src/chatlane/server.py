"""Where the hub and its app used to live; they are now :mod:`chatlane.hub`.

Kept so that ``from chatlane.server import …`` goes on working.
"""

from __future__ import annotations

from chatlane.hub import (
    LOOPBACK_NAMES,
    Adapter,
    AdoptingAdapter,
    Hub,
    OutcomeAdapter,
    RefusingAdapter,
    allowed_hosts,
    build_app,
    gateway_settings,
    open_hub,
    shutdown,
)

__all__ = [
    "LOOPBACK_NAMES",
    "Adapter",
    "AdoptingAdapter",
    "Hub",
    "OutcomeAdapter",
    "RefusingAdapter",
    "allowed_hosts",
    "build_app",
    "gateway_settings",
    "open_hub",
    "shutdown",
]
