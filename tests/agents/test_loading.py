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
