"""Two gateway harnesses on one store's two clients, as two processes of one gateway."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from chatlane.runtime.settings import LeaseSettings
from chatlane.stores import Store
from chatlane.testing import GatewayHarness
from chatlane.types import Agent

CHECKED_BY_HAND = LeaseSettings(fence_check=0)
"""No fence check in the background: a test makes one when the other process has acted."""


@contextlib.asynccontextmanager
async def two_processes(
    stores: tuple[Store, Store], agents: tuple[Agent, Agent], busy: str, **settings: Any
) -> AsyncIterator[tuple[GatewayHarness, GatewayHarness]]:
    """The process that runs the turns (``runner``) and another one, both under ``busy``,
    their fence checks made by hand (:data:`CHECKED_BY_HAND`)."""
    (here, there), (runner_agent, other_agent) = stores, agents
    async with (
        GatewayHarness(
            runner_agent, store=here, busy=busy, leases=CHECKED_BY_HAND, **settings
        ) as runner,
        GatewayHarness(
            other_agent, store=there, busy=busy, leases=CHECKED_BY_HAND, **settings
        ) as other,
    ):
        yield runner, other
