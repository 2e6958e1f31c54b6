"""Who may use a gateway: the check that is step 1 of :meth:`Gateway.dispatch`.

What stays true:

* One check decides, for every message and for every run of a job created
  from a chat: :attr:`GatewaySettings.authorize <chatlane.gateway.GatewaySettings>`.
  ``chatlane serve`` uses ``[allow]`` (:meth:`chatlane.config.Config.allows`);
  a library user passes an :class:`Allowlist` or any ``authorize(source)``.
* A refused sender's message runs nothing and stores nothing; see
  :meth:`chatlane.gateway.Gateway.dispatch` for how the refusal is reported.
* An allowlist names platforms; a platform it does not name allows everyone,
  and on a platform it names, a sender without a user id is refused.
* In a session shared with others (:func:`~chatlane.identity.is_shared`) one
  check decides whether a sender may run a command:
  :attr:`GatewaySettings.command_guard <chatlane.gateway.GatewaySettings>`
  (``chatlane serve``: :class:`AdminCommands` from ``[groups]`` and each
  platform's ``admins``). In a session of one's own every command runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TypeAlias

from chatlane.errors import ConfigError
from chatlane.identity import SessionSource

__all__ = [
    "NOT_ALLOWED",
    "AdminCommands",
    "Allowlist",
    "Authorize",
    "CommandGuard",
    "allow_all",
    "any_command",
]

Authorize: TypeAlias = Callable[[SessionSource], bool]
"""Whether the sender of a message (or the creator of a job) may use the gateway now."""

NOT_ALLOWED = "Sorry, you are not allowed to use this assistant."
"""The notice a refused sender gets, unless their adapter tells them otherwise."""


CommandGuard: TypeAlias = Callable[[SessionSource, str], bool]
"""Whether the sender of ``source`` may run the command named (``"model"``) in a shared session."""


def allow_all(source: SessionSource) -> bool:
    """The default check: everyone may use the gateway."""
    return True


def any_command(source: SessionSource, name: str) -> bool:
    """The default command guard: everyone may run every command, shared session or not."""
    return True


@dataclass(frozen=True, slots=True)
class AdminCommands:
    """Commands that only a platform's admins may run in a shared session.

    A message without an author (a Telegram channel's own post, which only the
    channel's admins can write) counts as an admin's.

    :param commands: command names, without the slash (``"model"``).
    :param admins: platform → the user ids of its admins; on a platform not
        named (or named with none) nobody is restricted: the rule applies once
        an operator names that platform's admins.
    """

    commands: frozenset[str]
    admins: Mapping[str, frozenset[str]]

    def __call__(self, source: SessionSource, name: str) -> bool:
        """Whether ``source``'s sender may run ``/name`` in a shared session."""
        admins = self.admins.get(source.platform)
        if not admins or name not in self.commands or source.user_id is None:
            return True
        return source.user_id in admins


@dataclass(frozen=True, slots=True, init=False)
class Allowlist:
    """User ids allowed per platform, as ``[allow]`` in the configuration.

    ``Allowlist({"telegram": ["123"]})`` lets user ``123`` on Telegram in,
    keeps every other Telegram user out, and leaves other platforms open.

    :raises ConfigError: for a platform whose ids are one string (a list was meant).
    """

    users: Mapping[str, frozenset[str]]

    def __init__(self, users: Mapping[str, Iterable[str]]) -> None:
        for platform, ids in users.items():
            if isinstance(ids, str):
                raise ConfigError(f"the allowlist of {platform!r} must be a list of user ids")
        frozen = {platform: frozenset(str(i) for i in ids) for platform, ids in users.items()}
        object.__setattr__(self, "users", frozen)

    def __call__(self, source: SessionSource) -> bool:
        """Whether ``source``'s user may use the gateway."""
        allowed = self.users.get(source.platform)
        return allowed is None or (source.user_id or "") in allowed
