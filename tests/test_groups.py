"""The shared group rule: precedence of its keys, patterns, and errors that name the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from chatlane.config import TelegramConfig, load_config
from chatlane.errors import ConfigError
from chatlane.groups import GroupPolicy


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
