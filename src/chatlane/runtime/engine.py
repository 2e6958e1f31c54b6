"""The turn engine: one running turn per session, and what happens to everything else.

What stays true:

* A message for an idle session claims the slot synchronously — before any
  ``await`` — so two messages arriving together never both start a turn.
* Each turn takes ``run_generation + 1``; stop, interrupt and eviction bump the
  generation again, so every displaced turn is stale from then on.
* A turn's replies go through its fence; a stale turn's output is dropped
  and logged, never delivered. Its ``finally`` frees only its own lease token
  and touches the slot only while the slot is still its own.
* A message for a busy session is queued, merged, steered, used to interrupt,
  or refused with a notice (:mod:`chatlane.runtime.busy`); none is dropped.
* An agent runs in a fresh :class:`contextvars.Context` with its session bound,
  so it starts from a clean slate, never from a sibling's copy.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from chatlane.context import bind_session
from chatlane.identity import SessionSource
from chatlane.runtime import pending
from chatlane.runtime.busy import (
    ALWAYS_ANSWERED,
    BusyContext,
    BusyOutcome,
    BusyPolicy,
    BusySettings,
    ack_text,
    decide,
    resolve_policy,
)
from chatlane.runtime.turn import Turn, TurnOverrides
from chatlane.state import AGENT_PENDING, SessionRegistry, SessionState
from chatlane.types import (
    Agent,
    AgentResult,
    Deliver,
    InboundMessage,
    Outbound,
    OutboundKind,
    SessionKey,
    Target,
    accepts_steering,
)

log = logging.getLogger("chatlane.runtime")


@dataclass(frozen=True, slots=True)
class RuntimeSettings:
    """Tunables of the turn engine; every duration is in seconds.

    :param queue_cap: messages that may wait per session; one more gets a notice.
    :param collect_debounce: quiet time before a ``collect`` follow-up starts.
    :param interrupt_grace: how long an interrupted agent may wind down before
        its task is cancelled.
    :param interrupt_depth: consecutive interrupts of one session after which
        ``interrupt`` degrades to ``queue``.
    :param ack_debounce: minimum time between two acks to one session
        (notices that a message will not run are never debounced).
    :param turn_timeout: a turn with no progress for this long is evicted
        (0 disables eviction).
    """

    busy: BusySettings = field(default_factory=BusySettings)
    queue_cap: int = 32
    collect_debounce: float = 0.5
    interrupt_grace: float = 5.0
    interrupt_depth: int = 3
    ack_debounce: float = 30.0
    turn_timeout: float = 600.0


@dataclass(frozen=True, slots=True)
class StopResult:
    """What ``/stop`` did: whether a turn was running and which messages it dropped."""

    stopped_turn: bool
    dropped: tuple[InboundMessage, ...]


class TurnEngine:
    """Runs an agent for many sessions at once, one turn per session."""

    def __init__(
        self,
        agent: Agent,
        deliver: Deliver,
        *,
        settings: RuntimeSettings | None = None,
        registry: SessionRegistry | None = None,
    ) -> None:
        self.agent = agent
        self.settings = settings or RuntimeSettings()
        self.registry = registry if registry is not None else SessionRegistry()
        self._deliver = deliver
        self._turns: set[Turn] = set()
        self._collecting: set[SessionKey] = set()
        self._turn_ended = asyncio.Event()
        self._timers: set[asyncio.TimerHandle] = set()
        self._watchdog: asyncio.Task[None] | None = None
        self._closed = False

    # -- inbound ---------------------------------------------------------------

    async def submit(self, key: SessionKey, message: InboundMessage) -> BusyOutcome | None:
        """Run ``message`` now if its session is idle, else apply the busy policy.

        :returns: ``None`` when a turn started for the message, else the busy outcome.
        """
        state = self.registry.get(key)
        if not state.turn.is_running:
            self._start(state, (message,))
            return None
        outcome = self._apply_busy(state, message)
        await self._acknowledge(state, message, outcome)
        return outcome

    async def enqueue(self, key: SessionKey, message: InboundMessage) -> BusyOutcome | None:
        """Queue ``message`` as its own turn, whatever the busy policy (``/queue``).

        :returns: ``None`` when it started at once, :attr:`BusyOutcome.QUEUED`, or
            :attr:`BusyOutcome.QUEUE_FULL` (refused: the caller tells the sender).
        """
        state = self.registry.get(key)
        if not state.turn.is_running:
            self._start(state, (message,))
            return None
        if pending.pending_count(state) >= self.settings.queue_cap:
            return BusyOutcome.QUEUE_FULL
        pending.enqueue(state, message)
        return BusyOutcome.QUEUED

    def _apply_busy(self, state: SessionState, message: InboundMessage) -> BusyOutcome:
        turn = self._running_turn(state)
        outcome = decide(self.policy_for(state, message), self._busy_context(state, message, turn))
        if outcome is BusyOutcome.QUEUED:
            pending.enqueue(state, message)
        elif outcome is BusyOutcome.MERGED:
            pending.collect(state, message, self.settings.collect_debounce)
        elif outcome is BusyOutcome.INTERRUPTING and turn is not None:
            pending.enqueue(state, message)
            state.conversation.interrupt_streak += 1
            self._supersede(state, turn, "interrupted by a new message")
        elif outcome is BusyOutcome.STEERED and turn is not None:
            turn.steer(message)
        return outcome

    def policy_for(self, state: SessionState, message: InboundMessage) -> BusyPolicy:
        """The busy policy in force for ``message`` in ``state``'s session."""
        return resolve_policy(self.settings.busy, message.source, state.persistent.busy_policy)

    def _busy_context(
        self, state: SessionState, message: InboundMessage, turn: Turn | None
    ) -> BusyContext:
        return BusyContext(
            queued=pending.pending_count(state),
            queue_cap=self.settings.queue_cap,
            internal=message.internal,
            agent_accepts_steering=turn is not None and accepts_steering(self.agent),
            interrupt_streak=state.conversation.interrupt_streak,
            interrupt_depth=self.settings.interrupt_depth,
            already_interrupted=turn is None or turn.interrupted.is_set(),
        )

    async def _acknowledge(
        self, state: SessionState, message: InboundMessage, outcome: BusyOutcome
    ) -> None:
        if outcome not in ALWAYS_ANSWERED and not self._ack_due(state, message):
            return
        kind = OutboundKind.NOTICE if outcome in ALWAYS_ANSWERED else OutboundKind.ACK
        text = ack_text(outcome, pending.pending_count(state))
        await self.send(kind, state.key, message.source, text, (message.id,))

    def _ack_due(self, state: SessionState, message: InboundMessage) -> bool:
        """Ack a person's message that waits on a running turn, at most once per debounce."""
        if message.internal or self._running_turn(state) is None:
            return False
        now = time.monotonic()
        last = state.turn.busy_ack_ts
        if last and now - last < self.settings.ack_debounce:
            return False
        state.turn.busy_ack_ts = now
        return True

    # -- running a turn --------------------------------------------------------

    def _start(self, state: SessionState, messages: tuple[InboundMessage, ...]) -> Turn:
        generation = state.persistent.bump_generation()
        turn = Turn(state, generation, messages, TurnOverrides.of(state))
        slot = state.turn
        slot.agent, slot.event, slot.ctx, slot.started_ts = (
            AGENT_PENDING,
            messages[0],
            turn,
            time.time(),
        )
        self._turns.add(turn)
        turn.task = asyncio.create_task(
            self._drive(state, turn),
            name=f"chatlane-turn:{state.key}:{generation}",
            context=contextvars.Context(),
        )
        self._ensure_watchdog()
        log.debug("turn started", extra={"session_key": state.key, "generation": generation})
        return turn

    async def _drive(self, state: SessionState, turn: Turn) -> None:
        try:
            with bind_session(turn.source, session_key=turn.session_key):
                state.turn.agent = turn
                text = await self._run_agent(turn)
            await self._deliver_reply(turn, text)
        except asyncio.CancelledError:
            log.info("turn cancelled: %s gen=%d", turn.session_key, turn.generation)
            raise
        except Exception as error:
            await self._report_failure(turn, error)
        finally:
            self._finish(state, turn)

    async def _run_agent(self, turn: Turn) -> str:
        result: object = self.agent(turn)
        if inspect.isawaitable(result):
            result = await result
        if isinstance(result, str):
            return result
        if isinstance(result, AsyncIterator):
            return await self._stream(turn, result)
        raise TypeError(f"agent returned {type(result).__name__}, not str or an async iterator")

    async def _stream(self, turn: Turn, chunks: AsyncIterator[str]) -> str:
        parts: list[str] = []
        try:
            async for chunk in chunks:
                if not isinstance(chunk, str):
                    raise TypeError(f"agent streamed {type(chunk).__name__}, not str")
                if not turn.is_current():
                    break
                turn.touch()
                parts.append(chunk)
                await self.send(
                    OutboundKind.CHUNK,
                    turn.session_key,
                    turn.source,
                    chunk,
                    turn.message_ids,
                    turn.generation,
                )
        finally:
            await _close(chunks)
        return "".join(parts)

    async def _deliver_reply(self, turn: Turn, text: str) -> None:
        if not turn.is_current():
            self._log_fenced(turn, "reply")
            return
        await self.send(
            OutboundKind.REPLY,
            turn.session_key,
            turn.source,
            text,
            turn.message_ids,
            turn.generation,
        )

    async def _report_failure(self, turn: Turn, error: Exception) -> None:
        log.error("agent failed: %s gen=%d", turn.session_key, turn.generation, exc_info=error)
        if not turn.is_current():
            self._log_fenced(turn, "failure notice")
            return
        text = f"Sorry — the agent failed on this message ({type(error).__name__})."
        await self.send(
            OutboundKind.NOTICE,
            turn.session_key,
            turn.source,
            text,
            turn.message_ids,
            turn.generation,
        )

    def _log_fenced(self, turn: Turn, what: str) -> None:
        current = self.registry.get(turn.session_key).persistent.run_generation
        log.info(
            "fenced stale %s: %s gen=%d current=%d",
            what,
            turn.session_key,
            turn.generation,
            current,
        )

    def _finish(self, state: SessionState, turn: Turn) -> None:
        self._turns.discard(turn)
        self._turn_ended.set()
        state.turn.release_lease_token(turn.generation)
        for message in turn.untaken_steers():
            pending.enqueue(state, message)
        if state.turn.ctx is not turn:
            return
        if not turn.interrupted.is_set():
            state.conversation.interrupt_streak = 0
        state.turn.clear()
        self._promote(state)

    def _promote(self, state: SessionState) -> None:
        """Start the session's next pending turn, or wait out a collect debounce."""
        queue = pending.pending_entries(state)
        if not queue or self._closed:
            return
        delay = queue[0].delay()
        if delay > 0:
            state.turn.agent, state.turn.started_ts = AGENT_PENDING, time.time()
            self._collecting.add(state.key)
            self._call_later(delay, self._promote_after_debounce, state)
            return
        self._start(state, tuple(queue.pop(0).messages))

    def _promote_after_debounce(self, state: SessionState) -> None:
        self._collecting.discard(state.key)
        if state.turn.ctx is None and state.turn.agent is AGENT_PENDING:
            state.turn.clear()
            self._promote(state)

    def _call_later(self, delay: float, callback: object, *args: object) -> None:
        loop = asyncio.get_running_loop()

        def fire() -> None:
            self._timers.discard(handle)
            callback(*args)  # type: ignore[operator]

        handle = loop.call_later(delay, fire)
        self._timers.add(handle)

    # -- control ---------------------------------------------------------------

    def running_turn(self, key: SessionKey) -> Turn | None:
        """The turn that holds ``key``'s slot, if any (``None`` while idle)."""
        state = self.registry.peek(key)
        return None if state is None else self._running_turn(state)

    @staticmethod
    def _running_turn(state: SessionState) -> Turn | None:
        turn = state.turn.ctx
        return turn if isinstance(turn, Turn) else None

    def _supersede(self, state: SessionState, turn: Turn, reason: str) -> None:
        """Make ``turn`` stale, ask it to stop, and cancel it after the grace period."""
        if turn.is_current():
            state.persistent.bump_generation()
        turn.interrupted.set()
        log.info("turn superseded (%s): %s gen=%d", reason, turn.session_key, turn.generation)
        task = turn.task
        if task is not None and not task.done():
            self._call_later(self.settings.interrupt_grace, _cancel, task)

    def interrupt(self, key: SessionKey, reason: str = "interrupted") -> bool:
        """Stop ``key``'s running turn (fenced from now on); its queue is kept.

        :returns: whether a turn was running.
        """
        state = self.registry.peek(key)
        turn = None if state is None else self._running_turn(state)
        if state is None or turn is None:
            return False
        self._supersede(state, turn, reason)
        return True

    def stop(self, key: SessionKey) -> StopResult:
        """``/stop``: interrupt the running turn, bump the generation, drop the queue."""
        state = self.registry.get(key)
        dropped = tuple(pending.drain(state))
        turn = self._running_turn(state)
        if turn is not None:
            self._supersede(state, turn, "stopped")
        else:
            state.persistent.bump_generation()
            if state.turn.agent is AGENT_PENDING:
                state.turn.clear()
                self._collecting.discard(key)
        return StopResult(turn is not None, dropped)

    # -- eviction --------------------------------------------------------------

    def _ensure_watchdog(self) -> None:
        if self.settings.turn_timeout > 0 and self._watchdog is None:
            self._watchdog = asyncio.create_task(self._watch(), name="chatlane-watchdog")

    async def _watch(self) -> None:
        period = min(self.settings.turn_timeout / 4, 1.0)
        while not self._closed:
            await asyncio.sleep(period)
            await self.evict_stuck()

    async def evict_stuck(self) -> int:
        """Evict every turn that made no progress for ``turn_timeout``; return how many."""
        deadline = time.monotonic() - self.settings.turn_timeout
        stuck = [turn for turn in self._turns if turn.last_progress < deadline]
        for turn in stuck:
            await self._evict(turn)
        return len(stuck)

    async def _evict(self, turn: Turn) -> None:
        state = self.registry.get(turn.session_key)
        if state.turn.ctx is not turn:
            return
        self._supersede(state, turn, "evicted: no progress")
        if turn.task is not None:
            turn.task.cancel()
        self._turns.discard(turn)
        state.turn.clear()
        timeout = self.settings.turn_timeout
        text = f"The running turn made no progress for {timeout:g}s and was stopped."
        await self.send(OutboundKind.NOTICE, turn.session_key, turn.source, text, turn.message_ids)
        self._promote(state)

    # -- delivery and shutdown -------------------------------------------------

    def is_idle(self) -> bool:
        """No turn runs and no session waits out a collect debounce.

        Messages only wait behind a running turn or a debounce, so an idle
        engine has nothing pending (unless it was closed with work queued).
        """
        return not self._turns and not self._collecting

    async def wait_idle(self) -> None:
        """Return once :meth:`is_idle` holds (wrap in a timeout to bound the wait)."""
        while not self.is_idle():
            self._turn_ended.clear()
            await self._turn_ended.wait()

    async def send(
        self,
        kind: OutboundKind,
        key: SessionKey,
        source: SessionSource,
        text: str,
        in_reply_to: tuple[str, ...] = (),
        generation: int | None = None,
    ) -> None:
        """Deliver one outbound message; an adapter's failure is logged, never raised."""
        if generation is None:
            generation = self.registry.get(key).persistent.run_generation
        outbound = Outbound(kind, key, Target.of(source), text, generation, in_reply_to)
        try:
            await self._deliver(outbound)
        except Exception:
            log.exception("delivery failed: %s %s", kind, key)

    async def aclose(self) -> None:
        """Stop every turn (fenced), cancel timers and wait for the tasks to end."""
        self._closed = True
        for handle in self._timers:
            handle.cancel()
        self._timers.clear()
        tasks = [turn.task for turn in self._turns if turn.task is not None]
        for turn in list(self._turns):
            self.interrupt(turn.session_key, "gateway shutting down")
        for task in tasks:
            task.cancel()
        if self._watchdog is not None:
            self._watchdog.cancel()
            tasks.append(self._watchdog)
        await asyncio.gather(*tasks, return_exceptions=True)


def _cancel(task: asyncio.Task[None]) -> None:
    if not task.done():
        task.cancel()


async def _close(chunks: AsyncIterator[str]) -> None:
    aclose = getattr(chunks, "aclose", None)
    if aclose is not None:
        await aclose()


__all__ = ["AgentResult", "RuntimeSettings", "StopResult", "TurnEngine"]
