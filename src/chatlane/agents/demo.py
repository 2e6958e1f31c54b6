"""The default agent: offline and deterministic, so people and tests can see every mechanism.

* ``whoami`` → ``platform=… chat=… thread=… user=… key=… gen=…``, read with
  ``get_session_env`` inside ``run_in_thread`` (a tool in a worker thread sees
  its own session and no other);
* ``sleep <seconds>`` (at most 60) → holds the turn, waiting on its
  ``interrupted`` event (no polling) and marking progress once a second;
  replies ``slept <seconds>`` unless interrupted;
* ``approve <command>`` → asks for approval; ``approved: …`` or ``denied: …``;
* ``settings`` → ``model=… reasoning=… tier=…`` as resolved for this turn;
* ``stream <n>`` (at most 50) → ``1``, ``2`` … ``n`` as chunks 0.2 s apart, so a
  message sent meanwhile shows what the busy policy does; an interrupt ends
  the stream at once (the reply is what was streamed so far);
* ``tokens <n>`` (at most 2,000) → ``1 2 … n``, each number a chunk of its own
  as soon as the event loop has run once more, as a fast model's tokens come;
  an interrupt ends it at once (see :func:`token_chunks`);
* ``context`` → the history the agent is given for the turn: the current
  conversation's entries in the store, one line each (so a ``redirect``'s
  kept partial reply, or what ``/new`` cleared, can be seen), then what the
  chat said without mentioning the bot, given with this turn
  (:attr:`~chatlane.runtime.turn.Turn.context`), under its label;
* anything else → ``echo: <text>``, streamed in a few chunks, followed by
  ``(1 attachment: photo.jpg image/jpeg 12 KB)`` when the turn's messages
  came with files (and ``context`` lists each entry's the same way).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Protocol

from chatlane.attachments import summary
from chatlane.context import get_session_env, run_in_thread
from chatlane.overheard import render
from chatlane.runtime.turn import Turn
from chatlane.state import SERVICE_TIER_UNSET
from chatlane.stores.records import TranscriptEntry
from chatlane.types import Attachment, SessionKey, clipped

MAX_SLEEP = 60.0
MAX_STREAM = 50
MAX_TOKENS = 2000
STREAM_EVERY = 0.2
"""Seconds between the chunks of ``stream <n>``."""
PROGRESS_EVERY = 1.0
"""Seconds between the progress marks of a sleeping turn (so it is not evicted as stuck)."""


def _whoami_line(generation: int) -> str:
    """Runs in a worker thread: every value comes from the task-local session context."""
    env = get_session_env
    return (
        f"platform={env('CHATLANE_SESSION_PLATFORM')} chat={env('CHATLANE_SESSION_CHAT_ID')} "
        f"thread={env('CHATLANE_SESSION_THREAD_ID')} user={env('CHATLANE_SESSION_USER_ID')} "
        f"key={env('CHATLANE_SESSION_KEY')} gen={generation}"
    )


class TranscriptSource(Protocol):
    """Where ``context`` reads history; every :class:`~chatlane.stores.Store` is one."""

    async def transcript(
        self, key: SessionKey, conversation_id: str | None = None, limit: int = 100
    ) -> list[TranscriptEntry]: ...


CONTEXT_ENTRIES = 20
"""The most recent transcript entries ``context`` lists."""
CONTEXT_WIDTH = 60
"""Characters of each entry ``context`` shows, on one line."""


class DemoAgent:
    """See the module docstring; it reads steered text (``accepts_steering``).

    ``context`` reads the transcript from the store given to :meth:`bind`
    (``chatlane serve`` binds the gateway's store at start).
    """

    accepts_steering = True

    def __init__(self) -> None:
        self._store: TranscriptSource | None = None

    def bind(self, store: TranscriptSource) -> None:
        """Read history from ``store`` from now on."""
        self._store = store

    async def __call__(self, turn: Turn) -> str | AsyncIterator[str]:
        command, _, rest = turn.text.strip().partition(" ")
        if command == "whoami":
            return await run_in_thread(_whoami_line, turn.generation)
        if command == "sleep":
            return await _sleep(turn, rest)
        if command == "approve" and rest:
            approved = await turn.request_approval(rest, "the demo agent asks")
            return f"{'approved' if approved else 'denied'}: {rest}"
        if command == "settings":
            return _settings(turn)
        if command == "stream":
            return _stream(turn, rest)
        if command == "tokens":
            return _tokens(rest)
        if command == "context" and not rest:
            return await self._context(turn)
        return _echo(turn)

    async def _context(self, turn: Turn) -> str:
        if self._store is None:
            return "context: no store to read history from"
        entries = await self._store.transcript(turn.session_key, limit=CONTEXT_ENTRIES)
        overheard = render(turn.context)
        if not entries:
            shown = "context: no history yet in this conversation"
            return f"{shown}\n{overheard}" if overheard else shown
        lines = [f"{e.role}: {_with_files(_one_line(e.content), e.attachments)}" for e in entries]
        if overheard:
            lines.append(overheard)
        return f"context ({len(entries)} entries):\n" + "\n".join(lines)


def _with_files(text: str, attachments: tuple[Attachment, ...]) -> str:
    """``text (1 attachment: …)``: ``text`` alone without attachments, the list without text."""
    if not attachments:
        return text
    files = f"({summary(attachments)})"
    return f"{text} {files}" if text else files


def _one_line(text: str) -> str:
    return clipped(" ".join(text.split()), CONTEXT_WIDTH)


async def _sleep(turn: Turn, argument: str) -> str:
    try:
        seconds = min(float(argument), MAX_SLEEP)
    except ValueError:
        return "usage: sleep <seconds> (at most 60)"
    if seconds != seconds or seconds < 0:
        return "usage: sleep <seconds> (at most 60)"
    if await _interrupted_within(turn, seconds):
        return f"interrupted after less than {seconds:g}s"
    return f"slept {seconds:g}"


async def _interrupted_within(turn: Turn, seconds: float) -> bool:
    """Wait up to ``seconds`` on ``turn.interrupted``; True as soon as it is set.

    The wait wakes only when the event is set or once per :data:`PROGRESS_EVERY`
    to mark progress, never to poll.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while (left := deadline - loop.time()) > 0:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(min(left, PROGRESS_EVERY)):
                await turn.interrupted.wait()
        if turn.interrupted.is_set():
            return True
        turn.touch()
    return turn.interrupted.is_set()


async def _stream(turn: Turn, argument: str) -> AsyncIterator[str]:
    """``1`` … ``n``, one chunk every :data:`STREAM_EVERY` seconds, until interrupted."""
    count = _count(argument, MAX_STREAM)
    if count is None:
        yield f"usage: stream <n> (1 to {MAX_STREAM})"
        return
    for number in range(1, count + 1):
        if number > 1 and await _interrupted_within(turn, STREAM_EVERY):
            return
        yield f"{number}\n"


def _count(argument: str, most: int) -> int | None:
    """``argument`` as a whole number from 1 to ``most`` (ASCII digits only), else ``None``."""
    digits = argument.lstrip("0")
    if not (argument.isascii() and argument.isdigit()) or len(digits) > len(str(most)):
        return None
    count = int(argument)
    return count if 1 <= count <= most else None


def token_chunks(count: int) -> list[str]:
    """The chunks of ``tokens <count>``: ``"1"``, then ``" 2"`` … ``" <count>"``.

    ``bench.http``'s floor streams the same chunks, so both sides send the same events.
    """
    return [f"{'' if number == 1 else ' '}{number}" for number in range(1, count + 1)]


async def _tokens(argument: str) -> AsyncIterator[str]:
    """:func:`token_chunks`, each after one more pass of the event loop (an interrupted
    turn stops reading its agent's chunks, which ends this at once)."""
    count = _count(argument, MAX_TOKENS)
    if count is None:
        yield f"usage: tokens <n> (1 to {MAX_TOKENS})"
        return
    for number, chunk in enumerate(token_chunks(count)):
        if number:
            await asyncio.sleep(0)
        yield chunk


def _settings(turn: Turn) -> str:
    overrides = turn.overrides
    model = overrides.model.name if overrides.model else "default"
    tier = overrides.service_tier
    shown = "default" if tier is SERVICE_TIER_UNSET else ("normal" if tier is None else tier)
    return f"model={model} reasoning={overrides.reasoning or 'default'} tier={shown}"


async def _echo(turn: Turn) -> AsyncIterator[str]:
    """The echo in pieces of a third of its length, all at once (as a burst of tokens)."""
    text = f"echo: {_with_files(turn.text, turn.attachments)}"
    size = max(1, len(text) // 3)
    for start in range(0, len(text), size):
        yield text[start : start + size]
