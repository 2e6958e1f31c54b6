"""Turns: one running turn per session, generations that fence off stale work,
busy policies and the pending queue."""

from __future__ import annotations

from chatlane.runtime.busy import BusyOutcome, BusyPolicy, BusySettings, resolve_policy
from chatlane.runtime.engine import RuntimeSettings, StopResult, TurnEngine
from chatlane.runtime.turn import Turn, TurnOverrides

__all__ = [
    "BusyOutcome",
    "BusyPolicy",
    "BusySettings",
    "RuntimeSettings",
    "StopResult",
    "Turn",
    "TurnEngine",
    "TurnOverrides",
    "resolve_policy",
]
