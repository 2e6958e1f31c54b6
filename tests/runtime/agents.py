"""Agents used by the runtime tests: each records what it saw, so tests can check exclusion."""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict
from collections.abc import AsyncIterator

from chatlane.context import get_session_env, run_in_thread
from chatlane.runtime.turn import Turn


class Recorder:
    """Counts concurrent turns per session and records every turn it ran."""

    def __init__(self) -> None:
        self.active: defaultdict[str, int] = defaultdict(int)
        self.max_active: defaultdict[str, int] = defaultdict(int)
        self.turns: defaultdict[str, list[Turn]] = defaultdict(list)
        self.cross_talk: list[str] = []

    def enter(self, turn: Turn) -> None:
        key = turn.session_key
        self.active[key] += 1
        self.max_active[key] = max(self.max_active[key], self.active[key])
        self.turns[key].append(turn)

    def leave(self, turn: Turn) -> None:
        self.active[turn.session_key] -= 1

    async def check_context(self, turn: Turn) -> None:
        seen = await run_in_thread(get_session_env, "CHATLANE_SESSION_KEY")
        here = get_session_env("CHATLANE_SESSION_CHAT_ID")
        if seen != turn.session_key or here != (turn.source.chat_id or ""):
            self.cross_talk.append(f"{turn.session_key} saw {seen!r}/{here!r}")


class EchoAgent:
    """Replies ``echo: <text>``; ``sleep <s>`` holds the turn until interrupted."""

    def __init__(self, recorder: Recorder | None = None) -> None:
        self.recorder = recorder or Recorder()

    async def __call__(self, turn: Turn) -> str:
        self.recorder.enter(turn)
        try:
            await self.recorder.check_context(turn)
            if turn.text.startswith("sleep "):
                return await hold(turn, float(turn.text.split()[1]))
            return f"echo: {turn.text}"
        finally:
            self.recorder.leave(turn)


async def hold(turn: Turn, seconds: float) -> str:
    """Wait ``seconds`` or until interrupted."""
    try:
        await asyncio.wait_for(turn.interrupted.wait(), seconds)
    except TimeoutError:
        return f"slept {seconds:g}"
    return "interrupted"


class SteeringAgent(EchoAgent):
    """Takes steered text while it runs and replies with everything it saw: once it
    saw three texts, or, with ``looks``, after that many looks for steered text."""

    accepts_steering = True

    def __init__(self, recorder: Recorder | None = None, looks: int | None = None) -> None:
        super().__init__(recorder)
        self.looks = looks

    async def __call__(self, turn: Turn) -> str:
        self.recorder.enter(turn)
        try:
            seen, looked = [turn.text], 0
            while not turn.interrupted.is_set() and len(seen) < 3 and looked != self.looks:
                await asyncio.sleep(0.01)
                seen += turn.take_steers()
                looked += 1
            return " + ".join(seen)
        finally:
            self.recorder.leave(turn)


async def streaming_agent(turn: Turn) -> AsyncIterator[str]:
    """Streams the reply word by word."""
    for word in f"echo: {turn.text}".split(" "):
        yield word + " "
        await asyncio.sleep(0)


async def settings_agent(turn: Turn) -> str:
    """Replies with the overrides resolved for this turn."""
    from chatlane.state import SERVICE_TIER_UNSET

    model = turn.overrides.model.name if turn.overrides.model else "default"
    tier = turn.overrides.service_tier
    shown = "default" if tier is SERVICE_TIER_UNSET else ("normal" if tier is None else tier)
    if turn.text.startswith("fail"):
        raise RuntimeError("boom")
    if turn.text.startswith("sleep "):
        await hold(turn, float(turn.text.split()[1]))
    return f"model={model} reasoning={turn.overrides.reasoning or 'default'} tier={shown}"


async def approving_agent(turn: Turn) -> str:
    """``approve <command>`` asks for approval (from a worker thread with ``thread``)."""
    words = turn.text.split(maxsplit=1)
    if words[0] == "thread":
        ok = await run_in_thread(turn.request_approval_threadsafe, words[1], "from a thread")
    else:
        ok = await turn.request_approval(words[1], "the test wants it")
    return f"{'approved' if ok else 'denied'}: {words[1]}"


class UntakenSteers:
    """Accepts steering but never takes any; ``long`` holds its turn for ``hold`` seconds,
    or until the turn is interrupted."""

    accepts_steering = True

    def __init__(self, hold: float) -> None:
        self.hold = hold

    async def __call__(self, turn: Turn) -> str:
        if turn.text == "long":
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(turn.interrupted.wait(), self.hold)
        return f"ran {turn.text}"
