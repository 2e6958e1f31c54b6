"""Slack in channels under the shared group rule: patterns, and a chat or a kind of chat
without mentions, through signed requests and slack-sdk against the Web API stand-in."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.adapters.slackapi import SlackApi
from tests.adapters.test_slack import ALICE, BOB, GENERAL, MENTION, RANDOM, served, slack_config


@pytest.fixture
async def api() -> AsyncIterator[SlackApi]:
    async with SlackApi() as api:
        yield api
    assert api.unknown == [], f"the adapter called methods the stand-in lacks: {api.unknown}"


async def test_a_pattern_counts_as_a_mention(api: SlackApi, tmp_path: Path) -> None:
    config = slack_config(api, tmp_path, mention_patterns=[r"\bchatty\b"])
    async with served(config) as s:
        await s.slack.message(GENERAL, ALICE, "chattybot is another", channel_type="channel")
        await s.slack.message(GENERAL, ALICE, "Hey CHATTY, hi", channel_type="channel")
        await api.wait_for_messages(GENERAL)
        await s.adapter.handled()
        await s.hub.gateway.engine.wait_idle()
    assert api.texts(GENERAL) == ["echo: Hey CHATTY, hi"]


async def test_a_chat_and_threads_can_go_without_mentions(api: SlackApi, tmp_path: Path) -> None:
    config = slack_config(
        api,
        tmp_path,
        require_mention_per_chat={RANDOM: False},
        require_mention_per_chat_type={"thread": False},
    )
    async with served(config) as s:
        thread = await s.slack.message(GENERAL, ALICE, "top level", channel_type="channel")
        await s.slack.message(
            GENERAL, ALICE, "in a thread", channel_type="channel", thread_ts=thread
        )
        await s.slack.message(RANDOM, ALICE, "plain", channel_type="channel")
        await api.wait_for_messages(GENERAL)
        await api.wait_for_messages(RANDOM)
        await s.slack.message(GENERAL, ALICE, f"{MENTION} mentioned", channel_type="channel")
        await api.wait_for_messages(GENERAL, 2)
        await s.adapter.handled()
        await s.hub.gateway.engine.wait_idle()
    assert api.texts(GENERAL) == ["echo: in a thread", "echo: mentioned"]
    assert api.texts(RANDOM) == ["echo: plain"]


async def test_in_a_thread_only_an_admin_changes_what_everyone_gets(
    api: SlackApi, tmp_path: Path
) -> None:
    async with served(slack_config(api, tmp_path, admins=[BOB])) as s:
        thread = await s.slack.message(GENERAL, BOB, "a thread", channel_type="channel")
        in_thread = {"channel_type": "channel", "thread_ts": thread}
        await s.slack.message(GENERAL, ALICE, f"{MENTION} /busy reject", **in_thread)
        [refused] = await api.wait_for_messages(GENERAL)
        assert refused.text.startswith("Only an admin can use /busy")
        assert refused.thread_ts == thread
        await s.slack.message(GENERAL, BOB, f"{MENTION} /busy reject", **in_thread)
        replies = await api.wait_for_messages(GENERAL, 2)
        assert replies[1].text == "Busy policy for this session: reject"


CONTEXT_LABEL = "Earlier in this chat, not addressed to you:"


async def test_unmentioned_messages_in_a_thread_are_context_for_its_next_turn(
    api: SlackApi, tmp_path: Path
) -> None:
    async with served(slack_config(api, tmp_path, unmentioned="context")) as s:
        thread = await s.slack.message(GENERAL, BOB, "a thread", channel_type="channel")
        other = await s.slack.message(GENERAL, BOB, "another", channel_type="channel")
        in_thread = {"channel_type": "channel", "thread_ts": thread}
        await s.slack.message(GENERAL, ALICE, "the build is red", **in_thread)
        await s.slack.message(GENERAL, BOB, "since noon", **in_thread)
        await s.slack.message(GENERAL, BOB, "elsewhere", channel_type="channel", thread_ts=other)
        await s.slack.message(GENERAL, ALICE, f"{MENTION} context", **in_thread)
        [shown] = await api.wait_for_messages(GENERAL)
        await s.adapter.handled()
        await s.hub.gateway.engine.wait_idle()
    assert CONTEXT_LABEL in shown.text
    assert f"{ALICE}: the build is red" in shown.text
    assert f"{BOB}: since noon" in shown.text
    assert "elsewhere" not in shown.text
    assert shown.thread_ts == thread
    assert len(api.texts(GENERAL)) == 1  # the messages kept were not answered


async def test_unmentioned_messages_are_ignored_by_default_and_strangers_never_kept(
    api: SlackApi, tmp_path: Path
) -> None:
    cases: list[tuple[dict[str, Any], bool]] = [
        ({}, False),
        ({"unmentioned": "context", "allowed_users": [ALICE]}, True),
    ]
    for keys, kept in cases:
        async with SlackApi() as slack_api, served(slack_config(slack_api, tmp_path, **keys)) as s:
            thread = await s.slack.message(GENERAL, ALICE, "a thread", channel_type="channel")
            in_thread = {"channel_type": "channel", "thread_ts": thread}
            await s.slack.message(GENERAL, ALICE, "from alice", **in_thread)
            await s.slack.message(GENERAL, BOB, "from a stranger", **in_thread)
            await s.slack.message(GENERAL, ALICE, f"{MENTION} context", **in_thread)
            [shown] = await slack_api.wait_for_messages(GENERAL)
            await s.adapter.handled()
            await s.hub.gateway.engine.wait_idle()
        assert ("from alice" in shown.text) is kept
        assert "stranger" not in shown.text


async def test_a_plain_yes_answers_the_senders_own_approval_prompt_without_a_mention(
    api: SlackApi, tmp_path: Path
) -> None:
    """The prompt says "(or yes)": the asker's plain yes answers it where the channel needs
    the bot mentioned; anyone else's stays unread."""
    async with served(slack_config(api, tmp_path)) as s:
        await s.slack.message(
            GENERAL, ALICE, f"{MENTION} approve rm -rf build", channel_type="channel"
        )
        [prompt] = await api.wait_for_messages(GENERAL)
        assert prompt.text.startswith("Approval needed")
        await s.slack.message(GENERAL, BOB, "yes", channel_type="channel")  # owes no answer
        await s.slack.message(GENERAL, ALICE, "yes", channel_type="channel")
        await api.wait_for_messages(GENERAL, 3)
        await s.adapter.handled()
        await s.hub.gateway.engine.wait_idle()
    assert api.texts(GENERAL)[1:] == ["Approved (once): `rm -rf build`", "approved: rm -rf build"]
