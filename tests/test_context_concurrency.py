"""No cross-talk under load: many concurrent turns, each bound to its own session.

One harness drives every turn through tasks, sleeps at random points, executor
threads, spawned tasks and child-process environments, and records every
lookup that does not show the turn's own values. The same harness run over a
naive ``os.environ`` design must record cross-talk, which shows the harness
can fail.
"""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field, fields
from typing import Protocol

import pytest

from chatlane.context import (
    SESSION_VAR_NAMES,
    SessionContext,
    bind_session,
    current_session,
    get_session_env,
    reset_session_vars,
    run_in_thread,
    spawn,
    subprocess_env,
)

SEED = 20_240_611
TURNS = 1_000
SLEEPS_PER_TURN = 4
MAX_SLEEP = 0.002
FIELD_NAMES = tuple(f.name for f in fields(SessionContext))


def hermes(name: str) -> str:
    return "HERMES_" + name.removeprefix("CHATLANE_")


def fields_for(turn: int) -> dict[str, str]:
    """Values no other turn shares, in every field."""
    return {
        "platform": f"platform-{turn}",
        "chat_id": f"chat-{turn}",
        "chat_name": f"Chat {turn}",
        "thread_id": f"thread-{turn}",
        "user_id": f"user-{turn}",
        "user_name": f"User {turn}",
        "session_key": f"main:platform-{turn}:group:chat-{turn}:thread-{turn}",
    }


def expected_view(values: Mapping[str, str]) -> dict[str, str]:
    """What every lookup key of a backend's ``snapshot`` should show for ``values``."""
    view: dict[str, str] = {}
    for name, field_name in zip(SESSION_VAR_NAMES, FIELD_NAMES, strict=True):
        view[name] = view[hermes(name)] = view[f"current.{field_name}"] = values[field_name]
    return view


class Backend(Protocol):
    def bind(self, values: Mapping[str, str]) -> AbstractContextManager[None]: ...
    def snapshot(self) -> dict[str, str]: ...
    def child_env(self) -> dict[str, str]: ...


class ContextVarBackend:
    """chatlane.context, used as a gateway handler uses it."""

    @contextmanager
    def bind(self, values: Mapping[str, str]) -> Iterator[None]:
        reset_session_vars()
        with bind_session(values):
            yield

    def snapshot(self) -> dict[str, str]:
        seen = {name: get_session_env(name) for name in SESSION_VAR_NAMES}
        seen |= {hermes(name): get_session_env(hermes(name)) for name in SESSION_VAR_NAMES}
        session = current_session() or SessionContext()
        return seen | {f"current.{name}": getattr(session, name) for name in FIELD_NAMES}

    def child_env(self) -> dict[str, str]:
        return subprocess_env()


class EnvironBackend:
    """The design chatlane replaces: session identity in the process environment."""

    @contextmanager
    def bind(self, values: Mapping[str, str]) -> Iterator[None]:
        for name, field_name in zip(SESSION_VAR_NAMES, FIELD_NAMES, strict=True):
            os.environ[name] = values[field_name]
        try:
            yield
        finally:
            for name in SESSION_VAR_NAMES:
                os.environ[name] = ""

    def snapshot(self) -> dict[str, str]:
        return {name: os.environ.get(name, "") for name in SESSION_VAR_NAMES}

    def child_env(self) -> dict[str, str]:
        return dict(os.environ)


@dataclass
class Harness:
    backend: Backend
    errors: list[str] = field(default_factory=list)
    active: int = 0
    peak: int = 0

    def check(
        self, turn: int, where: str, seen: Mapping[str, str], want: Mapping[str, str]
    ) -> None:
        wrong = {key: value for key, value in seen.items() if want[key] != value}
        if wrong:
            self.errors.append(f"turn {turn} {where}: {wrong}")

    async def later_snapshot(self, delay: float) -> dict[str, str]:
        await asyncio.sleep(delay)
        return self.backend.snapshot()

    async def turn(self, turn: int, delays: list[float]) -> None:
        want = expected_view(fields_for(turn))
        with self.backend.bind(fields_for(turn)):
            self.active += 1
            self.peak = max(self.peak, self.active)
            spawned = spawn(self.later_snapshot(delays[0]))
            for step, delay in enumerate(delays):
                await asyncio.sleep(delay)
                self.check(turn, f"task after sleep {step}", self.backend.snapshot(), want)
            self.check(turn, "thread", await run_in_thread(self.backend.snapshot), want)
            env = self.backend.child_env()
            self.check(turn, "child env", {k: env.get(k, "") for k in SESSION_VAR_NAMES}, want)
            self.active -= 1
        self.check(turn, "after exit", self.backend.snapshot(), dict.fromkeys(want, ""))
        self.check(turn, "spawned", await spawned, want)


async def run_turns(backend: Backend, turns: int) -> Harness:
    rng = random.Random(SEED)
    schedule = [[rng.uniform(0, MAX_SLEEP) for _ in range(SLEEPS_PER_TURN)] for _ in range(turns)]
    harness = Harness(backend)
    await asyncio.gather(*(harness.turn(i, delays) for i, delays in enumerate(schedule)))
    return harness


@pytest.fixture(autouse=True)
def stale_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stale process values, so any wrong fallback shows up as a mismatch."""
    for name in SESSION_VAR_NAMES:
        monkeypatch.setenv(name, "stale-env")
        monkeypatch.setenv(hermes(name), "stale-env")


@pytest.mark.asyncio
async def test_thousand_concurrent_turns_never_cross_talk() -> None:
    harness = await run_turns(ContextVarBackend(), TURNS)
    assert harness.errors == []
    assert harness.peak > TURNS // 2, "turns did not overlap; the test proves nothing"


@pytest.mark.asyncio
async def test_harness_catches_a_naive_environ_design() -> None:
    harness = await run_turns(EnvironBackend(), 100)
    assert harness.peak > 50
    assert len(harness.errors) > 100


def child_sees() -> tuple[str, str]:
    """Run a real child process with this thread's session environment."""
    code = (
        "import os;print(os.environ['CHATLANE_SESSION_CHAT_ID'], os.environ['HERMES_SESSION_KEY'])"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], env=subprocess_env(), capture_output=True, check=True
    )
    chat_id, key = result.stdout.decode().split()
    return chat_id, key


@pytest.mark.asyncio
async def test_real_subprocesses_of_concurrent_turns() -> None:
    async def turn(i: int) -> tuple[str, str]:
        reset_session_vars()
        with bind_session(fields_for(i)):
            await asyncio.sleep(0.001 * (i % 3))
            return await run_in_thread(child_sees)

    seen = await asyncio.gather(*(turn(i) for i in range(6)))
    assert seen == [(fields_for(i)["chat_id"], fields_for(i)["session_key"]) for i in range(6)]
