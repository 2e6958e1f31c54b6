"""What only the memory store does: forgetting answered marks in the order they were made."""

from __future__ import annotations

import asyncio

from chatlane.stores import MemoryStore, WriteBatch


async def test_a_heartbeat_forgets_marks_past_their_retention() -> None:
    store = MemoryStore()
    store.answered_retention = 0.2
    await store.commit("k", None, WriteBatch(answered=["m1", "m2"]))
    await asyncio.sleep(0.3)
    await store.commit("k", None, WriteBatch(answered=["m3"]))
    await store.heartbeat("p1", 5)
    assert list(store._answered) == ["m3"]
