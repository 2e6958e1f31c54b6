"""discord.py's messages and interactions, read into :mod:`~chatlane.adapters.discord_wire`'s terms.

What stays true:

* Only people's messages are read (:func:`read_message`): never the bot's own,
  nor Discord's own (its system user's announcements);
  another bot's or a webhook's only with ``discord.allow_bots``; only plain
  messages and replies (joins, pins, thread starts and every other system
  message are not); never one left with neither text, once the bot's mention
  is taken out, nor files (:mod:`~chatlane.adapters.discord_files`) — such as
  a message whose text and files Discord withheld because the Message Content
  intent is off.
* A thread is told from a channel by discord.py's cache of the servers'
  channels and threads; a channel missing from it is asked of the API once
  (:class:`Channels`) and remembered. A channel that cannot be looked up is
  taken as a channel of its own, never as another channel's thread.
* Approval buttons are sent as a finished view: discord.py keeps no state for
  them, and a press comes to the adapter as a raw interaction.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

import aiohttp
import discord

from chatlane.adapters.discord_files import files_of
from chatlane.adapters.discord_wire import (
    APPROVE,
    DENY,
    Posted,
    Press,
    Where,
    button_id,
    read_button,
    strip_mentions,
    where_of,
)
from chatlane.types import clean_text

__all__ = ["Channels", "approval_view", "read_message", "read_press"]

log = logging.getLogger("chatlane.adapters.discord")

READ_TYPES = frozenset({discord.MessageType.default, discord.MessageType.reply})
"""Message types that are a person writing."""
_PARENTS_KEPT = 8192
"""Channels looked up through the API whose parent (or none) is remembered."""


class Channels:
    """Where a message in a channel was written: the channel, or a thread and its parent."""

    def __init__(self, client: discord.Client) -> None:
        self._client = client
        self._parents: OrderedDict[int, int | None] = OrderedDict()
        """Channel id → its parent's id (None for a channel that is no thread), newest last."""

    async def where(self, guild_id: int | None, channel: Any) -> Where:
        """Where ``channel`` (a discord.py channel, thread or partial one) is."""
        if guild_id is None:
            return where_of(None, channel.id)
        if isinstance(channel, discord.Thread):
            return where_of(guild_id, channel.id, channel.parent_id)
        if not isinstance(channel, discord.PartialMessageable | discord.Object):
            return where_of(guild_id, channel.id)
        return where_of(guild_id, channel.id, await self._parent(channel.id))

    async def _parent(self, channel_id: int) -> int | None:
        """The parent of the thread ``channel_id``, None for a channel that is no thread (or
        one that cannot be looked up now: not remembered, so it is asked again)."""
        if channel_id in self._parents:
            self._parents.move_to_end(channel_id)
            return self._parents[channel_id]
        try:
            channel = await self._client.fetch_channel(channel_id)
        except (discord.DiscordException, aiohttp.ClientError, TimeoutError) as error:
            log.warning("discord: channel %s could not be looked up: %s", channel_id, error)
            return None
        parent = channel.parent_id if isinstance(channel, discord.Thread) else None
        self._parents[channel_id] = parent
        while len(self._parents) > _PARENTS_KEPT:
            self._parents.popitem(last=False)
        return parent


async def read_message(
    message: discord.Message, bot_id: int, channels: Channels, *, allow_bots: bool
) -> Posted | None:
    """The person's message ``message`` is, or None (see the module docstring)."""
    author = message.author
    if author.id == bot_id or author.system or message.type not in READ_TYPES:
        return None  # the bot's own, Discord's own (its official system user), no message
    if (author.bot or message.webhook_id is not None) and not allow_bots:
        return None
    mentioned = any(user.id == bot_id for user in message.mentions)
    content = clean_text(message.content)
    text = strip_mentions(content, bot_id) if mentioned else content.strip()
    files = files_of(message)
    if not text and not files:
        return None
    guild_id = guild_of(message)
    where = await channels.where(guild_id, message.channel)
    return Posted(
        where=where,
        message=message.id,
        user=author.id,
        text=text,
        mentions_bot=mentioned,
        replies_to_bot=_replies_to(message, bot_id),
        guild_id=guild_id,
        chat_name=clean_text(getattr(message.channel, "name", None) or ""),
        user_name=clean_text(author.name),
        files=files,
    )


def guild_of(message: discord.Message) -> int | None:
    """The id of the server ``message`` was written in; None in a direct message.

    A server discord.py has not cached (its ``GUILD_CREATE`` not come yet, or the server
    unavailable) leaves ``message.guild`` None, as a DM does; the message's channel then
    still names the server, and it is read as that server's, under its rules.
    """
    if message.guild is not None:
        return message.guild.id
    named = getattr(message.channel, "guild_id", None)
    return named if isinstance(named, int) else None


def _replies_to(message: discord.Message, bot_id: int) -> bool:
    """Whether ``message`` replies to one of the bot's messages."""
    reference = message.reference
    replied = None if reference is None else reference.resolved
    return isinstance(replied, discord.Message) and replied.author.id == bot_id


async def read_press(interaction: discord.Interaction, channels: Channels) -> Press | None:
    """The button press ``interaction`` is; None for any other interaction."""
    data = interaction.data
    if interaction.type is not discord.InteractionType.component or data is None:
        return None
    custom_id, channel_id = data.get("custom_id"), interaction.channel_id
    if not isinstance(custom_id, str) or channel_id is None:
        return None
    channel = interaction.channel or discord.Object(channel_id)
    where = await channels.where(interaction.guild_id, channel)
    return Press(where, interaction.id, interaction.user.id, read_button(custom_id))


def approval_view(request_id: str, asker: str | None) -> discord.ui.View:
    """Approve / Deny buttons for ``request_id``, naming ``asker`` (see the module docstring)."""
    view = discord.ui.View(timeout=None)
    approve = button_id(APPROVE, request_id, asker)
    deny = button_id(DENY, request_id, asker)
    view.add_item(
        discord.ui.Button(label="Approve", style=discord.ButtonStyle.success, custom_id=approve)
    )
    view.add_item(discord.ui.Button(label="Deny", style=discord.ButtonStyle.danger, custom_id=deny))
    view.stop()
    return view
