"""Discord: the gateway and the REST API with discord.py; DMs, server channels and threads.

What stays true:

* The bot opens the gateway itself (no public URL); discord.py keeps it
  open, answers heartbeats, and reconnects — resuming the session, so Discord
  sends again what it dispatched meanwhile — whenever the connection drops.
* A message goes to chatlane before anything else is done for it: read
  (:func:`~chatlane.adapters.discord_events.read_message`), checked, then
  handed to :meth:`~chatlane.hub.Hub.submit`, which queues it durably. Events
  are handled in arrival order within a channel, in parallel across channels.
  Discord never sends an event again once it was dispatched on a live
  connection, so a process that dies between receiving a message and its
  acceptance loses that message (``docs/discord.md`` says so). A shutdown
  closes the gateway first, then gives what it brought :data:`CLOSE_WAIT`
  seconds to be handed on.
* In a server the shared group rule decides (:class:`~chatlane.groups.GroupPolicy`,
  keyed by the channel — a thread's parent — and ``channel`` or ``thread``):
  with ``require_mention``, only a message that mentions the bot, replies to
  one of its messages or matches a mention pattern goes to chatlane; a DM
  always does. With ``unmentioned = "context"`` the others are kept for the
  next turn of their session (:meth:`~chatlane.hub.Hub.overhear`); by default
  they are ignored.
  The bot's mention is taken out of the text. Messages from servers not on
  ``allowed_guilds`` are ignored.
* A message's files go with it as attachments, referenced by their CDN URLs
  (:mod:`~chatlane.adapters.discord_files`); a message with a file over
  ``discord.max_attachment_bytes`` is refused with a notice instead, after
  the group and allowlist checks (a stranger hears only what strangers do).
* Replies go to the channel, thread or DM the message came from, split at
  2,000 characters with code fences kept balanced, and ping nobody. A streamed
  reply is shown as a draft edited in place (:mod:`~chatlane.adapters.drafts`);
  the complete reply replaces it. While a message's session is busy with it,
  the channel shows the bot typing (``discord.typing = false`` turns it off).
* An approval prompt carries Approve / Deny buttons naming its request and its
  asker; a press counts only from the asker, and is sent as
  ``/approve #<request>`` or ``/deny #<request>`` by the user who pressed it.
  Anyone else's press, and a press of a button chatlane does not know, is
  answered with an ephemeral message and sends nothing. A press is answered
  at once, beside its channel's queue (Discord wants it within three
  seconds); what it sends keeps its place in that queue.
* A sender not on the allowlist hears so at most once per
  :data:`REFUSAL_INTERVAL`, in a DM; in a server the refusal is logged and
  counted, never posted.
* Replies, notices and prompts go through the delivery ledger
  (:meth:`DiscordAdapter.send`); everything sent outside it (acknowledgements,
  refusals, and everything with ``[delivery] enabled = false``) is
  best-effort: a failure is logged, never raised.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import aiohttp
import discord
from discord.backoff import ExponentialBackoff
from starlette.routing import BaseRoute

from chatlane.adapters.aside import Aside
from chatlane.adapters.discord_client import Events, GatewayClient, answer_interaction
from chatlane.adapters.discord_delivery import Parts, edit, post, send_parts
from chatlane.adapters.discord_events import Channels, approval_view, read_message, read_press
from chatlane.adapters.discord_wire import (
    MESSAGE_LIMIT,
    PLATFORM,
    Posted,
    author_of,
    check_token,
    is_snowflake,
    split_message,
)
from chatlane.adapters.drafts import EDIT_INTERVAL, Draft, Drafts
from chatlane.adapters.lanes import Lanes
from chatlane.adapters.recent import Recent
from chatlane.adapters.splitting import blank, never_blank
from chatlane.adapters.typing import TypingIndicators
from chatlane.adapters.waits import WaitBudget
from chatlane.approvals import markdown_text
from chatlane.attachments import oversized, too_large_notice
from chatlane.config import Config
from chatlane.delivery.ledger import RESENT_LABEL, label_resent
from chatlane.delivery.worker import Attempt
from chatlane.errors import (
    ChatlaneError,
    ConfigError,
    DeliveryFailed,
    PermanentDelivery,
    PlatformUnavailable,
)
from chatlane.groups import GroupPolicy, Unmentioned
from chatlane.identity import NO_SESSION, ChatType
from chatlane.secrets import Secrets, read_secret
from chatlane.types import InboundMessage, Outbound, OutboundKind, Target, clean_text

if TYPE_CHECKING:
    from chatlane.gateway import DispatchResult
    from chatlane.hub import Hub

log = logging.getLogger("chatlane.adapters.discord")

RATE_LIMIT_CAP = 60.0
"""Seconds one message may wait out rate limits in all, in place, before it is given up."""
REFUSAL_INTERVAL = 3600.0
"""Seconds between two refusals told to one stranger."""
START_WAIT = 30.0
"""Seconds the start waits for the gateway's first session, to report a refusal."""
CLOSE_WAIT = 10.0
"""Seconds a shutdown waits, once the gateway is closed, for the messages it brought to be
handed to chatlane; what is left then is cancelled."""
MORE = " …"
LABELLED_LIMIT = MESSAGE_LIMIT - len(RESENT_LABEL)  # each of its characters one UTF-16 unit
"""Where a reply's parts are cut, labelled or not: the same cuts on every attempt."""
"""Ends a draft that shows only the beginning of a longer text."""
_SEEN_KEPT = 8192
"""Message ids remembered, so a message dispatched twice is handled once."""
_REFUSALS_KEPT = 4096
_DRAFTS_KEPT = 1024
_EPHEMERAL = 1 << 6
"""The flag of a message only the user who pressed sees."""
_NOT_ALLOWED = "Sorry, you are not allowed to use this assistant."
_NOT_HANDLED = "Sorry — your message could not be handled right now; please try again."
_NO_LONGER_ACTIVE = "This button is no longer active."
_INTENT_REFUSED = (
    "the Discord gateway refused the Message Content intent: enable it for the bot in "
    "the developer portal (Bot → Privileged Gateway Intents), or set "
    "discord.message_content = false"
)


class DiscordAdapter:
    """The Discord bot: receives over the gateway, sends with the REST API.

    :param config: the gateway configuration (``[discord]``).
    :param secrets: read at start, for the bot token; without them, :meth:`start`
        reads ``discord.token`` (:func:`~chatlane.secrets.read_secret`).
    :param edit_interval: seconds before a streamed reply's first draft, and
        at least between two edits of it.
    :param clock: monotonic seconds, for the pace of refusals.
    """

    platform = PLATFORM

    def __init__(
        self,
        config: Config,
        *,
        secrets: Secrets | None = None,
        edit_interval: float = EDIT_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._settings = config.discord
        self._groups = GroupPolicy(config.discord, "discord")
        self._secrets = secrets
        self._edit_interval = edit_interval
        self._clock = clock
        self._hub: Hub | None = None
        self._client: GatewayClient | None = None
        self._connection: asyncio.Task[None] | None = None
        self._sessions = asyncio.Event()
        self._seen = Recent(_SEEN_KEPT)
        self._refused_at = Recent(_REFUSALS_KEPT)
        self._lanes = Lanes("Discord")
        self._drafts = Drafts(self._draft_of, _DRAFTS_KEPT)
        self._aside = Aside()
        """Best-effort sends (acknowledgements), which hold their caller up only briefly."""
        self._channels: Channels | None = None
        self.typing: TypingIndicators | None = None
        """The typing indicators, while the bot runs with ``discord.typing`` on."""

    def routes(self) -> Sequence[BaseRoute]:
        """None: the bot opens the gateway itself."""
        return []

    async def start(self, hub: Hub) -> None:
        """Log in (``GET /users/@me``), open the gateway, wait for its first session.

        :raises ConfigError: the token is missing or rejected, the API cannot be
            reached, or the gateway refuses the bot (its token, or the Message
            Content intent). A gateway that does not answer within
            :data:`START_WAIT` is logged, not raised: discord.py keeps trying.
        """
        if self._client is not None:
            raise ChatlaneError("the Discord adapter is already running")
        token = self._read_token()
        events = Events(self._on_message, self._on_interaction, self._sessions.set)
        settings = self._settings
        client = GatewayClient(settings.api_url, events, message_content=settings.message_content)
        await _log_in(client, token, settings.api_url)
        self._hub, self._client, self._channels = hub, client, Channels(client)
        self._connection = asyncio.create_task(self._connect(client), name="chatlane-discord")
        if settings.typing:
            engine = hub.gateway.engine
            self.typing = TypingIndicators(
                self._show_typing, lambda key: bool(engine.unanswered(key))
            )
        await self._first_session()

    def _read_token(self) -> str:
        secrets = self._secrets
        token = read_secret(self._settings.token) if secrets is None else secrets.discord_token
        check_token(token, self._settings.token)
        return token

    async def _connect(self, client: GatewayClient) -> None:
        """The gateway connection, reconnected by discord.py until closed or refused.

        discord.py ends its connection when it cannot read an event (a payload
        it does not expect): the connection is then opened again, after a
        growing pause, with a new session.
        """
        backoff = ExponentialBackoff()
        while True:
            try:
                await client.connect(reconnect=True)
                return
            except Exception as error:
                if client.is_closed() or _refused(error):
                    if self._client is client:
                        log.error(
                            "discord: the gateway connection ended: %s", _gateway_failure(error)
                        )
                    raise
                delay = backoff.delay()
                log.exception("discord: an event could not be read; reconnecting in %.1fs", delay)
            if client.ws is not None:
                await client.ws.close(code=4000)
            await asyncio.sleep(delay)

    async def _first_session(self) -> None:
        connection = self._connection
        assert connection is not None
        session = asyncio.create_task(self._sessions.wait())
        try:
            await asyncio.wait(
                [connection, session], timeout=START_WAIT, return_when="FIRST_COMPLETED"
            )
        finally:
            session.cancel()
        if connection.done():
            error = None if connection.cancelled() else connection.exception()
            await self.aclose()
            raise ConfigError(_gateway_failure(error)) from None
        if not self._sessions.is_set():
            log.warning("discord: no gateway session after %gs; still trying", START_WAIT)

    async def aclose(self) -> None:
        """Close the gateway, let the events it brought be handed on, then stop drafts,
        typing and best-effort sends and log out.

        The gateway closes first, so nothing arrives that could no longer be handed
        on. What it brought before is given :data:`CLOSE_WAIT` seconds to reach
        chatlane (stored, refused, or its sender told it could not be), with the
        client and its REST API still there for what that needs; Discord never
        sends it again. Only what is left after that is cancelled.
        """
        await self._close_gateway()
        await self._lanes.aclose(CLOSE_WAIT)
        client, self._client = self._client, None
        typing, self.typing = self.typing, None
        await self._aside.aclose()
        await self._drafts.aclose()
        if typing is not None:
            await typing.aclose()
        if client is not None:
            await client.close()

    async def _close_gateway(self) -> None:
        """End the gateway connection, so Discord dispatches nothing more here; the REST API
        stays open."""
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.cancel()
            await asyncio.gather(connection, return_exceptions=True)
        client = self._client
        if client is not None and client.ws is not None and client.ws.open:
            await client.ws.close(code=1000)

    async def handled(self) -> None:
        """Wait until what the gateway's events asked for so far is done (handed to chatlane,
        ignored or refused): a drain, for shutting down in order or for tests."""
        await self._lanes.drained()

    def ready(self) -> bool:
        """Whether the bot is logged in, so the delivery worker may send (REST needs no gateway)."""
        return self._client is not None and not self._client.is_closed()

    async def deliver(self, outbound: Outbound) -> None:
        """Send ``outbound`` outside the ledger: a chunk to its draft, the rest best-effort;
        an acknowledgement holds the caller up at most
        :data:`~chatlane.adapters.aside.PATIENCE` seconds (:mod:`~chatlane.adapters.aside`),
        so one waiting out a rate limit never holds up the intake of the messages behind it."""
        client = self._client
        if client is None or _channel_of(outbound.target) is None:
            log.warning(
                "discord is not running; dropped a %s for %s", outbound.kind, outbound.target
            )
            return
        if outbound.kind is OutboundKind.CHUNK:
            self._drafts.add(outbound)
            return
        await self._aside.deliver(outbound, self._best_effort(client, outbound))

    async def _best_effort(self, client: discord.Client, outbound: Outbound) -> None:
        """Send ``outbound`` outside the ledger, a rate limit waited out in place."""
        try:
            message = await self._parts(outbound, uncertain=False)
            await send_parts(client, message, WaitBudget(RATE_LIMIT_CAP), wait_first=True)
        except DeliveryFailed as error:
            log.warning("discord send to %s failed: %s", outbound.target.chat_id, error)
        finally:
            self._drafts.forget(outbound)

    async def send(self, outbound: Outbound, attempt: Attempt) -> None:
        """Send one delivery of the ledger, all its parts, or raise why not.

        Each part carries a nonce made from :attr:`Attempt.delivery_id`, so
        Discord itself drops a re-send within its window; one that may have been
        sent before is labelled too (:data:`~chatlane.delivery.ledger.RESENT_LABEL`),
        for a re-send after that window.

        :raises DeliveryFailed: classified by :func:`~chatlane.adapters.discord_delivery.classify`.
        """
        client = self._client
        if client is None or client.is_closed():
            raise PlatformUnavailable("discord is not running")
        if _channel_of(outbound.target) is None:
            raise PermanentDelivery("discord: the delivery names no channel")
        message = await self._parts(
            outbound, uncertain=attempt.uncertain, nonce=attempt.delivery_id
        )
        await send_parts(client, message, WaitBudget(RATE_LIMIT_CAP, attempt.deadline))
        self._drafts.forget(outbound)

    async def _parts(self, outbound: Outbound, *, uncertain: bool, nonce: str = "") -> Parts:
        """``outbound`` as Discord gets it; a reply replaces its stream's draft, if one is
        shown.

        Parts are cut at the same places on every attempt, so a part sent before is the
        same part again, which its nonce deduplicates; an ``uncertain`` delivery's first
        posted part is labelled (:func:`~chatlane.delivery.ledger.label_resent`).
        """
        draft = self._drafts.of(outbound)
        shown = None if draft is None else await draft.finish()
        text = never_blank(clean_text(markdown_text(outbound, discord.utils.escape_markdown)))
        parts = [part for part in split_message(text, LABELLED_LIMIT) if not blank(part)]
        if uncertain:
            parts = label_resent(parts, 0 if shown is None else 1)
        view = None
        if outbound.kind is OutboundKind.APPROVAL and parts:
            view = approval_view(outbound.approval_id, author_of(outbound.in_reply_to))
        channel = _channel_of(outbound.target) or 0
        draft_id = None if shown is None else int(shown)
        return Parts(channel, parts, view, draft_id, nonce)

    def _draft_of(self, chunk: Outbound) -> Draft:
        """The draft a stream starts with its first ``chunk``, shown in the chunk's channel."""
        channel = _channel_of(chunk.target) or 0

        async def show(shown: str | None, text: str) -> str:
            client = self._client
            if client is None:
                raise PlatformUnavailable("discord is not running")
            if shown is None:
                return str(await post(client, channel, draft_text(text)))
            return str(await edit(client, channel, int(shown), draft_text(text)))

        return Draft(show, self._edit_interval)

    async def _show_typing(self, target: Target) -> None:
        client, channel = self._client, _channel_of(target)
        if client is not None and channel is not None:
            await client.routed.send_typing(channel)

    # -- what the gateway sends ---------------------------------------------------------

    async def _on_message(self, message: discord.Message) -> None:
        """Queue ``message`` in its channel's lane (synchronously: in dispatch order)."""
        self._lanes.run(str(message.channel.id), self._handle_message(message))

    async def _handle_message(self, message: discord.Message) -> None:
        client, channels = self._client, self._channels
        if client is None or channels is None or client.user is None:
            return
        allow_bots = self._settings.allow_bots
        posted = await read_message(message, client.user.id, channels, allow_bots=allow_bots)
        if posted is None or not self._guild_allowed(posted.guild_id):
            return
        if not self._addressed(posted):
            self._overhear(posted)
        elif self._seen.note(posted.id):
            await self._take(posted.inbound())

    def _guild_allowed(self, guild_id: int | None) -> bool:
        allowed = self._settings.allowed_guilds
        return guild_id is None or not allowed or str(guild_id) in allowed

    def _addressed(self, posted: Posted) -> bool:
        """Whether ``posted`` is for the bot (see the module docstring)."""
        where = posted.where
        if where.chat_type is ChatType.DM:
            return True
        kind = "channel" if where.thread_id is None else "thread"
        mentioned = posted.mentions_bot or posted.replies_to_bot
        if self._groups.answers(where.chat_id, kind, posted.text, mentioned=mentioned):
            return True
        return self._hub is not None and self._hub.awaits_answer(posted.text, posted.inbound)

    def _overhear(self, posted: Posted) -> None:
        """Keep ``posted`` (not for the bot) as context, where the group rule says so."""
        where = posted.where
        kind = "channel" if where.thread_id is None else "thread"
        mode = self._groups.unmentioned(where.chat_id, kind)
        if mode is Unmentioned.CONTEXT and self._hub is not None:
            self._hub.overhear(posted.inbound(), self._groups.limits)

    async def _on_interaction(self, interaction: discord.Interaction) -> None:
        """Answer a press at once, beside its channel's queue (Discord wants its answer within
        three seconds); what the press sends joins that queue now (synchronously: in dispatch
        order), after the channel's earlier messages."""
        answered = self._lanes.beside(self._answer_press(interaction))
        self._lanes.run(str(interaction.channel_id), self._send_press(answered))

    async def _answer_press(self, interaction: discord.Interaction) -> InboundMessage | None:
        """Answer ``interaction``: silently for the asker's press, else with why it sends
        nothing (only its user sees that); the message it sends, if any."""
        channels = self._channels
        press = None if channels is None else await read_press(interaction, channels)
        if press is None:
            return None
        answer = press.answer
        if answer is None:
            await self._tell(interaction, _NO_LONGER_ACTIVE)
            return None
        if answer.asker is not None and str(press.user) != answer.asker:
            await self._tell(interaction, f"Only <@{answer.asker}> can answer this approval.")
            return None
        inbound = press.inbound()
        if not self._guild_allowed(interaction.guild_id) or not self._admit(inbound):
            await self._tell(interaction, _NOT_ALLOWED)
            return None
        await self._answer(interaction, {"type": 6})  # acknowledged; the chat hears the rest
        return inbound

    async def _send_press(self, answered: asyncio.Task[InboundMessage | None]) -> None:
        """Hand on the message of the press ``answered`` answers, once it is answered."""
        await asyncio.wait([answered])
        failed = answered.cancelled() or answered.exception() is not None
        inbound = None if failed else answered.result()
        if inbound is not None:
            await self._submit(inbound)

    def _admit(self, message: InboundMessage) -> bool:
        return self._hub is not None and self._hub.admit(message)

    async def _tell(self, interaction: discord.Interaction, text: str) -> None:
        """Answer ``interaction`` with ``text`` only its user sees."""
        data = {"content": text, "flags": _EPHEMERAL, "allowed_mentions": {"parse": []}}
        await self._answer(interaction, {"type": 4, "data": data})

    async def _answer(self, interaction: discord.Interaction, answer: dict[str, Any]) -> None:
        client = self._client
        if client is None:
            return
        try:
            await answer_interaction(client, interaction, answer)
        except (discord.DiscordException, aiohttp.ClientError, TimeoutError) as error:
            log.warning("discord: interaction %s could not be answered: %s", interaction.id, error)

    async def refuse(self, message: InboundMessage) -> None:
        """A stranger wrote: told at most once an hour in a DM; silence in a server."""
        source = message.source
        if source.chat_type is ChatType.DM and self._refusal_due(source.user_id or ""):
            await self.deliver(_notice(message, _NOT_ALLOWED))

    def _refusal_due(self, user: str) -> bool:
        """Whether ``user`` may be told again (:data:`REFUSAL_INTERVAL`); records it if so."""
        now, last = self._clock(), self._refused_at.get(user)
        if last is not None and now - last < REFUSAL_INTERVAL:
            return False
        self._refused_at.note(user, now)
        return True

    async def _take(self, message: InboundMessage) -> None:
        """Hand ``message`` to the hub, unless one of its files is over the cap: then its
        sender is told so (a stranger hears only what strangers do)."""
        cap = self._settings.max_attachment_bytes
        too_large = oversized(message.attachments, cap)
        if too_large is None:
            await self._submit(message)
        elif not self._admit(message):
            await self.refuse(message)
        else:
            await self.deliver(_notice(message, too_large_notice(too_large, cap)))

    async def _submit(self, message: InboundMessage) -> DispatchResult | None:
        """Hand ``message`` to the hub; if the hub fails, tell the chat instead of going silent.
        While its session works on it, the channel shows the bot typing."""
        if self._hub is None:
            return None
        try:
            result = await self._hub.submit(message)
        except ChatlaneError as error:
            log.warning("discord message %s could not be handled: %s", message.id, error)
        except Exception:
            log.exception("discord message %s could not be handled", message.id)
        else:
            if self.typing is not None and result.command is None and not result.refused:
                self.typing.show(result.session_key, Target.of(message.source))
            return result
        await self.deliver(_notice(message, _NOT_HANDLED))
        return None


async def _log_in(client: GatewayClient, token: str, api_url: str) -> None:
    """Log ``client`` in with ``token``; closed again if that fails.

    :raises ConfigError: the API rejected the token, failed or could not be reached.
    """
    try:
        await client.login(token)
    except discord.LoginFailure:
        await client.close()
        raise ConfigError(f"the Discord API at {api_url} rejected the bot token") from None
    except (discord.DiscordException, aiohttp.ClientError, TimeoutError, OSError) as error:
        await client.close()
        reason = (str(error) or type(error).__name__).replace(token, "<token>")
        raise ConfigError(f"the Discord API at {api_url} failed: {reason}") from None


def _refused(error: BaseException) -> bool:
    """Whether the gateway refused the bot for good (its token, its intents, its shards)."""
    return isinstance(error, discord.ClientException | discord.ConnectionClosed)


def _gateway_failure(error: BaseException | None) -> str:
    """Why the gateway connection ended, in one line."""
    if isinstance(error, discord.PrivilegedIntentsRequired):
        return _INTENT_REFUSED
    if isinstance(error, discord.ConnectionClosed) and error.code == 4004:
        return "the Discord gateway rejected the bot token"
    reason = "it closed" if error is None else (str(error) or type(error).__name__)
    return f"the Discord gateway failed: {reason}"


def _channel_of(target: Target) -> int | None:
    """The channel to post in for ``target``: its thread, else its chat (a snowflake)."""
    channel = target.thread_id or target.chat_id or ""
    return int(channel) if is_snowflake(channel) else None


def draft_text(streamed: str) -> str:
    """What a draft shows of the text streamed so far: its first message's worth."""
    parts = split_message(clean_text(streamed), MESSAGE_LIMIT - len(MORE))
    return parts[0] + MORE if len(parts) > 1 else parts[0]


def _notice(message: InboundMessage, text: str) -> Outbound:
    """A notice about ``message`` to its channel or thread, in no session."""
    target = Target.of(message.source)
    return Outbound(OutboundKind.NOTICE, NO_SESSION, target, text, 0, (message.id,))
