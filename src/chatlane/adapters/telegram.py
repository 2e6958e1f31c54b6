"""Telegram: long polling with python-telegram-bot; private chats, groups and forum topics.

What stays true:

* A message's author is its sender — or, for a message sent on behalf of a
  chat (a channel, an anonymous admin, an automatic forward), that chat as
  ``chat:<id>`` (:func:`sender_id`), never Telegram's placeholder ``from``
  shared by every such sender: each has its own session, allowlist entry and
  approvals.
* Every text message — commands included, ``/stop@MyBot`` too — goes to
  :meth:`~chatlane.hub.Hub.submit` as text, so chatlane's own command
  parser, allowlist and busy policies apply; a forum topic is the thread.
  A command addressed to another bot (``/new@OtherBot``) is not chatlane's
  and is ignored.
* A photo, document, voice note, audio file or video goes the same way with
  its caption as the text (empty without one) and its file as an attachment
  (:mod:`~chatlane.adapters.telegram_media`); a file over
  ``telegram.max_attachment_bytes`` is refused with a notice instead, after
  the group and allowlist checks. Other messages (stickers, locations …)
  get a notice in a private chat saying what is read.
* In groups, supergroups and channels, with ``require_mention`` (the default),
  only a message that mentions the bot, replies to one of its messages or is
  a command goes to chatlane, without the mention
  (:mod:`~chatlane.adapters.telegram_groups`); private chats always do. With
  ``unmentioned = "context"`` the others are kept, as said, for the next turn
  there (:meth:`~chatlane.hub.Hub.overhear`); by default they are ignored.
* Every message handed to the hub is answered: by its turn, by a refusal, or —
  when the hub cannot take it — by a short notice in its chat and topic.
* Handling an update only waits until chatlane has accepted the message, never
  for the turn it starts. While the message's session is busy with it, the
  chat (and topic) shows "typing…" (:mod:`chatlane.adapters.typing`;
  ``telegram.typing = false`` turns it off).
* Replies go to the chat and topic the message came from. Each Telegram message
  holds at most 4096 UTF-16 code units, so long texts are split (at a newline
  or space where possible, never inside a character or an emoji sequence);
  streamed ``CHUNK``\\ s are not sent, the complete ``REPLY`` follows them. Its
  messages ask for whole replies (``InboundMessage.whole_reply``), so their
  turns do not send chunks out to be dropped here.
* A sender not on the allowlist is never answered in a group or channel
  (the refusal is logged and counted); in a private chat they hear so at
  most once per :data:`REFUSAL_INTERVAL`. A button pressed by such a sender
  is answered privately (the callback answer) and sends nothing.
* An approval prompt carries Approve / Deny buttons; pressing one sends
  ``/approve #<request>`` or ``/deny #<request>`` as the user who pressed it,
  so a button left on an old prompt answers its own request or nothing,
  never another one. The buttons name the asker too (when Telegram's 64
  bytes of button data hold it): anyone else's press is answered privately
  and sends nothing, so a group sees no "no longer pending" for a request
  its asker can still answer. In a channel anyone who reads it can press a
  button, so there a press only says to answer by posting ``/approve`` or
  ``/deny`` (which only the channel's admins can).
* A group upgraded to a supergroup keeps its conversation: the supergroup is
  known by the group's id, so its messages belong to the group's sessions,
  and everything addressed to the group — replies, approval prompts, cron
  jobs' results, notices, "typing…" — is sent to the supergroup, in the same
  topic (:mod:`~chatlane.adapters.telegram_moves`). A send refused with
  ``ChatMigrated`` delivered nothing: it goes to the supergroup once, and the
  move is remembered, in the store, for every later send.
* A send refused by flood control (HTTP 429, ``RetryAfter``) is sent again
  after the wait Telegram names, as long as one message's waits add up to at
  most :data:`FLOOD_WAIT_CAP`; nothing was delivered, so a retry cannot
  duplicate it. Any other failed send is logged, never raised; lone
  surrogates (which no UTF-8 wire can carry) become U+FFFD in both directions.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

from starlette.routing import BaseRoute
from telegram import (
    Bot,
    CallbackQuery,
    Chat,
    InlineKeyboardButton,
    InlineKeyboardMarkup,
    Message,
    Update,
    User,
)
from telegram.constants import ChatAction
from telegram.error import ChatMigrated, InvalidToken, TelegramError
from telegram.ext import (
    Application,
    ApplicationBuilder,
    CallbackQueryHandler,
    MessageHandler,
    Updater,
    filters,
)

from chatlane.adapters.aside import Aside
from chatlane.adapters.splitting import blank, joined, never_blank
from chatlane.adapters.splitting import utf16_len as utf16_len
from chatlane.adapters.telegram_delivery import (
    SendRequest,
    send_parts,
    thread_of,
)
from chatlane.adapters.telegram_groups import BotIdentity, addressed_text, overheard
from chatlane.adapters.telegram_media import MEDIA, attachment_of
from chatlane.adapters.telegram_moves import ChatMoves, move_of
from chatlane.adapters.telegram_updates import UpdatesRequest as UpdatesRequest
from chatlane.adapters.telegram_updates import readable_updates as readable_updates
from chatlane.adapters.typing import TypingIndicators
from chatlane.adapters.waits import WaitBudget
from chatlane.approvals import is_request_id
from chatlane.attachments import oversized, too_large_notice
from chatlane.commands import parse_command
from chatlane.config import Config
from chatlane.delivery.ledger import RESENT_LABEL
from chatlane.delivery.worker import Attempt
from chatlane.errors import (
    ChatlaneError,
    ConfigError,
    DeliveryFailed,
    InvalidChatMove,
    PermanentDelivery,
    PlatformUnavailable,
)
from chatlane.groups import GroupPolicy
from chatlane.identity import NO_SESSION, ChatType, SessionSource
from chatlane.secrets import Secrets, missing_secret, read_secret
from chatlane.types import (
    Attachment,
    InboundMessage,
    Outbound,
    OutboundKind,
    Target,
    clean_text,
)

if TYPE_CHECKING:
    from chatlane.hub import Hub

log = logging.getLogger("chatlane.adapters.telegram")

TelegramApp: TypeAlias = Application[Any, Any, Any, Any, Any, Any]

PLATFORM = "telegram"
MESSAGE_LIMIT = 4096
"""Telegram's limit for one message, in UTF-16 code units."""
SEND_CONNECTIONS = 256
"""Connections the bot keeps for sending (python-telegram-bot's own default)."""
FLOOD_WAIT_CAP = 60.0
"""Seconds one message may wait out flood control (429s) in all before it is given up."""
APPROVE_DATA = "chatlane:approve"
DENY_DATA = "chatlane:deny"
_ANSWERS = {APPROVE_DATA: "/approve", DENY_DATA: "/deny"}
"""Button data prefix → the command a press sends; ``:<request id>`` follows the prefix."""
SENDER_CHAT_PREFIX = "chat:"
"""The user id of a chat posting in a group is this prefix and the chat's id (:func:`sender_id`)."""
REFUSAL_INTERVAL = 3600.0
"""Seconds between two refusals told to one stranger in a private chat."""
_REFUSALS_KEPT = 4096
"""Strangers whose last refusal is remembered; older entries are forgotten first."""
_NOT_ALLOWED = "Sorry, you are not allowed to use this assistant."
_NOT_THE_ASKER = "Only the person who asked can answer this approval."
_AS_THE_CHAT = "A chat asked: answer by posting /approve or /deny as that chat."
_IN_A_CHANNEL = "In a channel, answer by posting /approve or /deny."
_CHAT_TYPES = {"private": ChatType.DM, "channel": ChatType.CHANNEL}
_UPDATES = ["message", "channel_post", "callback_query"]
_NOT_TEXT = (
    "Sorry, I can only read text, photos, documents, voice messages, audio and video "
    "— not this kind of message."
)
_NOT_HANDLED = "Sorry — your message could not be handled right now; please try again."
_TOKEN_LOGGERS = (
    "httpx",
    "telegram.Bot",
    "telegram.ext",
    "telegram.ext.Application",
    "telegram.ext.ExtBot",
    "telegram.ext.Updater",
)
"""Loggers whose records may carry the bot token (it is part of every request URL)."""


class TelegramAdapter:
    """The Telegram bot: receives by long polling, sends with ``sendMessage``.

    :param config: the gateway configuration (``telegram.token``, ``telegram.api_url``).
    :param secrets: read at start, for the bot token; without them, :meth:`start`
        reads ``telegram.token`` (:func:`~chatlane.secrets.read_secret`).
    :param poll_timeout: how long one ``getUpdates`` request waits for updates (seconds).
    :param poll_interval: pause between ``getUpdates`` requests (seconds).
    :param clock: monotonic seconds, for the pace of refusals in private chats.
    """

    platform = PLATFORM

    def __init__(
        self,
        config: Config,
        *,
        secrets: Secrets | None = None,
        poll_timeout: float = 30.0,
        poll_interval: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._config = config
        self._token = None if secrets is None else secrets.telegram_token
        self._clock = clock
        self._refused_at: dict[str, float] = {}
        """Stranger's user id → when a private chat last told them they are refused."""
        self._aside = Aside()
        """Acknowledgements and the adapter's own notices, which hold their caller up only
        briefly."""
        self._poll_timeout = poll_timeout
        self._poll_interval = poll_interval
        self._hub: Hub | None = None
        self._app: TelegramApp | None = None
        self._bot = BotIdentity(0, "")
        self._groups = GroupPolicy(config.telegram, "telegram")
        self._moves = ChatMoves()
        """Groups upgraded to supergroups (:mod:`~chatlane.adapters.telegram_moves`)."""
        self._redactor: TokenRedactor | None = None
        self.typing: TypingIndicators | None = None
        """The typing indicators, while the bot runs with ``telegram.typing`` on."""

    def routes(self) -> Sequence[BaseRoute]:
        """None: the adapter polls Telegram rather than receiving webhooks."""
        return []

    async def start(self, hub: Hub) -> None:
        """Read the groups known to have moved, check the token with ``getMe`` and start polling.

        :raises ConfigError: if no token is configured, or the Bot API rejects
            it or cannot be reached.
        :raises StoreError: the store could not say which groups moved.
        """
        if self._app is not None:
            raise ChatlaneError("the Telegram adapter is already running")
        configured = self._config.telegram.token
        token = read_secret(configured) if self._token is None else self._token
        if not token:
            raise missing_secret(
                "telegram is enabled but has no bot token", configured, "telegram.token"
            )
        await self._moves.load(hub.store, hub.gateway.settings.key_policy.namespace)
        self._redact(TokenRedactor(token))
        self._hub, self._app = hub, self._build(token)
        if self._config.telegram.typing:
            engine = hub.gateway.engine
            self.typing = TypingIndicators(
                self._show_typing, lambda key: bool(engine.unanswered(key))
            )
        try:
            await self._launch(self._app, token)
        except ConfigError:
            self._app = None
            self._redact(None)
            raise

    def _build(self, token: str) -> TelegramApp:
        api_url = self._config.telegram.api_url.rstrip("/")
        builder = ApplicationBuilder().token(token).base_url(f"{api_url}/bot")
        builder = builder.base_file_url(f"{api_url}/file/bot")
        builder = builder.request(SendRequest(connection_pool_size=SEND_CONNECTIONS))
        handed_over: asyncio.Queue[object] = asyncio.Queue()
        builder = builder.update_queue(handed_over)
        updates_request = UpdatesRequest(handed_over, connection_pool_size=1)
        app = builder.get_updates_request(updates_request).build()
        updates = filters.UpdateType.MESSAGE | filters.UpdateType.CHANNEL_POST
        app.add_handler(MessageHandler(filters.StatusUpdate.MIGRATE & updates, self._on_upgrade))
        app.add_handler(MessageHandler((filters.TEXT | MEDIA) & updates, self._on_message))
        other = filters.ChatType.PRIVATE & ~filters.StatusUpdate.ALL & updates  # no pins, timers
        app.add_handler(MessageHandler(other, self._on_other))
        app.add_handler(CallbackQueryHandler(self._on_button))
        app.add_error_handler(self._on_error)
        return app

    async def _launch(self, app: TelegramApp, token: str) -> None:
        """``initialize`` (``getMe``), ``start``, then polling; undone if any step fails."""
        api_url = self._config.telegram.api_url
        try:
            await app.initialize()
            self._bot = BotIdentity(app.bot.id, app.bot.username)
            await app.start()
            await _updater(app).start_polling(
                poll_interval=self._poll_interval,
                timeout=int(self._poll_timeout),
                allowed_updates=_UPDATES,
            )
        except InvalidToken:
            await _stop(app)
            raise ConfigError(f"the Telegram Bot API at {api_url} rejected the bot token") from None
        except TelegramError as error:
            await _stop(app)
            reason = str(error).replace(token, "<token>")
            raise ConfigError(f"the Telegram Bot API at {api_url} failed: {reason}") from None

    async def aclose(self) -> None:
        """Stop polling, finish the updates being handled, close the HTTP clients."""
        app, self._app = self._app, None
        typing, self.typing = self.typing, None
        try:
            if typing is not None:
                await typing.aclose()
            await self._aside.aclose()
            if app is not None:
                await _stop(app)
            await self._moves.aclose()
        finally:
            self._redact(None)

    def _redact(self, redactor: TokenRedactor | None) -> None:
        """Filter the token out of HTTP and PTB log records with ``redactor`` (or stop)."""
        for name in _TOKEN_LOGGERS:
            if self._redactor is not None:
                logging.getLogger(name).removeFilter(self._redactor)
            if redactor is not None:
                logging.getLogger(name).addFilter(redactor)
        self._redactor = redactor

    async def deliver(self, outbound: Outbound) -> None:
        """Send ``outbound`` to its chat and topic, split to fit; failures are logged.

        An acknowledgement or a notice of the adapter's own holds the caller up at most
        :data:`~chatlane.adapters.aside.PATIENCE` seconds (:mod:`~chatlane.adapters.aside`):
        python-telegram-bot hands updates on one at a time, so one waiting out flood
        control would hold up every chat's next message.
        """
        if outbound.kind is OutboundKind.CHUNK:
            return
        app, target = self._app, outbound.target
        if app is None or target.chat_id is None:
            log.warning("telegram is not running; dropped a %s for %s", outbound.kind, target)
            return
        await self._aside.deliver(outbound, self._send_whole(app.bot, outbound))

    async def _send_whole(self, bot: Bot, outbound: Outbound) -> None:
        """Send ``outbound``'s parts in order outside the ledger, flood control waited out;
        a failure is logged."""
        target = outbound.target
        parts = [part for part in split_message(_text_of(outbound)) if not blank(part)]
        try:
            budget = WaitBudget(FLOOD_WAIT_CAP)
            await send_parts(
                bot, target, parts, _buttons(outbound), budget, self._moves, wait_first=True
            )
        except DeliveryFailed as error:
            log.warning("telegram sendMessage to chat %s failed: %s", target.chat_id, error)

    def ready(self) -> bool:
        """Whether the bot runs, so the delivery worker may send (:mod:`chatlane.delivery`)."""
        return self._app is not None and self._app.running

    async def send(self, outbound: Outbound, attempt: Attempt) -> None:
        """Send one delivery of the ledger, all its parts, or raise why not.

        A delivery that may have been sent before is labelled
        (:data:`~chatlane.delivery.ledger.RESENT_LABEL`): Telegram cannot
        deduplicate.

        :raises DeliveryFailed: classified by :func:`~chatlane.adapters.telegram_delivery.classify`.
        """
        app, target = self._app, outbound.target
        if app is None:
            raise PlatformUnavailable("telegram is not running")
        if target.chat_id is None:
            raise PermanentDelivery("telegram: the delivery names no chat")
        text = _text_of(outbound)
        if attempt.uncertain:
            text = RESENT_LABEL + text
        parts = [part for part in split_message(text) if not blank(part)]
        budget = WaitBudget(FLOOD_WAIT_CAP, attempt.deadline)
        await send_parts(app.bot, target, parts, _buttons(outbound), budget, self._moves)

    async def _on_message(self, update: Update, context: object) -> None:
        """A text, or a file and its caption: to the hub, unless the file is over the cap."""
        inbound = inbound_message(update, self._bot, self._groups, self._moves)
        inbound = inbound or self._answer_owed(update)
        if inbound is None:
            said = overheard_message(update, self._bot, self._groups, self._moves)
            if said is not None and self._hub is not None:
                self._hub.overhear(said, self._groups.limits)
            return
        cap = self._config.telegram.max_attachment_bytes
        too_large = oversized(inbound.attachments, cap) if inbound.attachments else None
        if too_large is not None:
            await self._refuse_file(inbound, too_large_notice(too_large, cap))
        else:
            await self._submit(inbound)

    def _answer_owed(self, update: Update) -> InboundMessage | None:
        """``update``'s text if, not said to the bot, it is a yes or no its sender owes an
        approval prompt (:meth:`~chatlane.hub.Hub.awaits_answer`); else None."""
        message, hub = update.effective_message, self._hub
        if message is None or message.text is None or hub is None:
            return None
        text = clean_text(message.text)

        def said() -> InboundMessage:
            msg_id = f"tg-{message.chat.id}-{message.message_id}"
            return InboundMessage(
                source_of(message, message.from_user, self._moves), text, id=msg_id
            )

        return said() if hub.awaits_answer(text, said) else None

    async def _refuse_file(self, message: InboundMessage, notice: str) -> None:
        """Tell the sender their file was not taken (a stranger hears only what strangers do)."""
        if self._hub is None:
            return
        if not self._hub.admit(message):
            await self.refuse(message)
            return
        target = Target.of(message.source)
        await self.deliver(
            Outbound(OutboundKind.NOTICE, NO_SESSION, target, notice, 0, (message.id,))
        )

    async def _on_other(self, update: Update, context: object) -> None:
        """A sticker, location or poll in a private chat: say what is understood — to a
        sender the allowlist admits; a stranger hears only what strangers do."""
        message = update.effective_message
        if message is None or self._hub is None:
            return
        source = source_of(message, message.from_user, self._moves)
        inbound = InboundMessage(source, "", id=f"tg-{message.chat.id}-{message.message_id}")
        if not self._hub.admit(inbound):
            await self.refuse(inbound)
            return
        await self.deliver(Outbound(OutboundKind.NOTICE, NO_SESSION, Target.of(source), _NOT_TEXT))

    async def _on_upgrade(self, update: Update, context: object) -> None:
        """A group became a supergroup: remember where it went
        (:mod:`~chatlane.adapters.telegram_moves`); odd ids are logged and ignored."""
        message = update.effective_message
        try:
            move = None if message is None else move_of(message)
        except InvalidChatMove as error:
            log.warning("telegram: ignored a group upgrade: %s", error)
            return
        if move is not None:
            await self._moves.record(move)

    async def _on_button(self, update: Update, context: object) -> None:
        query = update.callback_query
        if query is None:
            return
        answer = button_command(query.data or "")
        message = query.message
        if answer is None or not isinstance(message, Message):
            await _answer(query, "This button is no longer active.")
            return
        if message.chat.type == "channel":
            await _answer(query, _IN_A_CHANNEL)  # any reader can press; only admins can post
            return
        msg_id = f"tg-{message.chat.id}-cb{query.id}"
        source = source_of(message, query.from_user, self._moves)
        inbound = InboundMessage(source, answer, id=msg_id)
        if self._hub is None or not self._hub.admit(inbound):
            await _answer(query, _NOT_ALLOWED)  # privately: the chat sees nothing
            return
        asker = button_asker(query.data or "")
        if asker is not None and asker != inbound.source.user_id:
            only = _AS_THE_CHAT if asker.startswith(SENDER_CHAT_PREFIX) else _NOT_THE_ASKER
            await _answer(query, only)  # privately: the asker may still answer
            return
        await _answer(query, f"Sent {answer.partition(' #')[0]}")
        await self._submit(inbound)

    async def refuse(self, message: InboundMessage) -> None:
        """A stranger wrote: silence in groups, a notice in private at most once an hour."""
        source = message.source
        if source.chat_type is not ChatType.DM or not self._refusal_due(source.user_id or ""):
            return
        target = Target.of(source)
        await self.deliver(
            Outbound(OutboundKind.NOTICE, NO_SESSION, target, _NOT_ALLOWED, 0, (message.id,))
        )

    def _refusal_due(self, user_id: str) -> bool:
        """Whether ``user_id`` may be told again (:data:`REFUSAL_INTERVAL`); records it if so."""
        now, last = self._clock(), self._refused_at.get(user_id)
        if last is not None and now - last < REFUSAL_INTERVAL:
            return False
        self._refused_at.pop(user_id, None)
        self._refused_at[user_id] = now
        while len(self._refused_at) > _REFUSALS_KEPT:
            del self._refused_at[next(iter(self._refused_at))]
        return True

    async def _submit(self, message: InboundMessage) -> None:
        """Hand ``message`` to the hub; if the hub fails, tell the chat instead of going silent."""
        if self._hub is None:
            return
        try:
            result = await self._hub.submit(message)
        except ChatlaneError as error:
            log.warning("telegram message %s could not be handled: %s", message.id, error)
            await self._not_handled(message)
        except Exception:
            log.exception("telegram message %s could not be handled", message.id)
            await self._not_handled(message)
        else:
            if self.typing is not None and result.command is None and not result.refused:
                self.typing.show(result.session_key, Target.of(message.source))

    async def _show_typing(self, target: Target) -> None:
        """``sendChatAction`` typing in ``target``'s chat and topic (in the supergroup a
        group became, followed as a send is)."""
        app = self._app
        if app is None or target.chat_id is None:
            return
        chat, thread = self._moves.destination(target.chat_id), thread_of(target)
        try:
            await app.bot.send_chat_action(chat, ChatAction.TYPING, message_thread_id=thread)
        except ChatMigrated as error:
            self._moves.follow(chat, error.new_chat_id)
            await app.bot.send_chat_action(
                error.new_chat_id, ChatAction.TYPING, message_thread_id=thread
            )

    async def _not_handled(self, message: InboundMessage) -> None:
        target = Target.of(message.source)
        await self.deliver(
            Outbound(OutboundKind.NOTICE, NO_SESSION, target, _NOT_HANDLED, 0, (message.id,))
        )

    async def _on_error(self, update: object, context: Any) -> None:
        log.error("telegram update could not be handled", exc_info=context.error)


class TokenRedactor(logging.Filter):
    """Replaces the bot token with ``<token>`` in a record's message and traceback.

    httpx logs every request URL at INFO, and the token is part of each one.
    """

    def __init__(self, token: str) -> None:
        super().__init__()
        self._token = token

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except (TypeError, ValueError):  # a malformed record: logging reports it later
            return True
        if self._token in message:
            record.msg, record.args = message.replace(self._token, "<token>"), None
        if record.exc_info and not record.exc_text:
            text = logging.Formatter().formatException(record.exc_info)
            record.exc_text = text.replace(self._token, "<token>")
        return True


def inbound_message(
    update: Update, bot: BotIdentity, groups: GroupPolicy, moves: ChatMoves | None = None
) -> InboundMessage | None:
    """The message chatlane gets for ``update``'s text, or its file and caption, or None.

    None when the update holds neither a text nor a file
    (:func:`~chatlane.adapters.telegram_media.attachment_of`), when its text is
    a command addressed to another bot (:func:`addressed_to`), or when in a
    group it is not for the bot
    (:func:`~chatlane.adapters.telegram_groups.addressed_text`).
    """
    message = update.effective_message
    said = None if message is None else _text_and_files(message)
    if message is None or said is None:
        return None
    cleaned, files = clean_text(said[0]), said[1]
    if not addressed_to(cleaned, bot.username):
        return None
    source = source_of(message, message.from_user, moves)
    text = addressed_text(message, cleaned, bot, groups, files=bool(files), chat=source.chat_id)
    if text is None:
        return None
    msg_id = f"tg-{message.chat.id}-{message.message_id}"
    return InboundMessage(source, text, id=msg_id, attachments=files, whole_reply=True)


def overheard_message(
    update: Update, bot: BotIdentity, groups: GroupPolicy, moves: ChatMoves | None = None
) -> InboundMessage | None:
    """``update``'s message as said, if it is kept as context: in a group that keeps what
    is not for the bot (:func:`~chatlane.adapters.telegram_groups.overheard`); else None."""
    message = update.effective_message
    said = None if message is None else _text_and_files(message)
    if message is None or said is None:
        return None
    text, files = clean_text(said[0]), said[1]
    source = source_of(message, message.from_user, moves)
    if not overheard(message, text, bot, groups, chat=source.chat_id):
        return None
    msg_id = f"tg-{message.chat.id}-{message.message_id}"
    return InboundMessage(source, text, id=msg_id, attachments=files)


def _text_and_files(message: Message) -> tuple[str, tuple[Attachment, ...]] | None:
    """A text message's text; a file's caption ("" without one) and the file; else None."""
    if message.text is not None:
        return message.text, ()
    attachment = attachment_of(message)
    return None if attachment is None else (message.caption or "", (attachment,))


def addressed_to(text: str, username: str) -> bool:
    """False for a command naming another bot than ``username`` (``/new@OtherBot``); else True."""
    command = parse_command(text)
    if command is None or command.mention is None:
        return True
    return command.mention.casefold() == username.casefold()


def source_of(message: Message, user: User | None, moves: ChatMoves | None = None) -> SessionSource:
    """Where ``message`` was written, and by whom (a forum topic is the thread).

    The author is ``user`` — or, for a message sent on behalf of a chat,
    that chat (:func:`sender_id`). A supergroup that was a group is known by
    the group's id, as ``moves`` say (:mod:`~chatlane.adapters.telegram_moves`).
    """
    chat = message.chat
    topic = message.message_thread_id if message.is_topic_message else None
    user_id, user_name = _author(message, user, moves)
    return SessionSource(
        PLATFORM,
        chat_id=str(chat.id) if moves is None else moves.known_as(chat.id),
        chat_type=_CHAT_TYPES.get(chat.type, ChatType.GROUP),
        chat_name=chat.effective_name or "",
        thread_id=str(topic) if topic is not None else None,
        user_id=user_id,
        user_name=user_name,
        message_id=str(message.message_id),
    )


def sender_id(sender_chat: Chat, moves: ChatMoves | None = None) -> str:
    """The user id of a chat that posts in a group: ``chat:<id>``.

    Telegram puts a placeholder shared by every such sender in ``from``
    (136817688 for posts as a channel, 1087968824 for anonymous admins,
    777000 for automatic forwards), so the sender is ``sender_chat``. The
    ``chat:`` prefix keeps it apart from every person's id (always a number).
    A supergroup that was a group (its anonymous admins) is named by the
    group's id, as ``moves`` say.
    """
    chat = str(sender_chat.id) if moves is None else moves.known_as(sender_chat.id)
    return f"{SENDER_CHAT_PREFIX}{chat}"


def _author(message: Message, user: User | None, moves: ChatMoves | None) -> tuple[str | None, str]:
    """The id and name of who wrote ``message``: ``sender_chat`` when set, else ``user``.

    A channel's own posts stay without a user: the channel is the chat.
    """
    sender_chat = message.sender_chat
    if sender_chat is not None and message.chat.type != "channel":
        return sender_id(sender_chat, moves), sender_chat.effective_name or ""
    if user is None:
        return None, ""
    return str(user.id), user.full_name


def approval_buttons(request_id: str, asker: str | None = None) -> InlineKeyboardMarkup:
    """Approve / Deny buttons for the approval request ``request_id``, naming ``asker``
    when the button's data has room for it (Telegram takes 64 bytes)."""
    suffix = f":{request_id}" if request_id else ""
    if request_id and asker and len(f"{APPROVE_DATA}{suffix}@{asker}".encode()) <= 64:
        suffix += f"@{asker}"
    return InlineKeyboardMarkup(
        [
            [
                InlineKeyboardButton("Approve", callback_data=f"{APPROVE_DATA}{suffix}"),
                InlineKeyboardButton("Deny", callback_data=f"{DENY_DATA}{suffix}"),
            ]
        ]
    )


def button_command(data: str) -> str | None:
    """The command a press of a button with ``data`` sends; None for no button of ours.

    ``chatlane:approve:a1b2c3d4`` (or ``…:a1b2c3d4@<asker>``) becomes
    ``/approve #a1b2c3d4``; data without a request (prompts sent by older
    versions) answers the oldest pending one.
    """
    for prefix, command in _ANSWERS.items():
        request = data.removeprefix(f"{prefix}:").partition("@")[0]
        if data.startswith(f"{prefix}:") and is_request_id(request):
            return f"{command} #{request}"
    return _ANSWERS.get(data)


def button_asker(data: str) -> str | None:
    """The user id a button's ``data`` names as the only one whose press counts; None when
    it names none (any allowed sender's press is sent)."""
    if button_command(data) is None:
        return None
    return data.partition("@")[2] or None


def split_message(text: str, limit: int = MESSAGE_LIMIT) -> list[str]:
    """``text`` in parts of at most ``limit`` UTF-16 units; joined, they equal ``text``.

    A part ends after the last newline (else space) in its second half where no
    character sequence (emoji, mark, Hangul syllable) is split; failing that, at
    the last point of its second half where none is (at the limit if none).
    """
    parts = []
    while utf16_len(text) > limit:
        cut = _cut_point(text, limit)
        parts.append(text[:cut])
        text = text[cut:]
    parts.append(text)
    return parts


def _fit(text: str, limit: int) -> int:
    """How many code points of ``text`` fit in ``limit`` UTF-16 units."""
    units = 0
    for index, char in enumerate(text):
        units += 2 if ord(char) > 0xFFFF else 1
        if units > limit:
            return index
    return len(text)


def _cut_point(text: str, limit: int) -> int:
    end = _fit(text, limit)
    for separator in ("\n", " "):
        at = text.rfind(separator, end // 2, end)
        while at >= 0 and _splits(text, at + 1):
            at = text.rfind(separator, end // 2, at)
        if at >= 0:
            return at + 1
    end = max(end, 1)
    cut = end
    while cut > end // 2 and _splits(text, cut):
        cut -= 1
    return cut if cut > end // 2 else end


def _splits(text: str, cut: int) -> bool:
    """Whether cutting ``text`` before index ``cut`` would split one visible character."""
    before, after = text[cut - 1], text[cut]
    if _is_flag_half(before) and _is_flag_half(after):
        halves = 0  # regional indicators pair up from the left: 🇩🇪 is two of them
        while cut - halves > 0 and _is_flag_half(text[cut - halves - 1]):
            halves += 1
        return halves % 2 == 1
    return joined(before, after)


def _is_flag_half(char: str) -> bool:
    return 0x1F1E6 <= ord(char) <= 0x1F1FF


def _text_of(outbound: Outbound) -> str:
    """``outbound``'s text as sent: lone surrogates as U+FFFD, a blank one as
    :data:`~chatlane.adapters.splitting.EMPTY_REPLY`."""
    return never_blank(clean_text(outbound.text))


def _buttons(outbound: Outbound) -> InlineKeyboardMarkup | None:
    """The buttons under ``outbound``'s last part: an approval's, else none."""
    if outbound.kind is OutboundKind.APPROVAL:
        asker = None if outbound.asks is None else outbound.asks.asker
        return approval_buttons(outbound.approval_id, asker)
    return None


async def _answer(query: CallbackQuery, text: str) -> None:
    try:
        await query.answer(text)
    except TelegramError as error:
        log.warning("telegram answerCallbackQuery failed: %s", error)


def _updater(app: TelegramApp) -> Updater:
    if app.updater is None:
        raise ChatlaneError("the Telegram application was built without an updater")
    return app.updater


async def _stop(app: TelegramApp) -> None:
    """Undo as much of the start as happened: updater, application, then its HTTP clients.

    The updater's last ``getUpdates`` (confirming what was fetched) may fail;
    that is logged and the rest still closes.
    """
    if app.updater is not None and app.updater.running:
        try:
            await app.updater.stop()
        except (TelegramError, ValueError, TypeError, KeyError):
            log.exception("telegram polling did not stop cleanly")
    if app.running:
        await app.stop()
    await app.shutdown()
    await app.bot.shutdown()  # a no-op unless ``initialize`` failed half-way
