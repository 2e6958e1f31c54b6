"""Telegram's side of the delivery ledger: one delivery sent, or the reason it was not.

What stays true:

* Every failure of ``sendMessage`` is raised as the kind the delivery worker
  settles by (:mod:`chatlane.errors`): flood control (429) as
  :class:`~chatlane.errors.RateLimited` with Telegram's ``retry_after``; a
  blocked bot, a chat that is gone or any other 400/403 as
  :class:`~chatlane.errors.PermanentDelivery`; a Bot API that cannot be
  reached (connection refused, 502, 503, a rejected token) as
  :class:`~chatlane.errors.PlatformUnavailable`, since nothing was sent; a
  timeout or any other failure as a :class:`~chatlane.errors.TransientDelivery`
  that may have been sent.
* Telegram cannot deduplicate, so a delivery that may have been sent before
  goes out again with :data:`~chatlane.delivery.ledger.RESENT_LABEL` in front.
* A long message goes out in parts; once one part went out, a failure of a
  later one may leave the chat with part of it, so it counts as maybe sent
  (the re-send is labelled) — a refusal too: its dead letter, redelivered,
  is labelled. Flood control between parts is waited out in
  place, up to :data:`~chatlane.adapters.telegram.FLOOD_WAIT_CAP` seconds for
  the whole message and never past the worker's deadline
  (:mod:`chatlane.adapters.waits`).
* A send to a group that became a supergroup goes to the supergroup
  (:mod:`~chatlane.adapters.telegram_moves`). One the moves did not know yet
  is refused with the new id (``ChatMigrated``), having delivered nothing: that
  part and the rest go there, in the same topic, once (no chain of moves is
  followed), and the move is remembered. The ledger marks the delivery
  delivered, under the target it was recorded for.
"""

from __future__ import annotations

import asyncio
import json
import logging
import warnings
from datetime import timedelta
from http import HTTPStatus
from typing import Any

import httpx
from telegram import Bot, InlineKeyboardMarkup
from telegram.error import (
    BadRequest,
    ChatMigrated,
    Forbidden,
    InvalidToken,
    NetworkError,
    RetryAfter,
    TelegramError,
)
from telegram.request import HTTPXRequest

from chatlane.adapters.telegram_moves import ChatMoves
from chatlane.adapters.waits import WaitBudget
from chatlane.errors import (
    DeliveryFailed,
    PermanentDelivery,
    PlatformUnavailable,
    RateLimited,
    TransientDelivery,
)
from chatlane.types import Target

__all__ = [
    "ApiDown",
    "BotApiRequest",
    "NotJson",
    "SendRequest",
    "classify",
    "retry_after_seconds",
    "send_parts",
    "thread_of",
]

log = logging.getLogger("chatlane.adapters.telegram")

_NOT_SENT_CAUSES = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
"""httpx failures that happen before a request leaves: nothing reached Telegram."""
_DOWN_STATUSES = frozenset({502, 503})
"""Statuses of a Bot API that is down (a proxy in front of it says so): nothing was sent."""


def classify(error: TelegramError, *, sent_before: bool = False) -> DeliveryFailed:
    """What ``error`` from ``sendMessage`` means for the delivery.

    :param sent_before: an earlier part of the same delivery went out, so a
        re-send repeats it at least in part.
    """
    text = f"telegram: {error}"
    if isinstance(error, RetryAfter) and not sent_before:
        return RateLimited(text, retry_after_seconds(error))
    if isinstance(error, Forbidden | BadRequest | ChatMigrated):
        return PermanentDelivery(text, maybe_sent=sent_before)
    if not sent_before and _not_sent(error):
        return PlatformUnavailable(text)
    return TransientDelivery(text, maybe_sent=True)


def _not_sent(error: TelegramError) -> bool:
    """Whether ``error`` shows that the request never reached Telegram."""
    if isinstance(error, InvalidToken | ApiDown):
        return True
    return isinstance(error, NetworkError) and isinstance(error.__cause__, _NOT_SENT_CAUSES)


class ApiDown(NetworkError):
    """The Bot API (or the proxy in front of it) answered 502 or 503: nothing was sent."""


class NotJson(TelegramError):
    """The server at ``telegram.api_url`` answered something other than JSON: it is not a
    Bot API (a web server, a proxy's error page). ``code`` is its HTTP status, if known."""

    def __init__(self, code: int | None) -> None:
        self.code = code
        status = "" if code is None else f" (HTTP {_status(code)})"
        super().__init__(f"its answer is not JSON{status}: is that a Telegram Bot API server?")


def _status(code: int) -> str:
    try:
        return f"{code} {HTTPStatus(code).phrase}"
    except ValueError:
        return str(code)


class BotApiRequest(HTTPXRequest):
    """A connection to the Bot API that tells an answer that is not JSON in a few words
    (:class:`NotJson`), where python-telegram-bot would log the whole body with a
    traceback and quote it in its error."""

    @staticmethod
    def parse_json_payload(payload: bytes) -> dict[str, Any]:
        try:
            parsed: dict[str, Any] = json.loads(payload.decode("utf-8", "replace"))
        except ValueError:
            raise NotJson(None) from None
        return parsed

    @staticmethod
    def json_answer(code: int, payload: bytes) -> tuple[int, bytes]:
        """``code`` and ``payload`` as they came, if ``payload`` is a JSON object (every
        answer of the Bot API is one).

        :raises NotJson: it is not.
        """
        if not payload.lstrip().startswith(b"{"):
            raise NotJson(code)
        return code, payload


class SendRequest(BotApiRequest):
    """The bot's connection for everything but ``getUpdates``: tells a Bot API that is down.

    python-telegram-bot reports a 502 or 503 by its description alone, like
    any other failure; raised here as :class:`ApiDown`, it is known for what
    it is, so no attempt is spent on it.
    """

    async def do_request(self, *args: Any, **kwargs: Any) -> tuple[int, bytes]:
        code, payload = await super().do_request(*args, **kwargs)
        if code in _DOWN_STATUSES:
            raise ApiDown(f"the Bot API is unavailable ({code})")
        return self.json_answer(code, payload)


async def send_parts(
    bot: Bot,
    target: Target,
    parts: list[str],
    buttons: InlineKeyboardMarkup | None,
    budget: WaitBudget,
    moves: ChatMoves,
    *,
    wait_first: bool = False,
) -> None:
    """Send ``parts`` in order (``buttons`` under the last), to the supergroup a group
    became if ``moves`` know it.

    Flood control is waited out in place between parts, and before the first
    one too with ``wait_first`` (for a send outside the ledger, which has no
    later attempt), as long as ``budget`` allows. A group that became a
    supergroup unknown to ``moves`` is followed, once: the part refused and the
    rest go to the chat Telegram names, in the same topic, and ``moves`` learn it.

    :raises DeliveryFailed: the failure, classified (:func:`classify`).
    """
    chat: int | str = moves.destination(target.chat_id or "")
    thread = thread_of(target)
    moved = False
    for index, part in enumerate(parts):
        markup = buttons if index == len(parts) - 1 else None
        later = index > 0
        while True:
            try:
                await bot.send_message(
                    chat_id=chat, text=part, message_thread_id=thread, reply_markup=markup
                )
                break
            except ChatMigrated as error:
                if moved:  # a chat moves once: no chain of moves is followed
                    raise classify(error, sent_before=later) from error
                moves.follow(str(chat), error.new_chat_id)
                chat, moved = error.new_chat_id, True
            except RetryAfter as error:
                seconds = retry_after_seconds(error)
                if not (wait_first or later) or not budget.allows(seconds):
                    raise classify(error, sent_before=later) from error
                log.info("telegram flood control: chat %s waits %gs", chat, seconds)
                await asyncio.sleep(seconds)  # in place: keep the parts in order
            except TelegramError as error:
                raise classify(error, sent_before=later) from error


def thread_of(target: Target) -> int | None:
    """The forum topic of ``target`` as Telegram's ``message_thread_id``."""
    thread = target.thread_id
    return int(thread) if thread is not None and thread.lstrip("-").isdigit() else None


def retry_after_seconds(error: RetryAfter) -> float:
    """The wait a 429 asks for, in seconds (python-telegram-bot gives an int or a timedelta)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the int form is deprecated in favour of timedelta
        value = error.retry_after
    seconds = value.total_seconds() if isinstance(value, timedelta) else float(value)
    return max(seconds, 0.0)
