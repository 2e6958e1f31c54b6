"""Message ids are unique across a gateway's sessions, and an answered mark tells which
session's message it answers and whether that turn failed.

A message whose id another session used is refused with a notice to its sender and a
refused outcome — never answered with the other session's answer, never silent — and a
turn whose agent failed ends failed in every process that reads its mark.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from chatlane.gateway import Gateway
from chatlane.identity import SessionSource
from chatlane.runtime.busy import STEERED_ELSEWHERE, BusyOutcome
from chatlane.runtime.outcomes import ID_IN_USE, MessageOutcome, Outcome, OutcomeLedger
from chatlane.runtime.settings import LeaseSettings
from chatlane.runtime.turn import Turn
from chatlane.runtime.watch import settle_watched
from chatlane.stores import Store, WriteBatch, open_store
from chatlane.testing import GatewayHarness
from chatlane.types import InboundMessage, Outbound
from tests.keys import chat_key
from tests.runtime.test_draw_in import ends

OpenStore = Callable[[], Awaitable[Store]]


@pytest.fixture(params=["memory", "sqlite"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Store]:
    url = "memory://" if request.param == "memory" else f"sqlite:///{tmp_path / 'ids.db'}"
    opened = await open_store(url)
    try:
        yield opened
    finally:
        await opened.close()


class Chats:
    """A gateway whose agent answers each chat with a secret of its own."""

    def __init__(self, store: Store) -> None:
        self.sent: list[tuple[str, str | None, str]] = []
        self.outcomes: list[MessageOutcome] = []
        self.gateway = Gateway(
            self.agent, self.deliver, store=store, on_outcome=self.outcomes.append
        )

    async def agent(self, turn: Turn) -> str:
        return f"secret for {turn.source.chat_id}"

    async def deliver(self, outbound: Outbound) -> None:
        self.sent.append((outbound.kind.value, outbound.target.chat_id, outbound.text))

    def of(self, chat: str) -> list[tuple[str, str]]:
        return [(kind, text) for kind, to, text in self.sent if to == chat]

    def ended(self, chat: str) -> list[tuple[Outcome, str]]:
        key = chat_key(chat)
        return [(o.outcome, o.text) for o in self.outcomes if o.session_key == key]


def message(chat: str, *, idempotent: bool) -> InboundMessage:
    source = SessionSource("test", chat_id=chat, user_id=chat)
    return InboundMessage(source, "hi", id="msg-1", idempotent=idempotent)


@pytest.mark.parametrize("idempotent", [False, True])
async def test_an_id_another_chat_was_answered_under_is_refused(
    store: Store, idempotent: bool
) -> None:
    chats = Chats(store)
    await chats.gateway.start()
    try:
        await chats.gateway.dispatch(message("alice", idempotent=idempotent))
        await chats.gateway.engine.wait_idle()
        await chats.gateway.dispatch(message("bob", idempotent=idempotent))
        await chats.gateway.engine.wait_idle()
    finally:
        await chats.gateway.aclose()
    assert chats.of("alice") == [("reply", "secret for alice")]
    assert chats.of("bob") == [("notice", ID_IN_USE)]
    assert chats.ended("alice") == [(Outcome.ANSWERED, "secret for alice")]
    assert chats.ended("bob") == [(Outcome.REFUSED, ID_IN_USE)]


@pytest.mark.parametrize("idempotent", [False, True])
async def test_an_id_another_chat_has_queued_is_refused_at_dispatch(
    store: Store, idempotent: bool
) -> None:
    chats = Chats(store)
    await chats.gateway.start()
    try:
        first, second = await asyncio.gather(
            chats.gateway.dispatch(message("alice", idempotent=idempotent)),
            chats.gateway.dispatch(message("bob", idempotent=idempotent)),
        )
        await chats.gateway.engine.wait_idle()
    finally:
        await chats.gateway.aclose()
    assert (first.started, second.started, second.outcome) == (True, False, BusyOutcome.REJECTED)
    assert chats.of("alice") == [("reply", "secret for alice")]
    assert chats.of("bob") == [("notice", ID_IN_USE)]
    assert chats.ended("alice") == [(Outcome.ANSWERED, "secret for alice")]
    assert chats.ended("bob") == [(Outcome.REFUSED, ID_IN_USE)]


async def test_a_watched_message_marked_by_another_session_ends_refused(store: Store) -> None:
    outcomes: list[MessageOutcome] = []
    ledger = OutcomeLedger(outcomes.append)
    ledger.open(chat_key("bob"), message("bob", idempotent=False))
    ledger.watch(["msg-1"])
    await store.commit(chat_key("alice"), None, WriteBatch(answered=["msg-1"], answer="secret"))
    assert await settle_watched(store, ledger) == 1
    assert [(o.outcome, o.text) for o in outcomes] == [(Outcome.REFUSED, ID_IN_USE)]


async def test_a_watched_message_whose_turn_failed_elsewhere_ends_failed(store: Store) -> None:
    outcomes: list[MessageOutcome] = []
    ledger = OutcomeLedger(outcomes.append)
    ledger.open(chat_key("bob"), message("bob", idempotent=False))
    ledger.watch(["msg-1"])
    failed = WriteBatch(answered=["msg-1"], answer="Sorry", failure="RuntimeError")
    await store.commit(chat_key("bob"), None, failed)
    await settle_watched(store, ledger)
    assert [(o.outcome, o.text, o.reason) for o in outcomes] == [
        (Outcome.FAILED, "Sorry", "RuntimeError")
    ]


class TakesThenFails:
    accepts_steering = True

    def __init__(self) -> None:
        self.release = asyncio.Event()

    async def __call__(self, turn: Turn) -> str:
        if turn.text == "long":
            await self.release.wait()
            turn.take_steers()
            raise RuntimeError("boom")
        return "ok"


async def test_a_message_drawn_into_a_turn_that_failed_elsewhere_ends_failed(
    tmp_path: Path,
) -> None:
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    stores = (await open_store(url), await open_store(url))
    runner_agent = TakesThenFails()
    by_hand = LeaseSettings(fence_check=0)
    try:
        async with (
            GatewayHarness(runner_agent, store=stores[0], busy="steer", leases=by_hand) as runner,
            GatewayHarness(
                TakesThenFails(), store=stores[1], busy="steer", leases=by_hand
            ) as other,
        ):
            first = await runner.send("long", chat_id="c")
            await runner.until_running(chat_id="c")
            second = await other.send("steer me", chat_id="c")
            assert await other.replies(chat_id="c", count=1) == [STEERED_ELSEWHERE]
            await runner.gateway.engine.upkeep.check_fences()  # `runner` draws it in
            runner_agent.release.set()
            await runner.settle()
            await other.settle()
            await other.gateway.engine.upkeep.settle_watched()
            assert ends(runner)[first.message_id][0] is Outcome.FAILED
            assert ends(other)[second.message_id][0] is Outcome.FAILED
    finally:
        for s in stores:
            await s.close()
