"""Turns: one running turn per session, generations that fence off stale work,
busy policies and the pending queue.

Importing a pure submodule (:mod:`chatlane.runtime.busy`,
:mod:`chatlane.runtime.settings`) loads only what it needs: the engine and the
turn are imported on first use of their names here.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from chatlane.runtime.busy import BusyOutcome, BusyPolicy, BusySettings, resolve_policy
from chatlane.runtime.settings import RuntimeSettings, StopIncomplete, StopResult

if TYPE_CHECKING:
    from chatlane.runtime.engine import TurnEngine
    from chatlane.runtime.turn import Turn, TurnOverrides

_LAZY = {
    "TurnEngine": "chatlane.runtime.engine",
    "Turn": "chatlane.runtime.turn",
    "TurnOverrides": "chatlane.runtime.turn",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(module), name)


__all__ = [
    "BusyOutcome",
    "BusyPolicy",
    "BusySettings",
    "RuntimeSettings",
    "StopIncomplete",
    "StopResult",
    "Turn",
    "TurnEngine",
    "TurnOverrides",
    "resolve_policy",
]
