"""Naming the agent in the configuration: demo, openai, or python:module:attribute."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import msgspec
import pytest

from chatlane.agents import load_agent
from chatlane.config import Config
from chatlane.errors import ConfigError


def named(name: str) -> Config:
    config = Config()
    return msgspec.structs.replace(config, agent=msgspec.structs.replace(config.agent, name=name))


def test_an_agent_module_in_the_working_directory_is_found(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "mybot_for_loading"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "agent.py").write_text("async def answer(turn):\n    return 'hi'\n")
    monkeypatch.chdir(tmp_path)
    # as under the `chatlane` console script: the working directory is not on the path
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", os.getcwd())])
    agent = load_agent(named("python:mybot_for_loading.agent:answer"))
    assert agent.__name__ == "answer"  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("python:nowhere_at_all:agent", "cannot import it"),
        ("python:os:sep", "is not callable"),
        ("python:justamodule", "expected python:module:attribute"),
        ("something", "expected demo, openai or python:module:attribute"),
    ],
)
def test_a_bad_agent_name_is_a_clear_error(name: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_agent(named(name))


def test_the_working_directory_leaves_the_path_after_the_import(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "mybot_leaving.py").write_text("async def answer(turn):\n    return 'hi'\n")
    (tmp_path / "shadow_for_loading.py").write_text("SHADOWED = True\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", os.getcwd())])
    load_agent(named("python:mybot_leaving:answer"))
    assert str(tmp_path) not in sys.path
    assert importlib.util.find_spec("shadow_for_loading") is None, "a later import is shadowed"


def openai_config(
    base_url: str = "https://api.openai.com/v1", key_env: str = "NO_SUCH_KEY"
) -> Config:
    from chatlane.config import AgentConfig, OpenAIConfig, Secret

    openai = OpenAIConfig(base_url=base_url, api_key=Secret(env=key_env))
    return msgspec.structs.replace(Config(), agent=AgentConfig(name="openai", openai=openai))


def test_the_openai_agent_without_a_key_for_a_remote_server_stops_the_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("NO_SUCH_KEY", raising=False)
    with pytest.raises(ConfigError, match="the openai agent has no API key for https://api"):
        load_agent(openai_config())


@pytest.mark.parametrize(
    "base_url", ["http://127.0.0.1:11434/v1", "http://localhost:8000/v1", "http://[::1]:8000/v1"]
)
def test_a_server_on_this_machine_needs_no_key(
    monkeypatch: pytest.MonkeyPatch, base_url: str
) -> None:
    monkeypatch.delenv("NO_SUCH_KEY", raising=False)
    assert callable(load_agent(openai_config(base_url)))


def test_a_configured_key_is_enough(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SOME_KEY", "sk-test")
    assert callable(load_agent(openai_config(key_env="SOME_KEY")))


def test_a_missing_extra_names_the_pip_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "chatlane.agents.openai_agent", raising=False)
    monkeypatch.setitem(sys.modules, "openai", None)  # as if not installed
    with pytest.raises(ConfigError) as raised:
        load_agent(openai_config("http://127.0.0.1:1/v1"))
    assert str(raised.value).endswith("pip install 'chatlane[openai]'")
    assert str(raised.value).startswith("the openai agent needs the openai extra")
