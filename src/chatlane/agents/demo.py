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
* anything else → ``echo: <text>``, streamed in a few chunks.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from chatlane.context import get_session_env, run_in_thread
from chatlane.runtime.turn import Turn
from chatlane.state import SERVICE_TIER_UNSET

MAX_SLEEP = 60.0
MAX_STREAM = 50
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


class DemoAgent:
    """See the module docstring; it reads steered text (``accepts_steering``)."""

    accepts_steering = True

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
        return _echo(turn)


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
    if not argument.isdecimal() or not 1 <= int(argument) <= MAX_STREAM:
        yield f"usage: stream <n> (1 to {MAX_STREAM})"
        return
    for number in range(1, int(argument) + 1):
        if number > 1 and await _interrupted_within(turn, STREAM_EVERY):
            return
        yield f"{number}\n"


def _settings(turn: Turn) -> str:
    overrides = turn.overrides
    model = overrides.model.name if overrides.model else "default"
    tier = overrides.service_tier
    shown = "default" if tier is SERVICE_TIER_UNSET else ("normal" if tier is None else tier)
    return f"model={model} reasoning={overrides.reasoning or 'default'} tier={shown}"


async def _echo(turn: Turn) -> AsyncIterator[str]:
    """The echo in pieces of a third of its length, all at once (as a burst of tokens)."""
    text = f"echo: {turn.text}"
    size = max(1, len(text) // 3)
    for start in range(0, len(text), size):
        yield text[start : start + size]
