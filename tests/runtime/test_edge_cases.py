"""Edge cases where a message could have been lost, run with the wrong settings, or granted
the wrong thing; each test holds one of them shut."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from chatlane.context import run_in_thread
from chatlane.errors import StoreDamaged, StoreError
from chatlane.identity import SessionKey, SessionSource
from chatlane.lifecycle import LifecycleOptions
from chatlane.runtime.leases import LeaseSettings
from chatlane.runtime.turn import Turn
from chatlane.stores import Admission, Lease, MemoryStore, Taken
from chatlane.stores.base import Conversation, WriteBatch
from chatlane.stores.codec import encode_message
from chatlane.testing import GatewayHarness
from chatlane.types import InboundMessage, OutboundKind
from tests.runtime.agents import EchoAgent


async def test_a_message_steered_at_a_stopped_turn_queues_instead() -> None:
    async def agent(turn: Turn) -> str:
        for _ in range(20):  # a tool finishing: it does not look at interrupted
            await asyncio.sleep(0.01)
        return "done " + turn.text

    agent.accepts_steering = True  # type: ignore[attr-defined]
    async with GatewayHarness(agent, busy="steer") as h:
        await h.send("first", chat_id="c")
        await h.until_running(chat_id="c")
        await h.send("/stop", chat_id="c")
        result = await h.send("do X instead", chat_id="c")
        assert result.outcome is not None
        assert result.outcome.value == "queued"
        replies = await h.replies(chat_id="c", count=3)
        assert replies[2] == "done do X instead"


async def test_a_newer_once_given_during_a_turn_applies_to_the_next() -> None:
    seen: list[str | None] = []

    async def agent(turn: Turn) -> str:
        seen.append(turn.overrides.model.name if turn.overrides.model else None)
        await asyncio.sleep(0.1)
        return "ok"

    async with GatewayHarness(agent) as h:
        for text in ("/model base", "/model --once A", "m1"):
            await h.send(text, chat_id="c")
        await h.until_running(chat_id="c")
        for text in ("/model --once B", "m2"):
            await h.send(text, chat_id="c")
        await h.settle()
        await h.send("m3", chat_id="c")
        await h.settle()
        assert seen == ["A", "B", "base"]


class SlowConversations(MemoryStore):
    """Stands in for SQLite and Redis, whose calls really yield to the event loop."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = asyncio.Event()

    async def new_conversation(self, key: SessionKey, title: str = "") -> Conversation:
        self.entered.set()
        await asyncio.sleep(0.05)
        return await super().new_conversation(key, title)


async def test_a_message_arriving_during_a_boundary_survives_it() -> None:
    async def agent(turn: Turn) -> str:
        await asyncio.sleep(0.2)
        return "ran " + turn.text

    options = LifecycleOptions(confirm_new=False)
    store = SlowConversations()
    async with GatewayHarness(agent, store=store, lifecycle=options) as h:
        await h.send("m1", chat_id="c")
        await h.until_running(chat_id="c")
        boundary = asyncio.create_task(h.send("/new", chat_id="c"))
        await store.entered.wait()  # the boundary has stopped m1's turn and is under way
        await h.send("m2", chat_id="c")
        await boundary
        await h.settle()
        assert "ran m2" in [o.text for o in h.outbox]


async def test_a_turn_that_keeps_losing_its_lease_is_kept_as_failed_and_can_run_again() -> None:
    blocking = True

    def blocking_agent(turn: Turn) -> str:  # holds the event loop past the lease's TTL
        if blocking:
            time.sleep(0.5)
        return "answer"

    async def agent(turn: Turn) -> str:
        return blocking_agent(turn)

    store = MemoryStore()
    async with GatewayHarness(agent, store=store, leases=LeaseSettings(ttl=0.3)) as h:
        result = await h.send("hello", chat_id="c")
        [notice] = await h.replies(chat_id="c", count=1, timeout=10)
        assert notice.startswith("Sorry — this message could not be completed")
        assert "kept as failed" in notice
        assert await store.pending(result.session_key) == []
        [failed] = await store.failed()
        assert failed.record.key == result.session_key
        assert failed.reason == "its turn lost its lease 3 times"
        assert h.gateway.engine.metrics.messages_failed == 1
        blocking = False
        assert await h.gateway.engine.retry_failed(failed.record.message_id)
        assert not await h.gateway.engine.retry_failed(failed.record.message_id)
        assert (await h.replies(chat_id="c", count=2, timeout=10))[1] == "answer"
        assert await store.failed() == []
        assert await store.pending(result.session_key) == []


async def test_an_evicted_turns_untaken_steers_still_run() -> None:
    ran: list[str] = []

    async def agent(turn: Turn) -> str:
        ran.append(turn.text)
        if turn.text == "stuck":
            await asyncio.sleep(100)
        return "ok"

    agent.accepts_steering = True  # type: ignore[attr-defined]
    async with GatewayHarness(agent, busy="steer", turn_timeout=0.3) as h:
        await h.send("stuck", chat_id="c")
        await h.until_running(chat_id="c")
        await h.send("steer me", chat_id="c")
        await h.wait_for(lambda out: any(o.text == "ok" for o in out), timeout=5)
        assert ran == ["stuck", "steer me"]


async def test_grants_are_exact_never_patterns() -> None:
    asked: list[str] = []

    async def agent(turn: Turn) -> str:
        command = "rm -rf build/*" if turn.text == "one" else "rm -rf build/ ~/"
        asked.append(command)
        return str(await turn.request_approval(command))

    async with GatewayHarness(agent, approval_timeout=0.3) as h:
        await h.send("one", chat_id="c")
        await h.wait_for(lambda out: any(o.kind is OutboundKind.APPROVAL for o in out))
        await h.send("/approve session", chat_id="c")
        await h.replies(chat_id="c", count=3)
        await h.send("two", chat_id="c")
        replies = await h.replies(chat_id="c", count=6)
        assert replies[3].startswith("Approval needed: `rm -rf build/ ~/`")
        assert replies[5] == "False"


async def test_a_stopped_turns_request_never_takes_the_next_answer() -> None:
    results: list[tuple[str, bool]] = []

    async def agent(turn: Turn) -> str:
        if turn.text == "one":  # a tool in a worker thread waits for approval
            ok = await run_in_thread(turn.request_approval_threadsafe, "deploy prod")
        else:
            ok = await turn.request_approval("ls")
        results.append((turn.text, ok))
        return "ok"

    async with GatewayHarness(agent, approval_timeout=2.0, interrupt_grace=0.05) as h:
        await h.send("one", chat_id="c")
        await h.wait_for(lambda out: any(o.kind is OutboundKind.APPROVAL for o in out))
        await h.send("/stop", chat_id="c")
        await h.settle()
        await h.send("two", chat_id="c")
        await h.wait_for(lambda out: sum(o.kind is OutboundKind.APPROVAL for o in out) == 2)
        await h.send("yes", chat_id="c")
        await h.settle()
        assert ("two", True) in results
        assert ("one", True) not in results


async def test_an_adopted_message_runs_with_the_sessions_stored_overrides() -> None:
    seen: list[str | None] = []

    async def agent(turn: Turn) -> str:
        seen.append(turn.overrides.model.name if turn.overrides.model else None)
        return "ok"

    store = MemoryStore()
    async with GatewayHarness(agent, store=store) as first:
        await first.send("/model big-model", chat_id="c")
        key = first.session_key(chat_id="c")
    left = InboundMessage(SessionSource("test", chat_id="c", user_id="u1"), "left behind")
    await store.enqueue(key, left.id, "h-dead", encode_message(left))
    async with GatewayHarness(agent, store=store) as second:
        await second.settle()
    assert seen == ["big-model"]


class FlakyAcquire(MemoryStore):
    """It queues a message without its lease, and the turn's first ``times`` requests
    for the lease fail with ``error``.

    A message queued without a lease or a refusal is what a store whose fused
    enqueue is not one transaction gives when its lease request failed: the
    turn waits for the lease.
    """

    def __init__(self, error: StoreError, times: int = 1) -> None:
        super().__init__()
        self.error = error
        self.failures = times

    async def enqueue_and_acquire(
        self, key: SessionKey, message_id: str, owner: str, payload: bytes, *_: Any, **__: Any
    ) -> Admission:
        seq = await self.enqueue(key, message_id, owner, payload)
        return Admission(seq, lease=None, refusal=None, persistent=None)

    async def acquire_and_read(self, *args: Any, **kwargs: Any) -> Taken:
        if self.failures:
            self.failures -= 1
            raise self.error
        return await super().acquire_and_read(*args, **kwargs)


async def test_a_store_error_before_the_turn_is_waited_out_and_the_message_runs() -> None:
    async def agent(turn: Turn) -> str:
        return "answer"

    store = FlakyAcquire(StoreError("connection reset"), times=3)
    async with GatewayHarness(agent, store=store) as h:
        result = await h.send("hello", chat_id="c")
        assert await h.replies(chat_id="c", count=1) == ["answer"]
        assert store.failures == 0
        assert await store.pending(result.session_key) == []
        assert h.gateway.engine.is_idle()


async def test_a_damaged_store_before_the_turn_gets_a_notice_at_once() -> None:
    async def agent(turn: Turn) -> str:
        return "answer"

    store = FlakyAcquire(StoreDamaged("store damaged", "malformed"))
    async with GatewayHarness(agent, store=store) as h:
        result = await h.send("hello", chat_id="c")
        [notice] = await h.replies(chat_id="c", count=1)
        assert notice == "Sorry — the gateway's store is damaged; your message was not run."
        assert await store.pending(result.session_key) == []
        assert h.gateway.engine.is_idle()


class AgentGaveUp(BaseException):
    """Not an ``Exception``: still the agent's own failure."""


@pytest.mark.parametrize("escape", ["cancelled subtask", "base exception"])
async def test_an_agent_that_lets_a_cancellation_out_fails_like_any_agent(escape: str) -> None:
    async def agent(turn: Turn) -> str:
        if turn.text != "fail":
            return f"echo: {turn.text}"
        if escape == "base exception":
            raise AgentGaveUp
        subtask = asyncio.ensure_future(asyncio.sleep(10))
        await asyncio.sleep(0)
        subtask.cancel()
        await subtask  # raises CancelledError; the turn itself was not cancelled
        return "unreachable"

    store = MemoryStore()
    async with GatewayHarness(agent, store=store) as h:
        result = await h.send("fail", chat_id="c")
        await h.send("next", chat_id="c")
        replies = await h.replies(chat_id="c", count=3)
        name = "AgentGaveUp" if escape == "base exception" else "CancelledError"
        assert replies[0] == "Queued for the next turn (1 queued)"
        assert replies[1:] == [f"Sorry — the agent failed on this message ({name}).", "echo: next"]
        await h.settle()
        assert await store.pending(result.session_key) == []


@pytest.mark.parametrize("store", ["memory", "sqlite"])
async def test_lone_surrogates_are_replaced_not_fatal(store: str, tmp_path: Path) -> None:
    url = "memory" if store == "memory" else f"sqlite:///{tmp_path / 'odd.db'}"
    async with GatewayHarness(EchoAgent(), store=url) as h:
        result = await h.send("hi \ud83d there", chat_id="c", user_name="ada \udc00")
        await h.send("/model \ud83d", chat_id="c")
        replies = await h.replies(chat_id="c", count=2)
        assert sorted(replies) == ["Model for this conversation: \ufffd", "echo: hi \ufffd there"]
        state = h.session(result.session_key)
        assert state.conversation.model_override.name == "\ufffd"


async def lone_reply(turn: Turn) -> str:
    return f"said \ud83d {turn.text}"


@pytest.mark.parametrize("store", ["memory", "sqlite"])
async def test_a_reply_holding_a_lone_surrogate_is_answered_with_it_replaced(
    store: str, tmp_path: Path
) -> None:
    url = "memory" if store == "memory" else f"sqlite:///{tmp_path / 'odd.db'}"
    async with GatewayHarness(lone_reply, store=url) as h:
        result = await h.send("hi", chat_id="c")
        assert await h.replies(chat_id="c", count=1) == ["said \ufffd hi"]
        await h.settle()
        entries = await h.gateway.engine.store.transcript(result.session_key)
        assert [e.content for e in entries] == ["hi", "said \ufffd hi"]


class CommitAnswersLate(MemoryStore):
    """A store whose first commit applies, then answers only once ``may_answer`` is set.

    Stands in for a commit on SQLite's writer thread or a Redis script: the
    store has the answer while its caller still waits to hear so.
    """

    def __init__(self) -> None:
        super().__init__()
        self.applied = asyncio.Event()
        self.may_answer = asyncio.Event()

    async def commit_and_release(self, lease: Lease, batch: WriteBatch) -> bool:
        released = await super().commit_and_release(lease, batch)
        if not self.applied.is_set():
            self.applied.set()
            await self.may_answer.wait()
        return released


@pytest.mark.parametrize("superseding", ["/stop", "next"])
async def test_an_answer_committed_before_its_turn_was_superseded_is_delivered(
    superseding: str,
) -> None:
    turns: list[Turn] = []

    async def agent(turn: Turn) -> str:
        turns.append(turn)
        return "ran " + turn.text

    store = CommitAnswersLate()
    async with GatewayHarness(agent, store=store, busy="interrupt") as h:
        first = await h.send("first", chat_id="c")
        await store.applied.wait()  # the store holds the answer; the turn waits to hear
        await h.send(superseding, chat_id="c")
        assert not turns[0].is_current()
        store.may_answer.set()
        await h.settle()
        texts = [o.text for o in h.delivered(chat_id="c")]
        assert texts.count("ran first") == 1  # the answer of record reaches its sender
        [outcome] = [o for o in h.outcomes if o.message_id == first.message_id]
        assert outcome.outcome.value == "answered"
        assert outcome.text == "ran first"
