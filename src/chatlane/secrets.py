"""Secrets: read once at start, from the files and variables the configuration names.

What stays true:

* This is the one module that reads a secret's value (:func:`read_secret`);
  no other reads the environment for one (``config.py`` decodes only the
  ``CHATLANE_<SECTION>__<KEY>`` overrides). ``chatlane serve`` and the local
  gateway of ``chatlane chat`` call :func:`resolve_secrets` once at start and
  hand the :class:`Secrets` to the hub, the adapters and the agent; a piece
  built without them reads the one value it needs here.
* Values live in memory only: kept out of ``repr``, never logged, never
  written to the store.
* Only the access token is read again, and only on an explicit reload
  (:meth:`TokenSource.reread`): a token file rotated in place is picked up; a
  token from an environment variable keeps the value read at start (a running
  process's environment does not change).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from chatlane.config import Config, Secret, SlackMode
from chatlane.errors import ConfigError


def read_secret(secret: Secret, environ: Mapping[str, str] | None = None) -> str:
    """``secret``'s value: its file, else its variable in ``environ`` (default ``os.environ``).

    :returns: ``""`` if nothing is configured or the variable is unset.
    :raises ConfigError: if the file cannot be read.
    """
    return secret.read(os.environ if environ is None else environ)


def why_empty(secret: Secret, environ: Mapping[str, str] | None = None) -> str:
    """Why ``secret`` reads as ``""``, in words for a message (never a value): its variable
    is not set in ``environ`` (default ``os.environ``) or is empty, its file is empty, or
    neither is configured."""
    environ = os.environ if environ is None else environ
    if secret.file:
        return f"the file {secret.file!r} is empty"
    if secret.env:
        state = "is empty" if secret.env in environ else "is not set"
        return f"the environment variable {secret.env} {state}"
    return "neither env nor file is set"


def where_to_set(secret: Secret, key: str) -> str:
    """What gives ``secret`` (configuration key ``key``) a value, when it gave none, in words
    for a message (never a value): the variable or the file the configuration names (a
    default's or another), never one it does not read."""
    if secret.file:
        return f"the file {secret.file!r} is empty (configuration key '{key}.file')"
    if secret.env:
        return f"set {secret.env} (or configuration key '{key}.env' / '{key}.file')"
    return f"set configuration key '{key}.env' or '{key}.file'"


def missing_secret(what: str, secret: Secret, key: str) -> ConfigError:
    """The error of a required ``secret`` (configuration key ``key``) that gave nothing:
    ``what`` is missing, then :func:`where_to_set`."""
    return ConfigError(f"{what}: {where_to_set(secret, key)}")


@dataclass(frozen=True, slots=True)
class TokenSource:
    """The access token as read at start, and where a reload reads it again."""

    secret: Secret = field(default_factory=Secret)
    value: str = field(default="", repr=False)

    @classmethod
    def read(cls, secret: Secret, environ: Mapping[str, str] | None = None) -> TokenSource:
        """Read ``secret`` now (see :func:`read_secret`).

        :raises ConfigError: if its file cannot be read.
        """
        return cls(secret, read_secret(secret, environ))

    def reread(self) -> str:
        """The token now: its file read again, else the value read at start.

        :raises ConfigError: if the file cannot be read.
        """
        return read_secret(self.secret, {}) if self.secret.file else self.value


@dataclass(frozen=True, slots=True)
class Secrets:
    """Every secret a gateway uses, read once; ``Secrets()`` holds none."""

    access_token: TokenSource = TokenSource()
    telegram_token: str = field(default="", repr=False)
    slack_bot_token: str = field(default="", repr=False)
    slack_signing_secret: str = field(default="", repr=False)
    slack_app_token: str = field(default="", repr=False)
    discord_token: str = field(default="", repr=False)
    openai_api_key: str = field(default="", repr=False)
    web_id_secret: str = field(default="", repr=False)
    """``web.id_secret``; ``""``: not configured (:func:`~chatlane.adapters.web_ids.id_secret`)."""
    api_client_tokens: Mapping[str, str] = field(
        default_factory=lambda: MappingProxyType({}), repr=False
    )
    """Each ``[api.clients]`` client's token, by client name."""


def read_client_tokens(
    config: Config, environ: Mapping[str, str] | None = None
) -> Mapping[str, str]:
    """Each ``[api.clients]`` client's token, by client name (see :func:`read_secret`).

    :raises ConfigError: if a token file cannot be read.
    """
    tokens = {name: read_secret(c.token, environ) for name, c in config.api.clients.items()}
    return MappingProxyType(tokens)


def resolve_secrets(config: Config, environ: Mapping[str, str] | None = None) -> Secrets:
    """Read the secrets ``config`` uses, once: the access token, every API client's token,
    ``web.id_secret``; the Telegram token when Telegram is enabled; Slack's bot token, and
    its signing secret or (in Socket Mode) its app token, when Slack is enabled; Discord's
    bot token when Discord is enabled;
    the OpenAI key when the agent is ``openai``.
    Variables are looked up in ``environ`` (default ``os.environ``).

    :raises ConfigError: if a secret file cannot be read.
    """
    environ = os.environ if environ is None else environ
    telegram = read_secret(config.telegram.token, environ) if config.telegram.enabled else ""
    slack, discord = config.slack, config.discord
    socket = slack.enabled and slack.mode is SlackMode.SOCKET
    events = slack.enabled and not socket
    openai = config.agent.name == "openai"
    return Secrets(
        access_token=TokenSource.read(config.server.token, environ),
        telegram_token=telegram,
        slack_bot_token=read_secret(slack.bot_token, environ) if slack.enabled else "",
        slack_signing_secret=read_secret(slack.signing_secret, environ) if events else "",
        slack_app_token=read_secret(slack.app_token, environ) if socket else "",
        discord_token=read_secret(discord.token, environ) if discord.enabled else "",
        openai_api_key=read_secret(config.agent.openai.api_key, environ) if openai else "",
        web_id_secret=read_secret(config.web.id_secret, environ),
        api_client_tokens=read_client_tokens(config, environ),
    )
