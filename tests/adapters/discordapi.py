"""A local stand-in for Discord: the REST API a bot calls, and the gateway it listens on.

:class:`DiscordApi` serves, on 127.0.0.1, the REST routes under ``/api/v10``
that discord.py calls for the adapter (``/users/@me``, ``/oauth2/applications/@me``,
``/gateway/bot``, ``/channels/{id}``, messages create and edit, typing,
interaction callbacks) with the bot token as ``Authorization: Bot …``, and the
gateway as a WebSocket at ``/gateway/`` speaking Discord's protocol: HELLO
(op 10), IDENTIFY (op 2) answered by READY and a GUILD_CREATE per server,
HEARTBEAT (op 1) answered by HEARTBEAT_ACK (op 11), RESUME (op 6) answered by
the events missed since the sequence it names and RESUMED, dispatches
(op 0) such as MESSAGE_CREATE and INTERACTION_CREATE. What stays true:

* Every dispatch is numbered and kept: one made while no connection is open
  is sent when the bot resumes, as Discord does; :meth:`DiscordApi.drop`
  closes the connection abruptly, so the bot must reconnect and resume.
* Creating a message checks what Discord checks (a channel that exists and the
  bot may post in, some content or components, at most 2,000 characters) and
  records it; a nonce with ``enforce_nonce`` seen before returns the message
  it made instead of a new one; an edit replaces a recorded message's text.
* A message a person writes (:meth:`DiscordApi.say`) lists in ``mentions``
  the users its text mentions as Discord finds them (:func:`mentioned`): not
  one quoted in code or escaped with a backslash.
* :meth:`DiscordApi.fail_next` makes the next call of a route fail with an
  HTTP status and Discord's error body; a 429 carries ``retry_after`` in its
  body and ``Retry-After`` and ``Via`` headers, as Discord's do.
* A route the stand-in does not implement gets 404 and is recorded in
  :attr:`DiscordApi.unknown`, so a test can fail on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import re
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Self
from urllib.parse import quote

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

TOKEN = "stand-in.bot.token"
BOT_ID = 900000000000000001
APP_ID = 900000000000000002
GUILD = 910000000000000001
OTHER_GUILD = 910000000000000002
GENERAL = 920000000000000001
RANDOM = 920000000000000002
ELSEWHERE = 920000000000000003
"""A channel of :data:`OTHER_GUILD`."""
THREAD = 930000000000000001
"""A thread of :data:`GENERAL`, known from the start (in GUILD_CREATE)."""
TEXT_LIMIT = 2000
MESSAGE_CONTENT = 1 << 15
"""The privileged Message Content intent's bit."""
WAIT = 20.0
"""How long the ``wait_for…`` helpers wait (seconds)."""

Json = dict[str, Any]
_ROUTES: list[tuple[str, str, re.Pattern[str]]] = [
    (method, name, re.compile(f"^/api/v10{path}$"))
    for method, name, path in [
        ("GET", "users.me", "/users/@me"),
        ("GET", "applications.me", "/oauth2/applications/@me"),
        ("GET", "gateway.bot", "/gateway/bot"),
        ("GET", "channels.get", r"/channels/(?P<channel>\d+)"),
        ("POST", "messages.create", r"/channels/(?P<channel>\d+)/messages"),
        ("PATCH", "messages.edit", r"/channels/(?P<channel>\d+)/messages/(?P<message>\d+)"),
        ("POST", "typing", r"/channels/(?P<channel>\d+)/typing"),
        ("POST", "interactions.callback", r"/interactions/(?P<id>\d+)/(?P<token>[^/]+)/callback"),
    ]
]


def user(user_id: int, name: str = "", *, bot: bool = False) -> Json:
    """A user object."""
    shown = name or f"user{user_id % 1000}"
    made = {"id": str(user_id), "username": shown, "discriminator": "0", "global_name": None}
    return made | {"avatar": None, "bot": bot}


BOT_USER = user(BOT_ID, "chatlane", bot=True)
_CODE = re.compile(r"```.*?```|``.+?``|`[^`]+`", re.DOTALL)
_MENTION = re.compile(r"(?<!\\)<@!?([0-9]+)>")
"""A user's mention not escaped (an escaped backslash before it is beyond the stand-in)."""


def mentioned(content: str) -> list[Json]:
    """The users ``content`` mentions, as a message's ``mentions`` lists them: once each,
    none in a code block or span, none escaped with a backslash."""
    ids = dict.fromkeys(_MENTION.findall(_CODE.sub("", content)))
    return [BOT_USER if int(found) == BOT_ID else user(int(found)) for found in ids]


def message(
    message_id: int,
    channel: int,
    author: Json,
    content: str,
    guild: int | None = None,
    **fields: Any,
) -> Json:
    """A message object as the gateway and the API send it."""
    made: Json = {
        "id": str(message_id),
        "channel_id": str(channel),
        "author": author,
        "content": content,
        "timestamp": "2026-01-01T00:00:00.000000+00:00",
        "edited_timestamp": None,
        "tts": False,
        "mention_everyone": False,
        "mentions": [],
        "mention_roles": [],
        "attachments": [],
        "embeds": [],
        "pinned": False,
        "type": 0,
        "components": [],
    }
    if guild is not None:
        made["guild_id"] = str(guild)
    return made | fields


VOICE_FLAG = 1 << 13
"""A message's flag saying it is a voice message."""
_attachment_ids = itertools.count(940000000000000001)


def attachment(
    channel: int, filename: str, size: int, content_type: str | None = None, **fields: Any
) -> Json:
    """An attachment object as a message carries it: its CDN URL signed, as Discord's are."""
    attachment_id = next(_attachment_ids)
    path = f"attachments/{channel}/{attachment_id}/{quote(filename, safe='')}"
    signed = "?ex=6a000000&is=69f00000&hm=0123456789abcdef&"
    made: Json = {"id": str(attachment_id), "filename": filename, "size": size}
    made |= {"url": f"https://cdn.discordapp.com/{path}{signed}"}
    made |= {"proxy_url": f"https://media.discordapp.net/{path}{signed}"}
    if content_type is not None:
        made["content_type"] = content_type
    return made | fields


def voice_note(channel: int, size: int) -> Json:
    """The fields of a voice message recorded in Discord: its flag and its one file."""
    recording = attachment(channel, "voice-message.ogg", size, "audio/ogg")
    recording |= {"duration_secs": 2.5, "waveform": "AAAAAAAA", "flags": 0}
    return {"flags": VOICE_FLAG, "attachments": [recording]}


@dataclass
class Posted:
    """One message the bot posted, as it reads now."""

    id: int
    channel: int
    text: str
    components: list[Json]
    nonce: str | None
    allowed_mentions: Json | None = None
    edits: list[str] = field(default_factory=list)
    """Every text it had before the current one, oldest first."""

    def button(self, label: str) -> Json:
        """The button labelled ``label`` under the message."""
        for row in self.components:
            for item in row.get("components", []):
                if item.get("label") == label:
                    return dict(item)
        raise LookupError(f"no {label!r} button under {self.text!r}")


@dataclass(frozen=True)
class Failure:
    status: int
    body: Json
    retry_after: float | None = None


class DiscordApi:
    """The stand-in; ``async with DiscordApi() as api:`` runs it on a free port."""

    def __init__(self, token: str = TOKEN, *, privileged: bool = True) -> None:
        self.token = token
        self.privileged = privileged
        """Whether the bot may have the Message Content intent (else: close 4014)."""
        self.port = 0
        self.calls: list[str] = []
        self.unknown: list[str] = []
        self.channels: dict[int, Json] = {}
        self.forbidden: set[int] = set()
        """Channels the bot may not post in (403 Missing Access)."""
        self.posted: list[Posted] = []
        self.answers: list[tuple[int, Json]] = []
        """Interaction callbacks: the interaction's id and the answer."""
        self.identified: list[Json] = []
        """Every IDENTIFY's payload."""
        self.resumed = 0
        self.refuse_resume = False
        """Refuse the next RESUME (op 9, not resumable), as for a session Discord dropped."""
        self.sessions = 0
        self._failures: dict[str, dict[int, Failure]] = {}
        self._ids = itertools.count(940000000000000001)
        self._dispatched: list[Json] = []
        self._socket: WebSocket | None = None
        self._session = ""
        self._changed = asyncio.Event()
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None
        self._add_guilds()

    @property
    def url(self) -> str:
        """The REST API's base, as ``discord.api_url`` expects it."""
        return f"http://127.0.0.1:{self.port}/api/v10"

    @property
    def gateway(self) -> str:
        return f"ws://127.0.0.1:{self.port}/gateway/"

    async def __aenter__(self) -> Self:
        listening = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        self.port = listening.getsockname()[1]
        routes = [
            Route(
                "/{path:path}", self._endpoint, methods=["GET", "POST", "PATCH", "DELETE", "PUT"]
            ),
        ]
        app = Starlette(routes=[WebSocketRoute("/gateway/", self._gateway), *routes])
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

    @property
    def connected(self) -> bool:
        """Whether the bot's gateway connection is open (identified or resumed)."""
        return self._socket is not None

    def new_id(self) -> int:
        """A snowflake no other object of the stand-in has."""
        return next(self._ids)

    def dm_channel(self, user_id: int) -> int:
        """The DM channel between the bot and ``user_id`` (made on first use)."""
        for channel_id, channel in self.channels.items():
            if channel["type"] == 1 and channel["recipients"][0]["id"] == str(user_id):
                return channel_id
        channel_id = self.new_id()
        self.channels[channel_id] = {
            "id": str(channel_id),
            "type": 1,
            "recipients": [user(user_id)],
            "last_message_id": None,
            "flags": 0,
        }
        return channel_id

    async def thread(self, parent: int, *, announce: bool = True) -> int:
        """A new public thread of ``parent``; announced with THREAD_CREATE unless not."""
        thread_id = self.new_id()
        guild = int(self.channels[parent]["guild_id"])
        self.channels[thread_id] = _thread(thread_id, parent, guild)
        if announce:
            await self.dispatch("THREAD_CREATE", self.channels[thread_id] | {"newly_created": True})
        return thread_id

    def fail_next(
        self,
        route: str,
        status: int,
        code: int = 0,
        text: str = "failed",
        *,
        retry_after: float | None = None,
        after: int = 0,
    ) -> None:
        """Make the next call of ``route`` (or the one ``after`` calls later) fail."""
        body: Json = {"message": text, "code": code}
        if retry_after is not None:
            body |= {"retry_after": retry_after, "global": False}
        failures = self._failures.setdefault(route, {})
        number = self.calls.count(route) + 1 + after
        while number in failures:
            number += 1
        failures[number] = Failure(status, body, retry_after)

    def unannounced_channel(self, guild: int, name: str) -> int:
        """A text channel of ``guild``, a server the bot was never sent (no ``GUILD_CREATE``:
        not in discord.py's cache); its id."""
        channel = self.new_id()
        self.channels[channel] = _text_channel(channel, guild, name)
        return channel

    async def say(
        self,
        channel: int,
        author_id: int,
        content: str,
        *,
        bot: bool = False,
        system: bool = False,
        **fields: Any,
    ) -> int:
        """``author_id`` writes ``content`` in ``channel``: a MESSAGE_CREATE (its ``mentions``
        found in ``content`` unless ``fields`` name them); its id. ``system``: the author
        is Discord's own system user."""
        message_id = self.new_id()
        guild = self.channels[channel].get("guild_id")
        payload = message(
            message_id,
            channel,
            user(author_id, bot=bot) | ({"system": True} if system else {}),
            content,
            None if guild is None else int(guild),
            **({"mentions": mentioned(content)} | fields),
        )
        await self.dispatch("MESSAGE_CREATE", payload)
        return message_id

    async def press(self, user_id: int, shown: Posted, button: Json) -> int:
        """``user_id`` presses ``button`` under ``shown``: an INTERACTION_CREATE; its id."""
        interaction = self.new_id()
        channel = self.channels[shown.channel]
        data: Json = {
            "id": str(interaction),
            "application_id": str(APP_ID),
            "type": 3,
            "data": {"custom_id": button["custom_id"], "component_type": 2},
            "token": f"interaction-token-{interaction}",
            "version": 1,
            "channel_id": str(shown.channel),
            "channel": channel,
            "message": message(shown.id, shown.channel, BOT_USER, shown.text),
            "attachment_size_limit": 8388608,
            "app_permissions": "0",
            "locale": "en-US",
            "entitlements": [],
            "authorizing_integration_owners": {},
        }
        guild = channel.get("guild_id")
        if guild is None:
            data |= {"user": user(user_id), "context": 1}
        else:
            member: Json = {"user": user(user_id), "roles": [], "joined_at": None, "flags": 0}
            data |= {"guild_id": guild, "member": member | {"deaf": False, "permissions": "0"}}
            data |= {"context": 0, "guild_locale": "en-US"}
        await self.dispatch("INTERACTION_CREATE", data)
        return interaction

    async def dispatch(self, event: str, data: Json) -> None:
        """Send ``event`` now if the bot is connected, else when it resumes."""
        entry = {"op": 0, "t": event, "s": len(self._dispatched) + 1, "d": data}
        self._dispatched.append(entry)
        socket = self._socket
        if socket is not None:
            with contextlib.suppress(RuntimeError, WebSocketDisconnect):
                await socket.send_text(json.dumps(entry))

    async def drop(self) -> None:
        """Close the gateway connection as a network failure would (no close frame reason)."""
        socket, self._socket = self._socket, None
        if socket is not None:
            with contextlib.suppress(RuntimeError, WebSocketDisconnect):
                await socket.close(code=1011)
        self._notify()

    def messages(self, channel: int) -> list[Posted]:
        """What the bot posted in ``channel``, oldest first."""
        return [posted for posted in self.posted if posted.channel == channel]

    def delete(self, posted: Posted) -> None:
        """``posted`` is deleted (by a moderator, say): an edit of it is 404 Unknown Message."""
        self.posted.remove(posted)

    def texts(self, channel: int) -> list[str]:
        return [posted.text for posted in self.messages(channel)]

    async def wait_for_messages(self, channel: int, count: int = 1) -> list[Posted]:
        """Wait until the bot posted at least ``count`` messages in ``channel``; all of them."""
        await self.wait_for(lambda: len(self.messages(channel)) >= count)
        return self.messages(channel)

    async def wait_for(self, done: Callable[[], bool]) -> None:
        """Wait until ``done()`` holds, checked after every call and gateway message.

        :raises TimeoutError: after :data:`WAIT` seconds.
        """
        async with asyncio.timeout(WAIT):
            while not done():
                await self._changed.wait()

    # -- the gateway ------------------------------------------------------------------

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _gateway(self, socket: WebSocket) -> None:
        await socket.accept()
        await socket.send_text(json.dumps({"op": 10, "d": {"heartbeat_interval": 41250}}))
        try:
            while True:
                payload = json.loads(await socket.receive_text())
                await self._opcode(socket, payload.get("op"), payload.get("d"))
                self._notify()
        except (WebSocketDisconnect, RuntimeError):
            pass
        finally:
            if self._socket is socket:
                self._socket = None
            self._notify()

    async def _opcode(self, socket: WebSocket, op: int, data: Any) -> None:
        if op == 1:
            await socket.send_text(json.dumps({"op": 11}))
        elif op == 2:
            await self._identify(socket, data)
        elif op == 6:
            await self._resume(socket, data)

    async def _identify(self, socket: WebSocket, data: Json) -> None:
        self.identified.append(data)
        if data.get("token") != self.token:
            await socket.close(code=4004)
            return
        if data.get("intents", 0) & MESSAGE_CONTENT and not self.privileged:
            await socket.close(code=4014)
            return
        self.sessions += 1
        self._session = f"session-{self.sessions}"
        self._socket = socket
        guilds = sorted({int(c["guild_id"]) for c in self.channels.values() if "guild_id" in c})
        await self.dispatch(
            "READY",
            {
                "v": 10,
                "user": BOT_USER,
                "guilds": [{"id": str(g), "unavailable": True} for g in guilds],
                "session_id": self._session,
                "resume_gateway_url": self.gateway,
                "application": {"id": str(APP_ID), "flags": 0},
            },
        )
        for guild in guilds:
            await self.dispatch("GUILD_CREATE", self._guild(guild))

    async def _resume(self, socket: WebSocket, data: Json) -> None:
        refused, self.refuse_resume = self.refuse_resume, False
        if refused or data.get("token") != self.token or data.get("session_id") != self._session:
            await socket.send_text(json.dumps({"op": 9, "d": False}))
            return
        self.resumed += 1
        for entry in self._dispatched[int(data.get("seq") or 0) :]:
            await socket.send_text(json.dumps(entry))
        self._socket = socket
        await self.dispatch("RESUMED", {})

    def _guild(self, guild: int) -> Json:
        mine = [c for c in self.channels.values() if c.get("guild_id") == str(guild)]
        return {
            "id": str(guild),
            "name": f"server {guild % 1000}",
            "owner_id": "1",
            "unavailable": False,
            "member_count": 3,
            "roles": [{"id": str(guild), "name": "@everyone", "permissions": "0", "position": 0}],
            "channels": [c for c in mine if c["type"] != 11],
            "threads": [c for c in mine if c["type"] == 11],
            "members": [],
            "emojis": [],
            "stickers": [],
            "features": [],
            "stage_instances": [],
            "guild_scheduled_events": [],
            "soundboard_sounds": [],
            "voice_states": [],
            "presences": [],
        }

    def _add_guilds(self) -> None:
        for guild, channel, name in (
            (GUILD, GENERAL, "general"),
            (GUILD, RANDOM, "random"),
            (OTHER_GUILD, ELSEWHERE, "elsewhere"),
        ):
            self.channels[channel] = _text_channel(channel, guild, name)
        self.channels[THREAD] = _thread(THREAD, GENERAL, GUILD)

    # -- the REST API -----------------------------------------------------------------

    async def _endpoint(self, request: Request) -> Response:
        name, params = _route(request.method, request.url.path)
        self.calls.append(name or f"{request.method} {request.url.path}")
        try:
            return await self._answer(name, params, request)
        finally:
            self._notify()

    async def _answer(self, name: str | None, params: dict[str, str], request: Request) -> Response:
        if name is None:
            self.unknown.append(f"{request.method} {request.url.path}")
            return _error(404, 0, "404: Not Found")
        if name != "interactions.callback" and request.headers.get("authorization") != (
            f"Bot {self.token}"
        ):
            return _error(401, 0, "401: Unauthorized")
        failure = self._failures.get(name, {}).pop(self.calls.count(name), None)
        if failure is not None:
            return _failed(failure)
        body = await request.body()
        payload = json.loads(body) if body else {}
        handler: Callable[[dict[str, str], Json], Response]
        handler = getattr(self, "_" + name.replace(".", "_"))
        return handler(params, payload)

    def _users_me(self, params: dict[str, str], payload: Json) -> Response:
        return JSONResponse(BOT_USER)

    def _applications_me(self, params: dict[str, str], payload: Json) -> Response:
        return JSONResponse(
            {
                "id": str(APP_ID),
                "name": "chatlane",
                "icon": None,
                "description": "",
                "bot_public": False,
                "bot_require_code_grant": False,
                "owner": user(1, "owner"),
                "verify_key": "0" * 64,
                "flags": 0,
                "summary": "",
            }
        )

    def _gateway_bot(self, params: dict[str, str], payload: Json) -> Response:
        limit = {"total": 1000, "remaining": 999, "reset_after": 0, "max_concurrency": 1}
        return JSONResponse({"url": self.gateway, "shards": 1, "session_start_limit": limit})

    def _channels_get(self, params: dict[str, str], payload: Json) -> Response:
        channel = self.channels.get(int(params["channel"]))
        return _error(404, 10003, "Unknown Channel") if channel is None else JSONResponse(channel)

    def _messages_create(self, params: dict[str, str], payload: Json) -> Response:
        channel = int(params["channel"])
        refusal = self._refusal(channel, payload)
        if refusal is not None:
            return refusal
        nonce = payload.get("nonce")
        if payload.get("enforce_nonce") and nonce is not None:
            for earlier in self.posted:
                if earlier.nonce == nonce:
                    return JSONResponse(self._shown(earlier))
        made = Posted(
            self.new_id(),
            channel,
            str(payload.get("content") or ""),
            list(payload.get("components") or []),
            nonce,
            payload.get("allowed_mentions"),
        )
        self.posted.append(made)
        return JSONResponse(self._shown(made))

    def _refusal(self, channel: int, payload: Json) -> Response | None:
        if channel not in self.channels:
            return _error(404, 10003, "Unknown Channel")
        if channel in self.forbidden:
            return _error(403, 50001, "Missing Access")
        content = str(payload.get("content") or "")
        if not content.strip() and not payload.get("components"):
            return _error(400, 50006, "Cannot send an empty message")
        if len(content) > TEXT_LIMIT:
            return _error(
                400, 50035, "Invalid Form Body: content: Must be 2000 or fewer in length."
            )
        return None

    def _messages_edit(self, params: dict[str, str], payload: Json) -> Response:
        channel, message_id = int(params["channel"]), int(params["message"])
        found = [p for p in self.posted if (p.channel, p.id) == (channel, message_id)]
        if not found:
            return _error(404, 10008, "Unknown Message")
        content = str(payload.get("content") or "")
        if len(content) > TEXT_LIMIT or not content.strip():
            return _error(400, 50035, "Invalid Form Body")
        found[0].edits.append(found[0].text)
        found[0].text = content
        if "components" in payload:
            found[0].components = list(payload["components"] or [])
        return JSONResponse(self._shown(found[0]))

    def _typing(self, params: dict[str, str], payload: Json) -> Response:
        if int(params["channel"]) not in self.channels:
            return _error(404, 10003, "Unknown Channel")
        return Response(status_code=204)

    def _interactions_callback(self, params: dict[str, str], payload: Json) -> Response:
        self.answers.append((int(params["id"]), payload))
        return Response(status_code=204)

    def _shown(self, posted: Posted) -> Json:
        guild = self.channels[posted.channel].get("guild_id")
        shown = message(
            posted.id,
            posted.channel,
            BOT_USER,
            posted.text,
            None if guild is None else int(guild),
            components=posted.components,
        )
        return shown if posted.nonce is None else shown | {"nonce": posted.nonce}


def _text_channel(channel: int, guild: int, name: str) -> Json:
    return {
        "id": str(channel),
        "type": 0,
        "guild_id": str(guild),
        "name": name,
        "position": 0,
        "permission_overwrites": [],
        "nsfw": False,
        "parent_id": None,
        "topic": None,
        "last_message_id": None,
        "rate_limit_per_user": 0,
        "flags": 0,
    }


def _thread(thread: int, parent: int, guild: int) -> Json:
    return {
        "id": str(thread),
        "type": 11,
        "guild_id": str(guild),
        "parent_id": str(parent),
        "owner_id": "1",
        "name": f"thread {thread % 1000}",
        "last_message_id": None,
        "rate_limit_per_user": 0,
        "message_count": 0,
        "member_count": 1,
        "flags": 0,
        "thread_metadata": {
            "archived": False,
            "auto_archive_duration": 1440,
            "archive_timestamp": "2026-01-01T00:00:00.000000+00:00",
            "locked": False,
        },
    }


def _route(method: str, path: str) -> tuple[str | None, dict[str, str]]:
    for wanted, name, pattern in _ROUTES:
        matched = pattern.match(path)
        if matched is not None and wanted == method:
            return name, matched.groupdict()
    return None, {}


def _error(status: int, code: int, text: str) -> Response:
    return JSONResponse({"message": text, "code": code}, status_code=status)


def _failed(failure: Failure) -> Response:
    headers = {"Via": "1.1 google"}
    if failure.retry_after is not None:
        headers |= {"Retry-After": str(failure.retry_after), "X-RateLimit-Scope": "user"}
    return JSONResponse(failure.body, status_code=failure.status, headers=headers)
