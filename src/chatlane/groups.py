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
* A message that is not for the bot is ignored, or — with ``unmentioned =
  "context"`` (per kind of chat and per chat as ``require_mention``:
  :meth:`GroupPolicy.unmentioned`) — kept as context for the bot's next turn
  in the session it would have gone to, bounded by ``context_messages`` and
  ``context_chars`` (:mod:`chatlane.overheard`). Only after the same
  allowlists as any message (:meth:`~chatlane.gateway.Gateway.overhear`).
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

import enum
import re
from collections.abc import Mapping, Sequence
from typing import ClassVar, Final

import msgspec

from chatlane.errors import ConfigError
from chatlane.identity import ChatType, SessionSource
from chatlane.overheard import CONTEXT_CHARS, CONTEXT_MESSAGES, ContextLimits

__all__ = [
    "ADMIN_COMMANDS",
    "GroupPolicy",
    "GroupSettings",
    "GroupsConfig",
    "Unmentioned",
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
CONTEXT_MESSAGES_MAX: Final = 200
"""The most ``context_messages`` may keep per session."""
CONTEXT_CHARS_MAX: Final = 4000
"""The most ``context_chars`` may keep of one message."""


class Unmentioned(enum.StrEnum):
    """What becomes of a message in a shared chat that is not for the bot."""

    IGNORE = "ignore"
    """Dropped: nothing is kept (the default)."""
    CONTEXT = "context"
    """Kept, bounded, and given to the agent with the next message for it in that session."""


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
    unmentioned: str = Unmentioned.IGNORE.value
    """What becomes of a message not for the bot (:class:`Unmentioned`): ``ignore`` or
    ``context``."""
    unmentioned_per_chat_type: dict[str, str] = msgspec.field(default_factory=dict)
    """Kind of chat → ``unmentioned`` there, over the default."""
    unmentioned_per_chat: dict[str, str] = msgspec.field(default_factory=dict)
    """Chat id → ``unmentioned`` there, over its kind's and the default."""
    context_messages: int = CONTEXT_MESSAGES
    """With ``context``: the most messages kept per session (the oldest dropped first)."""
    context_chars: int = CONTEXT_CHARS
    """With ``context``: the most characters kept of one message (cut with ``…``)."""

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
        self._unmentioned = _unmentioned(section, settings)
        self.limits = ContextLimits(settings.context_messages, settings.context_chars)
        """How much context a session keeps (``context_messages``, ``context_chars``)."""

    def needs_mention(self, chat_id: str, kind: str) -> bool:
        """Whether a message in chat ``chat_id`` of kind ``kind`` must mention the bot."""
        chosen = self._per_chat.get(chat_id)
        if chosen is None:
            chosen = self._per_kind.get(kind, self._default)
        return chosen

    def unmentioned(self, chat_id: str, kind: str) -> Unmentioned:
        """What becomes of a message not for the bot in chat ``chat_id`` of kind ``kind``:
        the chat's entry, else its kind's, else ``unmentioned`` (as :meth:`needs_mention`)."""
        default, per_kind, per_chat = self._unmentioned
        chosen = per_chat.get(chat_id)
        if chosen is None:
            chosen = per_kind.get(kind, default)
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


_Choices = tuple[Unmentioned, Mapping[str, Unmentioned], Mapping[str, Unmentioned]]


def _unmentioned(section: str, settings: GroupSettings) -> _Choices:
    """``unmentioned`` and its overrides read as :class:`Unmentioned`.

    :raises ConfigError: for a value that is none, naming its key.
    """
    key = f"{section}.unmentioned"
    return (
        _mode(key, settings.unmentioned),
        {
            k: _mode(f"{key}_per_chat_type.{k}", v)
            for k, v in settings.unmentioned_per_chat_type.items()
        },
        {k: _mode(f"{key}_per_chat.{k}", v) for k, v in settings.unmentioned_per_chat.items()},
    )


def _mode(key: str, value: str) -> Unmentioned:
    try:
        return Unmentioned(value)
    except ValueError:
        shown = " or ".join(repr(mode.value) for mode in Unmentioned)
        raise ConfigError(f"configuration key {key!r} = {value!r}: expected {shown}") from None


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
    for name in ("require_mention", "unmentioned"):
        for kind in getattr(settings, f"{name}_per_chat_type"):
            _check_kind(f"{section}.{name}_per_chat_type", settings, kind)
        for chat_id in getattr(settings, f"{name}_per_chat"):
            _check_chat_id(f"{section}.{name}_per_chat", settings, chat_id)
    _check_bound(f"{section}.context_messages", settings.context_messages, CONTEXT_MESSAGES_MAX)
    _check_bound(f"{section}.context_chars", settings.context_chars, CONTEXT_CHARS_MAX)
    for chat_id in settings.allowed_chat_ids():
        _check_chat_id(f"{section}.{type(settings).CHATS_KEY}", settings, chat_id)
    GroupPolicy(settings, section)


def _check_kind(key: str, settings: GroupSettings, kind: str) -> None:
    """:raises ConfigError: unless ``kind`` is one of the platform's kinds of chat."""
    kinds = type(settings).CHAT_KINDS
    if kind not in kinds:
        raise ConfigError(
            f"configuration key '{key}.{kind}': expected a kind of chat: {', '.join(kinds)}"
        )


def _check_chat_id(key: str, settings: GroupSettings, chat_id: str) -> None:
    """:raises ConfigError: unless ``chat_id`` has the shape of the platform's chat ids."""
    if type(settings).CHAT_ID.fullmatch(chat_id) is None:
        raise ConfigError(
            f"configuration key {key!r}: {chat_id!r} is not {type(settings).CHAT_ID_SHAPE}"
        )


def _check_bound(key: str, value: int, most: int) -> None:
    """:raises ConfigError: unless ``value`` is a whole number from 1 to ``most``."""
    if type(value) is not int or not 1 <= value <= most:
        raise ConfigError(f"configuration key {key!r} = {value!r}: expected 1 to {most}")
