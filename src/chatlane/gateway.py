"""Gateway wiring: from an inbound message to the engine or a command.

:meth:`Gateway.dispatch` is the one entry point adapters call. It first asks
whether the sender may use the gateway (:mod:`chatlane.authorization`), then
names the session (:mod:`chatlane.identity`), routes slash commands to the
:class:`~chatlane.commands.CommandRouter` (they may run while a turn is busy),
and hands everything else to the :class:`~chatlane.runtime.engine.TurnEngine`.
Replies leave through the adapter's ``deliver`` function only, after passing
every outbound filter (:meth:`Gateway.add_outbound_filter`) — or, for a
platform whose sender joined the delivery ledger (:meth:`Gateway.add_sender`),
through the store's ledger and its worker (:mod:`chatlane.delivery`).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeAlias

import msgspec

from chatlane.authorization import NOT_ALLOWED, Authorize, CommandGuard, allow_all, any_command
from chatlane.commands import (
    CommandRefused,
    CommandRouter,
    ParsedCommand,
    default_router,
    parse_command,
)
from chatlane.delivery.ledger import DeliveryLedger
from chatlane.delivery.worker import DeliverySettings, DeliveryWorker, Sender
from chatlane.errors import ChatlaneError, InvalidSource
from chatlane.identity import (
    NO_SESSION,
    ChatType,
    KeyPolicy,
    SessionSource,
    build_session_key,
    is_shared,
)
from chatlane.lifecycle import LifecycleOptions
from chatlane.overheard import ContextLimits, keep, line_of, take
from chatlane.runtime.busy import BusyOutcome
from chatlane.runtime.engine import RuntimeSettings, TurnEngine
from chatlane.runtime.outcomes import OnOutcome
from chatlane.runtime.recovery import OnAdopted
from chatlane.session_commands import YES, YES_OR_NO, is_yes_or_no
from chatlane.state import SessionRegistry, SessionState
from chatlane.stores.base import Store
from chatlane.types import (
    Agent,
    Deliver,
    InboundMessage,
    Outbound,
    OutboundFilter,
    OutboundKind,
    SessionKey,
    Target,
)

if TYPE_CHECKING:
    from chatlane.scheduling.loop import Scheduler

log = logging.getLogger("chatlane.gateway")

Refuse: TypeAlias = Callable[[InboundMessage], Awaitable[None]]
"""How a refused sender is told (or not); see :meth:`Gateway.notify_refused`."""


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    """How the gateway authorizes senders, names sessions and runs turns.

    :param authorize: whether a sender (or a job's creator) may use the
        gateway; everyone by default. An :class:`~chatlane.authorization.Allowlist`
        is one.
    :param command_guard: whether a sender may run a command in a session shared
        with others (:func:`~chatlane.identity.is_shared`); every command by
        default. :class:`~chatlane.authorization.AdminCommands` is one.
    """

    key_policy: KeyPolicy = field(default_factory=KeyPolicy)
    runtime: RuntimeSettings = field(default_factory=RuntimeSettings)
    lifecycle: LifecycleOptions = field(default_factory=LifecycleOptions)
    authorize: Authorize = allow_all
    command_guard: CommandGuard = any_command


class DispatchResult(msgspec.Struct, frozen=True):
    """What became of one inbound message.

    ``refused`` is True when the sender was not authorized: nothing ran and
    nothing was stored.
    """

    session_key: SessionKey
    message_id: str
    started: bool = False
    outcome: BusyOutcome | None = None
    command: str | None = None
    refused: bool = False


class Gateway:
    """Receives messages from adapters and runs one turn per session."""

    def __init__(
        self,
        agent: Agent,
        deliver: Deliver,
        *,
        settings: GatewaySettings | None = None,
        router: CommandRouter | None = None,
        registry: SessionRegistry | None = None,
        store: Store | None = None,
        holder: str | None = None,
        scheduler: Scheduler | None = None,
        refuse: Refuse | None = None,
        on_outcome: OnOutcome | None = None,
        on_adopted: OnAdopted | None = None,
    ) -> None:
        """``on_outcome`` hears the one outcome of every message the gateway accepted;
        ``on_adopted`` each message it adopted from a process that stopped (or an operator
        retried), once it runs or waits here."""
        self.settings = settings or GatewaySettings()
        self.router = router if router is not None else default_router(self.settings.lifecycle)
        self._deliver = deliver
        self._refuse = refuse or self.notify_refused
        self._closed = False
        self._started = False
        self._ledgered: set[str] = set()
        self.scheduler: Scheduler | None = None
        self.delivery: DeliveryWorker | None = None
        """The delivery ledger's worker, once a sender joined (:meth:`add_sender`)."""
        self.engine = TurnEngine(
            agent,
            self._deliver,
            settings=self.settings.runtime,
            registry=registry,
            store=store,
            holder=holder,
            on_outcome=on_outcome,
            on_adopted=on_adopted,
        )
        if scheduler is not None:
            self.use_scheduler(scheduler)

    def use_scheduler(self, scheduler: Scheduler) -> None:
        """Attach ``scheduler`` (see :mod:`chatlane.scheduling`).

        It then sees every message a person sends, adds its outbound filters
        (which hold back deliveries for its own jobs), and starts and stops
        with the gateway; if the gateway already started, call ``await
        scheduler.start()`` yourself.

        :raises RuntimeError: if ``scheduler`` is attached to another gateway.
        """
        scheduler.bind(self)
        self.scheduler = scheduler

    def add_sender(self, sender: Sender, settings: DeliverySettings | None = None) -> None:
        """Deliver ``sender.platform``'s replies, notices and approval prompts through the ledger.

        From then on they are recorded in the store (a turn's reply with its
        commit) and sent by :attr:`delivery`, the gateway's one worker, which
        retries until the platform accepts them (:mod:`chatlane.delivery`).
        ``settings`` configure the worker when it is created (by the first
        call of this method or :meth:`ledger_for`). The worker starts with the
        gateway (or now, if it already started).
        """
        self._worker(settings).add(sender)
        self.ledger_for(sender.platform)

    def ledger_for(self, platform: str, settings: DeliverySettings | None = None) -> None:
        """Record ``platform``'s replies, notices and prompts in the ledger, sender or not.

        For a process that serves no adapter of ``platform`` but may answer
        its messages (a session adopted after another process died): what it
        records, a process with the platform's sender delivers.
        """
        worker = self._worker(settings)
        self._ledgered.add(platform)
        self.engine.outlet.ledger = DeliveryLedger(self.engine.store, self._ledgered, worker.poke)

    def _worker(self, settings: DeliverySettings | None) -> DeliveryWorker:
        engine = self.engine
        if self.delivery is None:
            self.delivery = DeliveryWorker(
                engine.store, engine.holder, settings, count=engine.metrics.delivery
            )
            if self._started:
                self.delivery.start()
        return self.delivery

    def add_outbound_filter(self, keep: OutboundFilter) -> None:
        """Deliver only what ``keep`` returns True for.

        Every outbound message — replies, chunks, acks, notices — passes the
        filters in the order they were added, just before the adapter's
        ``deliver``; the first that returns False holds it back (later ones do
        not see it). A filter changes only what is delivered, never what is
        stored; one that raises is logged like a failed delivery. It runs on
        the delivery path of every message, so it must be quick.
        """
        self.engine.outlet.add_filter(keep)

    def session_key(self, message: InboundMessage) -> SessionKey:
        """The session ``message`` belongs to (lone surrogates read as U+FFFD, as dispatched).

        :raises InvalidSource: if its source cannot name a session.
        """
        return build_session_key(message.cleaned().source, self.settings.key_policy)

    def authorized(self, source: SessionSource) -> bool:
        """Whether ``source``'s sender may use the gateway now (``settings.authorize``).

        The one check, for a message and for every run of a job created from a chat.
        """
        return self.settings.authorize(source)

    def admit(self, message: InboundMessage) -> bool:
        """Whether ``message``'s sender may use the gateway; a refusal is logged and counted.

        The sender is not told here (:meth:`dispatch` does that).
        """
        if self.authorized(message.source):
            return True
        self._count_refused(message)
        return False

    def _count_refused(self, message: InboundMessage) -> None:
        source = message.source
        log.info("refused user %r on %s", source.user_id, source.platform)
        self.engine.metrics.refused(source.platform)

    async def notify_refused(self, message: InboundMessage) -> None:
        """Tell a refused sender with a notice to their chat (the default ``refuse``)."""
        target = Target.of(message.source)
        notice = Outbound(OutboundKind.NOTICE, NO_SESSION, target, NOT_ALLOWED, 0, (message.id,))
        await self.engine.outlet.deliver(notice)

    async def dispatch(self, message: InboundMessage) -> DispatchResult:
        """Handle one inbound message: a refusal, a command, a new turn, or a busy outcome.

        Step 1 is authorization: a sender :meth:`authorized` refuses is
        logged, counted (``chatlane_senders_refused_total``) and told through
        the ``refuse`` hook (a notice by default), and the result says
        ``refused``; nothing runs and nothing is stored.

        A command the sender may not run in a shared session (``settings.command_guard``)
        is answered with a notice and runs nothing — a "yes" confirming one too.

        A plain "yes" or "no" answers a pending approval or confirmation first.
        Lone surrogates in the text or source (which no store or wire can
        carry) are replaced by U+FFFD first.
        """
        message = message.cleaned()
        if not self.settings.authorize(message.source):  # as admit(), one call fewer
            self._count_refused(message)
            await self._refuse(message)
            key = build_session_key(message.source, self.settings.key_policy)
            return DispatchResult(key, message.id, refused=True)
        key = build_session_key(message.source, self.settings.key_policy)
        if self.scheduler is not None and not message.internal:
            self.scheduler.touch(key, message.source)
        parsed = None
        if not message.internal and self._may_be_command(key, message):
            parsed = await self._command_for(key, message)
        if parsed is not None and not self._may_run(key, message.source, parsed.name):
            return await self._refuse_command(key, message, parsed.name)
        if parsed is not None:
            policy = self._sends_as(parsed)
            if not policy:
                return await self._run_command(key, message, parsed)
            message = msgspec.structs.replace(message, text=parsed.args, busy_policy=policy)
        message = self._with_context(key, message)
        try:
            outcome = await self.engine.submit(key, message)
        except BaseException:
            self._give_back(key, message)
            raise
        return DispatchResult(key, message.id, outcome is None, outcome)  # started, outcome

    async def has_run(self, message: InboundMessage) -> bool:
        """Whether a turn ever ran, in any process sharing the store, for the session
        ``message`` would go to: its generation there is above 0 (every turn's lease
        bumps it). False when its source names no session.

        :raises ChatlaneError: the store could not say (a :class:`~chatlane.errors.StoreError`):
            not known, which a caller must not take for no.
        """
        try:
            key = self.session_key(message)
        except InvalidSource:
            return False
        return await self.engine.store.generation(key) > 0

    def awaits_answer(self, message: InboundMessage) -> bool:
        """Whether ``message``, said in a shared chat but not to the bot, is a plain yes or
        no its sender owes an approval prompt: a request of their own waits in its session
        here. An adapter hands such a message on as if it were for the bot, so the prompt's
        "(or yes)" holds where the chat needs the bot mentioned. Anyone else's yes, and a
        confirmation's (``/new``), still needs the mention.
        """
        if not is_yes_or_no(message.text):
            return False
        try:
            key = self.session_key(message)
        except ChatlaneError:
            return False
        state = self.engine.registry.peek(key)
        return state is not None and self.engine.approvals.asked_by(state, message.source.user_id)

    def overhear(self, message: InboundMessage, limits: ContextLimits) -> bool:
        """Keep ``message`` — said in a shared chat, not to the bot — as context for the
        next message for the agent in its session (:mod:`chatlane.overheard`); whether it
        was kept.

        Nothing is kept from a direct message, from a sender or chat the allowlists
        refuse (silently: nobody addressed the bot), or that names no session.
        """
        message = message.cleaned()
        source = message.source
        if source.chat_type is ChatType.DM or not self.settings.authorize(source):
            return False
        key = build_session_key(source, self.settings.key_policy)
        state = self.engine.registry.get(key)
        return keep(state.conversation.overheard, line_of(message, limits.chars), limits.messages)

    def _with_context(self, key: SessionKey, message: InboundMessage) -> InboundMessage:
        """``message`` carrying what its session overheard since the last one (which is
        then no longer kept); ``message`` itself when there is nothing, or it is internal."""
        state = self.engine.registry.peek(key)
        if message.internal or state is None or not state.conversation.overheard:
            return message
        context = take(state.conversation.overheard)
        return msgspec.structs.replace(message, context=(*message.context, *context))

    def _give_back(self, key: SessionKey, message: InboundMessage) -> None:
        """Keep ``message``'s context again: it was not accepted (the next one takes it)."""
        state = self.engine.registry.peek(key)
        if message.context and state is not None:
            ring = state.conversation.overheard
            ring[:0] = message.context

    def _may_run(self, key: SessionKey, source: SessionSource, name: str) -> bool:
        """Whether ``source``'s sender may run ``/name`` in ``key``: anyone in a session of
        their own; in a shared one, whoever ``settings.command_guard`` lets."""
        return not is_shared(key) or self.settings.command_guard(source, name)

    async def _refuse_command(
        self, key: SessionKey, message: InboundMessage, name: str
    ) -> DispatchResult:
        """Tell the sender ``/name`` is for admins here; nothing runs and nothing changes."""
        text = f"Only an admin can use /{name} in a chat shared with others; nothing changed."
        await self.engine.send(OutboundKind.NOTICE, key, message.source, text, (message.id,))
        log.info("refused /%s of user %r in %s", name, message.source.user_id, key)
        return DispatchResult(key, message.id, command=name)

    def _sends_as(self, parsed: ParsedCommand) -> str:
        """The busy policy ``parsed`` sends its text on under (``/steer``, ``/now``), if any."""
        spec = self.router.get(parsed.name)
        return spec.sends_as if spec is not None and parsed.args else ""

    async def _run_command(
        self, key: SessionKey, message: InboundMessage, parsed: ParsedCommand
    ) -> DispatchResult:
        """Run ``parsed``; send its reply, or the notice of a command that refused the message."""
        ids = (message.id,)
        spec = self.router.get(parsed.name)
        queues = spec is not None and spec.queues_message
        try:
            reply = await self.router.run(self.engine, key, message, parsed)
        except CommandRefused as refused:
            outcome = refused.outcome
            notice = OutboundKind.NOTICE
            await self.engine.send(notice, key, message.source, refused.text, ids, refusal=outcome)
            return DispatchResult(key, message.id, outcome=outcome, command=parsed.name)
        if reply:  # a command that answers later (/btw) replies then
            if message.idempotent and not queues:  # a retry gets this reply, runs nothing
                await self.engine.keep_answer(key, message, reply)
            await self.engine.send(OutboundKind.REPLY, key, message.source, reply, ids)
        return DispatchResult(key, message.id, command=parsed.name)

    def _may_be_command(self, key: SessionKey, message: InboundMessage) -> bool:
        """Whether ``message`` may be a command (:meth:`_command_for` decides).

        Plain text (most messages: neither a slash command nor a yes or no)
        is none; it cancels a pending confirmation, as :meth:`_command_for` would.
        """
        word = message.text.strip()
        if word[:1] == "/" or word.lower() in YES_OR_NO:
            return True
        self._cancel_confirmation(key)
        return False

    async def _command_for(self, key: SessionKey, message: InboundMessage) -> ParsedCommand | None:
        """The command ``message`` means: a slash command, or a yes/no to a pending question.

        Anything but a yes or no — another command included — cancels a
        pending confirmation, as its prompt says. A yes or no answers one
        question at most, and never one it may not be meant for: with both an
        approval and a confirmation waiting, it answers neither (the
        confirmation is given up) and the sender is told to answer each by
        its command. With neither waiting here, it answers an approval that
        waits in another process running the session's turn (read from the
        store only for a yes or no), and is otherwise a message.
        """
        parsed = parse_command(message.text)
        if parsed is not None:
            self._cancel_confirmation(key)
            return parsed
        word = message.text.strip().lower()
        if word not in YES_OR_NO:
            self._cancel_confirmation(key)
            return None
        state = await self.engine.session(key)
        confirm = state.conversation.pending_command_text
        state.conversation.pending_command_text = None
        if self.engine.approvals.has_pending(state):
            if confirm:  # two questions wait for it: a bare yes or no answers neither
                return ParsedCommand("unclear", confirm)
            return ParsedCommand("approve" if word in YES else "deny", "")
        current = confirm is not None and await self._confirmation_current(state)
        elsewhere = await self.engine.approvals.waits_elsewhere(key)
        if confirm and current and elsewhere:
            return ParsedCommand("unclear", confirm)
        if confirm and current:
            return parse_command(confirm) if word in YES else ParsedCommand("cancelled", "")
        if elsewhere:
            return ParsedCommand("approve" if word in YES else "deny", "")
        return None  # nothing waits for it (a confirmation that lapsed included): a message

    async def _confirmation_current(self, state: SessionState) -> bool:
        """Whether the confirmation ``state`` waits for still stands: no turn ran in another
        process since it was asked. Messages that reached another process (a load balancer
        in front of several) never cancelled it here, as they would have in this one; a
        turn they ran moved the session's generation past what this process knows."""
        asked = state.conversation.pending_command_generation
        try:
            now = await self.engine.store.generation(state.key)
        except ChatlaneError as error:
            log.warning("kept a confirmation the store could not be asked about: %s", error)
            return True
        known: int = state.persistent.run_generation
        return now <= max(asked, known)

    def _cancel_confirmation(self, key: SessionKey) -> None:
        state = self.engine.registry.peek(key)
        if state is not None and state.conversation.pending_command_text is not None:
            state.conversation.pending_command_text = None

    async def start(self) -> int:
        """Announce this process to the store and adopt messages dead processes left.

        :returns: how many messages were adopted (they run as if just received).
        """
        adopted = await self.engine.start()
        if self.scheduler is not None:
            await self.scheduler.start()
        self._started = True
        if self.delivery is not None:
            self.delivery.start()
        return adopted

    async def aclose(self) -> None:
        """Stop the scheduler (if any), then every running turn, and wait for them to end.

        Idempotent: a second call returns at once.
        """
        if self._closed:
            return
        self._closed = True
        if self.scheduler is not None:
            await self.scheduler.aclose()
        await self.engine.aclose()
        if self.delivery is not None:
            await self.delivery.aclose()
