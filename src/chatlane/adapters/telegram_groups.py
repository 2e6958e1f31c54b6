"""Which Telegram messages in groups are for the bot, and their text without its mention.

What stays true:

* A private chat's message is always for the bot.
* In a group, supergroup or channel the shared policy decides
  (:class:`~chatlane.groups.GroupPolicy`, keyed by the chat's id and Telegram's
  chat type). The bot counts as mentioned by an ``@username`` entity naming
  it, a text mention of its user id, a reply to one of its messages, or a
  command (a bare ``/cmd``, or ``/cmd@username``: one addressed to another
  bot never reaches this module).
* The bot's mentions are cut out of the text by their entities' UTF-16
  offsets, never by searching the text, so a lookalike name stays.
* Entities are read against the cleaned text (lone surrogates already U+FFFD,
  one UTF-16 unit each, so offsets still fit). An entity that falls outside
  the text or cuts a character in two names nothing: the message is read as
  if that entity were not there.
* A file's caption is its message's text, mentions and all; a message with a
  file is for the bot even when nothing is left of its caption.
* A group's message that is not for the bot is kept as context
  (:func:`overheard`) only where the policy says ``context``; a message that
  mentions the bot with nothing else in it is not for it, and not kept either.
"""

from __future__ import annotations

from dataclasses import dataclass

from telegram import Message, MessageEntity

from chatlane.commands import parse_command
from chatlane.groups import GroupPolicy, Unmentioned

__all__ = ["BotIdentity", "addressed_text", "overheard"]

_PRIVATE = "private"


@dataclass(frozen=True, slots=True)
class BotIdentity:
    """The bot as ``getMe`` names it."""

    id: int
    username: str


def addressed_text(
    message: Message,
    text: str,
    bot: BotIdentity,
    policy: GroupPolicy,
    *,
    files: bool = False,
    chat: str | None = None,
) -> str | None:
    """``text`` (``message``'s text or caption, cleaned) without the bot's mentions, or None
    if not for the bot; with ``files`` (the message has some), an empty text is kept.
    ``chat``: the id the policy knows the chat by (default: the message's chat's)."""
    if message.chat.type == _PRIVATE:
        return text
    mentions = _mentions_of(message, text, bot)
    stripped = _without(text, mentions).strip() if mentions else text
    answers = _answers(message, text, bot, policy, chat or str(message.chat.id))
    return stripped if answers and (stripped or files) else None


def overheard(
    message: Message, text: str, bot: BotIdentity, policy: GroupPolicy, *, chat: str | None = None
) -> bool:
    """Whether ``message`` (its text or caption ``text``), in a group and not for the bot,
    is kept as context for the bot's next turn there (``unmentioned = "context"``).
    ``chat``: the id the policy knows the chat by (default: the message's chat's)."""
    kind, chat_id = message.chat.type, chat or str(message.chat.id)
    if kind == _PRIVATE or policy.unmentioned(chat_id, kind) is Unmentioned.IGNORE:
        return False
    return not _answers(message, text, bot, policy, chat_id)


def _answers(
    message: Message, text: str, bot: BotIdentity, policy: GroupPolicy, chat_id: str
) -> bool:
    """Whether the group's ``message`` is for the bot, by the policy (nothing cut out yet)."""
    mentioned = (
        bool(_mentions_of(message, text, bot))
        or _replies_to(message, bot)
        or parse_command(text) is not None
    )
    return policy.answers(chat_id, message.chat.type, text, mentioned=mentioned)


def _mentions_of(message: Message, text: str, bot: BotIdentity) -> list[MessageEntity]:
    """The entities of ``message`` (of its caption, if it has no text) that name the bot in
    ``text``, the text or caption they were sent with."""
    entities = message.entities if message.text is not None else message.caption_entities
    units = text.encode("utf-16-le", "surrogatepass")
    return [entity for entity in entities if _names_bot(entity, _shown(units, entity), bot)]


def _shown(units: bytes, entity: MessageEntity) -> str | None:
    """The characters ``entity`` spans in ``units`` (UTF-16-LE); None when it reaches
    outside them or cuts a character in two."""
    start, end = entity.offset * 2, (entity.offset + entity.length) * 2
    if not 0 <= start < end <= len(units):
        return None
    try:
        return units[start:end].decode("utf-16-le")
    except UnicodeDecodeError:
        return None


def _names_bot(entity: MessageEntity, shown: str | None, bot: BotIdentity) -> bool:
    """Whether ``entity`` (showing ``shown``; None for no whole characters) is an
    ``@username`` or text mention of the bot."""
    if shown is None:
        return False
    if entity.type == MessageEntity.MENTION:
        return shown.casefold() == f"@{bot.username}".casefold()
    return (
        entity.type == MessageEntity.TEXT_MENTION
        and entity.user is not None
        and (entity.user.id == bot.id)
    )


def _replies_to(message: Message, bot: BotIdentity) -> bool:
    """Whether ``message`` replies to one of the bot's messages (not a topic's opening)."""
    replied = message.reply_to_message
    if replied is None or replied.from_user is None or replied.from_user.id != bot.id:
        return False
    return not (message.is_topic_message and replied.message_id == message.message_thread_id)


_SPACE = " ".encode("utf-16-le")


def _without(text: str, entities: list[MessageEntity]) -> str:
    """``text`` with the spans of ``entities`` (UTF-16 offsets) cut out, each with one space
    after it (so ``ask @bot about it`` reads ``ask about it``)."""
    units = text.encode("utf-16-le", "surrogatepass")
    kept, end = [], 0
    for entity in sorted(entities, key=lambda entity: entity.offset):
        kept.append(units[end * 2 : entity.offset * 2])
        end = max(end, entity.offset + entity.length)
        if units[end * 2 : end * 2 + 2] == _SPACE:
            end += 1
    kept.append(units[end * 2 :])
    return b"".join(kept).decode("utf-16-le", "surrogatepass")
