"""The gateway's own steps: outbound filters, and authorization before anything else."""

from __future__ import annotations

from chatlane.testing import GatewayHarness
from chatlane.types import Outbound
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
