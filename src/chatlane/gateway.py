"""Gateway wiring: from an inbound message to the engine or a command.

:meth:`Gateway.dispatch` is the one entry point adapters call. It names the
session (:mod:`chatlane.identity`), routes slash commands to the
:class:`~chatlane.commands.CommandRouter` (they may run while a turn is busy),
and hands everything else to the :class:`~chatlane.runtime.engine.TurnEngine`.
Replies leave through the adapter's ``deliver`` function only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from chatlane.commands import (
    CommandRefused,
    CommandRouter,
    ParsedCommand,
    default_router,
    parse_command,
)
from chatlane.identity import KeyPolicy, build_session_key
from chatlane.lifecycle import LifecycleOptions
from chatlane.runtime.busy import BusyOutcome
from chatlane.runtime.engine import RuntimeSettings, TurnEngine
from chatlane.runtime.outcomes import OnOutcome
from chatlane.session_commands import NO, YES
from chatlane.state import SessionRegistry
from chatlane.stores.base import Store
from chatlane.types import Agent, Deliver, InboundMessage, Outbound, OutboundKind, SessionKey

if TYPE_CHECKING:
    from chatlane.scheduler import Scheduler

_YES_OR_NO = YES | NO
"""Words that answer a pending approval or confirmation."""


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    """How the gateway names sessions and runs turns."""

    key_policy: KeyPolicy = field(default_factory=KeyPolicy)
    runtime: RuntimeSettings = field(default_factory=RuntimeSettings)
    lifecycle: LifecycleOptions = field(default_factory=LifecycleOptions)


class DispatchResult(msgspec.Struct, frozen=True):
    """What became of one inbound message."""

    session_key: SessionKey
    message_id: str
    started: bool = False
    outcome: BusyOutcome | None = None
    command: str | None = None


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
        on_outcome: OnOutcome | None = None,
    ) -> None:
        """``on_outcome`` hears the one outcome of every message the gateway accepted."""
        self.settings = settings or GatewaySettings()
        self.router = router if router is not None else default_router(self.settings.lifecycle)
        self._deliver = deliver
        self._closed = False
        self.scheduler: Scheduler | None = None
        self.engine = TurnEngine(
            agent,
            self._deliver_out,
            settings=self.settings.runtime,
            registry=registry,
            store=store,
            holder=holder,
            on_outcome=on_outcome,
        )
        if scheduler is not None:
            self.use_scheduler(scheduler)

    def use_scheduler(self, scheduler: Scheduler) -> None:
        """Attach ``scheduler`` (see :mod:`chatlane.scheduler`).

        It then sees every message a person sends, may hold back deliveries
        for its own jobs, and starts and stops with the gateway; if the gateway
        already started, call ``await scheduler.start()`` yourself.

        :raises RuntimeError: if ``scheduler`` is attached to another gateway.
        """
        scheduler.bind(self)
        self.scheduler = scheduler

    async def _deliver_out(self, outbound: Outbound) -> None:
        if self.scheduler is None or self.scheduler.deliverable(outbound):
            await self._deliver(outbound)

    def session_key(self, message: InboundMessage) -> SessionKey:
        """The session ``message`` belongs to (lone surrogates read as U+FFFD, as dispatched).

        :raises InvalidSource: if its source cannot name a session.
        """
        return build_session_key(message.cleaned().source, self.settings.key_policy)

    async def dispatch(self, message: InboundMessage) -> DispatchResult:
        """Handle one inbound message: a command, a new turn, or a busy outcome.

        A plain "yes" or "no" answers a pending approval or confirmation first.
        Lone surrogates in the text or source (which no store or wire can
        carry) are replaced by U+FFFD first.
        """
        message = message.cleaned()
        key = build_session_key(message.source, self.settings.key_policy)
        if self.scheduler is not None and not message.internal:
            self.scheduler.touch(key, message.source)
        parsed = None if message.internal else await self._command_for(key, message)
        if parsed is not None:
            return await self._run_command(key, message, parsed)
        outcome = await self.engine.submit(key, message)
        return DispatchResult(key, message.id, started=outcome is None, outcome=outcome)

    async def _run_command(
        self, key: SessionKey, message: InboundMessage, parsed: ParsedCommand
    ) -> DispatchResult:
        """Run ``parsed``; send its reply, or the notice of a command that refused the message."""
        ids = (message.id,)
        try:
            reply = await self.router.run(self.engine, key, message, parsed)
        except CommandRefused as refused:
            outcome = refused.outcome
            notice = OutboundKind.NOTICE
            await self.engine.send(notice, key, message.source, refused.text, ids, refusal=outcome)
            return DispatchResult(key, message.id, outcome=outcome, command=parsed.name)
        await self.engine.send(OutboundKind.REPLY, key, message.source, reply, ids)
        return DispatchResult(key, message.id, command=parsed.name)

    async def _command_for(self, key: SessionKey, message: InboundMessage) -> ParsedCommand | None:
        """The command ``message`` means: a slash command, or a yes/no to a pending question.

        Anything but a yes or no — another command included — cancels a
        pending confirmation, as its prompt says.
        """
        parsed = parse_command(message.text)
        if parsed is not None:
            self._cancel_confirmation(key)
            return parsed
        word = message.text.strip().lower()
        if word not in _YES_OR_NO:
            self._cancel_confirmation(key)
            return None
        state = await self.engine.session(key)
        if self.engine.approvals.has_pending(state):
            return ParsedCommand("approve" if word in YES else "deny", "")
        confirm = state.persistent.pending_command_text
        state.persistent.pending_command_text = None
        if confirm and word in YES:
            return parse_command(confirm)
        return ParsedCommand("cancelled", "") if confirm else None

    def _cancel_confirmation(self, key: SessionKey) -> None:
        state = self.engine.registry.peek(key)
        if state is not None and state.persistent.pending_command_text is not None:
            state.persistent.pending_command_text = None

    async def start(self) -> int:
        """Announce this process to the store and adopt messages dead processes left.

        :returns: how many messages were adopted (they run as if just received).
        """
        adopted = await self.engine.start()
        if self.scheduler is not None:
            await self.scheduler.start()
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
