"""Commands whose text runs on as a turn under the command's own id (``/queue``)."""

from __future__ import annotations

import asyncio

from chatlane.identity import SessionSource
from chatlane.runtime.outcomes import Outcome
from chatlane.runtime.turn import Turn
from chatlane.testing import GatewayHarness
from chatlane.types import InboundMessage, OutboundKind


def replies(h: GatewayHarness) -> list[str]:
    return [o.text for o in h.outbox if o.kind is OutboundKind.REPLY]


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
