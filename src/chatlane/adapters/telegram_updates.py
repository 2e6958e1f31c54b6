"""Telegram's ``getUpdates`` connection: an update is confirmed only once handled, and one
python-telegram-bot cannot read is reduced to its id (see :class:`UpdatesRequest`)."""

from __future__ import annotations

import asyncio
import copy
import json
import logging
from typing import Any

from telegram import Update

from chatlane.adapters.telegram_delivery import BotApiRequest

__all__ = ["UpdatesRequest", "readable_updates"]

log = logging.getLogger("chatlane.adapters.telegram")


class UpdatesRequest(BotApiRequest):
    """The ``getUpdates`` connection: an update is confirmed only once handled, and an
    update PTB cannot read is reduced to its id.

    Each ``getUpdates`` names the offset past the last update fetched, which
    tells Telegram never to send those again; PTB asks for the next batch as
    soon as it has queued the last one for its handlers. So a call waits
    until every update in ``updates`` was handled — its message stored by the
    hub, or refused, or its sender told it could not be — and an update
    fetched before a crash is still Telegram's to send again at the next start
    (where its message id makes it a repeat, not a second turn).

    PTB reads a whole batch or nothing, and fetches an unreadable batch again
    forever (a newer Bot API field, a malformed payload): polling would stall
    and spin. Reduced to ``{"update_id": …}``, the update is logged, confirmed
    and ignored, and the rest of the batch is handled.
    """

    def __init__(self, updates: asyncio.Queue[object], **options: Any) -> None:
        super().__init__(**options)
        self._updates = updates

    async def do_request(self, *args: Any, **kwargs: Any) -> tuple[int, bytes]:
        await self._updates.join()
        code, payload = self.json_answer(*await super().do_request(*args, **kwargs))
        return code, (readable_updates(payload) if code == 200 else payload)


def readable_updates(payload: bytes) -> bytes:
    """A ``getUpdates`` response with every unreadable update reduced to its id."""
    try:
        body = json.loads(payload)
        updates = body["result"]
    except (ValueError, TypeError, KeyError):
        return payload
    if not isinstance(updates, list):
        return payload
    body["result"] = [_readable(update) for update in updates]
    return json.dumps(body).encode()


def _readable(update: Any) -> Any:
    try:
        Update.de_json(copy.deepcopy(update), None)
    except (ValueError, TypeError, KeyError, AttributeError) as error:
        if not isinstance(update, dict) or not isinstance(update.get("update_id"), int):
            return update
        log.warning("skipped Telegram update %s: cannot read it (%s)", update["update_id"], error)
        return {"update_id": update["update_id"]}
    return update
