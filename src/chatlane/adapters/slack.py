"""Slack with slack-sdk, by the Events API over HTTP or Socket Mode; DMs, channels,
group DMs and threads.

What stays true:

* Slack reaches the app one way, ``slack.mode``: in ``events`` mode by its
  requests (``POST /slack/events``, ``POST /slack/interactions``), handled
  only when signed with the signing secret, and fresh
  (:mod:`~chatlane.adapters.slack_events`); in ``socket`` mode by envelopes
  over a WebSocket the app opens with its app-level token
  (:mod:`~chatlane.adapters.slack_socket`), and the two routes are not
  served. Either way one :class:`~chatlane.adapters.slack_events.Intake`
  handles what arrives: Slack is answered (a response, an acknowledgement)
  once chatlane holds it, and what it asks for is done afterwards, in order
  within a conversation. A shutdown stops taking events first (503, or the
  connection closed), then gives what Slack was answered for :data:`CLOSE_WAIT`
  seconds to be handed on.
* An event is handled once: a retry of an event seen before is not handed on
  again (by ``event_id``; it is answered once the first copy is), and a
  second event for a message seen before is ignored (a
  mention arrives as ``message`` and as ``app_mention``); the message id
  derived from the message (:func:`~chatlane.adapters.slack_wire.message_id`)
  lets the store keep one record of it across processes too.
* Only people's messages go to chatlane (:func:`~chatlane.adapters.slack_wire.read_posted`).
  Outside a DM the shared group rule decides (:class:`~chatlane.groups.GroupPolicy`,
  keyed by the conversation and ``channel`` or ``thread``): with ``require_mention``,
  only a message that mentions the bot, matches a mention pattern, or is in a
  thread the bot is in (it started it, or answered there) goes to chatlane;
  the bot's mention is taken out of the text. A message whose thread the store
  cannot say is the bot's is not taken as not for the bot: its sender is told,
  privately, that it could not be handled.
  With ``unmentioned = "context"`` the others are kept for the next turn of
  their session (:meth:`~chatlane.hub.Hub.overhear`); by default they are
  ignored.
* A message's files go with it as attachments, referenced by their private
  URLs (:mod:`~chatlane.adapters.slack_files`); a message with a file over
  ``slack.max_attachment_bytes`` is refused with a notice instead, after the
  group and allowlist checks (a stranger hears only what strangers do).
* Replies go to the conversation and thread the message came from, as mrkdwn,
  split to fit (:mod:`~chatlane.adapters.slack_format`). A streamed reply is
  shown as a draft edited in place (:mod:`~chatlane.adapters.slack_stream`);
  the complete reply replaces it. Slack has no typing indicator for bots
  over the Web API, so nothing is shown while a turn runs.
* An approval prompt carries Approve / Deny buttons naming its request and its
  asker; a press counts only from the asker, and is sent as
  ``/approve #<request>`` or ``/deny #<request>`` by the user who pressed it.
  Anyone else's press is answered with an ephemeral message and sends nothing.
* A sender not on the allowlist hears so at most once per :data:`REFUSAL_INTERVAL`:
  in a DM by a message, elsewhere by an ephemeral message only they see.
* Replies, notices and prompts go through the delivery ledger
  (:meth:`SlackAdapter.send`); everything sent outside it (acknowledgements,
  refusals, and everything with ``[delivery] enabled = false``) is best-effort:
  a failure is logged, never raised.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import aiohttp
from slack_sdk.errors import SlackApiError
from slack_sdk.web.async_client import AsyncWebClient
from starlette.routing import BaseRoute

from chatlane.adapters.aside import Aside
from chatlane.adapters.slack_delivery import Parts, bot_user, classify, post, send_parts
from chatlane.adapters.slack_events import Inbox, Intake
from chatlane.adapters.slack_format import MESSAGE_LIMIT, split_message, to_mrkdwn
from chatlane.adapters.slack_socket import SocketMode
from chatlane.adapters.slack_stream import EDIT_INTERVAL, Draft, Drafts, draft_text
from chatlane.adapters.slack_wire import (
    PLATFORM,
    Posted,
    Press,
    Recent,
    approval_blocks,
    author_of,
    check_secrets,
    read_posted,
)
from chatlane.adapters.splitting import blank, never_blank
from chatlane.adapters.waits import WaitBudget
from chatlane.approvals import markdown_text
from chatlane.attachments import oversized, too_large_notice
from chatlane.config import Config, SlackMode
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

log = logging.getLogger("chatlane.adapters.slack")

REQUEST_TIMEOUT = 20.0
"""Seconds one Web API call may take (less than the delivery worker's ``send_timeout``)."""
RATE_LIMIT_CAP = 60.0
"""Seconds one message may wait out rate limits in all, in place, before it is given up."""
REFUSAL_INTERVAL = 3600.0
"""Seconds between two refusals told to one stranger."""
CLOSE_WAIT = 10.0
"""Seconds a shutdown waits, once Slack's events are no longer taken, for those it took to
be handed to chatlane; what is left then is cancelled."""
_SEEN_KEPT = 8192
"""Message ids remembered, so a second event for one message is ignored."""
_THREADS_KEPT = 8192
"""Threads remembered as ones the bot is in."""
_REFUSALS_KEPT = 4096
_DRAFTS_KEPT = 1024
_NOT_ALLOWED = "Sorry, you are not allowed to use this assistant."
LABELLED_LIMIT = MESSAGE_LIMIT - len(RESENT_LABEL)
"""Where a reply's parts are cut, labelled or not: the same cuts on every attempt."""
_NOT_HANDLED = "Sorry — your message could not be handled right now; please try again."
_NO_LONGER_ACTIVE = "This button is no longer active."


class SlackAdapter:
    """The Slack app: receives the Events API (over HTTP or Socket Mode), sends with
    ``chat.postMessage``.

    :param config: the gateway configuration (``[slack]``).
    :param secrets: read at start, for the bot token and the signing secret or the
        app token; without them, :meth:`start` reads ``slack.bot_token`` and
        ``slack.signing_secret`` or ``slack.app_token``
        (:func:`~chatlane.secrets.read_secret`).
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
        self._settings = config.slack
        self._groups = GroupPolicy(config.slack, "slack")
        self._secrets = secrets
        self._edit_interval = edit_interval
        self._clock = clock
        self._hub: Hub | None = None
        self._client: AsyncWebClient | None = None
        self._bot_user = ""
        self._seen = Recent(_SEEN_KEPT)
        self._threads = Recent(_THREADS_KEPT)
        self._refused_at = Recent(_REFUSALS_KEPT)
        self._intake = Intake(self._on_event, self._on_press)
        self._inbox = Inbox(self._intake)
        self._socket: SocketMode | None = None
        self._drafts = Drafts(self._draft_of, _DRAFTS_KEPT)
        self._aside = Aside()
        """Best-effort sends (acknowledgements), which hold their caller up only briefly."""

    def routes(self) -> Sequence[BaseRoute]:
        """Slack's Request URLs: ``/slack/events``, and ``/slack/interactions`` (buttons);
        none in Socket Mode."""
        return [] if self._settings.mode is SlackMode.SOCKET else self._inbox.routes()

    async def start(self, hub: Hub) -> None:
        """Check the bot token with ``auth.test``, then take Slack's requests, or open
        Socket Mode's connection.

        :raises ConfigError: if a secret the mode needs is missing or malformed,
            the Web API rejects a token or cannot be reached, or Socket Mode's
            connection does not open.
        """
        if self._client is not None:
            raise ChatlaneError("the Slack adapter is already running")
        token, signing_secret, app_token = self._read_secrets()
        api_url = self._settings.api_url
        session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT))
        client = AsyncWebClient(token=token, base_url=api_url, session=session, retry_handlers=[])
        try:
            self._bot_user = await bot_user(client, api_url)
            self._hub, self._client = hub, client  # before an envelope can arrive
            await self._receive(client, signing_secret, app_token)
        except ConfigError:
            self._hub, self._client, self._socket = None, None, None
            await session.close()
            raise

    async def _receive(self, client: AsyncWebClient, signing_secret: str, app_token: str) -> None:
        """Take Slack's signed requests from now on, or open Socket Mode's connection."""
        if self._settings.mode is SlackMode.SOCKET:
            self._socket = SocketMode(self._intake)
            await self._socket.open(client, app_token, self._settings.api_url)
        else:
            self._inbox.open(signing_secret)

    def _read_secrets(self) -> tuple[str, str, str]:
        """The bot token, the signing secret and the app token (each ``""`` if not read)."""
        secrets, settings = self._secrets, self._settings
        if secrets is not None:
            token, signing_secret = secrets.slack_bot_token, secrets.slack_signing_secret
            app_token = secrets.slack_app_token
        else:
            socket = settings.mode is SlackMode.SOCKET
            token = read_secret(settings.bot_token)
            signing_secret = "" if socket else read_secret(settings.signing_secret)
            app_token = read_secret(settings.app_token) if socket else ""
        check_secrets(settings, token, signing_secret, app_token)
        return token, signing_secret, app_token

    async def aclose(self) -> None:
        """Stop taking Slack's events, let those Slack was answered for be handed on, then
        stop drafts and best-effort sends and close the client.

        Slack's requests are refused (503) and Socket Mode's connection closes first, so
        Slack sends again what arrives from now on and every envelope not acknowledged.
        What Slack was already answered for (at
        :data:`~chatlane.adapters.slack_events.ANSWER_WITHIN`, while a slow store still
        wrote it) Slack never sends again: it is given :data:`CLOSE_WAIT` seconds to
        reach chatlane (stored, refused, or its sender told it could not be), with the
        Web API still there for what that needs. Only what is left after that is
        cancelled.
        """
        await self._stop_taking()
        await self._intake.aclose(CLOSE_WAIT)
        client, self._client = self._client, None
        await self._aside.aclose()
        await self._drafts.aclose()
        if client is not None and client.session is not None:
            await client.session.close()

    async def _stop_taking(self) -> None:
        """Refuse Slack's requests from now on (503) and close Socket Mode's connection, so
        Slack sends again what this process did not take; the Web API stays open."""
        socket, self._socket = self._socket, None
        self._inbox.close()
        if socket is not None:
            await socket.aclose()

    async def handled(self) -> None:
        """Wait until what Slack sent so far asked for is done (handed to chatlane,
        ignored or refused): a drain, for shutting down in order or for tests."""
        await self._intake.lanes.drained()

    def ready(self) -> bool:
        """Whether the app runs, so the delivery worker may send (:mod:`chatlane.delivery`)."""
        return self._client is not None

    async def deliver(self, outbound: Outbound) -> None:
        """Send ``outbound`` outside the ledger: a chunk to its draft, the rest best-effort;
        an acknowledgement holds the caller up at most
        :data:`~chatlane.adapters.aside.PATIENCE` seconds (:mod:`~chatlane.adapters.aside`),
        so one waiting out a rate limit never holds up the intake of the messages behind it."""
        client, target = self._client, outbound.target
        if client is None or target.chat_id is None:
            log.warning("slack is not running; dropped a %s for %s", outbound.kind, target)
            return
        if outbound.kind is OutboundKind.CHUNK:
            self._drafts.add(outbound)
            return
        await self._aside.deliver(outbound, self._best_effort(client, outbound))

    async def _best_effort(self, client: AsyncWebClient, outbound: Outbound) -> None:
        """Send ``outbound`` outside the ledger, a rate limit waited out in place."""
        try:
            message = await self._parts(outbound, uncertain=False)
            await send_parts(client, message, WaitBudget(RATE_LIMIT_CAP), wait_first=True)
        except DeliveryFailed as error:
            log.warning("slack chat.postMessage to %s failed: %s", outbound.target.chat_id, error)
        finally:
            self._drafts.forget(outbound)

    async def send(self, outbound: Outbound, attempt: Attempt) -> None:
        """Send one delivery of the ledger, all its parts, or raise why not.

        A delivery that may have been sent before is labelled
        (:data:`~chatlane.delivery.ledger.RESENT_LABEL`): Slack cannot deduplicate.

        :raises DeliveryFailed: classified by :func:`~chatlane.adapters.slack_delivery.classify`.
        """
        client = self._client
        if client is None:
            raise PlatformUnavailable("slack is not running")
        if outbound.target.chat_id is None:
            raise PermanentDelivery("slack: the delivery names no conversation")
        message = await self._parts(outbound, uncertain=attempt.uncertain)
        await send_parts(client, message, WaitBudget(RATE_LIMIT_CAP, attempt.deadline))
        self._drafts.forget(outbound)

    async def _parts(self, outbound: Outbound, *, uncertain: bool) -> Parts:
        """``outbound`` as Slack gets it; a reply replaces its stream's draft, if one is shown.

        An ``uncertain`` delivery's first posted part is labelled
        (:func:`~chatlane.delivery.ledger.label_resent`): the first part when no draft is
        shown, else the second (the draft's edit repeats nothing, the parts after it may).
        """
        draft = self._drafts.of(outbound)
        draft_ts = None if draft is None else await draft.finish()
        mrkdwn = to_mrkdwn(clean_text(markdown_text(outbound)))  # escapes links and mentions
        text = never_blank(mrkdwn)
        parts = [part for part in split_message(text, LABELLED_LIMIT) if not blank(part)]
        if uncertain:
            parts = label_resent(parts, 0 if draft_ts is None else 1)
        blocks = None
        if outbound.kind is OutboundKind.APPROVAL and parts:
            asker = author_of(outbound.in_reply_to)
            blocks = approval_blocks(parts[-1], outbound.approval_id, asker)
        return Parts(outbound.target, parts, blocks, draft_ts)

    def _draft_of(self, chunk: Outbound) -> Draft:
        """The draft a stream starts with its first ``chunk``, shown in the chunk's thread."""
        target = chunk.target

        async def show(ts: str | None, text: str) -> str:
            client = self._client
            if client is None:
                raise PlatformUnavailable("slack is not running")
            return await post(client, target, draft_text(text), ts=ts)

        return Draft(show, self._edit_interval)

    async def _on_event(self, event: dict[str, Any]) -> None:
        posted = read_posted(event, self._bot_user)
        if posted is None:
            return
        try:
            for_the_bot = await self._for_the_bot(posted)
        except ChatlaneError as error:
            await self._unknown_thread(posted, error)
            return
        if not for_the_bot:
            self._overhear(posted)
            return
        if not self._seen.note(posted.id):
            return
        result = await self._take(posted.inbound())
        if posted.thread_ts is not None and result is not None and _ran_a_turn(result):
            self._threads.note((posted.channel, posted.thread_ts))  # the bot answers there

    async def _for_the_bot(self, posted: Posted) -> bool:
        """Whether ``posted`` is for the bot; whether its thread is one the bot is in is
        asked only when that decides it.

        :raises ChatlaneError: the store could not say whether the bot is in the thread.
        """
        if self._addressed(posted, in_bot_thread=False):
            return True
        return await self._in_bot_thread(posted) and self._addressed(posted, in_bot_thread=True)

    async def _unknown_thread(self, posted: Posted, error: ChatlaneError) -> None:
        """``posted`` is for the bot only if the bot is in its thread, which the store could
        not say (``error``): its sender alone is told it could not be handled, as it may
        not have been said to the bot at all."""
        log.warning("slack message %s could not be handled: %s", posted.id, error)
        await self._ephemeral(posted.channel, posted.user, posted.thread_ts, _NOT_HANDLED)

    def _addressed(self, posted: Posted, in_bot_thread: bool) -> bool:
        """Whether ``posted`` is for the bot (see the module docstring)."""
        if posted.chat_type is ChatType.DM:
            return True
        kind = "channel" if posted.thread_ts is None else "thread"
        mentioned = posted.mentions_bot or in_bot_thread
        if self._groups.answers(posted.channel, kind, posted.text, mentioned=mentioned):
            return True
        return self._hub is not None and self._hub.awaits_answer(posted.text, posted.inbound)

    def _overhear(self, posted: Posted) -> None:
        """Keep ``posted`` (not for the bot) as context, where the group rule says so."""
        kind = "channel" if posted.thread_ts is None else "thread"
        mode = self._groups.unmentioned(posted.channel, kind)
        if mode is Unmentioned.CONTEXT and self._hub is not None:
            self._hub.overhear(posted.inbound(), self._groups.limits)

    async def _in_bot_thread(self, posted: Posted) -> bool:
        """Whether ``posted`` is in a thread the bot started or answered in.

        A thread this process has not seen the bot answer in is asked of the
        store once (a turn ran for its session, in any process sharing it), and
        remembered here if so: a thread is one session, so this holds across
        processes and restarts.

        :raises ChatlaneError: the store could not say.
        """
        thread = posted.thread_ts
        if thread is None or posted.mentions_bot:
            return False
        if posted.parent_user == self._bot_user or (posted.channel, thread) in self._threads:
            return True
        if posted.chat_type is ChatType.DM or self._hub is None:
            return False
        if not await self._hub.has_run(posted.inbound()):
            return False
        self._threads.note((posted.channel, thread))
        return True

    async def _on_press(self, press: Press) -> None:
        if not press.command:
            await self._ephemeral(press.channel, press.user, press.thread_ts, _NO_LONGER_ACTIVE)
            return
        if press.asker is not None and press.user != press.asker:
            only = f"Only <@{press.asker}> can answer this approval."
            await self._ephemeral(press.channel, press.user, press.thread_ts, only)
            return
        inbound = press.inbound()
        if self._hub is None or not self._hub.admit(inbound):
            await self._ephemeral(press.channel, press.user, press.thread_ts, _NOT_ALLOWED)
            return
        await self._submit(inbound)

    async def refuse(self, message: InboundMessage) -> None:
        """A stranger wrote: told at most once an hour, in a DM or by an ephemeral message."""
        source = message.source
        user = source.user_id or ""
        if not self._refusal_due(user):
            return
        if source.chat_type is ChatType.DM:
            await self.deliver(_notice(message, _NOT_ALLOWED))
        else:
            await self._ephemeral(source.chat_id or "", user, source.thread_id, _NOT_ALLOWED)

    def _refusal_due(self, user: str) -> bool:
        """Whether ``user`` may be told again (:data:`REFUSAL_INTERVAL`); records it if so."""
        now, last = self._clock(), self._refused_at.get(user)
        if last is not None and now - last < REFUSAL_INTERVAL:
            return False
        self._refused_at.note(user, now)
        return True

    async def _ephemeral(self, channel: str, user: str, thread: str | None, text: str) -> None:
        """Tell ``user`` alone, in ``channel`` and ``thread``; a failure is logged."""
        client = self._client
        if client is None:
            return
        try:
            await client.chat_postEphemeral(channel=channel, user=user, text=text, thread_ts=thread)
        except (SlackApiError, aiohttp.ClientError, TimeoutError) as error:
            log.warning("slack chat.postEphemeral in %s failed: %s", channel, classify(error))

    async def _take(self, message: InboundMessage) -> DispatchResult | None:
        """Hand ``message`` to the hub, unless one of its files is over the cap: then its
        sender is told so (a stranger hears only what strangers do), and None."""
        cap = self._settings.max_attachment_bytes
        too_large = oversized(message.attachments, cap)
        if too_large is None:
            return await self._submit(message)
        if self._hub is not None and not self._hub.admit(message):
            await self.refuse(message)
        else:
            await self.deliver(_notice(message, too_large_notice(too_large, cap)))
        return None

    async def _submit(self, message: InboundMessage) -> DispatchResult | None:
        """Hand ``message`` to the hub; if the hub fails, tell the chat instead of going silent."""
        if self._hub is None:
            return None
        try:
            return await self._hub.submit(message)
        except ChatlaneError as error:
            log.warning("slack message %s could not be handled: %s", message.id, error)
        except Exception:
            log.exception("slack message %s could not be handled", message.id)
        await self.deliver(_notice(message, _NOT_HANDLED))
        return None


def _notice(message: InboundMessage, text: str) -> Outbound:
    """A notice about ``message`` to its conversation and thread, in no session."""
    target = Target.of(message.source)
    return Outbound(OutboundKind.NOTICE, NO_SESSION, target, text, 0, (message.id,))


def _ran_a_turn(result: DispatchResult) -> bool:
    """Whether ``result`` put its message to a turn (run, queued or steered: its session's
    generation is above 0 in the store), which makes its thread one the bot is in, as
    every process sharing the store sees it; a command's reply does not."""
    return result.command is None and not result.refused
