"""The test harness itself: used wrongly, it says so at once."""

from __future__ import annotations

from typing import Any

import pytest

from chatlane.errors import ConfigError, InvalidSource
from chatlane.runtime.leases import LeaseSettings
from chatlane.runtime.settings import RuntimeSettings
from chatlane.testing import GatewayHarness
from tests.runtime.agents import EchoAgent


async def test_outside_its_block_the_harness_refuses_at_once() -> None:
    h = GatewayHarness(EchoAgent())
    with pytest.raises(RuntimeError, match="async with"):
        await h.send("early", chat_id="c")
    with pytest.raises(RuntimeError, match="async with"):
        await h.replies(chat_id="c", count=1)
    async with h:
        await h.send("hello", chat_id="c")
        assert await h.replies(chat_id="c", count=1) == ["echo: hello"]
        with pytest.raises(RuntimeError, match="entered once"):
            await h.__aenter__()
    assert await h.replies(chat_id="c", count=1) == ["echo: hello"]  # still readable
    with pytest.raises(RuntimeError, match="closed with 1 of 2 replies"):
        await h.replies(chat_id="c", count=2, timeout=30)
    with pytest.raises(RuntimeError, match="closed"):
        await h.send("late", chat_id="c")
    with pytest.raises(RuntimeError, match="entered once"):
        await h.__aenter__()


async def test_chats_and_threads_are_addressed_as_the_gateway_names_them() -> None:
    async with GatewayHarness(EchoAgent()) as h:
        await h.send("no thread", chat_id="c", thread_id="")
        await h.send("number", chat_id=42, thread_id=7)  # type: ignore[arg-type]
        assert await h.replies(chat_id="c", count=1) == ["echo: no thread"]
        assert await h.replies(chat_id="c", thread_id="", count=1) == ["echo: no thread"]
        assert await h.replies(chat_id="42", thread_id="7", count=1) == ["echo: number"]
        assert await h.replies(chat_id=42, thread_id=7, count=1) == ["echo: number"]  # type: ignore[arg-type]
        with pytest.raises(InvalidSource, match="non-empty chat_id"):
            await h.send("nowhere", chat_id="")
        with pytest.raises(InvalidSource, match="unknown chat_type 'supergroup'"):
            await h.send("odd", chat_id="c", chat_type="supergroup")


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"queue_cap": "3"}, "RuntimeSettings.queue_cap = '3': expected a whole number > 0"),
        ({"queue_cap": -1}, "RuntimeSettings.queue_cap = -1"),
        ({"queue_cap": 2.5}, "RuntimeSettings.queue_cap = 2.5: expected a whole number > 0"),
        ({"interrupt_depth": True}, "RuntimeSettings.interrupt_depth = True"),
        ({"turn_timeout": float("nan")}, "RuntimeSettings.turn_timeout = nan"),
        ({"ack_debounce": -0.5}, "expected a finite number >= 0"),
        ({"nonsense": 1}, "unknown harness settings ['nonsense']"),
    ],
)
def test_settings_are_checked_when_made(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as raised:
        GatewayHarness(EchoAgent(), **settings)
    assert message in str(raised.value)


def test_lease_settings_are_checked_when_made() -> None:
    with pytest.raises(
        ConfigError, match=r"LeaseSettings\.ttl = 0: expected a finite number >= 0\.1"
    ):
        LeaseSettings(ttl=0)
    with pytest.raises(ConfigError, match=r"LeaseSettings\.fence_check = inf"):
        LeaseSettings(fence_check=float("inf"))
    assert RuntimeSettings(turn_timeout=0, leases=LeaseSettings(fence_check=0)).turn_timeout == 0


async def test_ids_with_lone_surrogates_are_found_as_the_gateway_files_them() -> None:
    async with GatewayHarness(EchoAgent()) as h:
        result = await h.send("ok", chat_id="c\udfff2", thread_id="t\udc00")
        replies = await h.replies(chat_id="c\udfff2", thread_id="t\udc00", count=1)
        assert replies == ["echo: ok"]
        assert h.session_key(chat_id="c\udfff2", thread_id="t\udc00") == result.session_key
        assert "\ufffd" in result.session_key


async def test_until_running_and_until_queued_wait_on_the_engine() -> None:
    async with GatewayHarness(EchoAgent(), busy="queue") as h:
        started = await h.send("sleep 5", chat_id="c")
        await h.until_running(chat_id="c")
        assert h.gateway.engine.running_turn(started.session_key) is not None
        for text in ("a", "b"):
            await h.send(text, chat_id="c")
        await h.until_queued(chat_id="c", count=2)
        with pytest.raises(TimeoutError, match="fewer than 3 messages were queued"):
            await h.until_queued(chat_id="c", count=3, timeout=0.05)
        with pytest.raises(TimeoutError, match="no agent was running"):
            await h.until_running(chat_id="elsewhere", timeout=0.05)
        h.gateway.engine.interrupt(started.session_key)
    with pytest.raises(RuntimeError, match="async with"):
        await h.until_running(chat_id="c")
