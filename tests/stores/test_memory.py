"""The memory store's own bookkeeping, beyond the contract every backend keeps."""

from __future__ import annotations

from chatlane.identity import SessionKey
from chatlane.stores import MemoryStore, WriteBatch


async def test_counting_live_leases_looks_only_at_sessions_holding_one() -> None:
    """A released lease leaves the set the active-session count walks at once,
    by either way of giving it back, so that count never grows with the
    sessions a busy gateway has seen since its last heartbeat."""
    store = MemoryStore()
    for n in range(200):
        key = SessionKey(f"s{n}")
        seq = await store.enqueue(key, f"m{n}", "p1", b"{}")
        lease = await store.acquire(key, "p1", 30, max_active=1_000)
        if n % 2:
            await store.release(lease)
        else:
            assert await store.commit_and_release(lease, WriteBatch(done=[seq]))
    held = await store.acquire(SessionKey("held"), "p1", 30, max_active=1_000)
    assert await store.active_sessions() == 1
    assert store._leased == {held.key}
