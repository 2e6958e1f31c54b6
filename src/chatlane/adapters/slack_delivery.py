"""Slack's side of the delivery ledger: one delivery sent, or the reason it was not.

What stays true:

* Every failure of ``chat.postMessage`` or ``chat.update`` is raised as the
  kind the delivery worker settles by (:mod:`chatlane.errors`):

  - rate limited (HTTP 429, ``ratelimited``) as :class:`~chatlane.errors.RateLimited`
    with Slack's ``Retry-After``;
  - a conversation the bot cannot post to (``channel_not_found``,
    ``not_in_channel``, ``is_archived``, ``account_inactive``) or any other
    refusal Slack answers with ``ok: false`` as :class:`~chatlane.errors.PermanentDelivery`;
  - a Web API that cannot be reached (the connection failed) or a bot token it
    no longer takes (``invalid_auth``, ``token_revoked`` …) as
    :class:`~chatlane.errors.PlatformUnavailable`, since nothing was sent;
  - a 5xx, a timeout or a connection lost after the request went out as a
    :class:`~chatlane.errors.TransientDelivery` that may have been sent.
* Slack cannot deduplicate a post, so a delivery that may have been sent
  before goes out again with :data:`~chatlane.delivery.ledger.RESENT_LABEL` in
  front (the adapter adds it). A long message goes out in parts; once one part
  went out, a failure of a later one counts as maybe sent (a refusal too: its
  dead letter, redelivered, is labelled), and a rate limit
  between parts is waited out in place, up to a cap for the whole message and never past the
  worker's deadline (:mod:`chatlane.adapters.waits`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Sequence
from typing import Any

import aiohttp
from slack_sdk.errors import SlackApiError
from slack_sdk.web.async_client import AsyncWebClient
from slack_sdk.web.async_slack_response import AsyncSlackResponse

from chatlane.adapters.waits import WaitBudget
from chatlane.errors import (
    ConfigError,
    DeliveryFailed,
    PermanentDelivery,
    PlatformUnavailable,
    RateLimited,
    TransientDelivery,
)
from chatlane.types import Target

__all__ = [
    "Parts",
    "bot_user",
    "checked",
    "classify",
    "post",
    "rate_limit_wait",
    "retry_after_seconds",
    "send_parts",
]

log = logging.getLogger("chatlane.adapters.slack")

TOKEN_REFUSED = frozenset({"invalid_auth", "not_authed", "token_revoked", "token_expired"})
"""Errors of a bot token the Web API no longer takes: nothing can be sent until it is fixed."""
SERVER_FAULTS = frozenset({"internal_error", "fatal_error", "service_unavailable"})
"""Errors Slack answers for its own failure: the message may have been posted."""
_NOT_SENT = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)
"""aiohttp failures that happen before a request leaves: nothing reached Slack."""
DEFAULT_RETRY_AFTER = 1.0
"""Seconds to wait on a 429 that names no ``Retry-After``."""

Blocks = Sequence[dict[str, Any]]


def classify(error: Exception, *, sent_before: bool = False) -> DeliveryFailed:
    """What ``error`` from the Web API means for the delivery.

    :param sent_before: an earlier part of the same delivery went out, so a
        re-send repeats it at least in part.
    """
    if not isinstance(error, SlackApiError):
        text = f"slack: {type(error).__name__}: {error}".rstrip(": ")
        if isinstance(error, _NOT_SENT) and not sent_before:
            return PlatformUnavailable(text)
        return TransientDelivery(text, maybe_sent=True)
    status, code = status_of(error), error_code(error)
    text = f"slack: {code or f'HTTP {status}'}"
    wait = rate_limit_wait(error)
    if wait is not None and not sent_before:
        return RateLimited(text, wait)
    if code in TOKEN_REFUSED and not sent_before:
        return PlatformUnavailable(text)
    if status >= 500 or wait is not None or code in SERVER_FAULTS or code in TOKEN_REFUSED:
        return TransientDelivery(text, maybe_sent=True)
    return PermanentDelivery(text, maybe_sent=sent_before)


def status_of(error: SlackApiError) -> int:
    """The HTTP status of the failed call (slack-sdk keeps it as ``status_code`` or ``status``)."""
    response = error.response
    status = getattr(response, "status_code", None) or getattr(response, "status", None)
    return status if isinstance(status, int) else 0


def error_code(error: SlackApiError) -> str:
    """Slack's ``error`` field (``channel_not_found``, ``ratelimited`` …), or ``""``."""
    data = getattr(error.response, "data", None)
    code = data.get("error") if isinstance(data, dict) else None
    return code if isinstance(code, str) else ""


def retry_after_seconds(error: SlackApiError) -> float:
    """The wait a 429 asks for (its ``Retry-After`` header), in seconds."""
    headers = getattr(error.response, "headers", None) or {}
    try:
        return max(float(headers.get("Retry-After", DEFAULT_RETRY_AFTER)), 0.0)
    except (TypeError, ValueError):
        return DEFAULT_RETRY_AFTER


class Parts:
    """One outbound message as Slack gets it: its parts, and buttons under the last one.

    ``draft_ts`` names a message already shown (a streamed draft): the first
    part replaces its text instead of being posted.
    """

    def __init__(
        self, target: Target, parts: list[str], blocks: Blocks | None, draft_ts: str | None = None
    ) -> None:
        self.target = target
        self.parts = parts
        self.blocks = blocks
        self.draft_ts = draft_ts


async def send_parts(
    client: AsyncWebClient, message: Parts, budget: WaitBudget, *, wait_first: bool = False
) -> None:
    """Send ``message``'s parts in order.

    A rate limit is waited out in place between parts, and before the first
    one too with ``wait_first`` (for a send outside the ledger, which has no
    later attempt), as long as ``budget`` allows (:mod:`chatlane.adapters.waits`).

    A draft that can no longer be edited (deleted, or past Slack's edit window)
    is let go: the first part is posted instead.

    :raises DeliveryFailed: the failure, classified (:func:`classify`).
    """
    for index, text in enumerate(message.parts):
        later = index > 0
        blocks = message.blocks if index == len(message.parts) - 1 else None
        while True:
            ts = message.draft_ts if index == 0 else None
            try:
                await _call(client, message.target, text, blocks, ts)
                break
            except SlackApiError as error:
                if ts is not None and error_code(error) in DRAFT_GONE:
                    log.info("slack: the draft %s is gone; the reply is posted anew", ts)
                    message.draft_ts = None
                    continue
                wait = rate_limit_wait(error)
                if wait is None or not (wait_first or later) or not budget.allows(wait):
                    raise classify(error, sent_before=later) from error
                log.info("slack rate limit: %s waits %gs", message.target.chat_id, wait)
                await asyncio.sleep(wait)  # in place: keep the parts in order
            except (aiohttp.ClientError, TimeoutError) as error:
                raise classify(error, sent_before=later) from error


DRAFT_GONE = frozenset({"message_not_found", "cant_update_message", "edit_window_closed"})
"""What ``chat.update`` answers for a message that cannot be edited any more."""


def rate_limit_wait(error: SlackApiError) -> float | None:
    """The seconds a rate-limited call asks to wait; None when it was not rate limited."""
    if status_of(error) == 429 or error_code(error) == "ratelimited":
        return retry_after_seconds(error)
    return None


async def post(client: AsyncWebClient, target: Target, text: str, *, ts: str | None = None) -> str:
    """Post ``text`` to ``target`` (or, with ``ts``, replace that message's text); its ``ts``.

    :raises DeliveryFailed: the failure, classified (:func:`classify`).
    """
    try:
        return await _call(client, target, text, None, ts)
    except (SlackApiError, aiohttp.ClientError, TimeoutError) as error:
        raise classify(error) from error


async def _call(
    client: AsyncWebClient, target: Target, text: str, blocks: Blocks | None, ts: str | None
) -> str:
    """``chat.postMessage`` (into the target's thread), or ``chat.update`` of ``ts``; the ts."""
    channel = target.chat_id or ""
    if ts is not None:
        await client.chat_update(channel=channel, ts=ts, text=text)
        return ts
    response = await client.chat_postMessage(
        channel=channel, text=text, thread_ts=target.thread_id, blocks=blocks
    )
    posted = response.get("ts")
    return posted if isinstance(posted, str) else ""


async def bot_user(client: AsyncWebClient, api_url: str) -> str:
    """The bot's own user id, from ``auth.test``: the check of the bot token at start.

    :raises ConfigError: the Web API rejected the token, failed or could not be reached.
    """
    identity = await checked(client.auth_test(), api_url, "bot token")
    user = identity.get("user_id")
    if not isinstance(user, str) or not user:
        raise ConfigError(f"the Slack Web API at {api_url} did not name the bot user (auth.test)")
    return user


async def checked(
    call: Awaitable[AsyncSlackResponse], api_url: str, token: str
) -> AsyncSlackResponse:
    """The answer to ``call``, a check of ``token`` (``"bot token"``, ``"app token"``) made
    at start; a failure is one line that names the Web API and Slack's reason, never the token.

    :raises ConfigError: the Web API rejected the token, failed or could not be reached.
    """
    try:
        return await call
    except SlackApiError as error:
        code = error_code(error)
        if code in TOKEN_REFUSED or code == "not_allowed_token_type":
            message = f"the Slack Web API at {api_url} rejected the {token} ({code})"
            raise ConfigError(message) from None
        reason = code or f"HTTP {status_of(error)}"
        raise ConfigError(f"the Slack Web API at {api_url} failed: {reason}") from None
    except (aiohttp.ClientError, TimeoutError) as error:
        reason = str(error) or type(error).__name__
        raise ConfigError(f"the Slack Web API at {api_url} failed: {reason}") from None
