"""Group controls every chat adapter shares: when a message in a shared chat is for the bot.

What stays true:

* A direct message is always for the bot; nothing here applies to it.
* Whether a message elsewhere must mention the bot is decided by one rule
  (:meth:`GroupPolicy.needs_mention`): the chat's own entry in
  ``require_mention_per_chat``, else its kind's entry in
  ``require_mention_per_chat_type``, else ``require_mention``.
* A message mentions the bot when its platform says so (an @-mention, a reply
  to one of the bot's messages, a command addressed to it), or when one of
  ``mention_patterns`` matches its text, case-insensitively.
* Who may talk is one rule for every platform (:meth:`GroupSettings.allows`):
  the section's ``allowed_users`` (empty: everyone) and, outside direct
  messages, its list of chats (empty: every one); a direct message is governed
  by the user list alone.
* In a session shared with others, the commands of ``[groups] admin_commands``
  run only for the platform's ``admins`` once that list names anyone (an empty
  one restricts nothing) (:meth:`chatlane.config.Config.admin_commands`
  builds the gateway's one check, :class:`~chatlane.authorization.AdminCommands`).
* The keys are the same in every chat adapter's section (``[telegram]``,
  ``[slack]``, ``[discord]``); only the chat kinds and the shape of a chat id
  differ (:class:`GroupSettings` subclasses name them), and they are checked
  at start (:func:`check_group_settings`), so a bad regex or a chat that is no
  id stops the start with a :class:`~chatlane.errors.ConfigError`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import ClassVar, Final

import msgspec

from chatlane.errors import ConfigError
from chatlane.identity import ChatType, SessionSource

__all__ = [
    "ADMIN_COMMANDS",
    "GroupPolicy",
    "GroupSettings",
    "GroupsConfig",
    "check_group_settings",
]

ADMIN_COMMANDS: Final = ("busy", "cron", "fast", "model", "new", "reasoning", "reset", "resume")
"""The commands only admins may run in a shared session, by default: each changes what
everyone there gets — the conversation (``/new``, ``/reset``, ``/resume``), how the agent
answers and what it costs (``/model``, ``/reasoning``, ``/fast``), what becomes of the
others' messages during a turn (``/busy``), and what runs in the chat unattended
(``/cron``). Commands that stop or steer a turn, ask aside or show state stay open to
everyone, so anyone can halt a runaway turn."""
_COMMAND_NAME = re.compile(r"[a-z][a-z0-9_-]{0,31}")


class GroupsConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``[groups]``: what holds for shared chats on every platform."""

    admin_commands: list[str] = msgspec.field(default_factory=lambda: list(ADMIN_COMMANDS))
    """Commands (without the slash) only a platform's ``admins`` may run in a shared session."""

    def check(self) -> None:
        """:raises ConfigError: for an entry that is no command name."""
        for index, name in enumerate(self.admin_commands):
            if _COMMAND_NAME.fullmatch(name) is None:
                raise ConfigError(
                    f"configuration key 'groups.admin_commands[{index}]' = {name!r}: "
                    "expected a command name without the slash, in lower case ('model')"
                )


class GroupSettings(msgspec.Struct, frozen=True, kw_only=True):
    """The group keys of one chat adapter's section (a base: each adapter names its kinds)."""

    CHAT_KINDS: ClassVar[tuple[str, ...]] = ()
    """The platform's kinds of shared chats, the keys of ``require_mention_per_chat_type``."""
    CHAT_ID: ClassVar[re.Pattern[str]] = re.compile(r"\S+")
    """What a chat id of the platform looks like."""
    CHAT_ID_SHAPE: ClassVar[str] = "a chat id"
    """How :attr:`CHAT_ID` is told to a user whose id does not fit it."""
    CHATS_KEY: ClassVar[str] = "allowed_chats"
    """The key of the list :meth:`allowed_chat_ids` reads (Slack and Discord keep theirs)."""

    require_mention: bool = True
    """Outside direct messages, answer only a message that mentions the bot."""
    require_mention_per_chat_type: dict[str, bool] = msgspec.field(default_factory=dict)
    """Kind of chat → ``require_mention`` there, over the default."""
    require_mention_per_chat: dict[str, bool] = msgspec.field(default_factory=dict)
    """Chat id → ``require_mention`` there, over its kind's and the default."""
    mention_patterns: list[str] = msgspec.field(default_factory=list)
    """Regular expressions (a nickname …); one matching a message's text, in any case,
    counts as a mention of the bot."""
    allowed_users: list[str] = msgspec.field(default_factory=list)
    """User ids that may use the bot; empty: everyone (``[allow] <platform>`` applies too)."""
    admins: list[str] = msgspec.field(default_factory=list)
    """User ids that may run ``[groups] admin_commands`` in a chat shared with others;
    empty: everyone may (the restriction applies once admins are named)."""

    def allowed_chat_ids(self) -> Sequence[str]:
        """The chats (not direct messages) where the bot answers; empty: every one."""
        return ()

    def allows(self, source: SessionSource) -> bool:
        """Whether ``source`` passes ``allowed_users`` and, outside a DM, the chat list."""
        if self.allowed_users and (source.user_id or "") not in self.allowed_users:
            return False
        chats = self.allowed_chat_ids()
        return source.chat_type is ChatType.DM or not chats or (source.chat_id or "") in chats


class GroupPolicy:
    """:class:`GroupSettings` made ready to decide, message by message (patterns compiled).

    :raises ConfigError: for a pattern that is no regular expression (naming ``section``).
    """

    def __init__(self, settings: GroupSettings, section: str) -> None:
        self._default = settings.require_mention
        self._per_kind: Mapping[str, bool] = dict(settings.require_mention_per_chat_type)
        self._per_chat: Mapping[str, bool] = dict(settings.require_mention_per_chat)
        self._patterns = tuple(
            _compiled(f"{section}.mention_patterns[{index}]", pattern)
            for index, pattern in enumerate(settings.mention_patterns)
        )

    def needs_mention(self, chat_id: str, kind: str) -> bool:
        """Whether a message in chat ``chat_id`` of kind ``kind`` must mention the bot."""
        chosen = self._per_chat.get(chat_id)
        if chosen is None:
            chosen = self._per_kind.get(kind, self._default)
        return chosen

    def matches(self, text: str) -> bool:
        """Whether one of the mention patterns occurs in ``text``."""
        return any(pattern.search(text) for pattern in self._patterns)

    def answers(self, chat_id: str, kind: str, text: str, *, mentioned: bool) -> bool:
        """Whether a message in a shared chat is for the bot (see the module docstring).

        ``mentioned``: the platform says the message mentions or replies to the bot.
        """
        if mentioned or not self.needs_mention(chat_id, kind):
            return True
        return self.matches(text)


def _compiled(key: str, pattern: str) -> re.Pattern[str]:
    try:
        return re.compile(pattern, re.IGNORECASE)
    except re.error as error:
        raise ConfigError(
            f"configuration key {key!r} = {pattern!r}: expected a regular expression ({error})"
        ) from None


def check_group_settings(section: str, settings: GroupSettings) -> None:
    """Check ``settings`` of ``[section]``: known chat kinds, chat ids, patterns that compile.

    :raises ConfigError: naming the key, the value and what was expected.
    """
    kinds = type(settings).CHAT_KINDS
    for kind in settings.require_mention_per_chat_type:
        if kind not in kinds:
            raise ConfigError(
                f"configuration key '{section}.require_mention_per_chat_type.{kind}': "
                f"expected a kind of chat: {', '.join(kinds)}"
            )
    for chat_id in settings.require_mention_per_chat:
        _check_chat_id(f"{section}.require_mention_per_chat", settings, chat_id)
    for chat_id in settings.allowed_chat_ids():
        _check_chat_id(f"{section}.{type(settings).CHATS_KEY}", settings, chat_id)
    GroupPolicy(settings, section)


def _check_chat_id(key: str, settings: GroupSettings, chat_id: str) -> None:
    """:raises ConfigError: unless ``chat_id`` has the shape of the platform's chat ids."""
    if type(settings).CHAT_ID.fullmatch(chat_id) is None:
        raise ConfigError(
            f"configuration key {key!r}: {chat_id!r} is not {type(settings).CHAT_ID_SHAPE}"
        )
