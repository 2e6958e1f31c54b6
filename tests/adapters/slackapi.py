"""A local stand-in for Slack: its Web API for the bot, and its signed requests to the app.

:class:`SlackApi` serves ``/api/<method>`` on 127.0.0.1 (JSON, form or query
parameters, the bot token as a bearer token) and answers as Slack does:
``{"ok": true, …}`` or ``{"ok": false, "error": …}``. What stays true:

* ``chat.postMessage`` checks what Slack checks (a conversation that is not
  gone, some text, at most 40,000 characters, a section's text at most 3,000)
  and records the message; ``chat.update`` replaces a recorded message's
  text; ``chat.postEphemeral`` records what one user alone would see.
* :meth:`SlackApi.fail_next` makes the next call of a method fail with an
  HTTP status, an error and, for a 429, a ``Retry-After`` header.
* A method the stand-in does not implement gets ``unknown_method`` and is
  recorded in :attr:`SlackApi.unknown`, so a test can fail on it.

:class:`SlackRequests` is Slack's side of the app's Request URLs: it signs
events and interactions with the signing secret and posts them.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import itertools
import json
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Self
from urllib.parse import parse_qsl, urlencode

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

BOT_USER = "UBOT0001"
BOT_ID = "BBOT0001"
TEXT_LIMIT = 40_000
SECTION_LIMIT = 3_000
WAIT = 20.0
"""How long the ``wait_for_…`` helpers wait (seconds)."""

Params = dict[str, Any]


@dataclass
class Message:
    """One message the bot posted, as it reads now."""

    channel: str
    ts: str
    text: str
    thread_ts: str | None
    blocks: list[dict[str, Any]] | None
    edits: list[str] = field(default_factory=list)
    """Every text it had before the current one, oldest first."""

    def button(self, label: str) -> dict[str, Any]:
        """The button labelled ``label`` under the message."""
        for block in self.blocks or []:
            for element in block.get("elements", []):
                if element.get("text", {}).get("text") == label:
                    return dict(element)
        raise LookupError(f"no {label!r} button under {self.text!r}")


@dataclass(frozen=True)
class Ephemeral:
    """A message only ``user`` sees."""

    channel: str
    user: str
    text: str
    thread_ts: str | None


def _ok(**result: Any) -> Response:
    return JSONResponse({"ok": True, **result})


def _error(error: str, status: int = 200, retry_after: int | None = None) -> Response:
    headers = {} if retry_after is None else {"Retry-After": str(retry_after)}
    return JSONResponse({"ok": False, "error": error}, status_code=status, headers=headers)


async def _params(request: Request) -> Params:
    params: Params = dict(request.query_params)
    body = await request.body()
    if request.headers.get("content-type", "").startswith("application/json"):
        params.update(json.loads(body) if body else {})
    elif body:
        params.update(parse_qsl(body.decode(), keep_blank_values=True))
    return params


class SlackApi:
    """The Web API stand-in; ``async with SlackApi() as api:`` runs it on a free port."""

    def __init__(self, token: str = "xoxb-stand-in-token") -> None:
        self.token = token
        self.port = 0
        self.calls: list[str] = []
        self.unknown: list[str] = []
        self.ephemerals: list[Ephemeral] = []
        self.gone: set[str] = set()
        """Conversations that answer ``channel_not_found``."""
        self._messages: list[Message] = []
        self._failures: dict[str, dict[int, tuple[str, int, int | None]]] = {}
        """Method → the number of the call (counted from 1) that fails, and how."""
        self._ts = itertools.count(1)
        self._changed = asyncio.Event()
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        """The base URL, as ``slack.api_url`` expects it."""
        return f"http://127.0.0.1:{self.port}/api"

    async def __aenter__(self) -> Self:
        listening = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        listening.bind(("127.0.0.1", 0))
        listening.listen()  # connections wait in the backlog until uvicorn takes them
        self.port = listening.getsockname()[1]
        route = Route("/api/{method}", self._endpoint, methods=["GET", "POST"])
        config = uvicorn.Config(Starlette(routes=[route]), lifespan="off", log_level="warning")
        self._server = server = uvicorn.Server(config)
        self._task = asyncio.create_task(server.serve(sockets=[listening]))
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            await self._task

    # -- what tests call ------------------------------------------------------------

    def fail_next(
        self,
        method: str,
        error: str = "internal_error",
        status: int = 200,
        retry_after: int | None = None,
        *,
        after: int = 0,
    ) -> None:
        """Make the next call of ``method`` (or the one ``after`` calls later) fail with
        ``error``, HTTP ``status`` and, if given, a ``Retry-After`` header."""
        failures = self._failures.setdefault(method, {})
        number = self.calls.count(method) + 1 + after
        while number in failures:
            number += 1
        failures[number] = (error, status, retry_after)

    def messages(self, channel: str) -> list[Message]:
        """What the bot posted in ``channel`` (threads included), oldest first."""
        return [message for message in self._messages if message.channel == channel]

    def texts(self, channel: str) -> list[str]:
        """The texts of :meth:`messages`, as they read now."""
        return [message.text for message in self.messages(channel)]

    async def wait_for_messages(self, channel: str, count: int = 1) -> list[Message]:
        """Wait until the bot posted at least ``count`` messages in ``channel``; all of them."""
        await self.wait_for(lambda: len(self.messages(channel)) >= count)
        return self.messages(channel)

    async def wait_for_call(self, method: str, count: int = 1) -> None:
        """Wait until ``method`` was called at least ``count`` times."""
        await self.wait_for(lambda: self.calls.count(method) >= count)

    async def wait_for(self, done: Callable[[], bool]) -> None:
        """Wait until ``done()`` holds, checked after every call.

        :raises TimeoutError: after :data:`WAIT` seconds.
        """
        async with asyncio.timeout(WAIT):
            while not done():
                await self._changed.wait()

    # -- internals ------------------------------------------------------------------

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _endpoint(self, request: Request) -> Response:
        method = request.path_params["method"]
        self.calls.append(method)
        try:
            return await self._answer(method, request)
        finally:
            self._notify()

    async def _answer(self, method: str, request: Request) -> Response:
        if request.headers.get("authorization") != f"Bearer {self.token}":
            return _error("invalid_auth")
        failure = self._failures.get(method, {}).pop(self.calls.count(method), None)
        if failure is not None:
            return _error(*failure)
        handler = {
            "auth.test": self._auth_test,
            "chat.postMessage": self._post_message,
            "chat.update": self._update,
            "chat.postEphemeral": self._post_ephemeral,
        }.get(method)
        if handler is None:
            self.unknown.append(method)
            return _error("unknown_method")
        return handler(await _params(request))

    def _auth_test(self, params: Params) -> Response:
        return _ok(
            url="https://stand-in.slack.com/",
            team="Stand-in",
            user="chatlane",
            team_id="T0001",
            user_id=BOT_USER,
            bot_id=BOT_ID,
        )

    def _post_message(self, params: Params) -> Response:
        channel, text = str(params.get("channel", "")), str(params.get("text") or "")
        blocks = params.get("blocks")
        if isinstance(blocks, str):
            blocks = json.loads(blocks)
        refusal = self._refusal(channel, text, blocks)
        if refusal:
            return _error(refusal)
        ts = self._next_ts()
        thread = params.get("thread_ts") or None
        self._messages.append(Message(channel, ts, text, thread, blocks))
        return _ok(channel=channel, ts=ts, message={"text": text, "ts": ts, "bot_id": BOT_ID})

    def _refusal(self, channel: str, text: str, blocks: Any) -> str:
        if not channel or channel in self.gone:
            return "channel_not_found"
        if not text.strip() and not blocks:
            return "no_text"
        if len(text) > TEXT_LIMIT:
            return "msg_too_long"
        for block in blocks or []:
            if len(block.get("text", {}).get("text", "")) > SECTION_LIMIT:
                return "invalid_blocks"
        return ""

    def _update(self, params: Params) -> Response:
        channel, ts = str(params.get("channel", "")), str(params.get("ts", ""))
        text = str(params.get("text") or "")
        found = [m for m in self._messages if (m.channel, m.ts) == (channel, ts)]
        if not found:
            return _error("message_not_found")
        if not text.strip():
            return _error("no_text")
        found[0].edits.append(found[0].text)
        found[0].text = text
        return _ok(channel=channel, ts=ts, text=text)

    def _post_ephemeral(self, params: Params) -> Response:
        channel, user = str(params.get("channel", "")), str(params.get("user", ""))
        thread = params.get("thread_ts") or None
        self.ephemerals.append(Ephemeral(channel, user, str(params.get("text") or ""), thread))
        return _ok(message_ts=self._next_ts())

    def _next_ts(self) -> str:
        return f"1800000000.{next(self._ts):06d}"


def signature(secret: str, timestamp: str, body: bytes) -> str:
    """Slack's ``X-Slack-Signature`` of ``body`` sent at ``timestamp``."""
    base = b"v0:" + timestamp.encode() + b":" + body
    return "v0=" + hmac.new(secret.encode(), base, hashlib.sha256).hexdigest()


class SlackRequests:
    """What Slack sends to the app's Request URLs, signed with ``secret``, to ``base_url``."""

    def __init__(self, base_url: str, secret: str) -> None:
        self.secret = secret
        self.http = httpx.AsyncClient(base_url=base_url, timeout=WAIT)
        self._ts = itertools.count(1)
        self._events = itertools.count(1)

    async def aclose(self) -> None:
        await self.http.aclose()

    def next_ts(self) -> str:
        """A message ts no earlier message had."""
        return f"1700000000.{next(self._ts):06d}"

    async def post(
        self,
        path: str,
        body: bytes,
        *,
        content_type: str = "application/json",
        age: float = 0.0,
        secret: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> httpx.Response:
        """``body`` posted to ``path``, signed ``age`` seconds ago (with ``secret``, if given)."""
        timestamp = str(int(time.time() - age))
        signed = {
            "Content-Type": content_type,
            "X-Slack-Request-Timestamp": timestamp,
            "X-Slack-Signature": signature(secret or self.secret, timestamp, body),
        }
        return await self.http.post(path, content=body, headers=signed | (headers or {}))

    def envelope(self, event: dict[str, Any], event_id: str | None = None) -> dict[str, Any]:
        """``event`` as the Events API wraps it."""
        return {
            "token": "deprecated-verification-token",
            "team_id": "T0001",
            "api_app_id": "A0001",
            "event": event,
            "type": "event_callback",
            "event_id": event_id or f"Ev{next(self._events):08d}",
            "event_time": int(time.time()),
        }

    async def event(
        self, event: dict[str, Any], event_id: str | None = None, **options: Any
    ) -> httpx.Response:
        """Post ``event`` to ``/slack/events``; it must be answered 200."""
        body = json.dumps(self.envelope(event, event_id)).encode()
        response = await self.post("/slack/events", body, **options)
        assert response.status_code == 200, response.text
        return response

    async def message(
        self,
        channel: str,
        user: str,
        text: str,
        *,
        channel_type: str = "im",
        thread_ts: str | None = None,
        **fields: Any,
    ) -> str:
        """A person's message event; its ts."""
        ts = self.next_ts()
        event = {"type": "message", "channel": channel, "user": user, "text": text, "ts": ts}
        event |= {"channel_type": channel_type, "event_ts": ts, **fields}
        if thread_ts is not None:
            event["thread_ts"] = thread_ts
        await self.event(event)
        return ts

    async def press(
        self, user: str, message: Message, button: dict[str, Any], **options: Any
    ) -> httpx.Response:
        """``user`` presses ``button`` under ``message``: posted to ``/slack/interactions``."""
        payload = {
            "type": "block_actions",
            "user": {"id": user, "username": user.lower(), "team_id": "T0001"},
            "team": {"id": "T0001"},
            "channel": {"id": message.channel, "name": "somewhere"},
            "container": {
                "type": "message",
                "message_ts": message.ts,
                "channel_id": message.channel,
            },
            "message": _shown(message),
            "trigger_id": f"trigger{next(self._events)}",
            "response_url": "https://hooks.slack.invalid/actions/1",
            "actions": [
                {
                    "action_id": button["action_id"],
                    "block_id": "b1",
                    "value": button.get("value"),
                    "type": "button",
                    "action_ts": f"1700000001.{next(self._events):06d}",
                }
            ],
        }
        body = urlencode({"payload": json.dumps(payload)}).encode()
        form = "application/x-www-form-urlencoded"
        return await self.post("/slack/interactions", body, content_type=form, **options)


def _shown(message: Message) -> dict[str, Any]:
    """``message`` as an interaction payload shows it."""
    shown: dict[str, Any] = {"type": "message", "ts": message.ts, "text": message.text}
    shown |= {"bot_id": BOT_ID, "user": BOT_USER, "blocks": message.blocks or []}
    if message.thread_ts is not None:
        shown["thread_ts"] = message.thread_ts
    return shown
