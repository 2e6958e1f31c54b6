"""The Telegram adapter end to end: python-telegram-bot polling a local Bot API stand-in,
a real hub with the demo agent behind it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from collections.abc import AsyncIterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import msgspec
import pytest
from telegram import Update
from telegram.request import HTTPXRequest

from chatlane.adapters import telegram as telegram_adapter
from chatlane.adapters.splitting import EMPTY_REPLY
from chatlane.adapters.telegram import (
    APPROVE_DATA,
    DENY_DATA,
    MESSAGE_LIMIT,
    REFUSAL_INTERVAL,
    TelegramAdapter,
    approval_buttons,
    button_asker,
    button_command,
    inbound_message,
    readable_updates,
    split_message,
    utf16_len,
)
from chatlane.adapters.telegram_groups import BotIdentity
from chatlane.adapters.waits import SEND_ROOM
from chatlane.commands import GREETING
from chatlane.config import AgentConfig, Config, Secret, TelegramConfig
from chatlane.delivery import Attempt, DeliverySettings
from chatlane.delivery.ledger import RESENT_LABEL
from chatlane.errors import ConfigError, StoreError, TransientDelivery
from chatlane.gateway import DispatchResult
from chatlane.groups import GroupPolicy
from chatlane.hub import Hub, open_hub, shutdown
from chatlane.identity import ChatType
from chatlane.stores.base import DEAD, DELIVERED
from chatlane.types import InboundMessage, Outbound, OutboundKind, Target
from tests.adapters.blank_agent import AGENT as BLANK_AGENT
from tests.adapters.botapi import ANONYMOUS_ADMIN, BOT_ID, CHANNEL_BOT, BotApi
from tests.clock import Clock
from tests.delivery.waits import dead, delivered, eventually
from tests.keys import chat_key

GROUP = -1001234
TOPIC = 7
ALICE, BOB = 42, 43
LONG = ("word " * 19 + "end\n") * 50
"""A reply of two parts (5,000 characters)."""


@pytest.fixture
async def api() -> AsyncIterator[BotApi]:
    async with BotApi() as api:
        yield api
    assert api.unknown == [], f"the adapter called methods the stand-in lacks: {api.unknown}"


QUICK_DELIVERY = DeliverySettings(
    poll_interval=0.05, first_retry=0.05, max_retry=0.2, unavailable_first=0.05, unavailable_max=0.2
)
"""The delivery ledger's retries, quick enough for tests."""


def telegram_config(
    api: BotApi,
    tmp_path: Path,
    token: str | None = None,
    *,
    groups: dict[str, Any] | None = None,
    **extra: Any,
) -> Config:
    """A configuration for the stand-in; ``groups``: the ``[telegram]`` group keys.

    Without ``groups`` a group is answered without a mention, so the tests of
    everything else can write there plainly (``test_telegram_groups`` tests the
    mention rule).
    """
    token_file = tmp_path / "telegram-token"
    token_file.write_text(api.token if token is None else token)
    secret = Secret(file=str(token_file))
    extra.setdefault("delivery", QUICK_DELIVERY)
    group_keys = {"require_mention": False} if groups is None else groups
    telegram = TelegramConfig(enabled=True, token=secret, api_url=api.url, **group_keys)
    return Config(telegram=telegram, **extra)


@contextlib.asynccontextmanager
async def running(
    config: Config, store_url: str = "memory://", **options: Any
) -> AsyncIterator[tuple[Hub, TelegramAdapter]]:
    """A hub on ``store_url`` with the demo agent and the Telegram adapter (made with
    ``options``), polling."""
    hub = await open_hub(config, store_url=store_url)
    adapter = TelegramAdapter(config, poll_timeout=5, **options)
    hub.add(adapter)
    await hub.gateway.start()
    try:
        await adapter.start(hub)
        yield hub, adapter
    finally:
        await shutdown(hub)


@pytest.fixture
async def adapter(api: BotApi, tmp_path: Path) -> AsyncIterator[TelegramAdapter]:
    async with running(telegram_config(api, tmp_path)) as (_, adapter):
        yield adapter


def key_of(whoami: str) -> str:
    return whoami.split(" key=")[1].split(" ")[0]


async def test_private_chat_echo(api: BotApi, adapter: TelegramAdapter) -> None:
    api.push_text(ALICE, ALICE, "hello there")
    [reply] = await api.wait_for_sent(ALICE)
    assert reply.text == "echo: hello there"
    assert reply.thread_id is None
    assert {"getMe", "deleteWebhook", "getUpdates"} <= set(api.calls)


async def test_whoami_in_forum_topic_replies_in_the_topic(
    api: BotApi, adapter: TelegramAdapter
) -> None:
    api.push_text(GROUP, ALICE, "whoami", thread_id=TOPIC, chat_type="supergroup")
    [reply] = await api.wait_for_sent(GROUP)
    assert f"platform=telegram chat={GROUP} thread={TOPIC} user={ALICE} " in reply.text
    assert reply.thread_id == TOPIC


async def test_group_users_are_separate_but_a_topic_is_shared(
    api: BotApi, adapter: TelegramAdapter
) -> None:
    for user in (ALICE, BOB):
        api.push_text(GROUP, user, "whoami", chat_type="supergroup")
    group = await api.wait_for_sent(GROUP, 2)
    assert all(sent.thread_id is None for sent in group)
    assert len({key_of(sent.text) for sent in group}) == 2
    for user in (ALICE, BOB):
        api.push_text(GROUP, user, "whoami", thread_id=TOPIC, chat_type="supergroup")
    topic = (await api.wait_for_sent(GROUP, 5))[2:]  # one session: Bob's whoami is queued
    assert all(sent.thread_id == TOPIC for sent in topic)
    assert topic[0].text == "Queued for the next turn (1 queued)"
    assert len({key_of(sent.text) for sent in topic[1:]}) == 1


async def test_a_long_echo_is_split_at_the_utf16_limit(
    api: BotApi, adapter: TelegramAdapter
) -> None:
    text = "😀" * (MESSAGE_LIMIT // 2)  # the most Telegram lets a user send: 4096 units
    api.push_text(ALICE, ALICE, text)
    parts = await api.wait_for_sent(ALICE, 2)
    assert len(parts) == 2
    assert all(utf16_len(part.text) <= MESSAGE_LIMIT for part in parts)
    assert "".join(part.text for part in parts) == f"echo: {text}"


async def test_a_9000_character_reply_becomes_three_messages(
    api: BotApi, adapter: TelegramAdapter
) -> None:
    api.push_text(ALICE, ALICE, "/help")  # makes the chat known to the stand-in
    await api.wait_for_sent(ALICE)
    line = "word " * 17 + "x👨‍👩‍👧 ünïcödé\n"  # 100 code points, 103 UTF-16 units
    text = line * 90
    assert len(text) == 9000
    target = Target("telegram", str(ALICE))
    await adapter.deliver(
        Outbound(OutboundKind.REPLY, chat_key(str(ALICE), "telegram"), target, text)
    )
    parts = api.sent(ALICE)[1:]
    assert len(parts) == 3
    assert all(utf16_len(part.text) <= MESSAGE_LIMIT for part in parts)
    assert all(part.text.endswith("\n") for part in parts)
    assert "".join(part.text for part in parts) == text


async def test_command_with_bot_mention(api: BotApi, adapter: TelegramAdapter) -> None:
    api.push_text(GROUP, ALICE, "/status@chatlane_bot", chat_type="supergroup")
    [reply] = await api.wait_for_sent(GROUP)
    assert reply.text.startswith("Status: idle")


async def test_commands_for_another_bot_are_ignored(
    api: BotApi, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with running(telegram_config(api, tmp_path)) as (hub, _):
        submitted: list[str] = []
        submit = hub.submit

        async def recording(message: InboundMessage) -> DispatchResult | None:
            submitted.append(message.text)
            return await submit(message)

        monkeypatch.setattr(hub, "submit", recording)
        api.push_text(GROUP, ALICE, "/status", chat_type="supergroup")
        [before] = await api.wait_for_sent(GROUP)
        for text in ("/new@OtherBot confirm", "/stop@other_bot", "/status@CHATLANE_BOT"):
            api.push_text(GROUP, ALICE, text, chat_type="supergroup")
        after = (await api.wait_for_sent(GROUP, 2))[1]
        assert after.text == before.text  # same generation: /new@OtherBot did not reset
        assert submitted == ["/status", "/status@CHATLANE_BOT"]


@pytest.mark.parametrize("error", [StoreError("the store is down"), RuntimeError("boom")])
async def test_a_message_the_hub_cannot_take_gets_a_notice(
    api: BotApi,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    error: Exception,
) -> None:
    async def failing(message: InboundMessage) -> DispatchResult | None:
        raise error

    async with running(telegram_config(api, tmp_path)) as (hub, _):
        monkeypatch.setattr(hub, "submit", failing)
        with caplog.at_level(logging.WARNING, logger="chatlane.adapters.telegram"):
            api.push_text(GROUP, ALICE, "hello", thread_id=TOPIC, chat_type="supergroup")
            [notice] = await api.wait_for_sent(GROUP)
    assert notice.text == "Sorry — your message could not be handled right now; please try again."
    assert notice.thread_id == TOPIC
    assert f"telegram message tg-{GROUP}-" in caplog.text
    assert ("Traceback" in caplog.text) is isinstance(error, RuntimeError)


async def test_the_allowlist_refuses_a_stranger_in_the_chat(api: BotApi, tmp_path: Path) -> None:
    config = telegram_config(api, tmp_path, allow={"telegram": [str(ALICE)]})
    async with running(config):
        api.push_text(BOB, BOB, "hello")
        [refusal] = await api.wait_for_sent(BOB)
        assert refusal.text == "Sorry, you are not allowed to use this assistant."
        api.push_text(ALICE, ALICE, "hello")
        [reply] = await api.wait_for_sent(ALICE)
        assert reply.text == "echo: hello"


async def test_a_message_during_a_turn_is_acknowledged_then_run(
    api: BotApi, adapter: TelegramAdapter
) -> None:
    api.push_text(ALICE, ALICE, "sleep 1")
    api.push_text(ALICE, ALICE, "and then this")
    sent = await api.wait_for_sent(ALICE, 3)
    assert [s.text for s in sent] == [
        "Queued for the next turn (1 queued)",
        "slept 1",
        "echo: and then this",
    ]


async def test_the_chat_shows_typing_while_its_turn_runs(
    api: BotApi, adapter: TelegramAdapter
) -> None:
    assert adapter.typing is not None
    adapter.typing.every = 0.05  # shown again and again while the turn runs
    api.push_text(GROUP, ALICE, "sleep 30", thread_id=TOPIC, chat_type="supergroup")
    await api.wait_for(lambda: len(api.actions(GROUP)) >= 2)
    assert {(a.action, a.thread_id) for a in api.actions(GROUP)} == {("typing", TOPIC)}
    api.push_text(GROUP, ALICE, "/stop", thread_id=TOPIC, chat_type="supergroup")
    await api.wait_for_sent(GROUP)
    await asyncio.wait_for(adapter.typing.settled(), 10)
    assert adapter.typing.showing() == []  # the turn ended: so did the indicator


async def test_start_the_first_message_of_every_user_is_greeted(
    api: BotApi, adapter: TelegramAdapter
) -> None:
    api.push_text(ALICE, ALICE, "/start")
    [reply] = await api.wait_for_sent(ALICE)
    assert reply.text.startswith(GREETING + "\n\nCommands:\n")
    assert "/help" in reply.text


async def test_a_command_answered_at_once_shows_no_typing(
    api: BotApi, adapter: TelegramAdapter
) -> None:
    api.push_text(ALICE, ALICE, "/help")
    await api.wait_for_sent(ALICE)
    assert api.actions(ALICE) == []


async def test_a_failed_typing_action_never_holds_up_the_reply(
    api: BotApi, adapter: TelegramAdapter
) -> None:
    api.fail_next("sendChatAction", 400, "Bad Request: not enough rights")
    api.push_text(ALICE, ALICE, "hello")
    [reply] = await api.wait_for_sent(ALICE)
    assert reply.text == "echo: hello"


async def test_typing_can_be_turned_off(api: BotApi, tmp_path: Path) -> None:
    config = telegram_config(api, tmp_path)
    config = msgspec.structs.replace(
        config, telegram=msgspec.structs.replace(config.telegram, typing=False)
    )
    async with running(config) as (_, adapter):
        assert adapter.typing is None
        api.push_text(ALICE, ALICE, "hello")
        await api.wait_for_sent(ALICE)
    assert api.actions(ALICE) == []


@pytest.mark.parametrize(
    ("status", "retry_after"),
    [(500, None), (429, 1)],  # a 429 whose wait is past the cap
)
async def test_without_the_ledger_a_failed_send_is_logged_and_the_adapter_goes_on(
    api: BotApi,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    status: int,
    retry_after: int | None,
) -> None:
    monkeypatch.setattr(telegram_adapter, "FLOOD_WAIT_CAP", 0.5)
    config = telegram_config(api, tmp_path, delivery=DeliverySettings(enabled=False))
    api.fail_next("sendMessage", status, "refused (test)", retry_after=retry_after)
    async with running(config) as (hub, _):
        assert hub.gateway.delivery is None
        with caplog.at_level(logging.WARNING, logger="chatlane.adapters.telegram"):
            api.push_text(ALICE, ALICE, "first")
            await api.wait_for_call("sendMessage")
            api.push_text(ALICE, ALICE, "second")
            [reply] = await api.wait_for_sent(ALICE)
    assert reply.text == "echo: second"
    assert "sendMessage to chat 42 failed" in caplog.text


async def test_a_reply_whose_send_failed_is_delivered_once_the_api_recovers(
    api: BotApi, tmp_path: Path
) -> None:
    api.fail_next("sendMessage", 500, "Internal Server Error")
    async with running(telegram_config(api, tmp_path)) as (hub, _):
        api.push_text(ALICE, ALICE, "first")
        await api.wait_for_sent(ALICE)
        api.push_text(ALICE, ALICE, "second")
        replies = await api.wait_for_sent(ALICE, 2)
        await eventually(hub.gateway.delivery, lambda: delivered(hub, 2))
        [first, second] = await hub.store.deliveries(DELIVERED)
    # a 500 may come after Telegram took the message: its re-send says it may repeat
    assert [r.text for r in replies] == [RESENT_LABEL + "echo: first", "echo: second"]
    assert (first.attempts, second.attempts) == (1, 0)


async def test_no_attempt_is_spent_while_the_api_is_down(api: BotApi, tmp_path: Path) -> None:
    for _ in range(3):
        api.fail_next("sendMessage", 502, "Bad Gateway")
    async with running(telegram_config(api, tmp_path)) as (hub, _):
        api.push_text(ALICE, ALICE, "first")
        [reply] = await api.wait_for_sent(ALICE)
        await eventually(hub.gateway.delivery, lambda: delivered(hub, 1))
        [done] = await hub.store.deliveries(DELIVERED)
    assert reply.text == "echo: first"  # nothing reached Telegram before: no label
    assert done.attempts == 0
    assert api.calls.count("sendMessage") == 4


async def test_a_reply_with_nothing_visible_is_sent_as_a_placeholder(
    api: BotApi, tmp_path: Path
) -> None:
    """Telegram shows no blank message: the user still sees the turn ended."""
    blank = telegram_config(api, tmp_path, agent=AgentConfig(name=BLANK_AGENT))
    async with running(blank) as (hub, _):
        api.push_text(ALICE, ALICE, "spaces")
        await eventually(hub.gateway.delivery, lambda: delivered(hub, 1))
        api.push_text(ALICE, ALICE, "zero-width")
        await eventually(hub.gateway.delivery, lambda: delivered(hub, 2))
    assert [sent.text for sent in api.sent(ALICE)] == [EMPTY_REPLY, EMPTY_REPLY]


async def test_a_reply_to_a_chat_that_is_gone_is_dead_lettered(api: BotApi, tmp_path: Path) -> None:
    api.fail_next("sendMessage", 403, "Forbidden: bot was blocked by the user")
    async with running(telegram_config(api, tmp_path)) as (hub, _):
        api.push_text(ALICE, ALICE, "first")
        await eventually(hub.gateway.delivery, lambda: dead(hub, 1))
        api.push_text(ALICE, ALICE, "second")
        [reply] = await api.wait_for_sent(ALICE)
        [gone] = await hub.store.deliveries(DEAD)
        text = hub.metrics.render(0, 0, ledger=await hub.store.delivery_stats())
    assert reply.text == "echo: second"
    assert gone.reason == "telegram: Forbidden: bot was blocked by the user"
    assert "chatlane_deliveries_dead 1" in text
    assert 'chatlane_delivery_attempts_total{outcome="dead"} 1' in text


async def test_a_redelivered_reply_whose_first_part_went_out_is_labelled(
    api: BotApi, tmp_path: Path
) -> None:
    """Part 1 of a long reply was taken, part 2 refused for good: the reply is dead-lettered,
    and once redelivered, the chat has part 1 unlabelled once and the labelled re-send."""
    text = "a" * 3000 + "\n" + "b" * 1090  # its echo is two parts, cut at the line break
    api.fail_next("sendMessage", 403, "Forbidden: bot was blocked by the user", after=1)
    async with running(telegram_config(api, tmp_path)) as (hub, _):
        api.push_text(ALICE, ALICE, text)
        await eventually(hub.gateway.delivery, lambda: dead(hub, 1))
        [gone] = await hub.store.deliveries(DEAD)
        assert await hub.store.retry_dead(gone.id)  # the user unblocked the bot
        await eventually(hub.gateway.delivery, lambda: delivered(hub, 1))
    first, *again = [sent.text for sent in api.sent(ALICE)]
    assert first == "echo: " + "a" * 3000 + "\n"
    assert again[0].startswith(RESENT_LABEL)
    assert "".join(again) == f"{RESENT_LABEL}echo: {text}"


async def test_flood_control_is_waited_out_without_losing_or_reordering(
    api: BotApi, adapter: TelegramAdapter
) -> None:
    api.fail_next("sendMessage", 429, "Too Many Requests: retry after 1", retry_after=1)
    started = time.monotonic()
    api.push_text(ALICE, ALICE, "first")
    await api.wait_for_call("sendMessage")  # refused: the reply waits out the second
    api.push_text(ALICE, ALICE, "second")  # its reply waits behind the first one's
    replies = await api.wait_for_sent(ALICE, 2)
    assert time.monotonic() - started >= 1.0
    assert [r.text for r in replies] == ["echo: first", "echo: second"]  # no label: not sent
    assert api.calls.count("sendMessage") == 3


async def test_a_flood_wait_that_would_outlast_the_attempt_is_not_begun(
    api: BotApi, adapter: TelegramAdapter
) -> None:
    """A wait between parts that would end past the worker's deadline fails the attempt at
    once (the first part went out: maybe sent), instead of being cancelled mid-wait."""
    api.push_text(ALICE, ALICE, "hi")  # the stand-in knows the chat once it wrote
    await api.wait_for_sent(ALICE)
    key = chat_key(str(ALICE), "telegram")
    reply = Outbound(OutboundKind.REPLY, key, Target("telegram", str(ALICE)), LONG)
    api.fail_next("sendMessage", 429, "Too Many Requests: retry after 30", 30, after=1)
    deadline = time.monotonic() + SEND_ROOM + 10
    with pytest.raises(TransientDelivery) as failed:
        await adapter.send(reply, Attempt("d_1", uncertain=False, attempts=0, deadline=deadline))
    assert failed.value.maybe_sent
    assert time.monotonic() < deadline
    assert api.calls.count("sendMessage") == 3  # "echo: hi", part 1, part 2 refused


async def test_a_reply_to_a_group_upgraded_to_a_supergroup_goes_to_the_supergroup(
    api: BotApi, tmp_path: Path
) -> None:
    old, new = -4321, -1004321
    async with running(telegram_config(api, tmp_path)) as (hub, _):
        api.migrate(old, new)  # Telegram still hands on a message sent before the upgrade
        api.push_text(old, ALICE, "before the upgrade", chat_type="group")
        [reply] = await api.wait_for_sent(new)
        await eventually(hub.gateway.delivery, lambda: delivered(hub, 1))
    assert reply.text == "echo: before the upgrade"
    assert api.sent(old) == []


async def test_approval_buttons_answer_as_the_presser(
    api: BotApi, adapter: TelegramAdapter
) -> None:
    api.push_text(GROUP, ALICE, "approve rm -rf build", thread_id=TOPIC, chat_type="supergroup")
    [prompt] = await api.wait_for_sent(GROUP)
    assert prompt.text.startswith("Approval needed")
    assert prompt.thread_id == TOPIC
    assert prompt.reply_markup is not None
    buttons = prompt.reply_markup["inline_keyboard"][0]
    assert [b["text"] for b in buttons] == ["Approve", "Deny"]
    api.push_button(ALICE, buttons[0]["callback_data"], prompt)
    sent = await api.wait_for_sent(GROUP, 3)
    assert "approved: rm -rf build" in [s.text for s in sent]
    assert all(s.thread_id == TOPIC for s in sent)
    assert [a["text"] for a in api.answers] == ["Sent /approve"]


async def test_another_users_press_is_answered_privately_and_the_asker_still_answers(
    api: BotApi, adapter: TelegramAdapter
) -> None:
    api.push_text(GROUP, ALICE, "approve rm -rf build", thread_id=TOPIC, chat_type="supergroup")
    [prompt] = await api.wait_for_sent(GROUP)
    assert prompt.reply_markup is not None
    approve = prompt.reply_markup["inline_keyboard"][0][0]["callback_data"]
    api.push_button(BOB, approve, prompt)
    await api.wait_for_call("answerCallbackQuery")
    assert [a["text"] for a in api.answers] == [
        "Only the person who asked can answer this approval."
    ]
    api.push_button(ALICE, approve, prompt)
    sent = await api.wait_for_sent(GROUP, 3)
    assert [s.text for s in sent][1:] == [
        "Approved (once): `rm -rf build`",
        "approved: rm -rf build",
    ]


def test_button_data_names_the_asker_when_it_fits() -> None:
    [[approve, deny]] = approval_buttons("a1b2c3d4", "42").inline_keyboard
    assert (approve.callback_data, deny.callback_data) == (
        f"{APPROVE_DATA}:a1b2c3d4@42",
        f"{DENY_DATA}:a1b2c3d4@42",
    )
    assert button_command(f"{APPROVE_DATA}:a1b2c3d4@42") == "/approve #a1b2c3d4"
    assert button_asker(f"{APPROVE_DATA}:a1b2c3d4@chat:-1001234") == "chat:-1001234"
    assert button_asker(f"{APPROVE_DATA}:a1b2c3d4") is None
    assert button_asker("other:a1b2c3d4@42") is None
    [[too_long, _]] = approval_buttons("a1b2c3d4", "9" * 60).inline_keyboard
    assert too_long.callback_data == f"{APPROVE_DATA}:a1b2c3d4"


async def test_a_button_on_an_old_prompt_never_answers_a_newer_request(
    api: BotApi, adapter: TelegramAdapter
) -> None:
    api.push_text(ALICE, ALICE, "approve echo harmless")
    [old] = await api.wait_for_sent(ALICE)
    api.push_text(ALICE, ALICE, "/stop")
    await api.wait_for_sent(ALICE, 2)
    api.push_text(ALICE, ALICE, "approve rm -rf /")
    sent = await api.wait_for_sent(ALICE, 3)
    assert sent[-1].text.startswith("Approval needed: `rm -rf /`")
    assert old.reply_markup is not None
    api.push_button(ALICE, old.reply_markup["inline_keyboard"][0][0]["callback_data"], old)
    sent = await api.wait_for_sent(ALICE, 4)
    assert sent[-1].text.startswith("That approval is no longer pending")
    api.push_text(ALICE, ALICE, "/deny")
    sent = await api.wait_for_sent(ALICE, 6)
    assert "Denied: `rm -rf /`" in [s.text for s in sent]
    assert not any("Approved" in s.text for s in sent)


async def test_in_a_channel_a_button_only_says_how_to_answer(
    api: BotApi, adapter: TelegramAdapter
) -> None:
    api.push_text(-1005, 0, "approve rm x", chat_type="channel")
    [prompt] = await api.wait_for_sent(-1005)
    assert prompt.reply_markup is not None
    api.push_button(ALICE, prompt.reply_markup["inline_keyboard"][0][0]["callback_data"], prompt)
    await api.wait_for_call("answerCallbackQuery")
    assert [a["text"] for a in api.answers] == [
        "In a channel, answer by posting /approve or /deny."
    ]
    api.push_text(-1005, 0, "/approve", chat_type="channel")  # only its admins can post
    sent = await api.wait_for_sent(-1005, 3)
    assert [s.text for s in sent][1:] == ["Approved (once): `rm x`", "approved: rm x"]


def test_button_data_names_the_request_and_old_data_still_answers() -> None:
    assert button_command(f"{APPROVE_DATA}:a1b2c3d4") == "/approve #a1b2c3d4"
    assert button_command(f"{DENY_DATA}:a0f") == "/deny #a0f"
    assert button_command(APPROVE_DATA) == "/approve"
    for data in ("", "chatlane:approve:x", "chatlane:approve:7", "other:a1", "chatlane:stop:a1"):
        assert button_command(data) is None


async def test_a_stale_button_is_answered_without_a_message(
    api: BotApi, adapter: TelegramAdapter
) -> None:
    api.push_text(ALICE, ALICE, "hi")
    [reply] = await api.wait_for_sent(ALICE)
    api.push_button(ALICE, "something-else", reply)
    await api.wait_for_call("answerCallbackQuery")
    assert [a["text"] for a in api.answers] == ["This button is no longer active."]


async def test_odd_unicode_round_trips(api: BotApi, adapter: TelegramAdapter) -> None:
    text = "bad \ud800 surrogate, family 👨‍👩‍👧, rtl \u202eabc, nul \x00 end"
    api.push_text(ALICE, ALICE, text)
    [reply] = await api.wait_for_sent(ALICE)
    assert reply.text == "echo: " + text.replace("\ud800", "\ufffd")


async def test_a_sticker_in_a_private_chat_gets_a_clear_notice(
    api: BotApi, adapter: TelegramAdapter
) -> None:
    sticker = {"file_id": "s1", "file_unique_id": "u1", "type": "regular", "width": 1}
    sticker |= {"height": 1, "is_animated": False, "is_video": False}
    api.push_message(ALICE, ALICE, {"sticker": sticker})
    [notice] = await api.wait_for_sent(ALICE)
    assert notice.text == (
        "Sorry, I can only read text, photos, documents, voice messages, audio and video "
        "— not this kind of message."
    )


STICKER = {"file_id": "s1", "file_unique_id": "u1", "type": "regular", "width": 1, "height": 1}
STICKER |= {"is_animated": False, "is_video": False}


async def test_a_strangers_stickers_get_only_the_hourly_refusal(
    api: BotApi, tmp_path: Path
) -> None:
    config = telegram_config(api, tmp_path, allow={"telegram": [str(ALICE)]})
    async with running(config) as (hub, _):
        for _ in range(3):
            api.push_message(BOB, BOB, {"sticker": STICKER})
        api.push_text(ALICE, ALICE, "after")
        await api.wait_for_sent(ALICE)
        await hub.gateway.engine.wait_idle()
    assert [sent.text for sent in api.sent(BOB)] == [NOT_ALLOWED]


async def test_a_pinned_message_in_a_private_chat_is_not_answered(
    api: BotApi, adapter: TelegramAdapter
) -> None:
    """A service message (a message pinned, a timer set) is no message to read."""
    api.push_text(ALICE, ALICE, "remember this")
    [reply] = await api.wait_for_sent(ALICE)
    pinned = {"message_id": reply.message_id, "date": 0, "text": reply.text}
    pinned |= {"chat": {"id": ALICE, "type": "private", "first_name": "Alice"}}
    pinned |= {"from": {"id": BOT_ID, "is_bot": True, "first_name": "Bot"}}
    api.push_message(ALICE, ALICE, {"pinned_message": pinned})
    api.push_text(ALICE, ALICE, "after")
    sent = await api.wait_for_sent(ALICE, 2)
    assert [s.text for s in sent] == ["echo: remember this", "echo: after"]


async def test_an_acknowledgement_waiting_out_flood_control_holds_up_no_other_chat(
    api: BotApi, adapter: TelegramAdapter
) -> None:
    """python-telegram-bot hands updates on one at a time: Bob's message, in another chat,
    is answered while Alice's "Queued…" waits out its 429 (longer than any test waits)."""
    api.push_text(BOB, BOB, "hi")
    await api.wait_for_sent(BOB)
    api.push_text(ALICE, ALICE, "sleep 30")
    await api.wait_for_call("sendChatAction")  # Alice's turn runs
    api.fail_next("sendMessage", 429, "Too Many Requests: retry after 50", retry_after=50)
    api.push_text(ALICE, ALICE, "and this")  # "Queued…" meets flood control
    api.push_text(BOB, BOB, "urgent")
    sent = await api.wait_for_sent(BOB, 2)
    assert sent[1].text == "echo: urgent"


async def test_an_unreadable_update_is_skipped_not_fetched_forever(
    api: BotApi, adapter: TelegramAdapter, caplog: pytest.LogCaptureFixture
) -> None:
    polls = api.calls.count("getUpdates")
    api.push_message(ALICE, ALICE, {"sticker": {"file_id": "no width, no height"}})
    api.push_text(ALICE, ALICE, "still here")
    [reply] = await api.wait_for_sent(ALICE)
    assert reply.text == "echo: still here"
    assert api.calls.count("getUpdates") - polls < 10
    assert "skipped Telegram update 1000: cannot read it" in caplog.text


class Confirming(BotApi):
    """The stand-in, noting at each ``getUpdates`` how many pushed updates its offset
    confirms and how many messages the hub had taken by then."""

    def __init__(self) -> None:
        super().__init__()
        self.pushed: list[int] = []
        self.taken = 0
        self.confirmations: list[tuple[int, int]] = []

    async def _get_updates(self, params: dict[str, Any]) -> Any:
        offset = int(params.get("offset") or 0)
        confirmed = sum(1 for update_id in self.pushed if update_id < offset)
        self.confirmations.append((confirmed, self.taken))
        return await super()._get_updates(params)


async def test_an_update_is_confirmed_to_telegram_only_once_the_hub_took_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A crash between the two would lose a message Telegram never sends again
    (on the durable SQLite store, whose writes let the poller run ahead)."""
    store = f"sqlite:///{tmp_path / 'chat.db'}"
    async with Confirming() as api, running(telegram_config(api, tmp_path), store) as (hub, _):
        submit = hub.submit

        async def counted(message: InboundMessage) -> DispatchResult:
            result = await submit(message)
            api.taken += 1
            return result

        monkeypatch.setattr(hub, "submit", counted)
        users = range(5000, 5030)
        for user in users:
            api.push_text(user, user, f"hello {user}")
        api.pushed = [update["update_id"] for update in api._updates]
        await api.wait_for(lambda: bool(api.confirmations) and api.confirmations[-1][0] == 30)
        for user in users:
            await api.wait_for_sent(user)
    early = [(confirmed, taken) for confirmed, taken in api.confirmations if confirmed > taken]
    assert early == []


async def test_getupdates_waits_until_every_update_fetched_before_it_was_handled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    asked: list[str] = []

    async def answered(self: HTTPXRequest, url: str, *args: Any, **kwargs: Any) -> Any:
        asked.append(url)
        return 200, b'{"ok": true, "result": []}'

    monkeypatch.setattr(HTTPXRequest, "do_request", answered)
    fetched: asyncio.Queue[object] = asyncio.Queue()
    fetched.put_nowait("an update not handled yet")
    joining = asyncio.Event()
    join = fetched.join

    async def noted_join() -> None:
        joining.set()
        await join()

    monkeypatch.setattr(fetched, "join", noted_join)
    request = telegram_adapter.UpdatesRequest(fetched)
    try:
        polled = asyncio.create_task(request.do_request("getUpdates", "POST"))
        async with asyncio.timeout(5):  # without the wait, it never begins
            await joining.wait()
        assert asked == []
        fetched.get_nowait()
        fetched.task_done()
        assert await polled == (200, b'{"ok": true, "result": []}')
        assert asked == ["getUpdates"]
    finally:
        await request.shutdown()


def text_update(text: str) -> Update:
    """A private-chat text message from Alice, parsed as polling parses it."""
    chat = {"id": ALICE, "type": "private", "first_name": "Alice"}
    user = {"id": ALICE, "is_bot": False, "first_name": "Alice"}
    fields = {"message_id": 9, "date": 0, "chat": chat, "from": user, "text": text}
    return Update.de_json({"update_id": 1, "message": fields}, None)


MY_BOT = BotIdentity(1, "MyBot")
ANY_GROUP = GroupPolicy(TelegramConfig(require_mention=False), "telegram")


def test_a_text_update_becomes_the_message_chatlane_gets() -> None:
    inbound = inbound_message(text_update("hello \ud800"), MY_BOT, ANY_GROUP)
    assert inbound is not None
    assert (inbound.id, inbound.text) == (f"tg-{ALICE}-9", "hello \ufffd")
    source = inbound.source
    assert (source.chat_id, source.chat_type, source.user_id) == (
        str(ALICE),
        ChatType.DM,
        str(ALICE),
    )
    assert (source.user_name, source.message_id) == ("Alice", "9")
    assert inbound.whole_reply  # Telegram shows no chunks: its turns send none out


def test_no_message_is_made_for_another_bot_or_without_text() -> None:
    assert inbound_message(text_update("/new@OtherBot"), MY_BOT, ANY_GROUP) is None
    assert inbound_message(text_update("/new@mybot"), MY_BOT, ANY_GROUP) is not None
    assert inbound_message(Update.de_json({"update_id": 2}, None), MY_BOT, ANY_GROUP) is None


def test_readable_updates_leaves_other_payloads_alone() -> None:
    for payload in (b"not json", b'{"ok": true, "result": true}', b"[]", b'{"ok": false}'):
        assert readable_updates(payload) == payload
    odd = b'{"ok": true, "result": [{"no": "id"}, {"update_id": 5}]}'
    assert json.loads(readable_updates(odd))["result"] == [{"no": "id"}, {"update_id": 5}]


async def test_a_channel_post_is_answered_in_the_channel(
    api: BotApi, adapter: TelegramAdapter
) -> None:
    api.push_text(-1005, 0, "whoami", chat_type="channel")
    [reply] = await api.wait_for_sent(-1005)
    assert reply.text.startswith("platform=telegram chat=-1005 thread= user= ")
    assert ":channel:" in key_of(reply.text)


async def test_the_token_never_reaches_the_logs(
    api: BotApi, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG):
        async with running(telegram_config(api, tmp_path)):
            api.push_text(ALICE, ALICE, "hello")
            await api.wait_for_sent(ALICE)
    assert "/bot<token>/getUpdates" in caplog.text  # httpx logs each request URL
    assert api.token not in caplog.text
    assert logging.getLogger("httpx").filters == []


async def test_no_token_is_a_config_error(api: BotApi) -> None:
    config = Config(telegram=TelegramConfig(enabled=True, token=Secret(), api_url=api.url))
    with pytest.raises(ConfigError, match="no bot token"):
        async with running(config):
            pass
    assert api.calls == []


async def test_a_rejected_token_is_a_config_error(api: BotApi, tmp_path: Path) -> None:
    config = telegram_config(api, tmp_path, token="999:wrong")
    with pytest.raises(ConfigError, match="rejected the bot token") as caught:
        async with running(config):
            pass
    assert "999:wrong" not in str(caught.value)


async def test_an_unreachable_api_is_a_config_error(tmp_path: Path) -> None:
    api = BotApi()  # never started: nothing listens on its port 0
    config = telegram_config(api, tmp_path)
    with pytest.raises(ConfigError, match="failed"):
        async with running(config):
            pass


class HtmlServer(BaseHTTPRequestHandler):
    """A web server, not a Bot API: a POST gets an HTML page (``http.server``'s 501 page)."""

    def log_message(self, format: str, *args: object) -> None:
        pass


class HtmlPage(HtmlServer):
    """A web server that answers a POST with 200 and an HTML page."""

    def do_POST(self) -> None:
        page = b"<!DOCTYPE html><html><body>" + b"<p>not the Bot API</p>" * 200 + b"</body></html>"
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(page)))
        self.end_headers()
        self.wfile.write(page)


@pytest.mark.parametrize(
    ("handler", "status"), [(HtmlServer, "HTTP 501 Not Implemented"), (HtmlPage, "HTTP 200 OK")]
)
async def test_an_api_url_that_answers_no_json_stops_the_start_in_one_line(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    handler: type[BaseHTTPRequestHandler],
    status: str,
) -> None:
    with ThreadingHTTPServer(("127.0.0.1", 0), handler) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{server.server_address[1]}"
        token = tmp_path / "telegram-token"
        token.write_text("123:abc")
        config = Config(
            telegram=TelegramConfig(enabled=True, token=Secret(file=str(token)), api_url=url)
        )
        try:
            with pytest.raises(ConfigError) as caught:
                async with running(config):
                    pass
        finally:
            server.shutdown()
    assert str(caught.value) == (
        f"the Telegram Bot API at {url} failed: its answer is not JSON ({status}): "
        "is that a Telegram Bot API server?"
    )
    assert [record.getMessage() for record in caplog.records if record.exc_info] == []
    assert "html" not in caplog.text.lower()


async def test_delivery_after_close_is_dropped(api: BotApi, tmp_path: Path) -> None:
    config = telegram_config(api, tmp_path)
    async with running(config) as (_, adapter):
        pass
    await adapter.deliver(
        Outbound(OutboundKind.REPLY, chat_key("42", "telegram"), Target("telegram", "42"), "late")
    )
    assert api.sent(42) == []


def test_split_keeps_short_texts_whole() -> None:
    assert split_message("a" * MESSAGE_LIMIT) == ["a" * MESSAGE_LIMIT]
    assert split_message("") == [""]


def test_split_without_spaces_counts_utf16_units() -> None:
    text = "x" + "😀" * 3000  # 6001 units, no separator
    parts = split_message(text)
    assert [utf16_len(p) for p in parts] == [4095, 1906]
    assert "".join(parts) == text


def test_split_never_separates_an_emoji_sequence() -> None:
    family = "👨‍👩‍👧"  # 5 code points, 8 units
    text = "a" * 4090 + family + "b"
    parts = split_message(text)
    assert parts == ["a" * 4090, family + "b"]


@pytest.mark.parametrize("lead", ["", "x", "xy"])
def test_split_never_separates_a_flag(lead: str) -> None:
    flag = "\U0001f1e9\U0001f1ea"  # 🇩🇪: two regional indicators, 4 units
    text = lead + flag * 1024 + "!"
    parts = split_message(text)
    assert "".join(parts) == text
    assert all(utf16_len(part) <= MESSAGE_LIMIT for part in parts)
    for part in parts:
        flags = part.removeprefix(lead).rstrip("!")
        assert flags == flag * (len(flags) // 2), "a part starts or ends inside a flag"


@pytest.mark.parametrize(
    "sequence",
    ["e\u0301", "\u0915\u093f", "\u1100\u1161\u11a8", " \u0301"],
    ids=["combining-mark", "spacing-mark", "hangul-jamo", "space-and-mark"],
)
def test_split_never_separates_a_mark_or_a_jamo_from_what_it_belongs_to(sequence: str) -> None:
    """Not even after a space: a mark after one belongs to it."""
    for lead in range(len(sequence)):
        text = "x" * lead + sequence * (2 * MESSAGE_LIMIT // len(sequence))
        parts = split_message(text)
        assert "".join(parts) == text
        assert all(utf16_len(part) <= MESSAGE_LIMIT for part in parts)
        cut = 0
        for part in parts[:-1]:
            cut += len(part)
            assert (cut - lead) % len(sequence) == 0, f"cut inside {sequence!r} at {cut}"


def test_split_prefers_newlines_then_spaces() -> None:
    text = "a" * 3000 + " " + "b" * 500 + "\n" + "c" * 1000
    assert split_message(text) == ["a" * 3000 + " " + "b" * 500 + "\n", "c" * 1000]
    spaced = "a" * 3000 + " " + "b" * 2000
    assert split_message(spaced) == ["a" * 3000 + " ", "b" * 2000]


CHANNEL_A, CHANNEL_B = -1009001, -1009002


def posts_as(api: BotApi, channel: int, text: str) -> None:
    """A post in the group on behalf of ``channel`` (``from`` is Telegram's placeholder)."""
    api.push_text(GROUP, CHANNEL_BOT, text, chat_type="supergroup", sender_chat=channel)


async def test_two_sender_chats_in_a_group_share_nothing(
    api: BotApi, adapter: TelegramAdapter
) -> None:
    for channel in (CHANNEL_A, CHANNEL_B):
        posts_as(api, channel, "whoami")
    whoami = [s.text for s in await api.wait_for_sent(GROUP, 2)]
    assert f"user=chat:{CHANNEL_A} " in whoami[0]
    assert f"user=chat:{CHANNEL_B} " in whoami[1]
    assert key_of(whoami[0]) != key_of(whoami[1])
    posts_as(api, CHANNEL_A, "/reasoning high")
    posts_as(api, CHANNEL_B, "settings")
    sent = await api.wait_for_sent(GROUP, 4)
    assert sent[3].text == "model=default reasoning=default tier=default"
    posts_as(api, CHANNEL_A, "approve rm -rf /srv")
    await api.wait_for_sent(GROUP, 5)
    posts_as(api, CHANNEL_B, "/approve always")  # not B's request: B cannot even see it
    posts_as(api, CHANNEL_A, "/approve always")
    texts = [s.text for s in await api.wait_for_sent(GROUP, 8)]
    assert texts[5:] == [
        "No approval is pending.",
        "Approved (always): `rm -rf /srv`",
        "approved: rm -rf /srv",
    ]
    posts_as(api, CHANNEL_B, "approve rm -rf /srv")  # A's grant is not B's
    sent = await api.wait_for_sent(GROUP, 9)
    assert sent[8].text.startswith("Approval needed: `rm -rf /srv`")


async def test_the_allowlist_names_a_sender_chat_never_the_placeholder(
    api: BotApi, tmp_path: Path
) -> None:
    allowed = [f"chat:{CHANNEL_A}", str(CHANNEL_BOT), str(ANONYMOUS_ADMIN)]
    async with running(telegram_config(api, tmp_path, allow={"telegram": allowed})) as (hub, _):
        posts_as(api, CHANNEL_B, "whoami")  # from the allowed placeholder, as a stranger
        api.push_text(GROUP, ANONYMOUS_ADMIN, "whoami", chat_type="supergroup", sender_chat=GROUP)
        posts_as(api, CHANNEL_A, "whoami")  # handled after the others (updates run in order)
        await api.wait_for(lambda: any("platform=" in s.text for s in api.sent(GROUP)))
        await hub.gateway.engine.wait_idle()
        [reply] = [s.text for s in api.sent(GROUP) if "platform=" in s.text]
        assert f"user=chat:{CHANNEL_A} " in reply


NOT_ALLOWED = "Sorry, you are not allowed to use this assistant."


async def test_a_stranger_is_never_answered_in_a_group_and_hourly_in_private(
    api: BotApi, tmp_path: Path
) -> None:
    clock = Clock()
    config = telegram_config(api, tmp_path, allow={"telegram": [str(ALICE)]})
    async with running(config, clock=clock) as (hub, _):
        api.push_text(GROUP, BOB, "hello", chat_type="supergroup")
        api.push_text(GROUP, ALICE, "hello", chat_type="supergroup")  # handled after Bob's
        [reply] = await api.wait_for_sent(GROUP)
        assert reply.text == "echo: hello"
        assert hub.metrics.senders_refused["telegram"] == 1
        for _ in range(2):
            api.push_text(BOB, BOB, "hello")
        api.push_text(ALICE, ALICE, "hello")
        await api.wait_for_sent(ALICE)
        assert [s.text for s in api.sent(BOB)] == [NOT_ALLOWED]
        assert hub.metrics.senders_refused["telegram"] == 3
        clock.now += REFUSAL_INTERVAL
        api.push_text(BOB, BOB, "hello")
        assert [s.text for s in await api.wait_for_sent(BOB, 2)] == [NOT_ALLOWED] * 2
        assert api.sent(GROUP) == [reply]
    assert "chatlane_senders_refused_total" in hub.metrics.render(0, 0)


async def test_a_strangers_button_press_is_answered_privately(api: BotApi, tmp_path: Path) -> None:
    config = telegram_config(api, tmp_path, allow={"telegram": [str(ALICE)]})
    async with running(config):
        api.push_text(GROUP, ALICE, "approve rm -rf build", thread_id=TOPIC, chat_type="supergroup")
        [prompt] = await api.wait_for_sent(GROUP)
        assert prompt.reply_markup is not None
        approve = prompt.reply_markup["inline_keyboard"][0][0]["callback_data"]
        api.push_button(BOB, approve, prompt)
        await api.wait_for_call("answerCallbackQuery")
        api.push_button(ALICE, approve, prompt)
        sent = [s.text for s in await api.wait_for_sent(GROUP, 3)]
    assert [a["text"] for a in api.answers] == [NOT_ALLOWED, "Sent /approve"]
    assert sent[1:] == ["Approved (once): `rm -rf build`", "approved: rm -rf build"]
