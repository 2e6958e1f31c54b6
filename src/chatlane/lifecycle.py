"""Conversation boundaries: the one funnel every ending goes through.

:func:`end_conversation` is the only way a conversation ends — ``/new``,
``/reset``, ``/resume``, auto-reset and expiry all call it. What stays true
after it returns:

* a running turn was interrupted and the generation bumped (here and in the
  store), so nothing the old turn does later can land;
* the store ended the conversation and a new one (or the resumed one) is current;
* the whole conversation scope is cleared — every field, including ones added
  later — and the overrides it held are cleared in the store too, before the
  store starts the new conversation: a boundary that fails part way may leave
  the old conversation without its choices, never the new one with them;
* a one-turn override is settled (nothing is left to restore);
* the security state is clean: pending approvals resolved as denied (a
  blocked tool call returns at once), session-level grants ended, a pending
  prompt dropped;
* queued messages of the old conversation were dropped and counted, so the
  caller can tell the user;
* a message that arrived after it began was not dropped, and no turn ran for
  the session meanwhile: it waited, whatever its busy policy, and runs in the
  new conversation with its cleared choices (or in the old one, if the
  boundary failed or was called off);
* if no process ran the session when it began, that holds across processes:
  it held the session's lease in the store throughout, so what other
  processes accepted meanwhile waited there for the lease, and only what they
  had queued before was dropped.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from chatlane.errors import ChatlaneError
from chatlane.logs import turn_fields
from chatlane.runtime import pending
from chatlane.runtime.settings import Boundary
from chatlane.stores.base import Conversation
from chatlane.stores.fields import CONVERSATION_ID, CONVERSATION_OVERRIDES
from chatlane.types import SessionKey

if TYPE_CHECKING:
    from chatlane.runtime.engine import TurnEngine

log = logging.getLogger("chatlane.lifecycle")

RESUMABLE = 1000
"""How many of a session's newest conversations one may be resumed from (by id or title)."""

HOOK_TIMEOUT = 120.0
"""Seconds a ``before_reset`` hook may take; past them the boundary fails, changing nothing.

The session is held for the boundary meanwhile (what arrives waits), so a hook
that never returned would hold it for good."""


class HookTimedOut(ChatlaneError):
    """A ``before_reset`` hook ran past its time: the boundary did nothing."""


class EndReason(enum.StrEnum):
    """Why a conversation ended."""

    NEW = "new"
    RESET = "reset"
    RESUME = "resume"
    IDLE = "idle"
    DAILY = "daily"
    EXPIRED = "expired"


BeforeReset = Callable[[SessionKey, EndReason, Conversation], Awaitable[None]]
"""Called before a conversation ends, with the conversation that is ending
(for example to summarize or archive its transcript)."""


@dataclass(frozen=True, slots=True)
class LifecycleOptions:
    """How conversation boundaries behave.

    :param confirm_new: ``/new`` and ``/reset`` ask before discarding a conversation.
    :param before_reset: called with the ending conversation before every boundary.
    """

    confirm_new: bool = True
    before_reset: BeforeReset | None = None


@dataclass(frozen=True, slots=True)
class Ended:
    """What :func:`end_conversation` did."""

    previous: Conversation
    current: Conversation
    interrupted_turn: bool
    dropped: int
    dropped_elsewhere: int = 0
    """Messages other gateway processes had taken (queued or running there), dropped too."""


async def end_conversation(
    engine: TurnEngine,
    key: SessionKey,
    reason: EndReason,
    *,
    resume_id: str | None = None,
    before_reset: BeforeReset | None = None,
) -> Ended:
    """End ``key``'s conversation and start a new one (or resume ``resume_id``).

    :raises KeyError: if ``resume_id`` names no conversation of ``key``; nothing
        was changed then.
    """
    boundary = engine.begin_boundary(key)
    try:
        await engine.hold_boundary(boundary)
        return await _end(engine, boundary, reason, resume_id, before_reset)
    finally:
        await engine.end_boundary(boundary)


async def _end(
    engine: TurnEngine,
    boundary: Boundary,
    reason: EndReason,
    resume_id: str | None,
    before_reset: BeforeReset | None,
) -> Ended:
    """:func:`end_conversation`'s steps, while no turn can start for the session here
    (nor anywhere, if ``boundary`` holds its lease); what waited when it began is
    dropped with the old conversation, what came since waits for the new one."""
    store, key = engine.store, boundary.key
    previous = await store.conversation(key)
    if resume_id is not None and not await _has_conversation(engine, key, resume_id):
        raise KeyError(resume_id)
    if before_reset is not None:
        await _run_hook(before_reset, key, reason, previous)
    stopped = await engine.stop(
        key, only=boundary.waiting, foreign=engine.dropped_elsewhere(boundary)
    )
    state = await engine.session(key)
    # the ending conversation's choices leave the store first: a step failing after this
    # can never carry them into the new conversation
    await store.set_persistent(key, None, **dict.fromkeys(CONVERSATION_OVERRIDES))
    if resume_id is None:
        current = await store.new_conversation(key)
    else:
        current = await store.resume_conversation(key, resume_id)
    engine.approvals.end_conversation(state)
    arrived_meanwhile = state.conversation.queued_events
    state.conversation.clear()
    state.conversation.queued_events = arrived_meanwhile  # came after it began: they stay
    state.conversation.conversation_id = current.id
    await store.set_persistent(key, None, **{CONVERSATION_ID: current.id})
    log.info(
        "conversation ended (%s): %s -> %s", reason, previous.id, current.id, extra=turn_fields(key)
    )
    dropped, elsewhere = len(stopped.dropped), stopped.dropped_elsewhere
    return Ended(previous, current, stopped.stopped_turn, dropped, elsewhere)


async def _run_hook(
    hook: BeforeReset, key: SessionKey, reason: EndReason, ending: Conversation
) -> None:
    """Await ``hook`` for at most :data:`HOOK_TIMEOUT` seconds.

    :raises HookTimedOut: it took longer (it was cancelled; nothing else was done).
    """
    limit = asyncio.timeout(HOOK_TIMEOUT)
    try:
        async with limit:
            await hook(key, reason, ending)
    except TimeoutError:
        if not limit.expired():
            raise  # the hook's own
        log.warning("before_reset took over %gs; %s was not reset", HOOK_TIMEOUT, key)
        raise HookTimedOut(
            f"the conversation could not be closed in time ({HOOK_TIMEOUT:g}s); try again"
        ) from None


async def _has_conversation(engine: TurnEngine, key: SessionKey, conversation_id: str) -> bool:
    found = await engine.store.conversations(key, RESUMABLE)
    return any(c.id == conversation_id for c in found)


def queued_count(engine: TurnEngine, key: SessionKey) -> int:
    """How many messages wait in ``key``'s queue (what a boundary would drop)."""
    state = engine.registry.peek(key)
    return 0 if state is None else pending.pending_count(state)
