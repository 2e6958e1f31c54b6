"""A local stand-in for Slack: its Web API for the bot, its signed requests to the app,
and Socket Mode.

:class:`SlackApi` serves ``/api/<method>`` on 127.0.0.1 (JSON, form or query
parameters, the bot token as a bearer token — the app-level token for
``apps.connections.open``) and answers as Slack does: ``{"ok": true, …}`` or
``{"ok": false, "error": …}``. What stays true:

* ``chat.postMessage`` checks what Slack checks (a conversation that is not
  gone, some text, at most 40,000 characters, a section's text at most 3,000)
  and records the message; ``chat.update`` replaces a recorded message's
  text; ``chat.postEphemeral`` records what one user alone would see.
* :meth:`SlackApi.fail_next` makes the next call of a method fail with an
  HTTP status, an error and, for a 429, a ``Retry-After`` header.
* A method the stand-in does not implement gets ``unknown_method`` and is
  recorded in :attr:`SlackApi.unknown`, so a test can fail on it.
* ``apps.connections.open`` takes the app token alone (a bot token gets
  ``not_allowed_token_type``, anything else ``invalid_auth``) and answers
  the URL of the stand-in's Socket Mode WebSocket, ``/link/?ticket=…``; a
  connection without a ticket it issued is closed at once. A connection is
  greeted with ``hello``, as Slack does.
* Every envelope (:meth:`SlackApi.send_envelope`) is kept until the app
  acknowledges its ``envelope_id`` (recorded in :attr:`SlackApi.acks`): one
  sent while no connection is open, or not acknowledged when a connection
  ends, is sent again on the next connection, as Slack does.
  :meth:`SlackApi.drop` closes the connection (code 1011);
  :meth:`SlackApi.disconnect` sends a ``disconnect`` envelope.
* :meth:`SlackApi.share` hosts a file and gives its file object as a
  ``message`` event carries it; its ``url_private`` is served only with the
  bot token as a bearer token (anything else gets 403 and no content).

:class:`SlackRequests` is Slack's side of the app's Request URLs: it signs
events and interactions with the signing secret and posts them.
:class:`SlackSocket` sends the same events and interactions as Socket Mode
envelopes, each returned once the app acknowledged it.
"""

from __future__ import annotations

import asyncio
import contextlib
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
from urllib.parse import parse_qsl, quote, urlencode

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

BOT_USER = "UBOT0001"
BOT_ID = "BBOT0001"
APP_ID = "A0001"
TEXT_LIMIT = 40_000
SECTION_LIMIT = 3_000
WAIT = 20.0
"""How long the ``wait_for_…`` helpers wait (seconds)."""

Params = dict[str, Any]
Json = dict[str, Any]


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

    def __init__(
        self, token: str = "xoxb-stand-in-token", app_token: str = "xapp-1-A0001-1-stand-in"
    ) -> None:
        self.token = token
        self.app_token = app_token
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
        self.connections = 0
        """Socket Mode connections opened so far."""
        self.acks: list[str] = []
        """The envelope ids the app acknowledged, in order (one may repeat)."""
        self.envelopes: dict[str, Json] = {}
        """Every envelope sent, by envelope id."""
        self._socket: WebSocket | None = None
        self._tickets = itertools.count(1)
        self._issued: set[str] = set()
        self._envelope_ids = itertools.count(1)
        self._files: dict[str, bytes] = {}
        """File id → its content, served at its ``url_private``."""
        self._file_ids = itertools.count(1)
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
        routes = [
            Route("/api/{method}", self._endpoint, methods=["GET", "POST"]),
            WebSocketRoute("/link/", self._link),
            Route("/files-pri/{file}/{name}", self._file),
        ]
        app = Starlette(routes=routes)
        config = uvicorn.Config(app, lifespan="off", log_level="warning", ws="websockets-sansio")
        self._server = server = uvicorn.Server(config)
        self._task = asyncio.create_task(server.serve(sockets=[listening]))
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.drop()
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

    def delete(self, message: Message) -> None:
        """``message`` is deleted (by its reader, say): an edit of it is ``message_not_found``."""
        self._messages.remove(message)

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

    def share(
        self,
        name: str,
        mimetype: str,
        content: bytes = b"",
        *,
        size: int | None = None,
        **fields: Any,
    ) -> Json:
        """Host ``content`` as a file called ``name``: its file object, as Slack sends it in
        a ``message`` event's ``files`` (``size``: the size Slack reports, if not the
        content's; ``fields``: more of the object, such as ``subtype``)."""
        file_id = f"F{next(self._file_ids):08d}"
        self._files[file_id] = content
        url = f"http://127.0.0.1:{self.port}/files-pri/T0001-{file_id}/{quote(name, safe='')}"
        shown = {"id": file_id, "created": int(time.time()), "name": name, "title": name}
        shown |= {"mimetype": mimetype, "filetype": name.rpartition(".")[2], "user": "U0"}
        shown |= {"size": len(content) if size is None else size, "mode": "hosted"}
        shown |= {"is_external": False, "url_private": url, "url_private_download": url}
        return shown | fields

    # -- Socket Mode --------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        """Whether a Socket Mode connection is open."""
        return self._socket is not None

    @property
    def unacknowledged(self) -> list[str]:
        """The envelope ids sent but not acknowledged yet, oldest first."""
        return [envelope for envelope in self.envelopes if envelope not in self.acks]

    async def send_envelope(self, kind: str, payload: Json, **fields: Any) -> str:
        """An envelope of ``kind`` carrying ``payload``, sent now or on the next connection;
        its envelope id."""
        envelope_id = f"env-{next(self._envelope_ids):04d}"
        envelope = {"envelope_id": envelope_id, "type": kind, "payload": payload}
        self.envelopes[envelope_id] = envelope | {"accepts_response_payload": False, **fields}
        await self._send(self.envelopes[envelope_id])
        return envelope_id

    async def wait_for_ack(self, envelope_id: str) -> None:
        """Wait until the app acknowledged ``envelope_id``."""
        await self.wait_for(lambda: envelope_id in self.acks)

    async def wait_for_connections(self, count: int) -> None:
        """Wait until ``count`` connections were opened and one of them is open."""
        await self.wait_for(lambda: self.connections >= count and self.connected)

    async def drop(self) -> None:
        """Close the open connection, as Slack does when it fails (code 1011)."""
        socket, self._socket = self._socket, None
        if socket is not None:
            with contextlib.suppress(RuntimeError, WebSocketDisconnect):
                await socket.close(code=1011)
        self._notify()

    async def disconnect(self, reason: str = "refresh_requested") -> None:
        """Ask the app for a new connection, as Slack does before it closes one."""
        message = {"type": "disconnect", "reason": reason, "debug_info": {"host": "stand-in"}}
        await self._send(message)

    async def _send(self, message: Json) -> None:
        socket = self._socket
        if socket is not None:
            with contextlib.suppress(RuntimeError, WebSocketDisconnect):
                await socket.send_text(json.dumps(message))

    async def _link(self, socket: WebSocket) -> None:
        if socket.query_params.get("ticket") not in self._issued:
            await socket.close(code=1008)
            return
        await socket.accept()
        self._socket, self.connections = socket, self.connections + 1
        hello = {"type": "hello", "num_connections": 1, "connection_info": {"app_id": APP_ID}}
        await socket.send_text(json.dumps(hello | {"debug_info": {"host": "stand-in"}}))
        for envelope_id in self.unacknowledged:  # kept while no connection was open
            await socket.send_text(json.dumps(self.envelopes[envelope_id]))
        self._notify()
        try:
            while True:
                answer = json.loads(await socket.receive_text())
                self.acks.append(str(answer["envelope_id"]))
                self._notify()
        except (WebSocketDisconnect, RuntimeError):
            pass
        finally:
            if self._socket is socket:
                self._socket = None
            self._notify()

    async def _file(self, request: Request) -> Response:
        """A hosted file's content, for the bot token alone."""
        team_file = request.path_params["file"]
        content = self._files.get(team_file.partition("-")[2])
        if request.headers.get("authorization") != f"Bearer {self.token}":
            return Response("not signed in", status_code=403)
        if content is None:
            return Response("file not found", status_code=404)
        return Response(content, media_type="application/octet-stream")

    def _connections_open(self, params: Params) -> Response:
        ticket = f"ticket-{next(self._tickets)}"
        self._issued.add(ticket)
        return _ok(url=f"ws://127.0.0.1:{self.port}/link/?ticket={ticket}&app_id={APP_ID}")

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
        refusal = self._token_refusal(method, request.headers.get("authorization", ""))
        if refusal:
            return _error(refusal)
        failure = self._failures.get(method, {}).pop(self.calls.count(method), None)
        if failure is not None:
            return _error(*failure)
        handler = {
            "apps.connections.open": self._connections_open,
            "auth.test": self._auth_test,
            "chat.postMessage": self._post_message,
            "chat.update": self._update,
            "chat.postEphemeral": self._post_ephemeral,
        }.get(method)
        if handler is None:
            self.unknown.append(method)
            return _error("unknown_method")
        return handler(await _params(request))

    def _token_refusal(self, method: str, authorization: str) -> str:
        """Slack's error for the bearer token of a call to ``method`` ("" when it is the one)."""
        token = self.app_token if method == "apps.connections.open" else self.token
        if authorization == f"Bearer {token}":
            return ""
        if authorization in (f"Bearer {self.token}", f"Bearer {self.app_token}"):
            return "not_allowed_token_type"
        return "invalid_auth"

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


def event_callback(event: Json, event_id: str) -> Json:
    """``event`` as the Events API wraps it, over HTTP and in Socket Mode alike."""
    return {
        "token": "deprecated-verification-token",
        "team_id": "T0001",
        "api_app_id": APP_ID,
        "event": event,
        "type": "event_callback",
        "event_id": event_id,
        "event_time": int(time.time()),
    }


def message_event(
    channel: str, user: str, text: str, ts: str, channel_type: str, thread_ts: str | None
) -> Json:
    """A person's ``message`` event."""
    event = {"type": "message", "channel": channel, "user": user, "text": text, "ts": ts}
    event |= {"channel_type": channel_type, "event_ts": ts}
    if thread_ts is not None:
        event["thread_ts"] = thread_ts
    return event


def block_actions(user: str, message: Message, button: Json, number: int) -> Json:
    """The interaction payload of ``user`` pressing ``button`` under ``message``."""
    return {
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
        "trigger_id": f"trigger{number}",
        "response_url": "https://hooks.slack.invalid/actions/1",
        "actions": [
            {
                "action_id": button["action_id"],
                "block_id": "b1",
                "value": button.get("value"),
                "type": "button",
                "action_ts": f"1700000001.{number:06d}",
            }
        ],
    }


_TIMESTAMPS = itertools.count(1)
"""Message timestamps for every sender in this process: two apps fed by two senders (two
gateway processes, say) never see one ts name two messages."""


class EventSender:
    """What sends Slack's events to an app, over HTTP or Socket Mode: people's messages."""

    def __init__(self) -> None:
        self._events = itertools.count(1)

    def next_ts(self) -> str:
        """A message ts no earlier message had."""
        return f"1700000000.{next(_TIMESTAMPS):06d}"

    async def event(self, event: Json, event_id: str | None = None) -> object:
        """Send ``event``; returns once the app took it."""
        raise NotImplementedError

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
        """A person's message event; its ts, once the app took it."""
        ts = self.next_ts()
        await self.event(message_event(channel, user, text, ts, channel_type, thread_ts) | fields)
        return ts


class SlackRequests(EventSender):
    """What Slack sends to the app's Request URLs, signed with ``secret``, to ``base_url``."""

    def __init__(self, base_url: str, secret: str) -> None:
        super().__init__()
        self.secret = secret
        self.http = httpx.AsyncClient(base_url=base_url, timeout=WAIT)

    async def aclose(self) -> None:
        await self.http.aclose()

    async def post(
        self,
        path: str,
        body: bytes,
        *,
        content_type: str = "application/json",
        age: float = 0.0,
        secret: str | None = None,
        headers: dict[str, str | bytes] | None = None,
    ) -> httpx.Response:
        """``body`` posted to ``path``, signed ``age`` seconds ago (with ``secret``, if given)."""
        timestamp = str(int(time.time() - age))
        signed: dict[str, str | bytes] = {
            "Content-Type": content_type,
            "X-Slack-Request-Timestamp": timestamp,
            "X-Slack-Signature": signature(secret or self.secret, timestamp, body),
        }
        sent = [
            (name.encode(), value if isinstance(value, bytes) else value.encode())
            for name, value in (signed | (headers or {})).items()
        ]
        return await self.http.post(path, content=body, headers=sent)

    def envelope(self, event: Json, event_id: str | None = None) -> Json:
        """``event`` as the Events API wraps it."""
        return event_callback(event, event_id or f"Ev{next(self._events):08d}")

    async def event(
        self, event: Json, event_id: str | None = None, **options: Any
    ) -> httpx.Response:
        """Post ``event`` to ``/slack/events``; it must be answered 200."""
        body = json.dumps(self.envelope(event, event_id)).encode()
        response = await self.post("/slack/events", body, **options)
        assert response.status_code == 200, response.text
        return response

    async def press(
        self, user: str, message: Message, button: Json, **options: Any
    ) -> httpx.Response:
        """``user`` presses ``button`` under ``message``: posted to ``/slack/interactions``."""
        payload = block_actions(user, message, button, next(self._events))
        body = urlencode({"payload": json.dumps(payload)}).encode()
        form = "application/x-www-form-urlencoded"
        return await self.post("/slack/interactions", body, content_type=form, **options)


class SlackSocket(EventSender):
    """What Slack sends the app in Socket Mode, as envelopes over ``api``'s WebSocket.

    Each method returns once the app acknowledged its envelope (as
    :class:`SlackRequests`' return once the app answered).
    """

    def __init__(self, api: SlackApi) -> None:
        super().__init__()
        self.api = api

    async def event(self, event: Json, event_id: str | None = None, retry_attempt: int = 0) -> str:
        """An ``events_api`` envelope carrying ``event``; its envelope id, once acknowledged."""
        payload = event_callback(event, event_id or f"Ev{next(self._events):08d}")
        retry = {"retry_attempt": retry_attempt, "retry_reason": "timeout" if retry_attempt else ""}
        return await self._acknowledged("events_api", payload, **retry)

    async def press(self, user: str, message: Message, button: Json) -> str:
        """``user`` presses ``button`` under ``message``: an ``interactive`` envelope; its id,
        once acknowledged."""
        payload = block_actions(user, message, button, next(self._events))
        return await self._acknowledged("interactive", payload)

    async def _acknowledged(self, kind: str, payload: Json, **fields: Any) -> str:
        envelope_id = await self.api.send_envelope(kind, payload, **fields)
        await self.api.wait_for_ack(envelope_id)
        return envelope_id


def _shown(message: Message) -> Json:
    """``message`` as an interaction payload shows it."""
    shown: Json = {"type": "message", "ts": message.ts, "text": message.text}
    shown |= {"bot_id": BOT_ID, "user": BOT_USER, "blocks": message.blocks or []}
    if message.thread_ts is not None:
        shown["thread_ts"] = message.thread_ts
    return shown
