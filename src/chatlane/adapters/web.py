"""The web chat adapter: a chat page at ``/`` and a JSON WebSocket at ``/ws``.

The page and its access gate live in :mod:`chatlane.adapters.web_page`, the
frames in :mod:`chatlane.adapters.web_wire`; ``docs/web.md`` describes both.

What stays true:

* A browser's tabs share its session: an outbound message goes to every open
  socket of its chat and to no other. One for a chat with no open socket is
  dropped (the transcript keeps it, and the next connect shows it).
* A socket gets the commands, the current conversation's history, the
  conversation list, the messages not answered yet (those the store queues
  for another process too: one that stopped, whose messages wait to be taken
  over) and the prompts of approval requests still waiting when it connects,
  and history and list again before the reply that follows a switch of
  conversation (``/new``, ``/resume``…), and the conversation's title before
  the reply that follows its change (the first reply of a conversation, a
  title the agent set).
* Each message shows once in a socket's page, with its answer: what is in
  flight is read as the socket joins its chat, the live events heard while
  its history is read follow that history, and nothing is sent about a
  message a history shows (:mod:`chatlane.adapters.web_view`).
* Reading never waits for the gateway: each message is submitted in a task of
  its own, after the chat's previous message was dispatched (or after
  :data:`HANDOFF` seconds, so a slow dispatch cannot hold up an ``/approve``).
  A browser has at most :data:`MAX_UNDISPATCHED` messages waiting to be
  handed on; one more is refused (its ``state`` says so, with an ``error``),
  so one flooding socket cannot fill the process's ``limits.queued_bytes``.
* Browser ids are signed by the server (:mod:`chatlane.adapters.web_ids`): a
  socket whose cookie holds no id this server issued is closed with 4400, so
  no client can invent browsers to get past :data:`MAX_TABS`; and no more
  than ``limits.sockets`` sockets are served at once (one more is closed with
  1013).
* Every tab of a chat hears what became of each of its messages: a
  ``state`` when the gateway took it (running, queued with its short id,
  merged, steered, interrupting, redirecting, refused, a command) and one ``outcome`` when
  it ended; the sender also learns the id of its own message (``accepted``).
  A message taken over from a process that stopped is shown (where it is not
  yet) with its state, running or queued, as it is taken. A reply delivered
  while its command is being dispatched is marked as a command's answer.
* Writing never waits for a browser: each socket has its own outbox and
  writer task; a socket that falls :data:`OUTBOX_LIMIT` events behind is closed.
* Bad input gets an ``error`` event and the socket stays open; nothing a
  client sends can crash the server.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from starlette.routing import BaseRoute, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from chatlane.access import AccessToken, TooManyGuesses
from chatlane.adapters.web_ids import BrowserIds, id_secret
from chatlane.adapters.web_page import Gate, WebPage, origin_host
from chatlane.adapters.web_view import View
from chatlane.adapters.web_wire import (
    Event,
    InvalidWebMessage,
    MessageFrame,
    MessageState,
    accepted_event,
    commands_event,
    conversation_item,
    encode,
    error_event,
    history_event,
    outbound_event,
    outcome_event,
    parse_frame,
    state_event,
    state_of,
    title_event,
)
from chatlane.approvals import ApprovalRequest
from chatlane.commands import parse_command
from chatlane.config import Config
from chatlane.errors import ChatlaneError, StoreError, shown_to_users
from chatlane.gateway import DispatchResult
from chatlane.identity import ChatType, SessionSource
from chatlane.runtime.outcomes import MessageOutcome
from chatlane.secrets import Secrets, TokenSource
from chatlane.session_commands import NO, YES
from chatlane.stores.base import PendingRecord
from chatlane.stores.codec import decode_message
from chatlane.types import InboundMessage, Outbound, OutboundKind, SessionKey

if TYPE_CHECKING:
    from chatlane.hub import Hub

log = logging.getLogger("chatlane.adapters.web")

OUTBOX_LIMIT = 512
MAX_TABS = 32
"""Most open sockets one browser may have; more are closed with 1013."""
SERVER_FULL = (1013, "the server has too many open connections; try again later")
HANDOFF = 1.0
MAX_UNDISPATCHED = 32
"""Most messages of one browser not handed to the gateway yet; one more is refused."""
HISTORY_LIMIT = 200
CONVERSATION_LIMIT = 20

CLOSE_UNAUTHORIZED = 4401
CLOSE_NO_IDENTITY = 4400
CLOSE_FOREIGN_ORIGIN = 4403
CLOSE_TOO_MANY_GUESSES = 4429
CLOSE_TRY_LATER = 1013
CLOSE_GOING_AWAY = 1001
NO_IDENTITY = (CLOSE_NO_IDENTITY, "no browser id: load the page first")
_TOO_MANY = (
    f"Too many messages at once ({MAX_UNDISPATCHED} wait to be taken): "
    "this one was not taken; send it again shortly."
)


@dataclass(eq=False)
class Connection:
    """One open socket, what its page shows, and the events waiting to be written to it.

    Events reach the outbox in the order they are sent, less those its page
    shows already (:class:`~chatlane.adapters.web_view.View`). Live events
    heard while the socket is greeted are held, and follow the greeting.
    """

    websocket: WebSocket
    outbox: asyncio.Queue[str | None] = field(default_factory=asyncio.Queue)
    close_with: tuple[int, str] | None = None
    view: View = field(default_factory=View)
    held: list[Event] | None = field(default_factory=list)
    """Live events heard before the greeting was sent; ``None`` once it was."""

    def hear(self, event: Event) -> None:
        """Send the live ``event``, after the greeting: held until that is sent."""
        if self.held is None:
            self.send(event)
        elif len(self.held) < OUTBOX_LIMIT:
            self.held.append(event)
        else:
            self._behind()

    def greeted(self, events: list[Event]) -> None:
        """Send ``events``, the greeting, then the live events held meanwhile."""
        held, self.held = self.held or [], None
        for event in [*events, *held]:
            self.send(event)

    def send(self, event: Event) -> None:
        """Queue ``event`` unless the page shows it already; a socket too far behind is
        closed instead."""
        if self.close_with is not None or not self.view.admits(event):
            return
        if self.outbox.qsize() >= OUTBOX_LIMIT:
            self._behind()
            return
        self.outbox.put_nowait(encode(event))

    def _behind(self) -> None:
        log.warning("web socket %d events behind; closing it", OUTBOX_LIMIT)
        self.close(CLOSE_TRY_LATER, "too far behind")

    def close(self, code: int, reason: str) -> None:
        """Close the socket once the events queued before are written."""
        if self.close_with is None:
            self.close_with = (code, reason)
            self.outbox.put_nowait(None)

    async def pump(self) -> None:
        """Write queued events until closed (a vanished client just ends the pump)."""
        try:
            while (text := await self.outbox.get()) is not None:
                await self.websocket.send_text(text)
            code, reason = self.close_with or (1000, "")
            await self.websocket.close(code, reason)
        except (WebSocketDisconnect, RuntimeError, OSError) as error:
            log.debug("web socket gone while writing: %r", error)


@dataclass(eq=False)
class WebChat:
    """One browser's session: its source, its open sockets, the conversation they show."""

    source: SessionSource
    session_key: SessionKey
    connections: set[Connection] = field(default_factory=set)
    conversation_id: str = ""
    title: str = ""
    """The current conversation's title as this chat's sockets were last told it."""
    last_submit: asyncio.Task[None] | None = None
    handing: dict[str, InboundMessage] = field(default_factory=dict)
    """Messages submitted from this chat's sockets and not yet handed to the gateway, by id."""
    commands: set[str] = field(default_factory=set)
    """Ids of this chat's commands being dispatched now (their replies are marked)."""

    def broadcast(self, event: Event, *, skip: Connection | None = None) -> None:
        """Queue ``event`` on every open socket of this chat except ``skip``."""
        for connection in list(self.connections):
            if connection is not skip:
                connection.hear(event)


class WebAdapter:
    """The ``web`` platform: the chat page, its WebSocket, and delivery to open tabs."""

    platform = "web"

    def __init__(
        self,
        config: Config,
        *,
        ids: BrowserIds | None = None,
        access: AccessToken | None = None,
        secrets: Secrets | None = None,
    ) -> None:
        """``access``: the hub's token, so a reload reaches the web chat; ``secrets``: read
        at start, for the token (without ``access``) and ``web.id_secret`` (without ``ids``).
        Without them, what is needed is read here (:mod:`chatlane.secrets`).
        """
        self.config = config
        if access is None:
            source = secrets.access_token if secrets else TokenSource.read(config.server.token)
            access = AccessToken(source)
        self.gate = Gate(access, ttl=config.server.sign_in_ttl)
        if ids is None:
            ids = BrowserIds(id_secret(config, secrets.web_id_secret if secrets else None))
        self.ids = ids
        self.page = WebPage(self.gate, self.ids)
        self._hub: Hub | None = None
        self._chats: dict[str, WebChat] = {}
        self._by_key: dict[SessionKey, WebChat] = {}
        self._open = 0
        """Sockets being served now, across every browser (at most ``limits.sockets``)."""
        self._tasks: set[asyncio.Task[None]] = set()

    def routes(self) -> Sequence[BaseRoute]:
        """``/``, ``/web/static/…`` and ``/ws``."""
        return [*self.page.routes(), WebSocketRoute("/ws", self.socket)]

    async def start(self, hub: Hub) -> None:
        """Accept sockets from now on."""
        self._hub = hub

    @property
    def hub(self) -> Hub:
        """The hub given to :meth:`start`."""
        if self._hub is None:
            raise RuntimeError("WebAdapter used before start()")
        return self._hub

    async def deliver(self, outbound: Outbound) -> None:
        """Send ``outbound`` to every open socket of its chat (none open: dropped)."""
        chat = self._chats.get(outbound.target.chat_id or "")
        if chat is None or not chat.connections:
            log.debug("web chat has no open socket; dropped %s", outbound.kind)
            return
        event = outbound_event(outbound, self._asks(outbound))
        if outbound.kind is OutboundKind.REPLY:
            await self._follow_conversation(chat)
            if event["id"] in chat.commands:
                event["command"] = True
        chat.broadcast(event)

    def _asks(self, outbound: Outbound) -> ApprovalRequest | None:
        """The request an approval prompt asks about, while it waits (else None)."""
        if not outbound.approval_id:
            return None
        engine = self.hub.gateway.engine
        state = engine.registry.peek(outbound.session_key)
        waiting = [] if state is None else engine.approvals.pending(state)
        return next((r for r in waiting if r.id == outbound.approval_id), None)

    def adopted(self, key: SessionKey, message: InboundMessage) -> None:
        """Tell the chat's open tabs that ``message``, taken over from a process that
        stopped, runs or waits here: the message (to a tab that does not show it) and its
        state."""
        chat = self._by_key.get(key)
        if chat is None or message.internal:
            return
        chat.broadcast(_said(message))
        for event in self._states(chat, {message.id}):
            chat.broadcast(event)

    def outcome(self, outcome: MessageOutcome) -> None:
        """Tell the chat's open tabs how one of its messages ended."""
        chat = self._by_key.get(outcome.session_key)
        if chat is not None:
            chat.broadcast(outcome_event(outcome))

    async def aclose(self) -> None:
        """Close every socket and let messages being dispatched finish (briefly)."""
        for chat in self._chats.values():
            for connection in chat.connections:
                connection.close(CLOSE_GOING_AWAY, "server shutting down")
        if self._tasks:
            _, pending = await asyncio.wait(self._tasks, timeout=5.0)
            for task in pending:
                task.cancel()

    # -- one socket -------------------------------------------------------------------

    async def socket(self, websocket: WebSocket) -> None:
        """Serve one WebSocket: check it, greet it, then read messages until it closes."""
        await websocket.accept()
        bid = self.ids.read(websocket)
        refusal = self._refusal(websocket) or (None if bid else NO_IDENTITY)
        if refusal is not None or bid is None:
            await websocket.close(*(refusal or NO_IDENTITY))
            return
        await self._serve(websocket, self._join(bid))

    async def _serve(self, websocket: WebSocket, chat: WebChat) -> None:
        if self._open >= self.config.limits.sockets:
            log.warning("web: %d sockets open; refused one more", self._open)
            self._leave(chat, None)
            await websocket.close(*SERVER_FULL)
            return
        if len(chat.connections) >= MAX_TABS:
            await websocket.close(CLOSE_TRY_LATER, "too many open tabs")
            return
        connection = Connection(websocket)
        self._open += 1
        writer = asyncio.create_task(connection.pump())
        try:
            await self._greet(chat, connection)
            await self._read(chat, connection)
        finally:
            self._open -= 1
            self._leave(chat, connection)
            writer.cancel()
            await asyncio.wait({writer})

    def _refusal(self, websocket: WebSocket) -> tuple[int, str] | None:
        """Why this socket may not be served, as a close code and reason; ``None`` if it may."""
        if self._hub is None:
            return (CLOSE_TRY_LATER, "the server is starting")
        try:
            if not self.gate.admits(websocket):
                return (CLOSE_UNAUTHORIZED, "access token required")
        except TooManyGuesses as blocked:
            return (CLOSE_TOO_MANY_GUESSES, str(blocked))
        origin = websocket.headers.get("origin")
        if origin is not None and origin_host(origin) != websocket.headers.get("host"):
            return (CLOSE_FOREIGN_ORIGIN, "cross-origin WebSocket refused")
        return None

    def _join(self, bid: str) -> WebChat:
        chat = self._chats.get(bid)
        if chat is None:
            source = SessionSource("web", chat_id=bid, user_id=bid, chat_type=ChatType.DM)
            key = self.hub.gateway.session_key(InboundMessage(source, "", id="web-join"))
            chat = self._chats[bid] = self._by_key[key] = WebChat(source, key)
        return chat

    def _leave(self, chat: WebChat, connection: Connection | None) -> None:
        if connection is not None:
            chat.connections.discard(connection)
        bid = chat.source.chat_id or ""
        if not chat.connections and self._chats.get(bid) is chat:
            del self._chats[bid]
            del self._by_key[chat.session_key]

    async def _greet(self, chat: WebChat, connection: Connection) -> None:
        """Join ``connection`` to ``chat`` and send its commands, history and list, then what
        the history cannot show yet, then the live events heard meanwhile.

        What is in flight here is read as the socket joins, with no ``await`` between,
        then the store's queue, then the history: a message answered in between is in
        the history, or its answer is heard live. Either way it shows once, as the view
        leaves out whatever is sent about a message the history shows
        (:mod:`~chatlane.adapters.web_view`).
        """
        chat.connections.add(connection)
        connection.send(commands_event(self.hub.gateway.router))
        here, told = self._in_flight(chat)
        try:
            queued = await self.hub.store.pending(chat.session_key)
            events = await self._snapshot(chat)
        except StoreError as error:
            log.warning("web: could not load %s: %s", chat.session_key, error)
            connection.greeted([error_event("Could not load this conversation; try again later.")])
            return
        said = [_said(m) for m in _unanswered(here, queued)]
        connection.greeted([*events, *said, *told])

    def _in_flight(self, chat: WebChat) -> tuple[list[InboundMessage], list[Event]]:
        """What a history may not show yet, of what this process holds: the messages not
        answered (held here or being handed on), and the prompts of waiting approvals and
        the messages' states."""
        engine = self.hub.gateway.engine
        held = [m for m in engine.unanswered(chat.session_key) if not m.internal]
        ids = {m.id for m in held}
        messages = [*held, *(m for m in chat.handing.values() if m.id not in ids)]
        prompts = engine.pending_approvals(chat.session_key)
        return messages, [
            *(outbound_event(prompt, self._asks(prompt)) for prompt in prompts),
            *self._states(chat, ids),
        ]

    def _states(self, chat: WebChat, ids: set[str]) -> list[Event]:
        """The state of each of ``ids`` still held here: running (and for how long), steered
        into the running turn and not taken yet, or queued."""
        engine = self.hub.gateway.engine
        turn = engine.running_turn(chat.session_key)
        running = [] if turn is None else [i for i in turn.message_ids if i in ids]
        elapsed = 0.0 if turn is None else time.monotonic() - turn.started_at
        waiting = [
            *((MessageState.STEERED, seq, m) for seq, m in engine.steered(chat.session_key)),
            *((MessageState.QUEUED, seq, m) for seq, m in engine.queued(chat.session_key)),
        ]
        return [
            *(state_event(i, MessageState.RUNNING, elapsed=elapsed) for i in running),
            *(state_event(m.id, state, short_id=seq) for state, seq, m in waiting if m.id in ids),
        ]

    async def _read(self, chat: WebChat, connection: Connection) -> None:
        while True:
            frame = await connection.websocket.receive()
            if frame["type"] == "websocket.disconnect":
                return
            try:
                parsed = parse_frame(frame)
            except InvalidWebMessage as error:
                connection.send(error_event(str(error)))
                continue
            self._submit(chat, connection, parsed)

    # -- messages -----------------------------------------------------------------------

    def _submit(self, chat: WebChat, connection: Connection, frame: MessageFrame) -> None:
        message = InboundMessage(chat.source, frame.text)
        if frame.ref:
            connection.send(accepted_event(frame.ref, message.id))
        if len(chat.handing) >= MAX_UNDISPATCHED:
            connection.send(state_event(message.id, MessageState.REFUSED))
            connection.send(error_event(_TOO_MANY))
            return
        chat.broadcast(_said(message), skip=connection)
        chat.handing[message.id] = message
        task = asyncio.create_task(self._dispatch(chat, connection, message, chat.last_submit))
        chat.last_submit = task
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _dispatch(
        self,
        chat: WebChat,
        connection: Connection,
        message: InboundMessage,
        previous: asyncio.Task[None] | None,
    ) -> None:
        """Submit after the chat's previous message (bounded wait), then tell every tab
        what became of it; a failure is told to the sender."""
        try:
            result = await self._handed_on(chat, message, previous)
        except ChatlaneError as error:
            log.warning("web: message %s not handled: %s", message.id, error)
            connection.send(error_event(f"The message was not handled: {shown_to_users(error)}"))
            chat.broadcast(state_event(message.id, MessageState.REFUSED))
            return
        except Exception:
            log.exception("web: dispatch failed for %s", message.id)
            connection.send(error_event("The message was not handled (internal error)."))
            chat.broadcast(state_event(message.id, MessageState.REFUSED))
            return
        finally:
            chat.commands.discard(message.id)
        chat.broadcast(self._arrival(chat, result))

    async def _handed_on(
        self, chat: WebChat, message: InboundMessage, previous: asyncio.Task[None] | None
    ) -> DispatchResult:
        """``message`` submitted to the gateway after the chat's previous message (a bounded
        wait); from then on, or if it never is, it no longer counts as waiting to be."""
        try:
            if previous is not None and not previous.done():
                await asyncio.wait({previous}, timeout=HANDOFF)
            if _may_be_command(message.text):
                chat.commands.add(message.id)
            return await self.hub.submit(message)
        finally:
            del chat.handing[message.id]

    def _arrival(self, chat: WebChat, result: DispatchResult) -> Event:
        """The ``state`` event of a dispatched message (one waiting names its short id: queued,
        merged, or steered and not taken by the agent yet)."""
        state = state_of(result)
        engine = self.hub.gateway.engine
        if state in (MessageState.QUEUED, MessageState.MERGED):
            waiting = engine.queued(chat.session_key)
        else:
            waiting = engine.steered(chat.session_key) if state is MessageState.STEERED else []
        short_id = next((seq for seq, m in waiting if m.id == result.message_id), 0)
        return state_event(result.message_id, state, short_id=short_id)

    async def _follow_conversation(self, chat: WebChat) -> None:
        """If the session switched conversation (/new, /resume…), resend history and list;
        if its conversation got a title (its first reply, or the agent named it), send that."""
        try:
            current = await self.hub.store.conversation(chat.session_key)
            if current.id == chat.conversation_id:
                if current.title != chat.title:
                    chat.title = current.title
                    chat.broadcast(title_event(current))
                return
            events = await self._snapshot(chat)
        except StoreError as error:
            log.warning("web: could not follow %s: %s", chat.session_key, error)
            return
        for event in events:
            chat.broadcast(event)

    async def _snapshot(self, chat: WebChat) -> list[Event]:
        """The current conversation's history and the session's conversation list."""
        store, key = self.hub.store, chat.session_key
        current = await store.conversation(key)
        chat.conversation_id, chat.title = current.id, current.title
        entries = await store.transcript(key, current.id, HISTORY_LIMIT)
        listed = await store.conversations(key, CONVERSATION_LIMIT)
        items = [
            conversation_item(c, current.id, await store.transcript(key, c.id, 20)) for c in listed
        ]
        return [history_event(current.id, entries), {"type": "conversations", "items": items}]


def _said(message: InboundMessage) -> Event:
    """The ``user`` event that shows ``message`` in a tab."""
    return {"type": "user", "text": message.text, "id": message.id}


def _unanswered(here: list[InboundMessage], queued: list[PendingRecord]) -> list[InboundMessage]:
    """The messages not answered yet, in the store's order: those ``here`` (what this
    process holds), and those the store ``queued`` for another process (one that stopped
    and whose messages wait to be taken over, or one running the session now)."""
    held = {m.id: m for m in here}
    listed = [held.pop(r.message_id, None) or _stored(r) for r in queued]
    return [m for m in (*listed, *held.values()) if m is not None and not m.internal]


def _stored(record: PendingRecord) -> InboundMessage | None:
    """The message ``record`` keeps; ``None`` if it cannot be read (it will be set aside)."""
    try:
        return decode_message(record.payload)
    except StoreError as error:
        log.debug("web: unreadable pending record %s: %s", record.seq, error)
        return None


def _may_be_command(text: str) -> bool:
    """Whether the gateway may answer ``text`` as a command (a slash command, a yes or no)."""
    return parse_command(text) is not None or text.strip().lower() in YES | NO
