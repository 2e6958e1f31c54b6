"""Discord in servers under the shared group rule: patterns, and a channel or threads without
mentions, through discord.py against the REST and gateway stand-in."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from chatlane.adapters.discord_wire import strip_mentions
from tests.adapters.discordapi import BOT_ID, BOT_USER, GENERAL, RANDOM, THREAD, DiscordApi
from tests.adapters.test_discord import ALICE, BOB, MENTION, discord_config, running


@pytest.fixture
async def api() -> AsyncIterator[DiscordApi]:
    async with DiscordApi() as api:
        yield api
    assert api.unknown == [], f"the adapter called routes the stand-in lacks: {api.unknown}"


async def test_a_pattern_counts_as_a_mention(api: DiscordApi, tmp_path: Path) -> None:
    async with running(discord_config(api, tmp_path, mention_patterns=[r"\bchatty\b"])) as bot:
        await api.say(GENERAL, ALICE, "chattybot is another")
        await api.say(GENERAL, ALICE, "Hey CHATTY, hi")
        await api.wait_for_messages(GENERAL)
        await bot.idle()
    assert api.texts(GENERAL) == ["echo: Hey CHATTY, hi"]


async def test_a_mention_quoted_in_code_or_escaped_is_no_mention(
    api: DiscordApi, tmp_path: Path
) -> None:
    """Discord pings nobody for these and lists no one in ``mentions``: neither does chatlane
    count them; a mention is what Discord lists, with or without one in the text."""
    async with running(discord_config(api, tmp_path)) as bot:
        await api.say(GENERAL, ALICE, f"type `{MENTION}` to ping the bot")
        await api.say(GENERAL, ALICE, f"```\n{MENTION}\n```")
        await api.say(GENERAL, ALICE, f"\\{MENTION} is how it is written")
        await api.say(GENERAL, ALICE, "listed only", mentions=[BOT_USER])  # a reply's ping
        await api.wait_for_messages(GENERAL)
        await bot.idle()
    assert api.texts(GENERAL) == ["echo: listed only"]


async def test_only_a_mention_discord_shows_is_taken_out(api: DiscordApi, tmp_path: Path) -> None:
    async with running(discord_config(api, tmp_path)) as bot:
        await api.say(GENERAL, ALICE, f"{MENTION} type `{MENTION}` or \\{MENTION} to ping")
        dm = api.dm_channel(ALICE)
        await api.say(dm, ALICE, f"```\n{MENTION}\n```")
        await api.wait_for_messages(GENERAL)
        await api.wait_for_messages(dm)
        await bot.idle()
    assert api.texts(GENERAL) == [f"echo: type `{MENTION}` or \\{MENTION} to ping"]
    assert api.texts(dm) == [f"echo: ```\n{MENTION}\n```"]


@pytest.mark.parametrize(
    ("text", "read"),
    [
        (f"<@!{BOT_ID}> nickname form", "nickname form"),
        (f"``a `{MENTION}` b`` {MENTION}hi", f"``a `{MENTION}` b`` hi"),
        (f"` unclosed {MENTION} hi", "` unclosed hi"),
        (f"\\`{MENTION}\\` escaped ticks", "\\`\\` escaped ticks"),
        (f"<@{BOB}> someone else", f"<@{BOB}> someone else"),
    ],
)
def test_a_mention_is_taken_out_only_where_discord_shows_one(text: str, read: str) -> None:
    assert strip_mentions(text, BOT_ID) == read


async def test_a_channel_and_threads_can_go_without_mentions(
    api: DiscordApi, tmp_path: Path
) -> None:
    config = discord_config(
        api,
        tmp_path,
        require_mention_per_chat={str(RANDOM): False},
        require_mention_per_chat_type={"thread": False},
    )
    async with running(config) as bot:
        await api.say(GENERAL, ALICE, "top level")
        await api.say(THREAD, ALICE, "in a thread")
        await api.say(RANDOM, ALICE, "plain")
        await api.say(GENERAL, ALICE, f"{MENTION} mentioned")
        await api.wait_for_messages(THREAD)
        await api.wait_for_messages(RANDOM)
        await api.wait_for_messages(GENERAL)
        await bot.idle()
    assert api.texts(THREAD) == ["echo: in a thread"]
    assert api.texts(RANDOM) == ["echo: plain"]
    assert api.texts(GENERAL) == ["echo: mentioned"]


async def test_in_a_thread_only_an_admin_changes_what_everyone_gets(
    api: DiscordApi, tmp_path: Path
) -> None:
    async with running(discord_config(api, tmp_path, admins=[str(BOB)])):
        await api.say(THREAD, ALICE, f"{MENTION} /busy reject")
        [refused] = await api.wait_for_messages(THREAD)
        assert refused.text.startswith("Only an admin can use /busy")
        await api.say(THREAD, BOB, f"{MENTION} /busy reject")
        replies = await api.wait_for_messages(THREAD, 2)
        assert replies[1].text == "Busy policy for this session: reject"
        dm = api.dm_channel(ALICE)
        await api.say(dm, ALICE, "/busy reject")  # a DM is a session of one's own
        [mine] = await api.wait_for_messages(dm)
        assert mine.text == "Busy policy for this session: reject"


CONTEXT_LABEL = "Earlier in this chat, not addressed to you:"


async def test_unmentioned_messages_in_a_thread_are_context_for_its_next_turn(
    api: DiscordApi, tmp_path: Path
) -> None:
    async with running(discord_config(api, tmp_path, unmentioned="context")) as bot:
        await api.say(THREAD, ALICE, "the build is red")
        await api.say(THREAD, BOB, "since noon")
        await api.say(GENERAL, BOB, "elsewhere")
        await api.say(THREAD, ALICE, f"{MENTION} context")
        [shown] = await api.wait_for_messages(THREAD)
        await bot.idle()
        assert CONTEXT_LABEL in shown.text
        assert f"({ALICE}): the build is red" in shown.text
        assert f"({BOB}): since noon" in shown.text
        assert "elsewhere" not in shown.text
        assert api.texts(GENERAL) == []
        await api.say(THREAD, ALICE, f"{MENTION} /new")
        await api.say(THREAD, ALICE, f"{MENTION} yes")
        await api.wait_for_messages(THREAD, 3)
        await api.say(THREAD, BOB, "after the reset")
        await api.say(THREAD, ALICE, f"{MENTION} context")
        replies = await api.wait_for_messages(THREAD, 4)
        await bot.idle()
    assert "after the reset" in replies[3].text
    assert "the build is red" not in replies[3].text


async def test_a_stranger_is_never_kept_and_by_default_nothing_is(
    api: DiscordApi, tmp_path: Path
) -> None:
    keys: dict[str, Any] = {
        "unmentioned_per_chat": {str(GENERAL): "context"},
        "allowed_users": [str(ALICE)],
    }
    async with running(discord_config(api, tmp_path, **keys)) as bot:
        await api.say(THREAD, ALICE, "from alice")
        await api.say(THREAD, BOB, "from a stranger")
        await api.say(RANDOM, ALICE, "ignored in random")
        await api.say(THREAD, ALICE, f"{MENTION} context")
        await api.say(RANDOM, ALICE, f"{MENTION} context")
        [shown] = await api.wait_for_messages(THREAD)
        [random] = await api.wait_for_messages(RANDOM)
        await bot.idle()
    assert "from alice" in shown.text
    assert "stranger" not in shown.text
    assert random.text == "context: no history yet in this conversation"


async def test_a_plain_yes_answers_the_senders_own_approval_prompt_without_a_mention(
    api: DiscordApi, tmp_path: Path
) -> None:
    """The prompt says "(or yes)": the asker's plain yes answers it where the channel needs
    the bot mentioned; anyone else's stays unread."""
    async with running(discord_config(api, tmp_path)) as bot:
        await api.say(GENERAL, ALICE, f"{MENTION} approve rm -rf build")
        [prompt] = await api.wait_for_messages(GENERAL)
        assert "Approval needed" in prompt.text
        await api.say(GENERAL, BOB, "yes")  # owes no answer
        await api.say(GENERAL, ALICE, "yes")
        await api.wait_for_messages(GENERAL, 3)
        await bot.idle()
    assert api.texts(GENERAL)[1:] == ["Approved (once): `rm -rf build`", "approved: rm -rf build"]
