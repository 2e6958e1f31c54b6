"""Telegram in groups: which messages are for the bot, through python-telegram-bot and the
local Bot API stand-in, with a real hub and the demo agent behind it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from chatlane.config import Config
from tests.adapters.botapi import BOT_ID, BotApi
from tests.adapters.test_telegram import ALICE, BOB, GROUP, TOPIC, running, telegram_config

OTHER_GROUP = -1005678
CHANNEL = -1007001


@pytest.fixture
async def api() -> AsyncIterator[BotApi]:
    async with BotApi() as api:
        yield api
    assert api.unknown == [], f"the adapter called methods the stand-in lacks: {api.unknown}"


def config(api: BotApi, tmp_path: Path, **groups: Any) -> Config:
    """The default group rule (mentions required) with ``groups`` keys on top."""
    return telegram_config(api, tmp_path, groups=groups)


def say(api: BotApi, text: str, chat: int = GROUP, user: int = ALICE, **options: Any) -> int:
    return api.push_text(chat, user, text, chat_type="supergroup", **options)


async def answered(api: BotApi, text: str, chat: int = GROUP, **options: Any) -> str:
    """Say ``text`` in ``chat`` and wait for the bot's next message there; its text.

    Updates are handled in order, so a message the bot ignored before this one
    would have been answered first.
    """
    before = len(api.sent(chat))
    say(api, text, chat, **options)
    return (await api.wait_for_sent(chat, before + 1))[before].text


async def test_in_a_group_only_a_mention_is_answered_and_it_is_stripped(
    api: BotApi, tmp_path: Path
) -> None:
    async with running(config(api, tmp_path)):
        say(api, "hello everyone")
        assert await answered(api, "@chatlane_bot hello") == "echo: hello"
        say(api, "@other_bot hello")
        assert await answered(api, "ask @ChatLane_Bot about it") == "echo: ask about it"
        say(api, "@chatlane_bot")  # nothing left to answer
        status = await answered(api, "/status")  # a bare command is for every bot of the group
        assert status.startswith("Status: idle")
        assert len(api.sent(GROUP)) == 3


async def test_a_private_chat_needs_no_mention(api: BotApi, tmp_path: Path) -> None:
    async with running(config(api, tmp_path)):
        api.push_text(ALICE, ALICE, "hello")
        [reply] = await api.wait_for_sent(ALICE)
        assert reply.text == "echo: hello"


async def test_a_reply_to_the_bot_and_a_text_mention_count_as_mentions(
    api: BotApi, tmp_path: Path
) -> None:
    async with running(config(api, tmp_path)):
        say(api, "@chatlane_bot first")
        [first] = await api.wait_for_sent(GROUP)
        assert await answered(api, "and then?", reply_to=first) == "echo: and then?"
        bot = {"id": BOT_ID, "is_bot": True, "first_name": "Bot"}
        named = {"type": "text_mention", "offset": 0, "length": 3, "user": bot}
        assert await answered(api, "Bot, again", entities=[named]) == "echo: , again"


async def test_a_pattern_counts_as_a_mention_in_any_case(api: BotApi, tmp_path: Path) -> None:
    async with running(config(api, tmp_path, mention_patterns=[r"\bchatty\b"])):
        say(api, "chattybot is someone else")
        say(api, "CHATTY, what time is it?")
        [reply] = await api.wait_for_sent(GROUP)
        assert reply.text == "echo: CHATTY, what time is it?"


async def test_a_chat_and_a_kind_of_chat_can_go_without_mentions(
    api: BotApi, tmp_path: Path
) -> None:
    groups = config(
        api,
        tmp_path,
        require_mention_per_chat={str(OTHER_GROUP): False},
        require_mention_per_chat_type={"channel": False, "supergroup": True},
    )
    async with running(groups):
        say(api, "not for the bot")
        say(api, "plain", chat=OTHER_GROUP)
        api.push_text(CHANNEL, 0, "a post", chat_type="channel")
        [reply] = await api.wait_for_sent(OTHER_GROUP)
        assert reply.text == "echo: plain"
        [post] = await api.wait_for_sent(CHANNEL)
        assert post.text == "echo: a post"
        say(api, "@chatlane_bot now", thread_id=TOPIC)
        [topic] = await api.wait_for_sent(GROUP)
        assert (topic.text, topic.thread_id) == ("echo: now", TOPIC)


async def test_a_chat_can_require_a_mention_when_the_default_does_not(
    api: BotApi, tmp_path: Path
) -> None:
    strict = {str(GROUP): True}
    async with running(
        config(api, tmp_path, require_mention=False, require_mention_per_chat=strict)
    ):
        say(api, "plain")
        assert await answered(api, "plain", chat=OTHER_GROUP) == "echo: plain"
        assert await answered(api, "@chatlane_bot mentioned") == "echo: mentioned"


async def test_a_chat_not_on_allowed_chats_is_never_answered(api: BotApi, tmp_path: Path) -> None:
    async with running(config(api, tmp_path, allowed_chats=[str(OTHER_GROUP)])) as (hub, _):
        say(api, "@chatlane_bot hello")  # not an allowed chat: silence
        assert await answered(api, "@chatlane_bot hello", chat=OTHER_GROUP) == "echo: hello"
        api.push_text(ALICE, ALICE, "hello")  # a private chat: the user lists alone
        [reply] = await api.wait_for_sent(ALICE)
        assert reply.text == "echo: hello"
        assert api.sent(GROUP) == []
        assert hub.metrics.senders_refused["telegram"] == 1


ADMIN_ONLY = "Only an admin can use /busy in a chat shared with others; nothing changed."


async def test_in_a_shared_topic_only_an_admin_changes_what_everyone_gets(
    api: BotApi, tmp_path: Path
) -> None:
    async with running(config(api, tmp_path, admins=[str(ALICE)])):
        assert await answered(api, "/busy reject", user=BOB, thread_id=TOPIC) == ADMIN_ONLY
        status = await answered(api, "/status", user=BOB, thread_id=TOPIC)
        assert "busy policy: queue (default)" in status
        said = await answered(api, "/busy@chatlane_bot reject", thread_id=TOPIC)
        assert said == "Busy policy for this session: reject"
        status = await answered(api, "/status", user=BOB, thread_id=TOPIC)
        assert "busy policy: reject (session)" in status


async def test_a_session_of_ones_own_takes_every_command(api: BotApi, tmp_path: Path) -> None:
    async with running(config(api, tmp_path, admins=[str(ALICE)])):
        mine = await answered(api, "/busy reject", user=BOB)  # each user has their own here
        assert mine == "Busy policy for this session: reject"
        api.push_text(BOB, BOB, "/busy collect")
        [reply] = await api.wait_for_sent(BOB)
        assert reply.text == "Busy policy for this session: collect"
