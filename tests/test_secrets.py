"""Secrets: read once, in one module, from what the configuration names; never shown."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

import chatlane
from chatlane.access import AccessToken
from chatlane.config import (
    AgentConfig,
    ApiClientConfig,
    ApiConfig,
    Config,
    OpenAIConfig,
    ServerConfig,
    TelegramConfig,
    WebConfig,
    load_config,
)
from chatlane.config import Secret as Named
from chatlane.errors import ConfigError
from chatlane.secrets import (
    Secrets,
    TokenSource,
    read_secret,
    resolve_secrets,
    where_to_set,
    why_empty,
)
from tests.ports import free_port

PACKAGE = Path(chatlane.__file__).parent
MAY_READ_THE_ENVIRONMENT = {
    "config.py": "decodes the CHATLANE_<SECTION>__<KEY> overrides",
    "context.py": "the context layer's documented legacy fallback",
    "secrets.py": "the one place secrets are read",
    "testing_redis.py": "REDIS_URL, for tests",
    "testing_postgres.py": "CHATLANE_TEST_POSTGRES_URL, for tests",
}
ENVIRONMENT_NAMES = {"environ", "environb", "getenv", "getenvb"}


def names_in(node: ast.AST) -> set[str]:
    """The names ``node`` uses, binds or imports (``os.environ``: ``environ``)."""
    if isinstance(node, ast.Attribute):
        return {node.attr}
    if isinstance(node, ast.Name):
        return {node.id}
    if isinstance(node, ast.arg):
        return {node.arg}
    if isinstance(node, ast.ImportFrom) and node.module == "os":
        return {alias.name for alias in node.names}
    return set()


def environment_reads(tree: ast.AST) -> list[int]:
    """Lines that touch the environment: ``os.environ``, ``getenv``, a name ``environ``."""
    located = (n for n in ast.walk(tree) if isinstance(n, ast.expr | ast.stmt | ast.arg))
    return [node.lineno for node in located if names_in(node) & ENVIRONMENT_NAMES]


def test_no_module_reads_the_environment_on_its_own() -> None:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative in MAY_READ_THE_ENVIRONMENT:
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        found += [f"{relative}:{line}" for line in environment_reads(tree)]
    assert found == [], "read secrets through chatlane.secrets, configuration through config"


def test_the_check_sees_every_way_in() -> None:
    source = (
        "import os\nfrom os import environ\nos.environ['X']\nos.getenv('X')\ndef f(environ): ...\n"
    )
    assert sorted(environment_reads(ast.parse(source))) == [2, 3, 4, 5]


def test_resolve_reads_what_the_configuration_uses(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("t0ken\n")
    config = Config(
        server=ServerConfig(token=Named(file=str(token_file))),
        agent=AgentConfig(name="openai", openai=OpenAIConfig(api_key=Named(env="KEY"))),
        telegram=TelegramConfig(enabled=True, token=Named(env="BOT")),
        web=WebConfig(id_secret=Named(env="WEB")),
        api=ApiConfig(clients={"alice": ApiClientConfig(token=Named(env="ALICE"))}),
    )
    environ = {"KEY": "sk-1", "BOT": "1:x", "WEB": "w" * 16, "ALICE": "a-token"}
    secrets = resolve_secrets(config, environ)
    assert secrets.access_token.value == "t0ken"
    assert (secrets.openai_api_key, secrets.telegram_token) == ("sk-1", "1:x")
    assert secrets.web_id_secret == "w" * 16
    assert dict(secrets.api_client_tokens) == {"alice": "a-token"}


def test_secrets_of_unused_features_are_not_read(tmp_path: Path) -> None:
    missing = Named(file=str(tmp_path / "missing"))
    config = Config(
        agent=AgentConfig(name="demo", openai=OpenAIConfig(api_key=missing)),
        telegram=TelegramConfig(enabled=False, token=missing),
    )
    secrets = resolve_secrets(config, {})
    assert (secrets.openai_api_key, secrets.telegram_token) == ("", "")
    with pytest.raises(ConfigError, match="secret file"):
        resolve_secrets(Config(server=ServerConfig(token=missing)), {})


def test_no_value_is_ever_shown() -> None:
    config = Config(
        agent=AgentConfig(name="openai"),
        telegram=TelegramConfig(enabled=True),
        web=WebConfig(id_secret=Named(env="WEB")),
        api=ApiConfig(clients={"alice": ApiClientConfig(token=Named(env="ALICE"))}),
    )
    values = {
        "CHATLANE_TOKEN": "value-token",
        "OPENAI_API_KEY": "value-key",
        "TELEGRAM_BOT_TOKEN": "value-bot",
        "WEB": "value-web-id-secret",
        "ALICE": "value-alice",
    }
    shown = repr(resolve_secrets(config, values))
    assert "value-" not in shown
    assert "CHATLANE_TOKEN" in shown  # where it comes from may be shown


def test_a_reload_rereads_a_file_and_keeps_a_variables_value(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("first")
    from_file = TokenSource.read(Named(file=str(token_file)))
    token_file.write_text("second")
    assert (from_file.value, from_file.reread()) == ("first", "second")
    from_variable = TokenSource.read(Named(env="T"), {"T": "kept"})
    assert from_variable.reread() == "kept"
    access = AccessToken(from_file)
    assert access.matches(b"first")
    access.reload()
    assert access.matches(b"second")
    assert not access.matches(b"first")


def test_nothing_configured_is_no_secret() -> None:
    assert read_secret(Named(), {"CHATLANE_TOKEN": "x"}) == ""
    assert not AccessToken(Secrets().access_token).required


def test_a_secret_file_that_is_not_text_is_a_clear_error_and_locks_on_reload(
    tmp_path: Path,
) -> None:
    token_file = tmp_path / "token"
    token_file.write_bytes(b"\xe4\xff\xfe")
    with pytest.raises(ConfigError, match=r"secret file .*: not UTF-8 text"):
        read_secret(Named(file=str(token_file)), {})
    token_file.write_text("first")
    access = AccessToken(TokenSource.read(Named(file=str(token_file))))
    token_file.write_bytes(b"\xe4\xff\xfe")  # rotated to something unreadable
    access.reload()
    assert not access.matches(b"first")  # locked until a reload finds a token
    assert access.required


@pytest.mark.parametrize(
    ("environ", "why"),
    [
        ({}, "the environment variable BOT_TOKEN is not set"),
        ({"BOT_TOKEN": ""}, "the environment variable BOT_TOKEN is empty"),
    ],
)
def test_an_empty_secret_says_whether_its_variable_is_set(
    environ: dict[str, str], why: str
) -> None:
    assert why_empty(Named(env="BOT_TOKEN"), environ) == why


def test_an_empty_secret_file_or_none_configured_says_so(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("\n")
    assert why_empty(Named(file=str(tmp_path / "token"))) == (
        f"the file '{tmp_path / 'token'}' is empty"
    )
    assert why_empty(Named()) == "neither env nor file is set"


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ('[telegram]\ntoken = "hunter2-inline"', "telegram.token"),
        ('[server]\ntoken = "hunter2-inline"', "server.token"),
        ('[agent.openai]\napi_key = "hunter2-inline"', "agent.openai.api_key"),
        ('[web]\nid_secret = "hunter2-inline"', "web.id_secret"),
        (
            '[api.clients.bob]\ntoken = { env = "BOB" }\n'
            '[api.clients.alice]\ntoken = "hunter2-inline"',
            "api.clients.alice.token",
        ),
    ],
)
def test_a_secret_written_as_its_value_is_told_where_to_keep_it(
    tmp_path: Path, text: str, key: str
) -> None:
    path = tmp_path / "chatlane.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as raised:
        load_config(path, environ={})
    assert str(raised.value) == (
        f"configuration key {key!r}: a secret is not written in the configuration: "
        'use { env = "VARIABLE" } or { file = "/path/to/file" }'
    )


def test_a_secret_overridden_with_a_value_is_told_the_same_and_not_shown() -> None:
    with pytest.raises(ConfigError) as raised:
        load_config(None, environ={"CHATLANE_TELEGRAM__TOKEN": "hunter2-inline"})
    assert str(raised.value).startswith("configuration key 'telegram.token': a secret is not")
    assert "hunter2" not in str(raised.value)


def test_a_missing_secret_is_told_where_the_configuration_reads_it(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("\n")
    key = "telegram.token"
    assert where_to_set(Named(env="MY_BOT_TOKEN"), key) == (
        "set MY_BOT_TOKEN (or configuration key 'telegram.token.env' / 'telegram.token.file')"
    )
    assert where_to_set(Named(file=str(tmp_path / "token")), key) == (
        f"the file '{tmp_path / 'token'}' is empty (configuration key 'telegram.token.file')"
    )
    assert where_to_set(Named(), key) == (
        "set configuration key 'telegram.token.env' or 'telegram.token.file'"
    )


RENAMED = [
    (
        '[telegram]\nenabled = true\ntoken = { env = "MY_BOT_TOKEN" }',
        "TELEGRAM_BOT_TOKEN",
        "telegram is enabled but has no bot token: set MY_BOT_TOKEN "
        "(or configuration key 'telegram.token.env' / 'telegram.token.file')",
    ),
    (
        '[discord]\nenabled = true\ntoken = { env = "MY_BOT_TOKEN" }',
        "DISCORD_BOT_TOKEN",
        "discord is enabled but has no bot token: set MY_BOT_TOKEN "
        "(or configuration key 'discord.token.env' / 'discord.token.file')",
    ),
    (
        '[slack]\nenabled = true\nbot_token = { env = "MY_BOT_TOKEN" }',
        "SLACK_BOT_TOKEN",
        "slack is enabled but has no bot token: set MY_BOT_TOKEN "
        "(or configuration key 'slack.bot_token.env' / 'slack.bot_token.file')",
    ),
    (
        '[slack]\nenabled = true\nbot_token = { env = "SET" }\n'
        'signing_secret = { env = "MY_BOT_TOKEN" }',
        "SLACK_SIGNING_SECRET",
        "slack is enabled but has no signing secret: set MY_BOT_TOKEN "
        "(or configuration key 'slack.signing_secret.env' / 'slack.signing_secret.file'), "
        'or use Socket Mode (slack.mode = "socket")',
    ),
    (
        '[slack]\nenabled = true\nmode = "socket"\nbot_token = { env = "SET" }\n'
        'app_token = { env = "MY_BOT_TOKEN" }',
        "SLACK_APP_TOKEN",
        "slack is in socket mode but has no app token: set MY_BOT_TOKEN "
        "(or configuration key 'slack.app_token.env' / 'slack.app_token.file')",
    ),
    (
        '[server]\nhost = "192.0.2.1"\ntoken = { env = "MY_BOT_TOKEN" }',
        "CHATLANE_TOKEN",
        "configuration key 'server.host' = '192.0.2.1': listening beyond this machine needs "
        "a token: set MY_BOT_TOKEN "
        "(or configuration key 'server.token.env' / 'server.token.file')",
    ),
]
"""A configuration naming its own variable (unset) for a secret the start needs, the
default variable it replaces, and the error."""


@pytest.mark.parametrize(
    ("text", "default", "error"), RENAMED, ids=[default for _, default, _ in RENAMED]
)
def test_a_missing_secret_names_the_variable_configured_not_the_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str, default: str, error: str
) -> None:
    """The default variable is set, and not read: naming it would send the user astray."""
    from chatlane.serve import prepare

    path = tmp_path / "chatlane.toml"
    path.write_text(text)
    monkeypatch.delenv("MY_BOT_TOKEN", raising=False)
    monkeypatch.setenv("SET", "xoxb-1")
    monkeypatch.setenv(default, "hunter2-default")
    with pytest.raises(ConfigError) as raised:
        prepare(str(path))
    assert str(raised.value) == error


def test_a_missing_openai_key_names_the_variable_configured(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from chatlane.agents import load_agent

    openai = OpenAIConfig(api_key=Named(env="MY_OPENAI_KEY"))
    config = msgspec.structs.replace(Config(), agent=AgentConfig(name="openai", openai=openai))
    monkeypatch.delenv("MY_OPENAI_KEY", raising=False)
    monkeypatch.setenv("OPENAI_API_KEY", "hunter2-default")
    with pytest.raises(ConfigError) as raised:
        load_agent(config, resolve_secrets(config))
    assert str(raised.value) == (
        "the openai agent has no API key for https://api.openai.com/v1: set MY_OPENAI_KEY "
        "(or configuration key 'agent.openai.api_key.env' / 'agent.openai.api_key.file'); "
        "a server on this machine needs none"
    )


def test_chatlane_serve_names_the_telegram_token_variable_configured(tmp_path: Path) -> None:
    (tmp_path / "chatlane.toml").write_text(
        '[telegram]\nenabled = true\ntoken = { env = "MY_BOT_TOKEN" }\n'
    )
    environ = {k: v for k, v in os.environ.items() if k != "MY_BOT_TOKEN"}
    command = ["--config", "chatlane.toml", "--port", str(free_port()), "--store", "memory://"]
    result = subprocess.run(
        [sys.executable, "-m", "chatlane", "serve", *command],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**environ, "TELEGRAM_BOT_TOKEN": "1:hunter2"},
        timeout=60,
    )
    assert (result.returncode, result.stdout) == (1, "")
    assert result.stderr.splitlines() == [
        "Error: telegram is enabled but has no bot token: set MY_BOT_TOKEN "
        "(or configuration key 'telegram.token.env' / 'telegram.token.file')"
    ]
