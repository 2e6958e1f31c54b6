"""Agents: ``demo`` (offline, deterministic), ``openai`` (any OpenAI-compatible endpoint),
or any async callable named as ``python:module:attribute``."""

from __future__ import annotations

import contextlib
import importlib
import ipaddress
import os
import sys
from collections.abc import Iterator
from urllib.parse import urlsplit

from chatlane.config import Config
from chatlane.errors import ConfigError
from chatlane.secrets import Secrets, where_to_set
from chatlane.types import Agent


def load_agent(config: Config, secrets: Secrets | None = None) -> Agent:
    """The agent ``config.agent.name`` names.

    ``secrets`` gives the ``openai`` agent its key, read at start; without it,
    the agent reads its key itself.

    :raises ConfigError: for an unknown name, an attribute that cannot be imported,
        a missing extra, or the ``openai`` agent without an API key for a
        server elsewhere.
    """
    name = config.agent.name
    if name == "demo":
        from chatlane.agents.demo import DemoAgent

        return DemoAgent()
    if name == "openai":
        with needs_extra("openai", "the openai agent"):
            from chatlane.agents.openai_agent import OpenAIAgent

        api_key = None if secrets is None else secrets.openai_api_key
        agent = OpenAIAgent(config.agent.openai, api_key=api_key)
        if not agent.has_key and not is_local_url(config.agent.openai.base_url):
            where = where_to_set(config.agent.openai.api_key, "agent.openai.api_key")
            raise ConfigError(
                f"the openai agent has no API key for {config.agent.openai.base_url}: "
                f"{where}; a server on this machine needs none"
            )
        return agent
    if name.startswith("python:"):
        return _import_agent(name.removeprefix("python:"))
    raise ConfigError(
        f"configuration key 'agent.name' = {name!r}: expected demo, openai or "
        "python:module:attribute"
    )


@contextlib.contextmanager
def needs_extra(extra: str, what: str) -> Iterator[None]:
    """Turn the block's ``ImportError`` into one line naming the extra to install.

    :raises ConfigError: ``what needs the <extra> extra (…): pip install 'chatlane[<extra>]'``.
    """
    try:
        yield
    except ImportError as error:
        raise ConfigError(
            f"{what} needs the {extra} extra ({error}): pip install 'chatlane[{extra}]'"
        ) from None


def is_local_url(url: str) -> bool:
    """Whether ``url`` names a server on this machine (a loopback address or ``localhost``)."""
    host = (urlsplit(url).hostname or "").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _import_agent(target: str) -> Agent:
    """Import ``module:attribute``; the working directory is searched first, as uvicorn does.

    The working directory is on ``sys.path`` only while the agent's module is
    imported, so a file there (a ``telegram.py``) cannot shadow a package that
    is imported later.
    """
    module_name, _, attribute = target.partition(":")
    if not module_name or not attribute:
        raise ConfigError(f"agent {target!r}: expected python:module:attribute")
    try:
        with _working_directory_first():
            module = importlib.import_module(module_name)
        agent: Agent = getattr(module, attribute)
    except (ImportError, AttributeError) as error:
        raise ConfigError(f"agent python:{target}: cannot import it ({error})") from None
    if not callable(agent):
        raise ConfigError(f"agent python:{target} is not callable")
    return agent


@contextlib.contextmanager
def _working_directory_first() -> Iterator[None]:
    """Put the working directory first on ``sys.path`` for the block, unless it is there.

    A console script starts without it; whatever this adds is taken out again.
    """
    here = os.getcwd()
    if "" in sys.path or here in sys.path:
        yield
        return
    sys.path.insert(0, here)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(here)
        sys.path_importer_cache.pop(here, None)
