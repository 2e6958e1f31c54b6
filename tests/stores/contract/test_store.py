"""The contract of the whole :class:`~chatlane.stores.base.Store`: closing, restarts, processes.

Tests that let time pass use the ``clock`` fixture: it moves the memory and
SQLite stores' clock at once, and waits for real with Redis, which reads its
server's ``TIME`` (so TTLs here stay short).
"""

from __future__ import annotations

import asyncio

from chatlane.stores import Store, WriteBatch
from tests.stores.conftest import Reopen, StoreClock
from tests.stores.contract.common import KEY, entry


async def test_close_is_idempotent(store: Store) -> None:
    await store.close()
    await store.close()


class TestAcrossProcesses:
    """A second store object on the same URL stands for another process (or a restart)."""

    async def test_one_winner_across_two_instances(self, store: Store, reopen: Reopen) -> None:
        other = await reopen()
        results = await asyncio.gather(
            *(s.acquire(KEY, f"p{i}", 5) for i, s in enumerate([store, other] * 10)),
            return_exceptions=True,
        )
        assert sum(not isinstance(r, BaseException) for r in results) == 1

    async def test_everything_survives_a_restart(self, store: Store, reopen: Reopen) -> None:
        lease = await store.acquire(KEY, "p1", 5)
        await store.commit(
            KEY,
            lease.generation,
            WriteBatch(
                transcript=[entry("hello", lease.generation)],
                persistent={"model": "m1"},
                answered=["m0"],
            ),
        )
        old = await store.conversation(KEY)
        await store.new_conversation(KEY, "second")
        seq = await store.enqueue(KEY, "m1", "p1", b"payload")
        await store.bump_generation(KEY)
        await store.close()

        again = await reopen()
        assert await again.generation(KEY) == 2
        assert await again.load_persistent(KEY) == {"model": "m1"}
        assert [c.title for c in await again.conversations(KEY)] == ["second", ""]
        assert [e.content for e in await again.transcript(KEY, old.id)] == ["hello"]
        assert [(r.seq, r.payload) for r in await again.pending(KEY)] == [(seq, b"payload")]
        assert await again.is_answered("m0")

    async def test_generations_are_never_reused_after_restart(
        self, store: Store, reopen: Reopen, clock: StoreClock
    ) -> None:
        lease = await store.acquire(KEY, "p1", 0.1)
        await store.close()
        await clock.advance(0.2)
        again = await reopen()
        assert (await again.acquire(KEY, "p2", 5)).generation == lease.generation + 1
