"""A turn's output: running the agent, streaming its chunks, committing and delivering its reply.

What stays true:

* Nothing is delivered for a turn that is not current: each chunk is checked
  before it goes out, and a stale streaming agent is closed at its next chunk.
  The one exception is what the store took: a reply whose commit applied is
  the answer of record and is delivered even if the turn was superseded (a
  ``/stop``, an interrupt) while the commit was on its way, as the delivery
  ledger sends what it recorded — so an ``answered`` outcome always means the
  sender is sent the answer.
* The reply is committed to the store — transcript, "answered" marks with the
  answer's text, removal from the durable queue — in one fenced write *before*
  it is delivered, so any process can tell what a message was answered with. A
  refused commit (stale generation, or a message already answered by an
  earlier run) means the reply is dropped and logged, never delivered. Each
  lone surrogate in the reply is made U+FFFD first, as the gateway makes those
  of a message: no store, and no wire, can carry one.
* That write also releases the turn's lease (the turn's work with the store
  is done; a committed reply is delivered without it), so the session's next
  turn, here or elsewhere, need not wait for a release of its own. A refused
  commit releases nothing: the turn's aftermath does, as for any other ending.
* With a delivery ledger (:mod:`chatlane.delivery`), the reply is recorded
  for delivery in that same write: once committed it reaches its chat
  through the ledger's worker, even if this process dies right after.
* That write also titles the conversation: with the title the agent set
  (:meth:`Turn.set_title`), or, until a commit of this process titled it,
  with one drawn from the turn's first message, which the store keeps only
  if the conversation has none. Once titled, a turn sends no title: the
  title costs the hot path nothing but its first turn's few bytes.
* A chunk goes out only while someone takes chunks: a turn whose messages all
  asked for their reply whole (:attr:`~chatlane.types.InboundMessage.whole_reply`:
  an API request without ``stream``, a Telegram message) sends none, until a
  message steered into it asks for them. Every chunk still marks the turn's
  progress and is part of the reply that is committed and delivered.
* The answered marks say which session answered and whether its turn failed
  (:class:`~chatlane.stores.records.AnsweredMark`): a failure notice is committed
  with its reason, so every process ends those messages failed, and a message
  whose id another session's answer holds is refused with :data:`ID_IN_USE`
  (on replay, or when its commit finds the mark), never given that answer.
* A redirected turn (busy policy ``redirect``) stops streaming at its next
  chunk and commits, under its own fence, its input and the reply shown so
  far, marked with :data:`CUT_SHORT`: the next turn sees both as history.
* A commit the store cannot take (an outage, a write lock held too long) is
  retried with backoff while the turn is current; a turn whose lease ran out
  meanwhile counts as having lost it, so its messages run again, in order.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from types import CoroutineType

from chatlane.errors import (
    AgentFailed,
    AlreadyAnswered,
    ChatlaneError,
    StaleGeneration,
    StoreDamaged,
    StoreError,
)
from chatlane.logs import turn_fields
from chatlane.overheard import CONTEXT_ROLE, render
from chatlane.runtime import pending
from chatlane.runtime.backoff import retry_store, retryable
from chatlane.runtime.ending import TurnEnd
from chatlane.runtime.leases import LeaseKeeper
from chatlane.runtime.outcomes import (
    ID_IN_USE,
    ID_IN_USE_REASON,
    Outcome,
    OutcomeLedger,
    marked_outcome,
)
from chatlane.runtime.outlet import Outlet
from chatlane.runtime.turn import Turn
from chatlane.stores.base import DeliveryDraft, TranscriptEntry, WriteBatch
from chatlane.titles import title_from
from chatlane.types import Agent, InboundMessage, OutboundKind, clean_text

log = logging.getLogger("chatlane.runtime")

_REPLY, _NOTICE, _ANSWERED = OutboundKind.REPLY, OutboundKind.NOTICE, Outcome.ANSWERED
"""Read on every turn; as globals, since on Python 3.11 a member read through its
enum class costs about ten times a global read."""


CUT_SHORT = "[cut short: a newer message redirected this reply]"
"""The mark a redirected turn's reply carries, in the transcript and in the chat."""


def cut_short(text: str) -> str:
    """``text`` (the reply shown so far, maybe none) marked as cut short by a redirect."""
    return f"{text}\n\n{CUT_SHORT}" if text else CUT_SHORT


class TurnOutput:
    """Runs agents and turns what they produce into committed, fenced deliveries."""

    def __init__(self, leases: LeaseKeeper, outlet: Outlet, outcomes: OutcomeLedger) -> None:
        self._leases = leases
        self._outlet = outlet
        self._outcomes = outcomes
        self.on_fenced: Callable[[], None] | None = None
        self.on_lost: Callable[[Turn, str], Awaitable[None]] | None = None
        """Decides why a turn the store fenced was fenced, and supersedes it
        (:meth:`~chatlane.runtime.upkeep.Upkeep.lease_lost`, asking the store)."""

    async def answer(self, agent: Agent, turn: Turn) -> None:
        """Run ``agent`` for ``turn``, commit its whole reply, and deliver what was committed.

        Chunks are streamed as they come, while the turn is current. A reply
        the store refused (the turn was fenced) is dropped; one it took is
        delivered, whatever superseded the turn meanwhile: the turn settles
        from the moment its commit is sent, so nothing cancels it between a
        commit the store applied and the delivery of what it holds.

        :raises TypeError: if the agent returns something other than text or chunks of text.
        """
        turn.mark_agent_called()  # from here a /model --once the turn runs with is used up
        result: object = agent(turn)
        if type(result) is CoroutineType or inspect.isawaitable(result):
            result = await result
        text = result if type(result) is str else await self._text_of(turn, result)
        text = clean_text(text)  # a lone surrogate: no store (and no wire) can carry it
        if turn.redirected:  # stopped at a safe point: what it said so far is kept, marked
            text = cut_short(text)
        drafts = self._outlet.drafts(turn, _REPLY, text)
        turn.mark_settling()  # the agent is done; a commit in flight may apply: no cancel
        if await self._commit(turn, "assistant", text, drafts=drafts):
            await self._outlet.to_turn(turn, _REPLY, text)

    async def _text_of(self, turn: Turn, result: object) -> str:
        """The whole reply in ``result``: text, or chunks of text streamed as they come."""
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
                if turn.interrupted.is_set() or not turn.is_current():
                    break  # stale, or redirected: this chunk was never shown
                turn.touch()
                parts.append(chunk)
                if turn.shows_chunks():
                    await self._outlet.to_turn(turn, OutboundKind.CHUNK, chunk)
        finally:
            aclose = getattr(chunks, "aclose", None)
            if aclose is not None:
                await aclose()
        return "".join(parts)

    async def replayed(self, turn: Turn) -> bool:
        """Whether ``turn`` was answered before, and its answer was delivered again.

        Only for a turn of :attr:`~chatlane.types.InboundMessage.idempotent`
        messages (retries of one request), asked under the turn's lease, so no
        other run of them can commit meanwhile: if the store holds an answer
        to every one, their queued records leave the queue, they end answered
        with it, and it is delivered — the agent does not run again. A store
        that cannot say is taken as "not answered": the turn runs, and its
        commit still refuses to answer a message twice.
        """
        if not all(message.idempotent for message in turn.messages):
            return False
        try:
            found = [await self._leases.store.mark(m.id) for m in turn.messages]
        except StoreError as error:
            log.warning("could not ask for an earlier answer: %s", error, extra=_fields(turn))
            return False
        marks = [mark for mark in found if mark is not None]
        if len(marks) < len(found):
            return False
        await self._forget(turn)
        ends = [marked_outcome(mark, turn.session_key) for mark in marks]
        for message, (outcome, text, reason) in zip(turn.messages, ends, strict=True):
            self._outcomes.end([message.id], outcome, text, reason)
        outcome, text, _ = ends[-1]  # the answer of record, as after a commit
        await self._outlet.to_turn(turn, _REPLY if outcome is _ANSWERED else _NOTICE, text)
        return True

    async def failure(self, turn: Turn, error: BaseException) -> None:
        """Tell the sender the agent failed (:func:`log_failure` logs it)."""
        log_failure(log, "agent failed", error, _fields(turn))
        text = failure_text(error)
        # a turn without a lease never ran: there is nothing to fence or record
        if turn.lease is None:
            self._outcomes.end(turn.message_ids, Outcome.FAILED, text, type(error).__name__)
        if turn.lease is None:
            await self._outlet.to_turn(turn, OutboundKind.NOTICE, text)
            return
        drafts = self._outlet.drafts(turn, OutboundKind.NOTICE, text)
        turn.mark_settling()  # as for an answer: a commit in flight may apply
        if await self._commit(turn, "notice", text, type(error).__name__, drafts):
            await self._outlet.to_turn(turn, OutboundKind.NOTICE, text)

    async def _commit(
        self,
        turn: Turn,
        role: str,
        text: str,
        failure: str = "",
        drafts: list[DeliveryDraft] | None = None,
    ) -> bool:
        """Record the answer; True if the caller should deliver it (it was recorded).

        Once recorded, the turn's messages have their outcome: answered, or
        failed (``failure`` names why) when the answer is a failure notice.
        ``drafts`` (the answer as deliveries, :meth:`Outlet.drafts`) are
        recorded in the same write: the delivery worker sends them even if the
        turn goes stale after its commit, and the caller has nothing to deliver.

        A turn fenced for no reason the engine recorded (its lease expired on
        this host's clock, or the store moved on) ends as the fence check ends
        it (:meth:`_lost`): interrupted, if another process fenced it to
        interrupt it; else it lost its lease, and its messages are run again
        if they are still its own.
        """
        if not turn.is_current():
            await self._lost(turn, "its lease ran out before its reply was committed")
            return self._fenced(turn, "reply")
        batch = _answer(turn, role, text)
        batch.failure = failure
        if drafts:
            batch.deliveries = drafts
        conversation = turn.session_state.conversation
        titling = conversation.conversation_id if batch.title else None
        try:
            await self._leases.commit_and_release(turn.session_state, turn.generation, batch)
        except StoreError as error:
            refused = await self._commit_through(turn, batch, error)
        except (StaleGeneration, AlreadyAnswered) as error:
            refused = error
        else:
            refused = None
        if refused is not None:
            return await self._refused(turn, refused)
        turn.mark_answered()
        if titling == conversation.conversation_id:  # no boundary came meanwhile
            conversation.titled = True  # the store has a title: later turns send none
        if failure:
            self._outcomes.end(turn.message_ids, Outcome.FAILED, text, failure)
        else:
            self._outcomes.end(turn.message_ids, _ANSWERED, text)
        if drafts:
            self._outlet.recorded()
            return False
        return True  # committed: the answer of record, delivered whatever came since

    async def _commit_through(
        self, turn: Turn, batch: WriteBatch, error: StoreError
    ) -> ChatlaneError | None:
        """Commit ``batch`` again after ``error``, through an outage while the turn is current.

        :returns: ``None`` once committed, else the error that refused it.
        """
        try:
            await self._retry_commit(turn, batch, error)
        except (AlreadyAnswered, StaleGeneration, StoreError) as refused:
            return None if await self._applied_before(turn, batch) else refused
        return None

    async def _applied_before(self, turn: Turn, batch: WriteBatch) -> bool:
        """Whether the try that failed had applied ``batch`` (its answer lost on the way back).

        Asked, on a store whose answers may be lost, when no retry applied it:
        one found its messages answered, or the session moved on since (after
        the lost try applied, say, a ``/stop`` bumped the generation), or the
        turn went stale before one could be made. Its messages were answered
        by this very write if the store keeps its answer for each — no other
        run answers them without taking the session, and then the lost try
        would have been refused — and that write also released the lease,
        which is then no longer held here.
        """
        store = self._leases.store
        if not store.answers_may_be_lost or not batch.answered:
            return False
        until = time.monotonic() + self._leases.settings.ttl  # then, anyone may have run them
        try:
            answers = await retry_store(
                lambda: asyncio.gather(*(store.answer(id_) for id_ in batch.answered)),
                wanted=lambda: time.monotonic() < until,
                what="asking whether a commit applied",
                fields=_fields(turn),
            )
        except StoreError:
            return False  # cannot tell: taken as not applied, as before
        if any(answer != batch.answer for answer in answers):
            return False
        turn.session_state.turn.release_lease_token(turn.generation)
        log.info("a commit whose answer was lost had applied", extra=_fields(turn))
        return True

    async def _refused(self, turn: Turn, error: ChatlaneError) -> bool:
        """A refused commit: the turn was fenced (:meth:`_lost`), or its messages were
        answered before."""
        if not isinstance(error, AlreadyAnswered):
            await self._lost(turn, f"its reply commit was refused ({error})")
            return self._fenced(turn, "reply commit")
        log.info("already answered, not delivering again: %s", error, extra=_fields(turn))
        answered = set(error.message_ids)
        foreign = await self._foreign(turn, error.message_ids)
        if foreign:
            self._outcomes.end(foreign, Outcome.REFUSED, ID_IN_USE, ID_IN_USE_REASON)
            await self._outlet.to_turn(turn, _NOTICE, ID_IN_USE)
        unanswered = [
            (message, seq)
            for message, seq in zip((*turn.messages, *turn.steered), turn.seqs, strict=True)
            if message.id not in answered
        ]
        if unanswered:
            await self._run_again(turn, unanswered)
            self._outcomes.watch(answered - foreign)
            return False
        await self._forget(turn)
        self._outcomes.watch(answered - foreign)  # the store has the answer
        return False

    async def _foreign(self, turn: Turn, message_ids: list[str]) -> set[str]:
        """Those of ``message_ids`` (found answered) whose marks another session set: their
        ids were used by another conversation. None if the store cannot say: watched, they
        end as their marks say (:mod:`chatlane.runtime.watch`)."""
        store = self._leases.store
        try:
            marks = await asyncio.gather(*(store.mark(m) for m in message_ids))
        except StoreError:
            return set()
        key = turn.session_key
        return {
            m
            for m, mark in zip(message_ids, marks, strict=True)
            if mark is not None and not mark.belongs_to(key)
        }

    async def _run_again(self, turn: Turn, unanswered: list[tuple[InboundMessage, int]]) -> None:
        """Another run answered some of ``turn``'s messages (a process taken over): their
        records leave the queue, and the others wait here to run again, in their place."""
        turn.mark_answered()  # what became of its messages is decided here
        done = sorted(set(turn.seqs) - {seq for _, seq in unanswered})
        try:
            await self._fenced_commit(turn, WriteBatch(done=done))
        except (StaleGeneration, StoreError):
            self._fenced(turn, "queue cleanup")
        messages, seqs = [m for m, _ in unanswered], [seq for _, seq in unanswered]
        pending.insert_in_order(turn.session_state, messages, seqs, turn.reruns + 1)

    async def _forget(self, turn: Turn) -> None:
        """Remove the queued records of messages an earlier run already answered."""
        turn.mark_answered()
        try:
            await self._fenced_commit(turn, WriteBatch(done=list(turn.seqs)))
        except (StaleGeneration, StoreError):
            self._fenced(turn, "queue cleanup")

    async def _fenced_commit(self, turn: Turn, batch: WriteBatch) -> None:
        """Commit ``batch`` under ``turn``'s generation, releasing its lease with it.

        Retried through an outage while the turn is current.

        :raises StoreError: the store stayed out of reach until the turn went stale.
        """
        state, generation = turn.session_state, turn.generation
        try:
            await self._leases.commit_and_release(state, generation, batch)
        except StoreError as error:
            await self._retry_commit(turn, batch, error)

    async def _retry_commit(self, turn: Turn, batch: WriteBatch, error: StoreError) -> None:
        """Retry a commit that failed with ``error``, if it may be retried and the turn is current.

        :raises StoreError: ``error`` itself, or the store stayed out of reach
            until the turn went stale.
        """
        if not retryable(error) or not turn.is_current():
            raise error
        state, generation = turn.session_state, turn.generation
        log.warning("commit failed, retrying: %s", error, extra=_fields(turn))
        await retry_store(
            lambda: self._leases.commit_and_release(state, generation, batch),
            wanted=turn.is_current,
            what="commit",
            fields=_fields(turn),
        )

    async def _lost(self, turn: Turn, why: str) -> None:
        """``turn`` may no longer write: end it as the fence check would (``why`` is for the log).

        Another process's interrupt ends it as interrupted (its messages are
        done, its senders told); anything else is a lost lease.
        """
        if self.on_lost is not None:
            await self.on_lost(turn, why)
        turn.end(TurnEnd.LEASE_LOST)  # unless that ended it: the first reason stands

    def _fenced(self, turn: Turn, what: str) -> bool:
        log.info("fenced stale %s", what, extra=_fields(turn))
        if self.on_fenced is not None:
            self.on_fenced()
        return False


def failure_text(error: BaseException) -> str:
    """What the sender is told when a turn failed: what went wrong in words when the agent
    said (:class:`~chatlane.errors.AgentFailed`), else the kind of error."""
    if isinstance(error, StoreDamaged):
        return "Sorry — the gateway's store is damaged; your message was not run."
    if isinstance(error, StoreError):
        return "Sorry — the gateway could not reach its store; your message was not run."
    if isinstance(error, AgentFailed):
        return f"Sorry — the agent failed on this message: {error}."
    return f"Sorry — the agent failed on this message ({type(error).__name__})."


def log_failure(
    logger: logging.Logger, what: str, error: BaseException, fields: dict[str, object]
) -> None:
    """Log an agent's failure: an :class:`~chatlane.errors.AgentFailed` in one line with its
    ``detail``, anything else with its traceback."""
    if isinstance(error, AgentFailed):
        logger.error("%s: %s", what, error.detail, extra=fields)
    else:
        logger.error(what, exc_info=error, extra=fields)


def _fields(turn: Turn) -> dict[str, object]:
    return turn_fields(turn.session_key, turn.generation)


def _answer(turn: Turn, role: str, text: str) -> WriteBatch:
    """The one fenced write that records a turn's input and its answer."""
    g = turn.generation
    entries = []
    for m in (*turn.messages, *turn.steered):  # a loop, as most turns answer one message
        if m.context:
            entries.append(TranscriptEntry(CONTEXT_ROLE, render(m.context), g))
        # by place (made in C): conversation, message id, created_at (stamped), attachments
        entries.append(TranscriptEntry("user", m.text, g, "", m.id, 0.0, m.attachments))
    entries.append(TranscriptEntry(role, text, g))
    answered, done = list(turn.message_ids), list(turn.seqs)
    batch = WriteBatch(entries, {}, answered, done, text)  # transcript, persistent, …, answer
    if turn.chosen_title:
        batch.title, batch.rename = turn.chosen_title, True
    elif not turn.session_state.conversation.titled:
        batch.title = _first_title(turn)
    return batch


def _first_title(turn: Turn) -> str:
    """A title drawn from the first of ``turn``'s messages that gives one ("" if none does)."""
    for message in turn.messages:
        title = title_from(message.text)
        if title:
            return title
    return ""
