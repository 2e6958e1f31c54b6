"""Telegram in groups: which messages are for the bot, through python-telegram-bot and the
local Bot API stand-in, with a real hub and the demo agent behind it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from chatlane.config import Config
from chatlane.identity import ChatType, SessionSource
from chatlane.types import InboundMessage
from tests.adapters.botapi import BOT_ID, BotApi
from tests.adapters.test_telegram import ALICE, BOB, GROUP, TOPIC, running, telegram_config
from tests.adapters.test_telegram_media import photo_sizes

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


# -- unmentioned messages kept as context ------------------------------------------------

OTHER_TOPIC = 8
CONTEXT_LABEL = "Earlier in this chat, not addressed to you:"


def keeping(api: BotApi, tmp_path: Path, **groups: Any) -> Config:
    """Mentions required; what is not for the bot kept as context."""
    return config(api, tmp_path, unmentioned="context", **groups)


async def test_unmentioned_messages_are_given_to_the_next_turn_once_and_not_answered(
    api: BotApi, tmp_path: Path
) -> None:
    async with running(keeping(api, tmp_path)) as (hub, _):
        say(api, "the build is red", thread_id=TOPIC)
        say(api, "since noon", thread_id=TOPIC, user=BOB)
        shown = await answered(api, "@chatlane_bot context", thread_id=TOPIC)
        assert len(api.sent(GROUP)) == 1  # the two before were not answered
        assert CONTEXT_LABEL in shown
        assert "User 42 (42): the build is red" in shown
        assert "User 43 (43): since noon" in shown
        again = await answered(api, "@chatlane_bot context", thread_id=TOPIC)
        assert CONTEXT_LABEL not in again.replace(f"context: {CONTEXT_LABEL}", "")
        key = hub.gateway.session_key(_topic_message())
        [context, *_] = [e for e in await hub.store.transcript(key) if e.role == "context"]
        assert context.content.startswith(CONTEXT_LABEL)
        assert context.content.endswith("User 43 (43): since noon")


def _topic_message() -> InboundMessage:
    source = SessionSource("telegram", str(GROUP), ChatType.GROUP, thread_id=str(TOPIC))
    return InboundMessage(source, "")


async def test_by_default_unmentioned_messages_are_not_kept(api: BotApi, tmp_path: Path) -> None:
    async with running(config(api, tmp_path)):
        say(api, "the build is red", thread_id=TOPIC)
        shown = await answered(api, "@chatlane_bot context", thread_id=TOPIC)
        assert "build" not in shown
        assert shown == "context: no history yet in this conversation"


async def test_context_stays_in_its_own_topic_and_a_per_user_session(
    api: BotApi, tmp_path: Path
) -> None:
    async with running(keeping(api, tmp_path)):
        say(api, "elsewhere", thread_id=OTHER_TOPIC)
        say(api, "bob at the top", user=BOB)  # outside topics each user has a session
        say(api, "alice at the top")
        shown = await answered(api, "@chatlane_bot context", thread_id=TOPIC)
        assert shown == "context: no history yet in this conversation"
        top = await answered(api, "@chatlane_bot context")
        assert "alice at the top" in top
        assert "bob" not in top


async def test_new_clears_what_was_kept(api: BotApi, tmp_path: Path) -> None:
    async with running(keeping(api, tmp_path, unmentioned_per_chat_type={"channel": "ignore"})):
        say(api, "before the reset", thread_id=TOPIC)
        asked = await answered(api, "/new", thread_id=TOPIC)
        assert "yes" in asked.lower()
        await answered(api, "@chatlane_bot yes", thread_id=TOPIC)
        say(api, "after the reset", thread_id=TOPIC)
        shown = await answered(api, "@chatlane_bot context", thread_id=TOPIC)
        assert "after the reset" in shown
        assert "before the reset" not in shown


async def test_a_sender_the_allowlist_refuses_is_never_kept(api: BotApi, tmp_path: Path) -> None:
    async with running(keeping(api, tmp_path, allowed_users=[str(ALICE)])):
        say(api, "from a stranger", thread_id=TOPIC, user=BOB)
        say(api, "from alice", thread_id=TOPIC)
        shown = await answered(api, "@chatlane_bot context", thread_id=TOPIC)
        assert "from alice" in shown
        assert "stranger" not in shown


async def test_a_chat_can_keep_context_when_the_default_ignores(
    api: BotApi, tmp_path: Path
) -> None:
    per_chat = {str(OTHER_GROUP): "context"}
    async with running(config(api, tmp_path, unmentioned_per_chat=per_chat)):
        say(api, "ignored here", thread_id=TOPIC)
        say(api, "kept there", chat=OTHER_GROUP, thread_id=TOPIC)
        here = await answered(api, "@chatlane_bot context", thread_id=TOPIC)
        there = await answered(api, "@chatlane_bot context", chat=OTHER_GROUP, thread_id=TOPIC)
        assert "ignored here" not in here
        assert "kept there" in there


async def test_a_plain_yes_answers_the_senders_own_approval_prompt_without_a_mention(
    api: BotApi, tmp_path: Path
) -> None:
    """The prompt says "(or yes)": the asker's plain yes answers it where the group needs
    the bot mentioned; anyone else's stays unread, as does one nothing waits for."""
    async with running(config(api, tmp_path)):
        say(api, "@chatlane_bot approve rm -rf build")
        [prompt] = await api.wait_for_sent(GROUP)
        assert prompt.text.startswith("Approval needed")
        say(api, "yes", user=BOB)  # Bob owes no answer
        say(api, "yes")
        sent = await api.wait_for_sent(GROUP, 3)
        assert [s.text for s in sent[1:]] == [
            "Approved (once): `rm -rf build`",
            "approved: rm -rf build",
        ]
        say(api, "yes")  # nothing waits for it now
        assert (await answered(api, "/status")).startswith("Status: idle")
        assert len(api.sent(GROUP)) == 4


# -- text Telegram would not send, read without losing the message ----------------------

EMOJI = "\U0001f600"
"""Two UTF-16 units: an entity at offset 1 cuts it in two."""


async def test_a_lone_surrogate_in_a_text_or_caption_is_read_as_u_fffd(
    api: BotApi, tmp_path: Path
) -> None:
    async with running(config(api, tmp_path)):
        assert await answered(api, "@chatlane_bot hi \ud800 there") == "echo: hi \ufffd there"
        caption = "@chatlane_bot look \udfff"
        api.push_media(GROUP, ALICE, "photo", photo_sizes(), caption, chat_type="supergroup")
        [_, shown] = await api.wait_for_sent(GROUP, 2)
        assert shown.text == "echo: look \ufffd (1 attachment: image image/jpeg 12 KB)"


async def test_an_entity_that_cuts_a_character_or_leaves_the_text_names_nothing(
    api: BotApi, tmp_path: Path
) -> None:
    bot = {"id": BOT_ID, "is_bot": True, "first_name": "Bot"}
    cut = {"type": "bold", "offset": 1, "length": 2}
    async with running(config(api, tmp_path)):
        shown = await answered(api, f"{EMOJI} @chatlane_bot hi", entities=[cut])
        assert shown == f"echo: {EMOJI} hi"
        say(api, f"{EMOJI} Bot, hi", entities=[{**cut, "type": "text_mention", "user": bot}])
        past = {"type": "text_mention", "offset": 0, "length": 99, "user": bot}
        say(api, "Bot, hi", entities=[past])
        assert await answered(api, "@chatlane_bot after") == "echo: after"  # in order
        assert len(api.sent(GROUP)) == 2


async def test_a_hostile_message_not_for_the_bot_is_still_kept_as_context(
    api: BotApi, tmp_path: Path
) -> None:
    async with running(keeping(api, tmp_path)):
        cut = {"type": "italic", "offset": 1, "length": 3}
        say(api, f"{EMOJI} the build is red \ud800", thread_id=TOPIC, entities=[cut])
        shown = await answered(api, "@chatlane_bot context", thread_id=TOPIC)
        assert f"User 42 (42): {EMOJI} the build is red \ufffd" in shown
