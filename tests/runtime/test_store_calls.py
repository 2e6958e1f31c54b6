"""What a turn asks of its store: a message to an idle session costs two calls, on every backend.

The store is wrapped in :class:`CountingStore`, which passes every call
through unchanged and notes its name and the task that made it; calls made
by the engine's background upkeep (renewals, heartbeats, fence checks,
adoption) are left out of a turn's count.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import secrets
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

import pytest

from chatlane.context import current_session
from chatlane.runtime.outcomes import Outcome
from chatlane.runtime.turn import Turn
from chatlane.stores import Admission, MemoryStore, Store, open_store
from chatlane.testing import GatewayHarness
from chatlane.types import SessionKey
from tests.runtime.agents import EchoAgent
from tests.stores.conftest import forget_store, own_schema

FUSED = ["enqueue_and_acquire", "commit_and_release"]


class CountingStore:
    """Passes every call through to ``store``, noting each call's name, who made it, and refusals.

    A call is the turn's if it was made from the task that sent the message
    (the dispatch that queues it) or in the context a turn binds to its
    session; the engine's upkeep runs in neither.
    """

    def __init__(self, store: Store) -> None:
        self.store = store
        self.calls: list[tuple[str, bool]] = []
        self.refused: list[str] = []
        """The calls noted since the last :meth:`watch` that raised, by name."""
        self.sender: asyncio.Task[Any] | None = None
        self._answered = asyncio.Event()

    def __getattr__(self, name: str) -> Any:
        found = getattr(self.store, name)
        if not inspect.iscoroutinefunction(found):
            return found

        @functools.wraps(found)
        async def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((name, self._by_a_turn()))
            try:
                return await found(*args, **kwargs)
            except Exception:
                self.refused.append(name)
                raise
            finally:
                self._answered.set()
                self._answered = asyncio.Event()

        return counted

    def _by_a_turn(self) -> bool:
        return asyncio.current_task() is self.sender or current_session() is not None

    def made_by_turns(self) -> list[str]:
        """The calls noted since the last :meth:`watch`, but those of the engine's upkeep."""
        return [name for name, by_turn in self.calls if by_turn]

    def watch(self) -> None:
        """Count from now on, and count the calls this task makes."""
        self.calls.clear()
        self.refused.clear()
        self.sender = asyncio.current_task()

    async def until_refused(self, name: str) -> None:
        """Wait until a call to ``name`` noted since the last :meth:`watch` raised."""
        async with asyncio.timeout(10):
            while name not in self.refused:
                await self._answered.wait()


@pytest.fixture(params=["memory", "sqlite", "redis", "postgres"])
async def counted(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[CountingStore]:
    url = "memory://"
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'chatlane.db'}"
    elif request.param == "redis":
        base: str = request.getfixturevalue("redis_url")
        url = f"{base}{'&' if '?' in base else '?'}prefix=calls-{secrets.token_hex(6)}"
    elif request.param == "postgres":
        url = own_schema(request.getfixturevalue("postgres_url"), "calls")
    store = await open_store(url)
    yield CountingStore(store)
    await store.close()
    await forget_store(url)


async def one_turn(h: GatewayHarness, counted: CountingStore, text: str) -> list[str]:
    """Send ``text`` to chat c1 and wait until its turn is over; the store calls it cost."""
    counted.watch()
    result = await h.send(text, chat_id="c1")
    assert result.started
    await h.settle()
    return counted.made_by_turns()


@pytest.mark.parametrize("reread_stored", [0.0, 60.0], ids=["choices-stale", "choices-fresh"])
async def test_a_message_to_an_idle_session_costs_two_store_calls(
    counted: CountingStore, reread_stored: float
) -> None:
    store = cast(Store, counted)
    async with GatewayHarness(EchoAgent(), store=store, reread_stored=reread_stored) as h:
        first = await one_turn(h, counted, "first")
        assert first == FUSED  # a session this process never saw is read with its lease
        for n in range(3):
            assert await one_turn(h, counted, f"again {n}") == FUSED
        replies = await h.replies(chat_id="c1", count=4)
    assert replies == ["echo: first", "echo: again 0", "echo: again 1", "echo: again 2"]
    key = h.session_key(chat_id="c1")
    real = counted.store
    assert await real.pending(key) == []
    assert await real.active_sessions() == 0
    assert await real.generation(key) == 4
    assert len(await real.transcript(key)) == 8


async def test_stored_choices_changed_elsewhere_reach_the_next_turn_without_a_read(
    counted: CountingStore,
) -> None:
    store = cast(Store, counted)
    async with GatewayHarness(EchoAgent(), store=store, reread_stored=0.0) as h:
        await one_turn(h, counted, "first")
        key = h.session_key(chat_id="c1")
        await counted.store.set_persistent(key, None, busy_policy="reject")  # another process
        assert await one_turn(h, counted, "second") == FUSED
        state = h.gateway.engine.registry.get(key)
        assert state.persistent.busy_policy is not None
        assert state.persistent.busy_policy.value == "reject"


class Seen:
    """Replies ``ok`` and notes each turn's generation and model override."""

    def __init__(self) -> None:
        self.turns: list[tuple[int, str | None]] = []

    async def __call__(self, turn: Turn) -> str:
        model = turn.overrides.model
        self.turns.append((turn.generation, None if model is None else model.name))
        return "ok"


async def test_a_session_another_process_ran_is_read_with_its_first_lease(
    counted: CountingStore,
) -> None:
    agent, store = Seen(), cast(Store, counted)
    async with GatewayHarness(agent, store=store) as h:
        key = h.session_key(chat_id="c1")
        for _ in range(3):  # another process ran three turns and chose a model
            await counted.store.release(await counted.store.acquire(key, "elsewhere", 30))
        await counted.store.set_persistent(key, None, model_override={"name": "m-elsewhere"})
        assert await one_turn(h, counted, "first here") == FUSED
        assert await one_turn(h, counted, "second here") == FUSED
    assert agent.turns == [(4, "m-elsewhere"), (5, "m-elsewhere")]
    assert await counted.store.generation(key) == 5


async def test_a_session_busy_elsewhere_is_read_before_its_turn_waits(
    counted: CountingStore,
) -> None:
    agent, store = Seen(), cast(Store, counted)
    async with GatewayHarness(agent, store=store) as h:
        key = h.session_key(chat_id="c1")
        elsewhere = await counted.store.acquire(key, "another-process", 30)
        counted.watch()
        assert (await h.send("first here", chat_id="c1")).started
        await counted.until_refused("acquire_and_read")  # it waits for the lease
        await counted.store.release(elsewhere)
        await h.settle()
        calls = counted.made_by_turns()
    assert calls[:3] == ["enqueue_and_acquire", "load_persistent", "generation"]
    assert agent.turns == [(2, None)]


async def test_a_turn_that_waited_reads_its_choices_with_the_lease(
    counted: CountingStore,
) -> None:
    store = cast(Store, counted)
    async with GatewayHarness(EchoAgent(), store=store, reread_stored=0.0) as h:
        await one_turn(h, counted, "first")
        key = h.session_key(chat_id="c1")
        elsewhere = await counted.store.acquire(key, "another-process", 30)
        counted.watch()
        result = await h.send("second", chat_id="c1")
        assert result.started
        await counted.until_refused("acquire_and_read")  # it waits, asking again now and then
        await counted.store.release(elsewhere)
        await h.settle()
        calls = counted.made_by_turns()
    assert calls[0] == "enqueue_and_acquire"
    assert calls[-1] == "commit_and_release"
    assert "acquire_and_read" in calls
    # the generation moved on elsewhere meanwhile: the turn checks its messages are still queued
    assert set(calls[1:-1]) == {"acquire_and_read", "pending"}
    assert "load_persistent" not in calls


class SlowFirstAdmission(MemoryStore):
    """The first message's admission (lease given) reaches the engine only once ``gate`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.admitted = asyncio.Event()

    async def enqueue_and_acquire(self, *args: Any, **kwargs: Any) -> Admission:
        admission = await super().enqueue_and_acquire(*args, **kwargs)
        if not self.admitted.is_set():
            self.admitted.set()
            await self.gate.wait()
        return admission


async def test_a_lease_taken_for_a_message_that_finds_a_turn_started_is_given_back() -> None:
    store = SlowFirstAdmission()
    async with GatewayHarness(EchoAgent(), store=store) as h:
        first = asyncio.create_task(h.send("first", chat_id="c1"))
        await store.admitted.wait()  # "first" is queued and holds the lease, unseen yet
        second = await h.send("second", chat_id="c1")  # idle here: it starts a turn, refused
        assert second.started
        store.gate.set()
        assert not (await first).started  # a turn is running: it waits behind it
        replies = await h.replies(chat_id="c1", count=3)
        await h.settle()
        key = h.session_key(chat_id="c1")
    assert [r for r in replies if r.startswith("echo")] == ["echo: first", "echo: second"]
    assert await store.pending(key) == []
    assert await store.active_sessions() == 0
    assert [o.outcome for o in h.outcomes].count(Outcome.ANSWERED) == 2


class SlowFirstLoad(MemoryStore):
    """The first ``load_persistent`` waits for :attr:`gate` (its caller is between the
    store call that queued its message and the engine taking the message in)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.reading = asyncio.Event()

    async def load_persistent(self, key: SessionKey) -> dict[str, Any]:
        if not self.reading.is_set():
            self.reading.set()
            await self.gate.wait()
        return await super().load_persistent(key)


async def test_messages_taken_in_out_of_store_order_still_run_in_store_order() -> None:
    store = SlowFirstLoad()
    async with GatewayHarness(EchoAgent(), store=store) as h:
        key = h.session_key(chat_id="c1")
        elsewhere = await store.acquire(key, "another-process", 30)
        first = asyncio.create_task(h.send("a", chat_id="c1"))  # queued first, read slowly
        await store.reading.wait()
        for text in ("z", "b", "c"):  # queued after it, taken in before it
            await h.send(text, chat_id="c1")
        store.gate.set()
        await first
        await store.release(elsewhere)
        replies = await h.replies(chat_id="c1", count=5, timeout=10)  # one ack, four answers
    echoes = [reply for reply in replies if reply.startswith("echo: ")]
    assert echoes == ["echo: a", "echo: z", "echo: b", "echo: c"]
