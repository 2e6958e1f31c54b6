"""Discord's side of the delivery ledger: one delivery sent, or the reason it was not.

What stays true:

* Every failure of a send or an edit is raised as the kind the delivery
  worker settles by (:mod:`chatlane.errors`):

  - rate limited (HTTP 429 with ``retry_after``, longer than discord.py waits
    out in place) as :class:`~chatlane.errors.RateLimited`;
  - a channel the bot cannot post to (404 Unknown Channel, 403 Missing Access
    or Missing Permissions, a user who does not take DMs) and every other 4xx
    refusal as :class:`~chatlane.errors.PermanentDelivery`;
  - an API that cannot be reached (the connection failed) or a bot token it no
    longer takes (401) as :class:`~chatlane.errors.PlatformUnavailable`, since
    nothing was sent;
  - a 5xx (after discord.py's own retries), a timeout or a connection lost
    after the request went out as a :class:`~chatlane.errors.TransientDelivery`
    that may have been sent.
* Each part of a delivery carries a nonce made from the delivery's id, with
  ``enforce_nonce``: Discord answers a re-send within its window (a few
  minutes) with the message it already created instead of posting it again.
  Past that window a re-send may repeat, so the adapter labels it.
* A long message goes out in parts; once one part went out, a failure of a
  later one counts as maybe sent (a refusal too: its dead letter, redelivered,
  is labelled), and a rate limit between parts is waited
  out in place, up to a cap for the whole message and never past the
  worker's deadline (:mod:`chatlane.adapters.waits`).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from dataclasses import dataclass
from typing import Any

import aiohttp
import discord

from chatlane.adapters.waits import WaitBudget
from chatlane.errors import (
    DeliveryFailed,
    PermanentDelivery,
    PlatformUnavailable,
    RateLimited,
    TransientDelivery,
)

__all__ = ["Parts", "classify", "edit", "post", "send_parts"]

log = logging.getLogger("chatlane.adapters.discord")

DEFAULT_RETRY_AFTER = 1.0
"""Seconds to wait on a 429 that names no wait."""
NO_MENTIONS = discord.AllowedMentions.none()
"""Nothing chatlane sends pings anyone: an agent's ``@everyone`` or ``<@id>`` stays text."""
_NOT_SENT = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)
"""aiohttp failures that happen before a request leaves: nothing reached Discord."""


def classify(error: Exception, *, sent_before: bool = False) -> DeliveryFailed:
    """What ``error`` from the REST API means for the delivery.

    :param sent_before: an earlier part of the same delivery went out, so a
        re-send repeats it at least in part.
    """
    text = f"discord: {error}" if str(error) else f"discord: {type(error).__name__}"
    wait = rate_limit_wait(error)
    if wait is not None:
        return TransientDelivery(text, maybe_sent=True) if sent_before else RateLimited(text, wait)
    if isinstance(error, discord.HTTPException):
        if error.status == 401 and not sent_before:
            return PlatformUnavailable(text)
        if error.status >= 500 or error.status == 401:
            return TransientDelivery(text, maybe_sent=True)
        return PermanentDelivery(text, maybe_sent=sent_before)
    if isinstance(error, _NOT_SENT) and not sent_before:
        return PlatformUnavailable(text)
    return TransientDelivery(text, maybe_sent=True)


def rate_limit_wait(error: Exception) -> float | None:
    """The seconds a rate-limited request asks to wait; None when it was not rate limited."""
    if isinstance(error, discord.RateLimited):
        return max(error.retry_after, 0.0)
    if isinstance(error, discord.HTTPException) and error.status == 429:
        header = error.response.headers.get("Retry-After", DEFAULT_RETRY_AFTER)
        try:
            return max(float(header), 0.0)
        except ValueError:
            return DEFAULT_RETRY_AFTER
    return None


@dataclass(frozen=True, slots=True)
class Parts:
    """One outbound message as Discord gets it: its parts, and buttons under the last one.

    ``draft`` names a message already shown (a streamed draft): the first part
    replaces its text instead of being posted. ``delivery_id`` (the ledger's)
    makes each part's nonce.
    """

    channel: int
    parts: list[str]
    view: discord.ui.View | None = None
    draft: int | None = None
    delivery_id: str = ""

    def nonce(self, index: int) -> str | None:
        """Part ``index``'s nonce (25 characters at most, as Discord allows); None outside
        the ledger."""
        if not self.delivery_id:
            return None
        return hashlib.sha256(f"{self.delivery_id}:{index}".encode()).hexdigest()[:25]


async def send_parts(
    client: discord.Client, message: Parts, budget: WaitBudget, *, wait_first: bool = False
) -> None:
    """Send ``message``'s parts in order.

    A rate limit is waited out in place between parts, and before the first
    one too with ``wait_first`` (for a send outside the ledger, which has no
    later attempt), as long as ``budget`` allows (:mod:`chatlane.adapters.waits`).
    A draft that no longer exists (deleted) is let go: the first part is
    posted instead.

    :raises DeliveryFailed: the failure, classified (:func:`classify`).
    """
    draft = message.draft
    for index, text in enumerate(message.parts):
        later = index > 0
        view = message.view if index == len(message.parts) - 1 else None
        while True:
            shown = draft if index == 0 else None
            try:
                await _send_part(client, message, index, text, view, shown)
                break
            except (discord.DiscordException, aiohttp.ClientError, TimeoutError) as error:
                if shown is not None and _gone(error):
                    log.info("discord: the draft %s is gone; the reply is posted anew", shown)
                    draft = None
                    continue
                wait = rate_limit_wait(error)
                if wait is None or not (wait_first or later) or not budget.allows(wait):
                    raise classify(error, sent_before=later) from error
                log.info("discord rate limit: channel %s waits %gs", message.channel, wait)
                await asyncio.sleep(wait)  # in place: keep the parts in order


UNKNOWN_MESSAGE = 10008
"""Discord's error code for a message that does not exist (any more)."""


def _gone(error: BaseException) -> bool:
    """Whether ``error`` says the message edited does not exist any more."""
    return isinstance(error, discord.NotFound) and error.code == UNKNOWN_MESSAGE


async def _send_part(
    client: discord.Client,
    message: Parts,
    index: int,
    text: str,
    view: discord.ui.View | None,
    draft: int | None,
) -> None:
    """Part ``index``: an edit of ``draft`` if one is given, else posted."""
    if draft is not None:
        await _edit(client, message.channel, draft, text, view)
        return
    channel = client.get_partial_messageable(message.channel)
    await channel.send(text, **_options(view, nonce=message.nonce(index)))


async def post(client: discord.Client, channel: int, text: str) -> int:
    """Post ``text`` in ``channel`` (a channel, thread or DM); the message's id.

    :raises DeliveryFailed: the failure, classified (:func:`classify`).
    """
    try:
        sent = await client.get_partial_messageable(channel).send(
            text, allowed_mentions=NO_MENTIONS
        )
    except (discord.DiscordException, aiohttp.ClientError, TimeoutError) as error:
        raise classify(error) from error
    return sent.id


async def edit(client: discord.Client, channel: int, message: int, text: str) -> int:
    """Replace the text of the bot's ``message`` in ``channel``; its id.

    :raises DeliveryFailed: the failure, classified (:func:`classify`).
    """
    try:
        await _edit(client, channel, message, text, None)
    except (discord.DiscordException, aiohttp.ClientError, TimeoutError) as error:
        raise classify(error) from error
    return message


async def _edit(
    client: discord.Client, channel: int, message: int, text: str, view: discord.ui.View | None
) -> None:
    shown = client.get_partial_messageable(channel).get_partial_message(message)
    await shown.edit(content=text, **_options(view))


def _options(view: discord.ui.View | None, nonce: str | None = None) -> dict[str, Any]:
    """What a send or an edit passes besides the text: no pings, and the view and nonce
    when there are any."""
    options: dict[str, Any] = {"allowed_mentions": NO_MENTIONS}
    if view is not None:
        options["view"] = view
    if nonce is not None:
        options["nonce"] = nonce
    return options
