"""The contract of :class:`~chatlane.stores.protocols.Liveness`, over every backend.

Tests that let time pass use the ``clock`` fixture: it moves the memory and
SQLite stores' clock at once, and waits for real with Redis, which reads its
server's ``TIME`` (so TTLs here stay short).
"""

from __future__ import annotations

import pytest

from chatlane.stores import Store
from tests.keys import chat_key
from tests.stores.conftest import StoreClock, stored_liveness
from tests.stores.contract.common import KEY


class TestLiveness:
    async def test_heartbeat_expires(self, store: Store, clock: StoreClock) -> None:
        await store.heartbeat("p1", 0.2)
        await store.heartbeat("p2", 5)
        assert await store.alive(["p1", "p2", "p3"]) == {"p1": True, "p2": True, "p3": False}
        await clock.advance(0.35)
        assert (await store.alive(["p1"]))["p1"] is False


class TestPruning:
    async def test_heartbeats_prune_long_expired_heartbeats_and_leases(
        self, store: Store, monkeypatch: pytest.MonkeyPatch, clock: StoreClock
    ) -> None:
        for module in ("memory", "sqlite", "postgres.liveness"):
            monkeypatch.setattr(f"chatlane.stores.{module}.PRUNE_AFTER", 0.0)
        await store.heartbeat("gone", 0.01)
        await store.acquire(KEY, "gone", 0.01)
        await store.heartbeat("alive", 30)
        held = chat_key("held")
        await store.acquire(held, "alive", 30)
        await clock.advance(0.05)
        await store.heartbeat("me", 5)
        assert await stored_liveness(store) == (["alive", "me"], [held])
