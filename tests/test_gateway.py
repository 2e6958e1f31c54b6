"""The gateway's own steps: outbound filters, and authorization before anything else."""

from __future__ import annotations

import pytest

from chatlane.authorization import NOT_ALLOWED, Allowlist
from chatlane.config import Config
from chatlane.errors import ConfigError
from chatlane.gateway import Gateway, GatewaySettings
from chatlane.identity import SessionSource
from chatlane.stores import MemoryStore
from chatlane.testing import GatewayHarness
from chatlane.types import InboundMessage, Outbound
from tests.runtime.agents import EchoAgent


async def test_outbound_filters_run_in_order_and_hold_back_delivery_only() -> None:
    seen: list[str] = []

    def first(outbound: Outbound) -> bool:
        seen.append(f"first {outbound.text}")
        return "hidden" not in outbound.text

    def second(outbound: Outbound) -> bool:
        seen.append(f"second {outbound.text}")
        return True

    async with GatewayHarness(EchoAgent()) as h:
        h.gateway.add_outbound_filter(first)
        h.gateway.add_outbound_filter(second)
        await h.send("hidden", chat_id="c")
        await h.settle()
        await h.send("shown", chat_id="c")
        assert await h.replies(chat_id="c", count=1) == ["echo: shown"]
        await h.settle()
        key = h.session_key(chat_id="c")
        stored = [e.content for e in await h.gateway.engine.store.transcript(key)]
    assert stored == ["hidden", "echo: hidden", "shown", "echo: shown"]
    assert seen == ["first echo: hidden", "first echo: shown", "second echo: shown"]
    assert all("hidden" not in o.text for o in h.outbox)


async def test_a_harness_with_an_allowlist_refuses_a_stranger_before_anything_runs() -> None:
    async with GatewayHarness(EchoAgent(), allow={"test": ["ann"]}) as h:
        refused = await h.send("hello", chat_id="c", user_id="eve")
        assert refused.refused
        assert not refused.started
        assert await h.replies(chat_id="c", count=1) == [NOT_ALLOWED]
        assert await h.gateway.engine.store.transcript(refused.session_key) == []
        assert h.gateway.engine.metrics.senders_refused["test"] == 1
        assert not (await h.send("/status", chat_id="c", user_id="eve")).command
        allowed = await h.send("hello", chat_id="c", user_id="ann")
        assert not allowed.refused
        assert (await h.replies(chat_id="c", count=3))[2] == "echo: hello"
        await h.send("hi", chat_id="o", user_id="eve", platform="other")  # not listed: open
        assert await h.replies(chat_id="o", count=1) == ["echo: hi"]


async def test_the_refuse_hook_decides_how_a_refused_sender_is_told() -> None:
    told: list[str] = []
    delivered: list[Outbound] = []

    async def refuse(message: InboundMessage) -> None:
        told.append(message.text)

    async def deliver(outbound: Outbound) -> None:
        delivered.append(outbound)

    settings = GatewaySettings(authorize=lambda source: source.user_id != "eve")
    gateway = Gateway(EchoAgent(), deliver, settings=settings, store=MemoryStore(), refuse=refuse)
    await gateway.start()
    try:
        result = await gateway.dispatch(InboundMessage(SessionSource("test", chat_id="c"), "x"))
        assert not result.refused  # no user id, but the check lets it in
        source = SessionSource("test", chat_id="c", user_id="eve")
        assert (await gateway.dispatch(InboundMessage(source, "let me in"))).refused
        assert told == ["let me in"]
        assert gateway.authorized(SessionSource("test", chat_id="c", user_id="ann"))
    finally:
        await gateway.aclose()
    assert all(o.text != NOT_ALLOWED for o in delivered)


@pytest.mark.parametrize("user_id", [None, "", "ann", "eve", "123"])
@pytest.mark.parametrize("platform", ["telegram", "web"])
def test_an_allowlist_reads_as_the_configurations_allow(platform: str, user_id: str | None) -> None:
    users = {"telegram": ["ann", "123"]}
    source = SessionSource(platform, chat_id="c", user_id=user_id)
    assert Allowlist(users)(source) == Config(allow=users).allows(source)


def test_an_allowlist_of_one_string_is_refused() -> None:
    with pytest.raises(ConfigError, match="must be a list"):
        Allowlist({"test": "ann"})
