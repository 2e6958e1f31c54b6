"""The turn an agent receives: its input, its generation, and its fence.

A :class:`Turn` is created by the engine when a session's slot is claimed and
handed to the agent once its lease is held. What stays true:

* ``generation`` is the lease's fencing token; it is set once, when the lease
  is taken, before the agent starts, and never changes after.
  :meth:`Turn.is_current` is true exactly while the session's
  ``run_generation`` still equals it and the lease has not expired on this
  host's clock. Stop, interrupt, eviction and a lost lease all make it false,
  so a displaced turn learns it is stale from one comparison.
* Every reply chunk and state write made for the turn goes through
  :meth:`Turn.fence` (or :meth:`Turn.is_current`); stale work is refused, never
  half-applied.
* Steered text is kept until the agent takes it; whatever it never takes is
  queued as a follow-up turn by the engine, so steering loses nothing. Until
  taken, a steered message waits as a queued one does: :func:`waiting_here`
  counts both, and that count is what ``queue_cap`` bounds; :func:`steered_here`
  names them, under the store ``seq`` ``/status`` lists and ``/unqueue`` takes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from operator import attrgetter
from typing import TYPE_CHECKING

import msgspec

from chatlane.context import bound_context
from chatlane.errors import StaleGeneration
from chatlane.identity import SessionSource
from chatlane.runtime import pending
from chatlane.runtime.ending import TurnEnd
from chatlane.state import SERVICE_TIER_UNSET, ServiceTier, SessionState
from chatlane.stores.base import Lease
from chatlane.titles import clean_title

if TYPE_CHECKING:
    from chatlane.approvals import ApprovalBroker
from chatlane.types import Attachment, ContextLine, InboundMessage, ModelChoice, SessionKey


class TurnOverrides(msgspec.Struct, frozen=True):
    """Per-turn model settings as resolved from the session's conversation scope.

    ``service_tier`` keeps three states: :data:`~chatlane.state.SERVICE_TIER_UNSET`
    (the agent's default), ``None`` (explicitly normal), or a tier name such as
    ``"priority"``.
    """

    model: ModelChoice | None = None
    reasoning: str | None = None
    service_tier: ServiceTier = SERVICE_TIER_UNSET

    @classmethod
    def of(cls, state: SessionState) -> TurnOverrides:
        """The overrides in force for ``state``'s next turn.

        Most sessions choose nothing: they share one frozen instance of the defaults.
        """
        conversation = state.conversation
        model, reasoning = conversation.model_override, conversation.reasoning_override
        tier = conversation.service_tier_override
        chose = model is not None or reasoning is not None or tier is not SERVICE_TIER_UNSET
        if not chose and cls is TurnOverrides:
            return _NO_OVERRIDES
        return cls(model, reasoning, tier)

    def rebased(self, old: TurnOverrides, new: TurnOverrides) -> TurnOverrides:
        """These overrides, with each field that ``old`` and ``new`` disagree on from ``new``."""
        changed = {
            name: getattr(new, name)
            for name in self.__struct_fields__
            if getattr(old, name) != getattr(new, name)
        }
        return msgspec.structs.replace(self, **changed) if changed else self


_NO_OVERRIDES = TurnOverrides()
"""The overrides of a session that chose none (the defaults), made once."""

_message_id = attrgetter("id")
"""A message's id, read in C: a turn's ids are made on every turn."""


def turn_source(messages: tuple[InboundMessage, ...]) -> SessionSource:
    """The source a turn of ``messages`` runs under, and is bound to: its last message's,
    without user (no ``user_id`` or ``user_name``) when not every message has that user
    (a full queue collapsed into one turn in a shared thread, say), so that neither the
    agent nor a tool ever acts as one sender for another's request."""
    source = messages[-1].source
    if len(messages) == 1 or source.chat_id is None:
        return source  # one message, or a chat that is its user's own
    user = source.user_id
    if all(message.source.user_id == user for message in messages):
        return source
    return dataclasses.replace(source, user_id=None, user_name="")


_assign = msgspec.structs.force_setattr
"""How a turn's own methods set its read-only attributes."""


class TurnRecord(msgspec.Struct):
    """The engine's bookkeeping of one turn, apart from what its agent sees.

    The agent reads a :class:`Turn`, whose attributes are read-only; only
    the engine changes this record, through the turn's engine-side methods.
    """

    seqs: tuple[int, ...]
    """The store's ``seq`` of each message the turn answers, steered ones included (a tuple,
    replaced when a steer is taken: read as it is, never copied)."""
    once_restore: object
    reruns: int = 0
    """How many earlier turns ran these messages and lost their lease."""
    refusable: bool = False
    """A fresh message that found its session idle here: the busy policy may refuse it."""
    approvals: ApprovalBroker | None = None
    lease: Lease | None = None
    ended_by: TurnEnd | None = None
    """Why the turn ended early, once recorded (:meth:`Turn.end`)."""
    answered: bool = False
    agent_called: bool = False
    """The agent was called for the turn (:meth:`Turn.mark_agent_called`): only such a turn
    uses up a ``/model --once``."""
    redirected: bool = False
    """A newer message redirected it: it stops at its next safe point and keeps its work."""
    note: str = ""
    """What the agent reads before the messages' text (:attr:`Turn.note`)."""
    title: str = ""
    """The conversation's title the agent chose (:meth:`Turn.set_title`), cleaned; "" if none."""
    settling: bool = False
    """The agent is done: the engine settles the turn's messages, which nothing may cancel."""
    lease_given_up: bool = False
    """The upkeep gave the turn up for its lease (refused, fenced elsewhere, or about to
    expire unrenewed): it is superseded, logged and counted once (:meth:`Turn.give_up_lease`)."""
    finished: bool = False
    """The engine is done with the turn: whatever still runs for it can ask nothing."""
    task: asyncio.Task[None] | None = None
    last_progress: float = msgspec.field(default_factory=lambda: time.monotonic())
    """When the turn was made, then when it last made progress: read through this module's
    ``time``, as :meth:`Turn.touch` and the watchdog read it, so every stamp is on one clock."""


class Turn(msgspec.Struct, frozen=True, eq=False):
    """One run of the agent for one session; read-only for the agent (see the module docstring).

    Made with :meth:`of`. Every attribute is read-only: assigning one raises
    :class:`AttributeError`. What an agent reads most (``session_key``,
    ``messages``, ``generation``, …) is a plain field, read as cheaply as any
    attribute; only the turn's engine-side methods below change one. Two
    turns are equal only if they are the same turn.
    """

    session_state: SessionState
    """The state of the session this turn runs for (engine side)."""
    session_key: SessionKey
    """The session this turn runs for."""
    messages: tuple[InboundMessage, ...]
    """The messages this turn was started with, oldest first (steered ones: :attr:`steered`)."""
    message_ids: tuple[str, ...]
    """The ids of the inbound messages this turn answers, steered ones included."""
    source: SessionSource
    """Where the turn's last message came from (its replies go there); with no user
    (:func:`turn_source`) when its messages came from more than one."""
    overrides: TurnOverrides
    """The model settings this turn runs with."""
    interrupted: asyncio.Event
    """Set when the turn is told to stop (stop, interrupt, eviction, lost lease, shutdown)."""
    started_at: float
    """When the turn was made (``time.monotonic()``)."""
    _record: TurnRecord
    _loop: asyncio.AbstractEventLoop
    _steers: tuple[tuple[InboundMessage, int], ...]
    """Steered messages (and seqs) the agent has not taken. It and :attr:`steered` are
    tuples, replaced on each change, so the many turns never steered share the empty one."""
    _steered: tuple[InboundMessage, ...]
    generation: int = 0
    """The fencing token: set once, when the lease is taken, before the agent starts."""

    @classmethod
    def of(
        cls,
        state: SessionState,
        messages: tuple[InboundMessage, ...],
        seqs: tuple[int, ...],
        overrides: TurnOverrides,
        *,
        reruns: int = 0,
        refusable: bool = False,
        approvals: ApprovalBroker | None = None,
        claims_once: bool = True,
    ) -> Turn:
        """A turn of ``messages`` (stored under ``seqs``) for ``state``'s session.

        :param claims_once: the turn uses up a ``/model --once`` in force (its model is
            then restored once the turn ends); False for a turn that leaves it to the next.
        """
        once_restore = state.conversation.one_turn_restore if claims_once else None
        record = TurnRecord(tuple(seqs), once_restore, reruns, refusable, approvals)  # by place
        return cls(
            state,
            state.key,
            messages,
            tuple(map(_message_id, messages)),
            turn_source(messages),
            overrides,
            asyncio.Event(),
            record.last_progress,
            record,
            asyncio.get_running_loop(),
            (),
            (),
        )

    # -- what the agent reads --------------------------------------------------

    @property
    def steered(self) -> tuple[InboundMessage, ...]:
        """Messages steered into this run that the agent took (:meth:`take_steers`)."""
        return self._steered

    # -- what the engine reads (the record's fields, read-only here) -------------

    def shows_chunks(self) -> bool:
        """Whether the agent's chunks go out: unless every message this turn answers
        (steered ones taken included) asked for its reply whole
        (:attr:`~chatlane.types.InboundMessage.whole_reply`)."""
        for message in self.messages:
            if not message.whole_reply:
                return True
        return any(not message.whole_reply for message in self._steered)

    @property
    def seqs(self) -> tuple[int, ...]:
        """The store's ``seq`` of each message this turn answers (engine side)."""
        return self._record.seqs

    @property
    def lease(self) -> Lease | None:
        """The lease the turn runs under, as last renewed (engine side)."""
        return self._record.lease

    @property
    def ended_by(self) -> TurnEnd | None:
        """Why the turn ended early, once recorded; ``None`` while it has not."""
        return self._record.ended_by

    @property
    def answered(self) -> bool:
        """Whether the turn's answer was committed."""
        return self._record.answered

    @property
    def redirected(self) -> bool:
        """Whether a newer message redirected the turn (busy policy ``redirect``): it stops
        at its next safe point, still current, and its reply so far is kept as cut short."""
        return self._record.redirected

    @property
    def finished(self) -> bool:
        """Whether the engine is done with the turn."""
        return self._record.finished

    @property
    def reruns(self) -> int:
        """How many earlier turns ran these messages and lost their lease."""
        return self._record.reruns

    @property
    def refusable(self) -> bool:
        """A fresh message that found its session idle here: the busy policy may refuse it."""
        return self._record.refusable

    @property
    def task(self) -> asyncio.Task[None] | None:
        """The task running the turn (engine side)."""
        return self._record.task

    @property
    def once_restore(self) -> object:
        """The ``/model --once`` snapshot this turn settles if its agent is called (engine side)."""
        return self._record.once_restore

    @property
    def agent_called(self) -> bool:
        """Whether the agent was called for this turn (engine side)."""
        return self._record.agent_called

    @property
    def last_progress(self) -> float:
        """When the turn last made progress (``time.monotonic()``)."""
        return self._record.last_progress

    # -- what the engine changes ---------------------------------------------------

    def attach(self, task: asyncio.Task[None]) -> None:
        """The task that runs this turn (engine side, once)."""
        self._record.task = task

    def renewed(self, lease: Lease) -> None:
        """The turn's lease was renewed as ``lease`` (engine side)."""
        self._record.lease = lease

    @property
    def lease_given_up(self) -> bool:
        """Whether the turn was given up because its lease was lost or about to expire."""
        return self._record.lease_given_up

    def give_up_lease(self) -> None:
        """Record that the turn was given up for its lease, once (engine side)."""
        self._record.lease_given_up = True

    def mark_agent_called(self) -> None:
        """The agent is called for this turn now (engine side)."""
        self._record.agent_called = True

    def mark_answered(self) -> None:
        """The turn's answer was committed (engine side)."""
        self._record.answered = True

    def redirect(self) -> None:
        """Ask the turn to stop at its next safe point, keeping its work (engine side).

        The turn stays current, so it can still commit what it did; its agent
        sees :attr:`interrupted` set, as for any stop.
        """
        self._record.redirected = True
        self.interrupted.set()

    @property
    def settling(self) -> bool:
        """Whether the agent is done and the engine settles the turn (it may not be cancelled)."""
        return self._record.settling

    def mark_settling(self) -> None:
        """The agent is done; from here the turn task settles its messages (engine side)."""
        self._record.settling = True

    def mark_finished(self) -> None:
        """The engine is done with the turn (engine side)."""
        self._record.finished = True

    def rebase_overrides(self, old: TurnOverrides, new: TurnOverrides) -> None:
        """Take up what the store changed between ``old`` and ``new`` (engine side)."""
        _assign(self, "overrides", self.overrides.rebased(old, new))

    @property
    def author(self) -> str | None:
        """The user whose messages this turn runs, and the only one who can answer its approvals.

        ``collect`` never merges messages of two authors, so every message of
        the turn (steered ones aside) has this user id; ``None`` for a source
        without a user (a channel post), whose requests anyone there can answer.
        """
        return self.messages[0].source.user_id

    def _one_author(self) -> bool:
        return all(message.source.user_id == self.author for message in self.messages)

    @property
    def text(self) -> str:
        """The input: one message's text, or every merged message's text in order,
        after the turn's :attr:`note` if it has one."""
        joined = "\n".join(message.text for message in self.messages)
        note = self._record.note
        return f"{note}\n{joined}" if note else joined

    @property
    def attachments(self) -> tuple[Attachment, ...]:
        """The files sent with the turn's messages, in the order of :attr:`messages`
        (each message's own are ``message.attachments``; steered ones': :attr:`steered`)."""
        messages = self.messages
        if len(messages) == 1:
            return messages[0].attachments
        return tuple(a for message in messages for a in message.attachments)

    @property
    def context(self) -> tuple[ContextLine, ...]:
        """What was said in the chat without mentioning the bot before the turn's messages
        (``unmentioned = "context"``), oldest first; empty otherwise. Each line is given to
        one turn only (:mod:`chatlane.overheard`); :func:`chatlane.overheard.render` makes
        the labelled block an agent can read."""
        messages = self.messages
        if len(messages) == 1:
            return messages[0].context
        return tuple(line for message in messages for line in message.context)

    @property
    def note(self) -> str:
        """What the engine tells the agent about this turn's input, if anything: a turn
        collapsed from a full queue (overflow ``summarize``) says so."""
        return self._record.note

    def annotate(self, note: str) -> None:
        """Give the turn a :attr:`note` before its agent runs (engine side)."""
        self._record.note = note

    def set_title(self, title: str) -> None:
        """Name the conversation ``title``, with this turn's answer.

        The title is written in the commit that records the turn's answer
        (a failure notice included), and replaces any the conversation has,
        the one drawn from its first message too; of several set in one turn,
        the last counts. Set it before the agent returns: nothing is written
        for a turn whose answer is not committed (a stop, a lost lease). The
        text is cleaned as every title is (:mod:`chatlane.titles`): one line,
        invisible characters dropped, shortened to
        :data:`~chatlane.titles.TITLE_LIMIT` characters with ``…``.

        :raises TypeError: ``title`` is not a string.
        :raises ValueError: nothing is left to show once it is cleaned.
        """
        self._record.title = clean_title(title)

    @property
    def chosen_title(self) -> str:
        """The title the agent set for the conversation this turn (cleaned), or ""."""
        return self._record.title

    def end(self, reason: TurnEnd) -> None:
        """Record why this turn ended early; the first reason recorded stands (engine side)."""
        if self._record.ended_by is None:
            self._record.ended_by = reason

    def bind_lease(self, lease: Lease) -> None:
        """Take ``lease`` and its generation as this turn's (engine side, once, when acquired)."""
        self._record.lease = lease
        _assign(self, "generation", lease.generation)

    def is_current(self) -> bool:
        """Whether this turn may still write state and deliver replies."""
        record = self._record
        lease = record.lease
        if lease is None or self.session_state.persistent.run_generation != self.generation:
            return False
        return lease.expires_at > time.time()

    def is_fenced(self) -> bool:
        """Whether the session's generation moved past this turn's (its lease's expiry aside)."""
        return self.session_state.persistent.run_generation != self.generation

    def fence(self, what: str = "write") -> None:
        """Refuse ``what`` unless this turn is current.

        :raises StaleGeneration: if the session's generation moved on or the lease expired.
        """
        if not self.is_current():
            current = self.session_state.persistent.run_generation
            raise StaleGeneration(self.session_key, self.generation, current, what)

    def take_steers(self) -> list[str]:
        """Text steered into this run since the last call, oldest first.

        The messages taken are recorded in :attr:`steered`: this turn answers them.
        """
        steers = self._steers
        if not steers:
            return []
        _assign(self, "_steers", ())
        record = self._record
        for message, seq in steers:
            _assign(self, "_steered", (*self._steered, message))
            record.seqs = (*record.seqs, seq)
            _assign(self, "message_ids", (*self.message_ids, message.id))
        self.touch()
        return [message.text for message, _ in steers]

    def touch(self) -> None:
        """Record progress, so the turn is not evicted as stuck."""
        self._record.last_progress = time.monotonic()

    def steer(self, message: InboundMessage, seq: int) -> None:
        """Hand ``message`` to the running agent (engine side of :meth:`take_steers`)."""
        _assign(self, "_steers", (*self._steers, (message, seq)))

    def waiting_steers(self) -> list[tuple[InboundMessage, int]]:
        """Messages (and seqs) steered into this run that the agent has not taken yet (a copy)."""
        return list(self._steers)

    def steers_waiting(self) -> int:
        """How many messages steered into this run the agent has not taken yet."""
        return len(self._steers)

    def unsteer(self, seq: int) -> InboundMessage | None:
        """Take back the untaken steer stored under ``seq`` (engine side): the agent never
        gets it; ``None`` if none waits under ``seq``."""
        found = next((message for message, steered in self._steers if steered == seq), None)
        if found is not None:
            _assign(self, "_steers", tuple(pair for pair in self._steers if pair[1] != seq))
        return found

    def steer_again(self, message: InboundMessage, seq: int) -> None:
        """Hand ``message`` (taken back by :meth:`unsteer`) to the agent again, in its place:
        before the untaken steers stored after it (engine side)."""
        steers = self._steers
        index = next((i for i, pair in enumerate(steers) if pair[1] > seq), len(steers))
        _assign(self, "_steers", (*steers[:index], (message, seq), *steers[index:]))

    def keep_steers(self, stored: set[int], known: set[int]) -> list[InboundMessage]:
        """Let go of untaken steers ``known`` before a read of the store that did not
        find them (not in ``stored``); return them. Steers that came during the read stay.
        """
        gone = [message for message, seq in self._steers if seq in known and seq not in stored]
        kept = tuple(pair for pair in self._steers if pair[1] in stored or pair[1] not in known)
        _assign(self, "_steers", kept)
        return gone

    def untaken_steers(self) -> tuple[tuple[InboundMessage, int], ...]:
        """Steered messages (and seqs) the agent never took (engine side, at the end)."""
        untaken = self._steers
        if untaken:  # most turns were steered nothing: nothing to replace
            _assign(self, "_steers", ())
        return untaken

    async def request_approval(self, command: str, reason: str = "") -> bool:
        """Ask this turn's user to approve ``command``; True only if they did, in time.

        The prompt goes to the chat and thread the turn came from; only the
        turn's :attr:`author` can answer it. A stale turn, a timeout and a
        conversation that ends are all a denial. So is, at once and with
        nothing sent, a request from a turn that already ended (a task it left
        behind), that is winding down after a stop, interrupt or lost lease
        (:attr:`interrupted` set), or whose messages have two authors (it
        could name no one to answer).
        """
        approvals = self._record.approvals
        if not self._may_ask() or approvals is None:
            return False
        decision = await approvals.request(
            self.session_state, self.generation, self.author, command, reason
        )
        return decision.approved

    def _may_ask(self) -> bool:
        """Whether this turn runs as the session's current one, has one author, and may go on."""
        return (
            self.lease is not None
            and not self.finished
            and not self.interrupted.is_set()
            and self.is_current()
            and self._one_author()
        )

    def request_approval_threadsafe(self, command: str, reason: str = "") -> bool:
        """:meth:`request_approval` for tools running in a worker thread (blocks that thread).

        :raises RuntimeError: if called on the event loop's own thread, which
            it would block for good; there, ``await request_approval()``.
        """
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            raise RuntimeError(
                "request_approval_threadsafe() would block the event loop; "
                "await turn.request_approval() instead"
            )
        asking = self.request_approval(command, reason)
        bound = bound_context(self.source, self.session_key)  # not the calling thread's context
        future = bound.run(asyncio.run_coroutine_threadsafe, asking, self._loop)
        return future.result()

    def __repr__(self) -> str:
        return f"<Turn {self.session_key!r} gen={self.generation} messages={len(self.messages)}>"


PLAIN_READS: dict[str, str] = {
    "lease": "_record.lease",
    "ended_by": "_record.ended_by",
    "answered": "_record.answered",
    "finished": "_record.finished",
    "reruns": "_record.reruns",
    "refusable": "_record.refusable",
    "task": "_record.task",
    "once_restore": "_record.once_restore",
    "agent_called": "_record.agent_called",
    "last_progress": "_record.last_progress",
    "chosen_title": "_record.title",
    "lease_given_up": "_record.lease_given_up",
}
"""The read-only properties of :class:`Turn` that only read an attribute, with its path.

The engine reads them many times per message, so each is served by a getter
built in C (:func:`operator.attrgetter`) instead of its Python body, which
stays the typed, documented definition; a test checks the two read the same.
"""


AS_DEFINED: dict[str, property] = {}
"""The Python definitions :data:`PLAIN_READS` replaced, kept to check them against."""


def _read_plainly(cls: type[Turn]) -> None:
    for name, path in PLAIN_READS.items():
        defined = AS_DEFINED[name] = cls.__dict__[name]
        setattr(cls, name, property(attrgetter(path), doc=defined.__doc__))


_read_plainly(Turn)


def running_turn_of(state: SessionState) -> Turn | None:
    """The turn that holds ``state``'s slot, if any (``None`` while idle or between turns)."""
    return state.turn.current


def waiting_here(state: SessionState) -> int:
    """How many of ``state``'s messages wait here: queued for a turn, or steered into the
    running one and not taken by its agent yet. ``queue_cap`` bounds this count."""
    turn = state.turn.current
    queued = pending.pending_count(state)
    return queued if turn is None else queued + turn.steers_waiting()


def steered_here(state: SessionState) -> list[tuple[int, InboundMessage]]:
    """The messages steered into ``state``'s running turn that its agent has not taken yet,
    each with its store ``seq`` (as :func:`~chatlane.runtime.pending.queued` gives the
    queued ones), in the order the agent would take them."""
    turn = state.turn.current
    return [] if turn is None else [(seq, message) for message, seq in turn.waiting_steers()]
