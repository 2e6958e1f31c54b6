"""Admin-only commands in shared sessions: one check in the gateway, for every platform."""

from __future__ import annotations

from pathlib import Path

import pytest

from chatlane.agents.demo import DemoAgent
from chatlane.authorization import AdminCommands
from chatlane.config import Config, DiscordConfig, TelegramConfig, load_config
from chatlane.errors import ConfigError
from chatlane.groups import ADMIN_COMMANDS
from chatlane.identity import ChatType, KeyPolicy, SessionSource, build_session_key, is_shared
from chatlane.lifecycle import LifecycleOptions
from chatlane.testing import GatewayHarness

GUARD = AdminCommands(frozenset(ADMIN_COMMANDS), {"test": frozenset({"admin"})})


def test_a_session_is_shared_when_no_user_is_in_its_key() -> None:
    thread = SessionSource("t", chat_id="g", chat_type=ChatType.GROUP, thread_id="1", user_id="u")
    group = SessionSource("t", chat_id="g", chat_type=ChatType.GROUP, user_id="u")
    direct = SessionSource("t", chat_id="u", chat_type=ChatType.DM, user_id="u")
    assert is_shared(build_session_key(thread))
    assert not is_shared(build_session_key(group))  # each user has their own by default
    assert is_shared(build_session_key(group, KeyPolicy(group_sessions_per_user=False)))
    assert not is_shared(build_session_key(direct))


def test_admin_commands_name_admins_per_platform() -> None:
    def source(platform: str, user: str | None) -> SessionSource:
        return SessionSource(platform, chat_id="g", chat_type=ChatType.GROUP, user_id=user)

    assert not GUARD(source("test", "someone"), "model")
    assert GUARD(source("test", "someone"), "status")
    assert GUARD(source("test", "admin"), "model")
    assert GUARD(source("other", "someone"), "model")  # no admins named there: open
    assert GUARD(source("test", None), "model")  # no author: a channel's own post


async def in_thread(h: GatewayHarness, text: str, user: str, count: int) -> str:
    await h.send(text, chat_id="g", chat_type="group", thread_id="t", user_id=user)
    return (await h.replies(chat_id="g", thread_id="t", count=count))[-1]


async def test_a_non_admin_is_refused_and_nothing_changes_even_by_saying_yes() -> None:
    confirm = LifecycleOptions(confirm_new=True)
    async with GatewayHarness(DemoAgent(), command_guard=GUARD, lifecycle=confirm) as h:
        assert await in_thread(h, "/model big", "eve", 1) == (
            "Only an admin can use /model in a chat shared with others; nothing changed."
        )
        assert "model=default" in await in_thread(h, "settings", "eve", 2)
        asked = await in_thread(h, "/new", "admin", 3)
        assert "yes" in asked.lower()
        refused = await in_thread(h, "yes", "eve", 4)
        assert refused.startswith("Only an admin can use /new")
        await h.send("/model big", chat_id="eve", user_id="eve")  # a DM: their own
        [mine] = await h.replies(chat_id="eve", count=1)
        assert "big" in mine


def test_admins_and_admin_commands_load_and_bad_ones_are_named(tmp_path: Path) -> None:
    path = tmp_path / "chatlane.toml"
    path.write_text(
        '[groups]\nadmin_commands = ["model"]\n[telegram]\nadmins = [42, "chat:-100"]\n'
        "[discord]\nadmins = [950000000000000001]\n"
    )
    config = load_config(path, environ={})
    guard = config.admin_commands()
    assert guard.commands == {"model"}
    assert guard.admins["telegram"] == {"42", "chat:-100"}
    assert guard.admins["discord"] == {"950000000000000001"}
    for text, key in [
        ('[groups]\nadmin_commands = ["/model"]\n', "'groups.admin_commands[0]' = '/model'"),
        ("[groups]\nadmins = []\n", "'groups.admins'"),
        ('[discord]\nadmins = ["alice"]\n', "'discord.admins'"),
        ("[telegram]\nadmins = 42\n", "'telegram.admins' = 42"),
    ]:
        path.write_text(text)
        with pytest.raises(ConfigError) as error:
            load_config(path, environ={})
        assert key in str(error.value)


def test_by_default_the_commands_that_change_a_shared_session_are_admin_only() -> None:
    config = Config(telegram=TelegramConfig(admins=["1"]), discord=DiscordConfig())
    guard = config.admin_commands()
    changes = {"busy", "cron", "fast", "model", "new", "reasoning", "reset", "resume"}
    assert guard.commands == changes
    assert guard.admins == {"telegram": {"1"}, "slack": set(), "discord": set()}
