"""Idle sessions leave memory and come back from the store without loss, on every local store."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from chatlane.gateway import Gateway
from chatlane.identity import SessionSource
from chatlane.runtime.busy import BusyPolicy
from chatlane.runtime.persisted import nothing_to_save
from chatlane.runtime.turn import Turn, TurnOverrides
from chatlane.state import SessionRegistry
from chatlane.stores import Store, open_store
from chatlane.types import InboundMessage, ModelChoice, Outbound, OutboundKind, SessionKey

SESSIONS = 200
ROOM = 16
"""The registry keeps this many sessions: all but the last few leave memory."""


@pytest.fixture(params=["memory", "sqlite"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Store]:
    url = "memory://" if request.param == "memory" else f"sqlite:///{tmp_path / 'c.db'}"
    opened = await open_store(url)
    yield opened
    await opened.close()


class Chats:
    """A gateway whose registry keeps ``room`` sessions; it records what each turn saw."""

    def __init__(self, store: Store, room: int = ROOM) -> None:
        self.registry = SessionRegistry(max_sessions=room, on_evict=nothing_to_save)
        self.gateway = Gateway(self.agent, self.deliver, registry=self.registry, store=store)
        self.seen: dict[SessionKey, list[tuple[int, TurnOverrides]]] = {}
        self.replies: list[Outbound] = []

    async def agent(self, turn: Turn) -> str:
        self.seen.setdefault(turn.session_key, []).append((turn.generation, turn.overrides))
        return f"echo: {turn.messages[-1].text}"

    async def deliver(self, outbound: Outbound) -> None:
        self.replies.append(outbound)

    async def say(self, session: int, text: str) -> SessionKey:
        """Send ``text`` from ``session``'s chat and wait until its turn (if any) ended."""
        source = SessionSource("test", chat_id=f"c{session}", user_id=f"u{session}")
        result = await self.gateway.dispatch(InboundMessage(source, text))
        assert result.outcome is None, result
        await self.gateway.engine.wait_idle()
        return result.session_key


async def test_idle_sessions_leave_memory_and_come_back_without_loss(store: Store) -> None:
    chats = Chats(store)
    engine = chats.gateway.engine
    keys: list[SessionKey] = []
    try:
        for n in range(SESSIONS):
            key = await chats.say(n, "/new")
            await chats.say(n, "yes")
            await chats.say(n, f"/model model-{n}")
            await chats.say(n, "/reasoning high")
            await chats.say(n, "/fast off")  # explicitly normal: neither unset nor priority
            await chats.say(n, "/busy interrupt")
            await engine.persist(key, approval_allowlist=[f"ls {n}"])
            await chats.say(n, "hello")
            keys.append(key)
        assert len(chats.registry) == ROOM
        assert not any(key in chats.registry for key in keys[:-ROOM])
        conversations = {key: (await store.conversation(key)).id for key in keys}

        for n, key in enumerate(keys):
            await chats.say(n, "again")
            state = chats.registry.get(key)
            assert state.conversation.model_override == ModelChoice(f"model-{n}")
            assert state.conversation.reasoning_override == "high"
            assert state.conversation.service_tier_override is None
            assert state.conversation.conversation_id == conversations[key]
            assert state.persistent.busy_policy is BusyPolicy.INTERRUPT
            assert state.persistent.approval_allowlist == [f"ls {n}"]
            assert state.persistent.run_generation == await store.generation(key)
            expected = TurnOverrides(ModelChoice(f"model-{n}"), "high", None)
            first, second = chats.seen[key]
            assert first == (first[0], expected)
            assert second == (first[0] + 1, expected)
            transcript = await store.transcript(key)
            assert [e.content for e in transcript] == [
                "hello",
                "echo: hello",
                "again",
                "echo: again",
            ]
        assert len(chats.registry) == ROOM
    finally:
        await chats.gateway.aclose()
    turns = [o for o in chats.replies if o.kind is OutboundKind.REPLY and o.text.startswith("echo")]
    assert len(turns) == 2 * SESSIONS


async def test_a_session_below_the_registrys_floor_runs_at_its_own_generation(
    store: Store,
) -> None:
    chats = Chats(store, room=1)
    try:
        busy = await chats.say(0, "turn 0")
        for n in range(1, 6):
            await chats.say(0, f"turn {n}")
        quiet = await chats.say(1, "hello")  # evicts the busy session: the floor is 6
        fresh = await chats.say(2, "hello")  # starts below the floor, as `quiet` comes back
        await chats.say(1, "again")
        assert chats.registry.generation_floor == 6
        assert [g for g, _ in chats.seen[fresh]] == [1]
        assert [g for g, _ in chats.seen[quiet]] == [1, 2]
        assert [g for g, _ in chats.seen[busy]] == [1, 2, 3, 4, 5, 6]
        assert not await store.failed()
    finally:
        await chats.gateway.aclose()


async def test_a_once_model_and_a_confirmation_outlast_the_eviction_of_idle_sessions(
    store: Store,
) -> None:
    """No store keeps a ``/model --once`` or a ``/new`` waiting for its "yes": the
    sessions holding them are passed over while other idle sessions can leave."""
    chats = Chats(store, room=3)
    try:
        once = await chats.say(0, "/model --once special")
        asked = await chats.say(1, "/new")
        others = [await chats.say(n, "hello") for n in range(2, 8)]
        assert once in chats.registry
        assert asked in chats.registry
        assert not any(key in chats.registry for key in others[:-1])
        assert len(chats.registry) == 3
        old_conversation = (await store.conversation(asked)).id
        await chats.say(1, "yes")
        await chats.say(0, "go")
        assert (await store.conversation(asked)).id != old_conversation
        assert [overrides.model for _, overrides in chats.seen[once]] == [ModelChoice("special")]
        assert asked not in chats.seen  # the yes confirmed: it ran no turn
    finally:
        await chats.gateway.aclose()
