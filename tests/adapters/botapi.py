"""A local stand-in for the Telegram Bot API, enough for python-telegram-bot's long polling.

It serves ``/bot<token>/<method>`` on 127.0.0.1 (JSON or form bodies; PTB sends
form fields) and answers as the real API does: ``{"ok": true, "result": …}`` or
``{"ok": false, "error_code": …, "description": …}``. What stays true:

* ``getUpdates`` holds the request until an update is queued, the ``timeout``
  elapses or the stand-in closes; an update stays until a later ``offset``
  confirms it, so a cancelled poll loses nothing.
* ``sendMessage`` checks what Telegram checks (known chat, non-empty text, at
  most 4096 UTF-16 units) and records every accepted message.
* ``sendChatAction`` checks the chat and the action and records each one
  (:meth:`BotApi.actions`).
* A group upgraded to a supergroup (:meth:`BotApi.migrate`) answers every
  send with a 400 naming the new chat (``migrate_to_chat_id``), as Telegram
  does, and counts it (:meth:`BotApi.bounced`); :meth:`BotApi.upgrade` also
  queues the two service messages Telegram sends for it.
* Files are never served: a message with one (:meth:`BotApi.push_media`)
  carries its Bot API object, whose ``file_id`` chatlane only passes on.
* A method the stand-in does not implement gets a 400 naming it and is recorded
  in :attr:`BotApi.unknown`, so a test can fail on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self
from urllib.parse import parse_qsl

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

BOT_ID = 700000001
BOT_USERNAME = "chatlane_bot"
CHANNEL_BOT = 136817688
"""The placeholder ``from`` of every message sent on behalf of a channel."""
ANONYMOUS_ADMIN = 1087968824
"""The placeholder ``from`` of every message an anonymous group admin sends."""
MESSAGE_LIMIT = 4096
CAPTION_LIMIT = 1024
WAIT = 20.0
"""How long the ``wait_for_…`` helpers wait (seconds)."""
_INT_FIELDS = frozenset({"chat_id", "message_thread_id", "offset", "timeout", "limit"})
_MENTION = re.compile(r"(?<![\w@])@[A-Za-z][A-Za-z0-9_]{3,31}\b")
"""An ``@username`` as Telegram finds it in a message's text."""
_JSON_FIELDS = frozenset({"reply_markup", "allowed_updates", "reply_parameters", "entities"})

Params = dict[str, Any]
Method = Callable[[Params], Awaitable[Response]]


@dataclass(frozen=True)
class Sent:
    """One message the bot sent."""

    chat_id: int | str
    text: str
    thread_id: int | None
    message_id: int
    reply_markup: dict[str, Any] | None = None


@dataclass(frozen=True)
class Action:
    """One chat action the bot showed (``typing``, …)."""

    chat_id: int | str
    action: str
    thread_id: int | None


CHAT_ACTIONS = frozenset(
    [
        "typing",
        "upload_photo",
        "record_video",
        "upload_video",
        "record_voice",
        "upload_voice",
        "upload_document",
        "choose_sticker",
        "find_location",
        "record_video_note",
        "upload_video_note",
    ]
)
"""The actions ``sendChatAction`` takes."""


def utf16_len(text: str) -> int:
    """Telegram's length of ``text``: UTF-16 code units."""
    return len(text.encode("utf-16-le", "surrogatepass")) // 2


def _ok(result: object) -> Response:
    return Response(json.dumps({"ok": True, "result": result}), media_type="application/json")


def _error(
    status: int, description: str, retry_after: int | None = None, **parameters: int
) -> Response:
    body: dict[str, Any] = {"ok": False, "error_code": status, "description": description}
    if retry_after is not None:
        parameters["retry_after"] = retry_after
    if parameters:
        body["parameters"] = parameters
    return Response(json.dumps(body), status_code=status, media_type="application/json")


def _moved(chat: int) -> Response:
    upgraded = "Bad Request: group chat was upgraded to a supergroup chat"
    return _error(400, upgraded, migrate_to_chat_id=chat)


def _coerce(name: str, value: str) -> Any:
    """A form field as the Bot API reads it: ids as ints, structures as JSON, text as is."""
    if name in _INT_FIELDS:
        with contextlib.suppress(ValueError):
            return int(value)
    if name in _JSON_FIELDS:
        return json.loads(value)
    return value


async def _params(request: Request) -> Params:
    body = await request.body()
    if request.headers.get("content-type", "").startswith("application/json"):
        loaded: Params = json.loads(body) if body else {}
        return loaded
    fields = [*request.query_params.multi_items(), *parse_qsl(body.decode(), True)]
    return {name: _coerce(name, value) for name, value in fields}


def _found_entities(text: str) -> list[dict[str, Any]]:
    """The entities Telegram finds in ``text``: a leading command and each ``@username``."""
    found = []
    if text.startswith("/"):
        command = text.split()[0] if text.split() else text
        found.append({"type": "bot_command", "offset": 0, "length": utf16_len(command)})
    for match in _MENTION.finditer(text):
        offset = utf16_len(text[: match.start()])
        found.append({"type": "mention", "offset": offset, "length": utf16_len(match.group())})
    return found


def _user(user: int) -> dict[str, Any]:
    return {"id": user, "is_bot": False, "first_name": "User", "last_name": str(user)}


class BotApi:
    """The stand-in server; ``async with BotApi() as api:`` runs it on a free port."""

    def __init__(self, token: str = "123456:stand-in-token") -> None:
        self.token = token
        self.port = 0
        self.calls: list[str] = []
        self.unknown: list[str] = []
        self.answers: list[Params] = []
        self._sent: list[Sent] = []
        self._actions: list[Action] = []
        self._updates: list[dict[str, Any]] = []
        self._chats: dict[int | str, dict[str, Any]] = {}
        self._moved: dict[int | str, int] = {}
        self._bounced: list[int | str] = []
        self._failures: dict[str, dict[int, tuple[int, str, int | None]]] = {}
        """Failures to answer with, by method and the number of the call (from 1)."""
        self._update_ids = itertools.count(1000)
        self._message_ids = itertools.count(1)
        self._changed = asyncio.Event()
        self._closing = False
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        """The base URL, as ``telegram.api_url`` expects it."""
        return f"http://127.0.0.1:{self.port}"

    async def __aenter__(self) -> Self:
        route = Route("/bot{token}/{method}", self._endpoint, methods=["GET", "POST"])
        config = uvicorn.Config(
            Starlette(routes=[route]), host="127.0.0.1", port=0, lifespan="off", log_level="warning"
        )
        self._server = server = uvicorn.Server(config)
        self._task = task = asyncio.create_task(server.serve())
        while not server.started:
            if task.done():
                task.result()
            await asyncio.sleep(0.01)
        self.port = server.servers[0].sockets[0].getsockname()[1]
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._closing = True
        self._notify()
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            await self._task

    # -- what tests call ------------------------------------------------------------

    def push_text(
        self,
        chat: int,
        user: int,
        text: str,
        thread_id: int | None = None,
        chat_type: str = "private",
        sender_chat: int | None = None,
        reply_to: Sent | None = None,
        entities: list[dict[str, Any]] | None = None,
    ) -> int:
        """Queue a text message from ``user`` in ``chat``; its message id.

        Entities are found as Telegram finds them (a leading command, every
        ``@username``), with ``entities`` (text mentions …) added. With
        ``sender_chat`` the message is sent on behalf of that channel, as
        Telegram shows it: ``from`` is the placeholder ``user`` (such as
        :data:`CHANNEL_BOT`) and ``sender_chat`` the channel. With ``reply_to``
        it replies to that message of the bot.

        :raises ValueError: for a text Telegram would not accept (over 4096 UTF-16 units).
        """
        if utf16_len(text) > MESSAGE_LIMIT:
            raise ValueError("Telegram messages hold at most 4096 UTF-16 code units")
        fields: dict[str, Any] = {"text": text}
        found = [*_found_entities(text), *(entities or [])]
        if found:
            fields["entities"] = found
        if reply_to is not None:
            fields["reply_to_message"] = self._message(reply_to, self._chats[reply_to.chat_id])
        if sender_chat is not None:
            fields["sender_chat"] = {
                "id": sender_chat,
                "type": "channel",
                "title": f"Channel {sender_chat}",
            }
        return self.push_message(chat, user, fields, thread_id, chat_type)

    def push_message(
        self,
        chat: int,
        user: int,
        fields: dict[str, Any],
        thread_id: int | None = None,
        chat_type: str = "private",
    ) -> int:
        """Queue any message (``fields`` such as ``{"sticker": …}``); its message id."""
        message = {
            "message_id": next(self._message_ids),
            "date": int(time.time()),
            "chat": self._chat(chat, chat_type, forum=thread_id is not None),
            **fields,
        }
        if chat_type != "channel":
            message["from"] = _user(user)
        if thread_id is not None:
            message.update(message_thread_id=thread_id, is_topic_message=True)
        self._enqueue("channel_post" if chat_type == "channel" else "message", message)
        return int(message["message_id"])

    def push_media(
        self,
        chat: int,
        user: int,
        kind: str,
        media: Any,
        caption: str | None = None,
        thread_id: int | None = None,
        chat_type: str = "private",
    ) -> int:
        """Queue a message carrying a file (``kind``: ``photo``, ``document``, ``voice`` …,
        ``media`` its Bot API object) and ``caption``, whose entities are found as in a text.

        :raises ValueError: for a caption Telegram would not accept (over 1024 UTF-16 units).
        """
        fields: dict[str, Any] = {kind: media}
        if caption is not None:
            if utf16_len(caption) > CAPTION_LIMIT:
                raise ValueError("Telegram captions hold at most 1024 UTF-16 code units")
            fields["caption"] = caption
            found = _found_entities(caption)
            if found:
                fields["caption_entities"] = found
        return self.push_message(chat, user, fields, thread_id, chat_type)

    def push_button(self, user: int, data: str, sent: Sent) -> str:
        """Queue a press of an inline button under ``sent``; the callback query id."""
        query_id = f"cq{next(self._update_ids)}"
        message = self._message(sent, self._chats[sent.chat_id])
        query = {"id": query_id, "from": _user(user), "chat_instance": "1", "data": data}
        self._enqueue("callback_query", {**query, "message": message})
        return query_id

    def migrate(self, chat: int, to: int) -> None:
        """Upgrade the group ``chat`` to the supergroup ``to``: sends to ``chat`` fail."""
        self._chat(to, "supergroup", forum=False)
        self._moved[chat] = to

    def upgrade(self, chat: int, to: int, user: int) -> None:
        """Upgrade the group ``chat`` to the supergroup ``to`` as Telegram tells a bot:
        ``migrate_to_chat_id`` in the group, then ``migrate_from_chat_id`` in the
        supergroup, both from ``user`` (who upgraded it)."""
        self.migrate(chat, to)
        self.push_message(chat, user, {"migrate_to_chat_id": to}, chat_type="group")
        self.push_message(to, user, {"migrate_from_chat_id": chat}, chat_type="supergroup")

    def bounced(self, chat_id: int | str) -> int:
        """How many sends to ``chat_id`` were refused because the group was upgraded."""
        return self._bounced.count(chat_id)

    def fail_next(
        self,
        method: str,
        status: int = 500,
        description: str = "Internal",
        retry_after: int | None = None,
        *,
        after: int = 0,
    ) -> None:
        """Make the next call of ``method`` (or the one ``after`` calls later) fail with
        ``status`` (and ``retry_after``, for 429s)."""
        failures = self._failures.setdefault(method, {})
        number = self.calls.count(method) + 1 + after
        while number in failures:
            number += 1
        failures[number] = (status, description, retry_after)

    def sent(self, chat_id: int | str) -> list[Sent]:
        """What the bot sent to ``chat_id``, oldest first."""
        return [sent for sent in self._sent if sent.chat_id == chat_id]

    def actions(self, chat_id: int | str) -> list[Action]:
        """The chat actions shown in ``chat_id``, in order."""
        return [action for action in self._actions if action.chat_id == chat_id]

    async def wait_for_sent(self, chat_id: int | str, count: int = 1) -> list[Sent]:
        """Wait until the bot sent at least ``count`` messages to ``chat_id``; all of them.

        :raises TimeoutError: after :data:`WAIT` seconds.
        """
        await self._wait(lambda: len(self.sent(chat_id)) >= count, WAIT)
        return self.sent(chat_id)

    async def wait_for(self, done: Callable[[], bool]) -> None:
        """Wait until ``done()`` holds, checked after every request and update.

        :raises TimeoutError: after :data:`WAIT` seconds.
        """
        await self._wait(done, WAIT)

    async def wait_for_call(self, method: str, count: int = 1) -> None:
        """Wait until ``method`` was called at least ``count`` times.

        :raises TimeoutError: after :data:`WAIT` seconds.
        """
        await self._wait(lambda: self.calls.count(method) >= count, WAIT)

    # -- internals ------------------------------------------------------------------

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _wait(self, done: Callable[[], bool], seconds: float) -> None:
        async with asyncio.timeout(seconds):
            while not done() and not self._closing:
                await self._changed.wait()

    def _chat(self, chat: int, chat_type: str, forum: bool) -> dict[str, Any]:
        known = self._chats.get(chat, {})
        shape: dict[str, Any] = {"id": chat, "type": chat_type}
        if chat_type == "private":
            shape.update(first_name="User", last_name=str(chat))
        else:
            shape["title"] = f"Chat {chat}"
        if forum or known.get("is_forum"):
            shape["is_forum"] = True
        self._chats[chat] = shape
        return shape

    def _enqueue(self, kind: str, payload: dict[str, Any]) -> None:
        self._updates.append({"update_id": next(self._update_ids), kind: payload})
        self._notify()

    def _message(self, sent: Sent, chat: dict[str, Any]) -> dict[str, Any]:
        message: dict[str, Any] = {
            "message_id": sent.message_id,
            "date": int(time.time()),
            "chat": chat,
            "from": {"id": BOT_ID, "is_bot": True, "first_name": "Bot", "username": BOT_USERNAME},
            "text": sent.text,
        }
        if sent.thread_id is not None and chat.get("is_forum"):
            message.update(message_thread_id=sent.thread_id, is_topic_message=True)
        if sent.reply_markup is not None:
            message["reply_markup"] = sent.reply_markup
        return message

    async def _endpoint(self, request: Request) -> Response:
        if request.path_params["token"] != self.token:
            return _error(401, "Unauthorized")
        method = request.path_params["method"]
        self.calls.append(method)
        self._notify()
        failure = self._failures.get(method, {}).pop(self.calls.count(method), None)
        if failure is not None:
            return _error(*failure)
        handler = self._methods().get(method)
        if handler is None:
            self.unknown.append(method)
            return _error(400, f"Bad Request: method {method} is not implemented by the stand-in")
        return await handler(await _params(request))

    def _methods(self) -> dict[str, Method]:
        return {
            "getMe": self._get_me,
            "deleteWebhook": self._true,
            "getUpdates": self._get_updates,
            "sendMessage": self._send_message,
            "answerCallbackQuery": self._answer_callback_query,
            "sendChatAction": self._send_chat_action,
        }

    async def _get_me(self, params: Params) -> Response:
        return _ok(
            {"id": BOT_ID, "is_bot": True, "first_name": "Bot", "username": BOT_USERNAME}
            | {"can_join_groups": True, "can_read_all_group_messages": False}
            | {"supports_inline_queries": False}
        )

    async def _true(self, params: Params) -> Response:
        return _ok(True)

    async def _get_updates(self, params: Params) -> Response:
        offset = int(params.get("offset") or 0)
        if offset > 0:
            self._updates = [u for u in self._updates if u["update_id"] >= offset]
        with contextlib.suppress(TimeoutError):
            await self._wait(lambda: bool(self._updates), float(params.get("timeout") or 0))
        return _ok(self._updates[: int(params.get("limit") or 100)])

    async def _send_message(self, params: Params) -> Response:
        moved = self._moved.get(params.get("chat_id", ""))
        if moved is not None:
            self._bounced.append(params["chat_id"])
            return _moved(moved)
        chat = self._chats.get(params.get("chat_id", ""))
        text = str(params.get("text", ""))
        if chat is None:
            return _error(400, "Bad Request: chat not found")
        if not text.strip():
            return _error(400, "Bad Request: message text is empty")
        if utf16_len(text) > MESSAGE_LIMIT:
            return _error(400, "Bad Request: message is too long")
        thread = params.get("message_thread_id")
        sent = Sent(chat["id"], text, thread, next(self._message_ids), params.get("reply_markup"))
        self._sent.append(sent)
        self._notify()
        return _ok(self._message(sent, chat))

    async def _send_chat_action(self, params: Params) -> Response:
        moved = self._moved.get(params.get("chat_id", ""))
        if moved is not None:
            self._bounced.append(params["chat_id"])
            return _moved(moved)
        chat = self._chats.get(params.get("chat_id", ""))
        action = str(params.get("action", ""))
        if chat is None:
            return _error(400, "Bad Request: chat not found")
        if action not in CHAT_ACTIONS:
            return _error(400, "Bad Request: wrong parameter action in request")
        self._actions.append(Action(chat["id"], action, params.get("message_thread_id")))
        self._notify()
        return _ok(True)

    async def _answer_callback_query(self, params: Params) -> Response:
        self.answers.append(params)
        self._notify()
        return _ok(True)
