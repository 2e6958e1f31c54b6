"""What Discord sends, read into chatlane's terms: where a message was written, by whom, and
what a button press asks for.

Nothing here talks to Discord or imports discord.py: these are pure functions
of ids and text, so :mod:`chatlane.serve` can check the configuration without
the ``discord`` extra.

What stays true:

* Where a message was written depends only on its server, channel and (for a
  thread) the thread's parent (:func:`where_of`): a DM is ``dm`` with the DM
  channel as chat; a server channel is ``group`` with the channel as chat; a
  thread is ``group`` with its parent channel as chat and the thread as
  ``thread_id``. Every id is a snowflake (digits), never a name.
* A message's id is made from the message's snowflake and its author's
  (:func:`message_id`), so the author of every turn can be read back from its
  messages' ids (:func:`author_of`) and an approval prompt's buttons name who
  may press them.
* Whether a message mentions the bot is Discord's word (its ``mentions``),
  never a search of the text; :func:`strip_mentions` takes out only the
  mentions Discord shows as one — not one quoted in code or escaped with a
  backslash, which stays as written.
* A button's ``custom_id`` names the answer, the request and the asker
  (:func:`button_id`); :func:`read_button` gives the command a press sends, or
  None for anything it did not make — a forged, malformed or foreign id
  answers nothing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from chatlane.adapters.splitting import split_text, utf16_len
from chatlane.approvals import is_request_id
from chatlane.config import Secret
from chatlane.identity import ChatType, SessionSource
from chatlane.secrets import missing_secret
from chatlane.types import Attachment, InboundMessage

__all__ = [
    "APPROVE",
    "DENY",
    "MESSAGE_LIMIT",
    "PLATFORM",
    "Answer",
    "Posted",
    "Press",
    "Where",
    "author_of",
    "button_id",
    "check_token",
    "message_id",
    "read_button",
    "split_message",
    "strip_mentions",
    "where_of",
]

PLATFORM = "discord"
ID_PREFIX = "discord"
MESSAGE_LIMIT = 2000
"""Characters of one Discord message; chatlane counts UTF-16 code units, so a part fits
however the characters are counted (an emoji outside the BMP counts as two)."""
APPROVE = "chatlane:approve"
DENY = "chatlane:deny"
_ANSWERS = {APPROVE: "/approve", DENY: "/deny"}
"""A button's ``custom_id`` prefix → the command a press sends."""
_SNOWFLAKE = re.compile(r"[0-9]{1,20}")
_MARKUP = re.compile(r"\\.|```.*?```|``.+?``|`[^`]+`|<@!?(?P<user>[0-9]+)> ?", re.DOTALL)
"""What a mention is read among, from the left: an escaped character, a code block, a
code span (none of which holds a mention), or a user's mention with one space after it."""


def check_token(token: str, configured: Secret) -> None:
    """``token``, read from ``configured`` (``discord.token``), is there.

    :raises ConfigError: in one line, naming what is missing and where the configuration
        reads it from (:func:`~chatlane.secrets.where_to_set`).
    """
    if not token:
        raise missing_secret("discord is enabled but has no bot token", configured, "discord.token")


def is_snowflake(text: str) -> bool:
    """Whether ``text`` has the shape of a Discord id."""
    return _SNOWFLAKE.fullmatch(text) is not None


@dataclass(frozen=True, slots=True)
class Where:
    """The chat and thread a message was written in, as chatlane keys them."""

    chat_id: str
    chat_type: ChatType
    thread_id: str | None = None


def where_of(guild_id: int | None, channel_id: int, parent_id: int | None = None) -> Where:
    """Where a message in ``channel_id`` was written (see the module docstring).

    :param guild_id: the server; None for a DM.
    :param parent_id: the channel a thread belongs to; None when ``channel_id``
        is no thread.
    """
    if guild_id is None:
        return Where(str(channel_id), ChatType.DM)
    if parent_id is not None:
        return Where(str(parent_id), ChatType.GROUP, str(channel_id))
    return Where(str(channel_id), ChatType.GROUP)


def message_id(message: int | str, user: int | str) -> str:
    """chatlane's id of the message ``message`` that ``user`` wrote."""
    return f"{ID_PREFIX}-{message}-{user}"


def author_of(message_ids: tuple[str, ...]) -> str | None:
    """Who wrote the messages of a turn, read from their ids; None when they do not say."""
    authors = {_author(message) for message in message_ids}
    return authors.pop() if len(authors) == 1 else None


def _author(message: str) -> str | None:
    prefix, *parts = message.split("-")
    if prefix != ID_PREFIX or len(parts) != 2 or not is_snowflake(parts[1]):
        return None
    return parts[1]


def strip_mentions(text: str, bot_id: int) -> str:
    """``text`` without the bot's mentions (``<@id>``, ``<@!id>``), each with one space after
    it (so ``ask <@id> about it`` reads ``ask about it``), trimmed; one in a code block or
    span, or escaped (``\\<@id>``), is no mention and stays."""
    kept, end = [], 0
    for found in _MARKUP.finditer(text):
        if found["user"] == str(bot_id):
            kept.append(text[end : found.start()])
            end = found.end()
    kept.append(text[end:])
    return "".join(kept).strip()


def split_message(text: str, limit: int = MESSAGE_LIMIT) -> list[str]:
    """``text`` (Markdown) in parts of at most ``limit`` UTF-16 code units, code fences
    kept balanced (:func:`~chatlane.adapters.splitting.split_text`)."""
    return split_text(text, limit, measure=utf16_len)


@dataclass(frozen=True, slots=True)
class Posted:
    """A person's message the bot can read."""

    where: Where
    message: int
    user: int
    text: str
    """As chatlane reads it: the bot's mentions taken out, trimmed."""
    mentions_bot: bool
    replies_to_bot: bool
    guild_id: int | None
    chat_name: str = ""
    user_name: str = ""
    files: tuple[Attachment, ...] = ()
    """The files sent with the message, as attachments; with some, ``text`` may be empty."""

    @property
    def id(self) -> str:
        return message_id(self.message, self.user)

    def inbound(self) -> InboundMessage:
        """The message chatlane gets; its replies go to the same channel or thread."""
        source = SessionSource(
            PLATFORM,
            chat_id=self.where.chat_id,
            chat_type=self.where.chat_type,
            chat_name=self.chat_name,
            thread_id=self.where.thread_id,
            user_id=str(self.user),
            user_name=self.user_name,
            message_id=str(self.message),
        )
        return InboundMessage(source, self.text, id=self.id, attachments=self.files)


@dataclass(frozen=True, slots=True)
class Answer:
    """What a press of one of chatlane's buttons sends, and who may send it."""

    command: str
    """``/approve #<request>`` or ``/deny #<request>``."""
    asker: str | None
    """The user whose turn asked; None when the prompt did not say."""


def button_id(prefix: str, request_id: str, asker: str | None) -> str:
    """The ``custom_id`` of an Approve (:data:`APPROVE`) or Deny (:data:`DENY`) button."""
    return f"{prefix}:{request_id}:{asker or ''}"


def read_button(custom_id: str) -> Answer | None:
    """The answer a button's ``custom_id`` names; None for anything :func:`button_id` did
    not make (another app's button, a forged or malformed id)."""
    prefix, _, rest = custom_id.rpartition(":")
    asker = rest
    prefix, _, request = prefix.rpartition(":")
    verb = _ANSWERS.get(prefix)
    if verb is None or not is_request_id(request) or (asker and not is_snowflake(asker)):
        return None
    return Answer(f"{verb} #{request}", asker or None)


@dataclass(frozen=True, slots=True)
class Press:
    """A press of one of chatlane's buttons (``answer`` None: a button it does not know)."""

    where: Where
    interaction: int
    user: int
    answer: Answer | None

    def inbound(self) -> InboundMessage:
        """The command the press sends, as the user who pressed, where the prompt is."""
        source = SessionSource(
            PLATFORM,
            chat_id=self.where.chat_id,
            chat_type=self.where.chat_type,
            thread_id=self.where.thread_id,
            user_id=str(self.user),
        )
        command = "" if self.answer is None else self.answer.command
        return InboundMessage(source, command, id=message_id(f"press{self.interaction}", self.user))
