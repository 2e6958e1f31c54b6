"""The shared group rule: precedence of its keys, patterns, and errors that name the key."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import pytest

from chatlane.config import Config, DiscordConfig, SlackConfig, TelegramConfig, load_config
from chatlane.errors import ConfigError
from chatlane.groups import GroupPolicy
from chatlane.identity import ChatType, SessionSource
from chatlane.scheduler import Scheduler, SchedulerSettings
from tests.test_scheduler import FakeClock, scheduled


def policy(**keys: object) -> GroupPolicy:
    return GroupPolicy(TelegramConfig(**keys), "telegram")  # type: ignore[arg-type]


def test_a_chat_overrides_its_kind_which_overrides_the_default() -> None:
    rule = policy(
        require_mention=True,
        require_mention_per_chat_type={"group": False},
        require_mention_per_chat={"-1": True, "-2": False},
    )
    assert rule.needs_mention("-9", "supergroup")
    assert not rule.needs_mention("-9", "group")
    assert rule.needs_mention("-1", "group")
    assert not rule.needs_mention("-2", "supergroup")


def test_a_pattern_matches_anywhere_in_any_case() -> None:
    rule = policy(mention_patterns=[r"\bchatty\b", "^hey bot"])
    assert rule.answers("-1", "group", "so, ChAtTy?", mentioned=False)
    assert rule.answers("-1", "group", "Hey Bot, hi", mentioned=False)
    assert not rule.answers("-1", "group", "chattybot", mentioned=False)
    assert rule.answers("-1", "group", "chattybot", mentioned=True)
    assert policy(require_mention=False).answers("-1", "group", "anything", mentioned=False)


def load(tmp_path: Path, text: str) -> None:
    path = tmp_path / "chatlane.toml"
    path.write_text(text)
    load_config(path, environ={})


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ('[telegram]\nmention_patterns = ["(unclosed"]\n', "'telegram.mention_patterns[0]'"),
        ("[telegram.require_mention_per_chat_type]\nforum = false\n", "per_chat_type.forum'"),
        ('[telegram.require_mention_per_chat]\n"@mygroup" = false\n', "per_chat'"),
        ('[telegram.require_mention_per_chat]\n"-100" = "no"\n', "per_chat.*'"),
        ("[telegram]\nrequire_mentions = true\n", "'telegram.require_mentions'"),
        ("[telegram]\nmention_patterns = 'chatty'\n", "'telegram.mention_patterns'"),
        ('[slack.require_mention_per_chat]\n"general" = false\n', "'slack.require_mention"),
        ('[discord.require_mention_per_chat]\n"C01" = false\n', "'discord.require_mention"),
        ("[discord.require_mention_per_chat_type]\nforum = false\n", "per_chat_type.forum'"),
        ('[slack]\nmention_patterns = ["[z-a]"]\n', "'slack.mention_patterns[0]'"),
    ],
)
def test_a_bad_group_key_is_a_config_error_naming_it(tmp_path: Path, text: str, named: str) -> None:
    with pytest.raises(ConfigError, match="configuration key") as error:
        load(tmp_path, text)
    assert named in str(error.value)


def test_group_keys_load_from_the_file(tmp_path: Path) -> None:
    path = tmp_path / "chatlane.toml"
    path.write_text(
        '[telegram]\nrequire_mention = false\nmention_patterns = ["chatty"]\n'
        '[telegram.require_mention_per_chat]\n"-1001234" = true\n'
    )
    telegram = load_config(path, environ={}).telegram
    assert telegram.require_mention is False
    assert telegram.require_mention_per_chat == {"-1001234": True}
    assert telegram.mention_patterns == ["chatty"]


# -- who may talk: one rule for every chat adapter ------------------------------------------


def group(platform: str, chat: str, user: str = "7") -> SessionSource:
    return SessionSource(platform, chat_id=chat, chat_type=ChatType.GROUP, user_id=user)


def dm(platform: str, user: str = "7") -> SessionSource:
    return SessionSource(platform, chat_id=user, chat_type=ChatType.DM, user_id=user)


@pytest.mark.parametrize(
    ("platform", "config", "inside", "outside"),
    [
        ("telegram", Config(telegram=TelegramConfig(allowed_chats=["-1"])), "-1", "-2"),
        ("slack", Config(slack=SlackConfig(allowed_channels=["C1"])), "C1", "C2"),
        ("discord", Config(discord=DiscordConfig(allowed_channels=["1"])), "1", "2"),
    ],
)
def test_every_platform_allows_by_chat_and_user_alike(
    platform: str, config: Config, inside: str, outside: str
) -> None:
    assert config.allows(group(platform, inside))
    assert not config.allows(group(platform, outside))
    assert config.allows(dm(platform))  # a DM is governed by the user lists alone
    section = config.chat_settings(platform)
    assert section is not None
    users = msgspec.structs.replace(section, allowed_users=["7"])
    only_seven = msgspec.structs.replace(config, **{platform: users})
    assert only_seven.allows(group(platform, inside))
    assert not only_seven.allows(group(platform, inside, user="8"))
    assert not only_seven.allows(dm(platform, user="8"))
    limited = msgspec.structs.replace(config, allow={platform: ["8"]})
    assert not limited.allows(group(platform, inside))  # [allow] applies on top


def test_telegram_ids_may_be_numbers_and_chats_must_be_ids(tmp_path: Path) -> None:
    path = tmp_path / "chatlane.toml"
    path.write_text("[telegram]\nallowed_users = [42, 'chat:-7']\nallowed_chats = [-1001]\n")
    telegram = load_config(path, environ={}).telegram
    assert (telegram.allowed_users, telegram.allowed_chats) == (["42", "chat:-7"], ["-1001"])
    with pytest.raises(ConfigError, match=re.escape("'telegram.allowed_chats': 'my group' is not")):
        load(tmp_path, "[telegram]\nallowed_chats = ['my group']\n")
    with pytest.raises(ConfigError, match=re.escape("'telegram.allowed_users' = 42: expected")):
        load(tmp_path, "[telegram]\nallowed_users = 42\n")
    with pytest.raises(ConfigError, match=re.escape("'slack.allowed_channels': 'general' is not")):
        load(tmp_path, "[slack]\nallowed_channels = ['general']\n")


async def test_a_job_made_in_a_chat_taken_off_the_list_is_paused() -> None:
    """The scheduler asks the same rule before every run, so the chat list applies to jobs."""
    chats = {"-1"}
    clock = FakeClock()
    scheduler = Scheduler(SchedulerSettings(period=0.02), now=clock)

    def allows(source: SessionSource) -> bool:
        telegram = TelegramConfig(allowed_chats=sorted(chats))
        return Config(telegram=telegram).allows(source)

    async def send(text: str) -> None:
        await h.send(
            text, platform="telegram", chat_id="-1", chat_type="group", thread_id="t", user_id="7"
        )

    async with scheduled(scheduler, allow=allows) as h:
        await send("/cron add every 1m ping")
        await h.replies(chat_id="-1", thread_id="t", count=1)
        chats.clear()
        chats.add("-2")
        clock.advance(60)
        [job] = scheduler.list_jobs()
        assert scheduler.is_paused(job)
        await scheduler.run_once()
        await scheduler.wait_idle()
        await h.settle()
        assert [o.text for o in h.delivered(chat_id="-1", thread_id="t")][1:] == []
        chats.add("-1")
        clock.advance(60)
        assert (await h.replies(chat_id="-1", thread_id="t", count=2))[1] == "echo: ping"
