"""A platform may send one message again — a retry, a redelivery after a restart, Slack's
two events for one mention, each maybe to another process: its command runs once."""

from __future__ import annotations

import asyncio
from pathlib import Path

from chatlane.identity import SessionSource
from chatlane.runtime.outcomes import Outcome
from chatlane.runtime.turn import Turn
from chatlane.stores import Store
from chatlane.stores.sqlite import SQLiteStore
from chatlane.testing import GatewayHarness
from chatlane.types import InboundMessage, OutboundKind
from tests.runtime.agents import EchoAgent
from tests.runtime.refusing import Refusing, first_of

SOURCE = SessionSource("telegram", chat_id="42", user_id="7")


def sent_again(text: str) -> InboundMessage:
    """A message as a platform names it: by its own id, the same in every copy."""
    return InboundMessage(SOURCE, text, id="tg-42-1001")


def replies(h: GatewayHarness) -> list[str]:
    return [o.text for o in h.outbox if o.kind is OutboundKind.REPLY]


async def test_a_command_sent_again_to_another_process_runs_once(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    here, there = await SQLiteStore.open(url), await SQLiteStore.open(url)
    try:
        async with (
            GatewayHarness(EchoAgent(), store=here) as first,
            GatewayHarness(EchoAgent(), store=there) as second,
        ):
            message = sent_again("/busy steer")
            await first.gateway.dispatch(message)
            await second.gateway.dispatch(message)  # the same message, to another process
            await first.gateway.dispatch(message)  # and here again
            await first.settle()
            await second.settle()
        assert replies(first) == ["Busy policy for this session: steer"]
        assert replies(second) == []
    finally:
        await here.close()
        await there.close()


async def test_a_command_sent_again_after_a_restart_runs_once(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'store.db'}"
    outboxes: list[list[str]] = []
    for _ in range(2):
        store: Store = await SQLiteStore.open(url)
        try:
            async with GatewayHarness(EchoAgent(), store=store) as h:
                await h.gateway.dispatch(sent_again("/status"))
                await h.settle()
            outboxes.append(replies(h))
        finally:
            await store.close()
    assert [len(replies) for replies in outboxes] == [1, 0]
    assert outboxes[0][0].startswith("Status: idle")


async def test_a_command_runs_though_the_store_cannot_note_it() -> None:
    """``/stop`` must work through an outage: unmarked, the command runs all the same."""
    store = Refusing(first_of("commit"))
    async with GatewayHarness(EchoAgent(), store=store) as h:
        await h.gateway.dispatch(sent_again("/busy steer"))
        await h.settle()
    assert store.refused["commit"] == 1
    assert replies(h) == ["Busy policy for this session: steer"]


class Holds:
    """Holds ``long`` until released; answers anything else at once."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.ran: list[str] = []

    async def __call__(self, turn: Turn) -> str:
        self.ran.append(turn.text)
        if turn.text == "long":
            await self.release.wait()
        return f"ran {turn.text}"


async def test_a_queued_text_of_a_request_sent_with_a_key_is_answered() -> None:
    """``/queue`` queues its text under the request's own id: its reply ("Queued…") is not
    kept as that id's answer, or the turn that runs the text could never commit its own."""
    agent = Holds()
    async with GatewayHarness(agent) as h:
        await h.send("long", chat_id="c")
        await h.until_running(chat_id="c")
        source = SessionSource("test", chat_id="c", user_id="u1")
        keyed = InboundMessage(source, "/queue hello", id="k-1", idempotent=True)
        await h.gateway.dispatch(keyed)
        agent.release.set()
        await h.settle()
    assert agent.ran == ["long", "hello"]
    assert replies(h)[-1] == "ran hello"
    assert [(o.outcome, o.text) for o in h.outcomes if o.message_id == "k-1"] == [
        (Outcome.ANSWERED, "ran hello")
    ]
