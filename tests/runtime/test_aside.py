"""``/btw``: a side answer runs beside the session's turn and never touches it."""

from __future__ import annotations

import asyncio
import sys

from chatlane.context import get_session_env
from chatlane.runtime.aside import SIDE_MARK
from chatlane.runtime.turn import Turn
from chatlane.stores import MemoryStore
from chatlane.testing import GatewayHarness
from chatlane.types import OutboundKind


class Beside:
    """``hold`` waits for :attr:`opened`; ``block`` for :attr:`unblocked`; ``fail`` raises,
    ``exit`` calls ``sys.exit``;
    anything else answers with what it saw of its turn and its session's context."""

    def __init__(self) -> None:
        self.opened = asyncio.Event()
        self.unblocked = asyncio.Event()

    async def __call__(self, turn: Turn) -> str:
        if turn.text == "hold":
            await self.opened.wait()
            return "ran: hold"
        if turn.text == "block":
            await self.unblocked.wait()
        if turn.text == "fail":
            raise RuntimeError("boom")
        if turn.text == "exit":
            sys.exit(2)  # a tool's argparse on bad arguments
        chat = get_session_env("CHATLANE_SESSION_CHAT_ID")
        approved = await turn.request_approval("rm -rf /", "a side answer may not")
        return f"{turn.text} in {chat}, current={turn.is_current()}, approved={approved}"


def texts(h: GatewayHarness, chat_id: str, kind: OutboundKind) -> list[str]:
    return [o.text for o in h.delivered(chat_id=chat_id) if o.kind is kind]


async def test_a_side_answer_comes_while_the_turn_runs_and_leaves_it_alone() -> None:
    store, agent = MemoryStore(), Beside()
    async with GatewayHarness(agent, store=store) as h:
        turn = await h.send("hold", chat_id="c")
        await h.until_running(chat_id="c")
        generation = h.session(turn.session_key).persistent.run_generation
        side = await h.send("/btw what is 2+2?", chat_id="c")
        [answer] = await h.replies(chat_id="c", count=1)
        assert answer == f"{SIDE_MARK}what is 2+2? in c, current=False, approved=False"
        assert h.gateway.engine.running_turn(turn.session_key) is not None  # still running
        assert h.session(turn.session_key).persistent.run_generation == generation
        agent.opened.set()
        await h.settle()
        transcript = [(e.role, e.content) for e in await store.transcript(turn.session_key)]
    assert transcript == [("user", "hold"), ("assistant", "ran: hold")]  # nothing of /btw
    [reply] = [o for o in h.delivered(chat_id="c") if o.text == answer]
    assert reply.in_reply_to == (side.message_id,)
    assert not texts(h, "c", OutboundKind.APPROVAL)  # denied at once, never asked


async def test_a_side_answer_neither_uses_nor_uses_up_a_once_model() -> None:
    """A ``/model --once`` is for the next turn: a side answer runs with the conversation's
    own model, and the turn after it still gets the one-turn model."""

    async def says_its_model(turn: Turn) -> str:
        model = turn.overrides.model
        return f"{turn.text}: {model.name if model else '-'}"

    async with GatewayHarness(says_its_model) as h:
        for text in ("/model sticky", "/model --once special", "/btw which?"):
            await h.send(text, chat_id="c")
        await h.wait_for(
            lambda _: f"{SIDE_MARK}which?: sticky" in texts(h, "c", OutboundKind.REPLY)
        )
        for text in ("next", "after"):
            await h.send(text, chat_id="c")
            await h.settle()
    assert texts(h, "c", OutboundKind.REPLY)[-2:] == ["next: special", "after: sticky"]


async def test_side_answers_have_their_own_budget() -> None:
    agent = Beside()
    async with GatewayHarness(agent, side_answers=1) as h:
        await h.send("/btw block", chat_id="a")
        assert h.gateway.engine.asides.running == 1  # started as the command ran
        await h.send("/btw and this?", chat_id="b")
        [refused] = await h.replies(chat_id="b", count=1)
        assert refused.startswith("Not answered: 1 side questions are being answered")
        agent.unblocked.set()
        [answer] = await h.replies(chat_id="a", count=1)
        assert answer.startswith(f"{SIDE_MARK}block in a")


async def test_a_failed_side_answer_is_a_notice_and_many_sessions_keep_apart() -> None:
    async with GatewayHarness(Beside(), side_answers=64) as h:
        await h.send("/btw fail", chat_id="x")
        await h.wait_for(lambda _: bool(texts(h, "x", OutboundKind.NOTICE)))
        assert texts(h, "x", OutboundKind.NOTICE) == [
            "Sorry — the agent failed on this message (RuntimeError)."
        ]
        chats = [f"c{n}" for n in range(40)]
        await asyncio.gather(*(h.send(f"/btw q{c}", chat_id=c) for c in chats))
        for chat in chats:
            [answer] = await h.replies(chat_id=chat, count=1)
            assert answer.startswith(f"{SIDE_MARK}q{chat} in {chat},")


async def test_a_side_answer_that_calls_exit_is_a_notice_not_the_gateways_end() -> None:
    async with GatewayHarness(Beside()) as h:
        await h.send("/btw exit", chat_id="x")
        await h.wait_for(lambda _: bool(texts(h, "x", OutboundKind.NOTICE)))
        await h.send("/btw still here?", chat_id="y")
        [answer] = await h.replies(chat_id="y", count=1)
    assert texts(h, "x", OutboundKind.NOTICE) == [
        "Sorry — the agent failed on this message (SystemExit)."
    ]
    assert answer.startswith(f"{SIDE_MARK}still here? in y,")


async def test_btw_without_a_question_shows_its_usage() -> None:
    async with GatewayHarness(Beside()) as h:
        await h.send("/btw", chat_id="c")
        [reply] = await h.replies(chat_id="c", count=1)
        assert reply.endswith("Usage: /btw <question>")
