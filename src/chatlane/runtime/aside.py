"""Side answers (``/btw <question>``): the agent answers beside the session's turn.

What stays true:

* A side answer never touches the session's turn: it takes no lease, writes
  nothing to the transcript or the session's state, and is never queued
  behind the running turn nor steered into it. Its agent sees a turn that
  is not current, so any approval it asks for is denied at once. It runs
  with the conversation's own model: a ``/model --once`` waiting for the
  next turn is neither used nor used up.
* At most ``side_answers`` run at once in a process; one more is refused
  with a notice, never queued.
* Its reply, or a failure notice, goes to the chat it came from, in reply
  to the ``/btw`` message, marked as a side answer. It runs in its own
  task, bound to its session's context like any turn, so the command
  returns at once and the adapter is never held up by the agent.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import AsyncIterator

import msgspec

from chatlane.context import bound_context
from chatlane.errors import ChatlaneError
from chatlane.logs import turn_fields
from chatlane.runtime.outlet import Outlet
from chatlane.runtime.output import failure_text, log_failure
from chatlane.runtime.persisted import without_once
from chatlane.runtime.settings import RuntimeSettings
from chatlane.runtime.turn import Turn
from chatlane.state import SessionState
from chatlane.types import Agent, InboundMessage, OutboundKind

log = logging.getLogger("chatlane.runtime")

SIDE_MARK = "(aside) "
"""What a side answer's reply starts with, so it is never mistaken for the turn's."""


class TooManyAsides(ChatlaneError):
    """Every side answer this process allows is running."""


class SideAnswers:
    """Runs ``/btw`` questions within their own budget (see the module docstring)."""

    def __init__(self, agent: Agent, outlet: Outlet, settings: RuntimeSettings) -> None:
        self._agent = agent
        self._outlet = outlet
        self._settings = settings
        self._running: set[asyncio.Task[None]] = set()

    @property
    def running(self) -> int:
        """How many side answers run now."""
        return len(self._running)

    def ask(self, state: SessionState, message: InboundMessage, question: str) -> None:
        """Start answering ``question`` (from ``message``) beside ``state``'s session.

        :raises TooManyAsides: if ``side_answers`` already run.
        """
        limit = self._settings.side_answers
        if len(self._running) >= limit:
            raise TooManyAsides(f"{limit} side questions are being answered; ask again shortly")
        asked = msgspec.structs.replace(message, text=question)
        turn = Turn.of(state, (asked,), (), without_once(state), claims_once=False)
        context = bound_context(message.source, state.key)
        task = asyncio.get_running_loop().create_task(self._answer(turn), context=context)
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def close(self) -> None:
        """Cancel the side answers still running and wait for them."""
        for task in self._running:
            task.cancel()
        await asyncio.gather(*self._running, return_exceptions=True)

    async def _answer(self, turn: Turn) -> None:
        kind, text = OutboundKind.REPLY, ""
        try:
            async with asyncio.timeout(self._settings.turn_timeout or None):
                text = SIDE_MARK + await self._text(turn)
        except (Exception, SystemExit) as error:  # the agent's failure: told, and logged
            log_failure(log, "side answer failed", error, turn_fields(turn.session_key))
            kind, text = OutboundKind.NOTICE, failure_text(error)
        message = turn.messages[0]
        await self._outlet.send(kind, turn.session_key, message.source, text, (message.id,))

    async def _text(self, turn: Turn) -> str:
        """The agent's whole answer: text, or its chunks joined (nothing is streamed)."""
        result: object = self._agent(turn)
        if inspect.isawaitable(result):
            result = await result
        if isinstance(result, str):
            return result
        if not isinstance(result, AsyncIterator):
            raise TypeError(f"agent returned {type(result).__name__}, not str or an async iterator")
        parts = []
        async for chunk in result:
            if not isinstance(chunk, str):
                raise TypeError(f"agent streamed {type(chunk).__name__}, not str")
            parts.append(chunk)
        return "".join(parts)


__all__ = ["SIDE_MARK", "SideAnswers", "TooManyAsides"]
